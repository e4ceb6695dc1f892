"""The second example (train_block.py), the quantize demo and the FSDP2 FP8 example
(train_fsdp_fp8.py, two CPU processes) run end to end (a few steps, every recipe; the main job,
train_gpt.py, is tested in test_train_gpt.py)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from fusible.ops.basic.quantized_weight import compile_quantized_supported

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, *args: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8", "custom"])
def test_train_block_runs(recipe_name, monkeypatch, capsys):
    # A generous tolerance: 6 steps prove the job runs and reports, not that FP8 matches BF16
    # (the 200-step comparison is tests/python/ops/test_ops.py::test_block_trains_like_bf16).
    try:
        _run("train_block.py", "--recipe", recipe_name, "--steps", "6", "--tolerance", "10",
             monkeypatch=monkeypatch)  # fmt: skip
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().out[-2000:]
    out = capsys.readouterr().out
    assert "final loss" in out
    if recipe_name != "none":
        assert "linear_bias_activation" in out  # the fusion plan is printed


def test_quantize_demo_runs(monkeypatch, capsys):
    try:
        _run("quantize_demo.py", monkeypatch=monkeypatch)
    except SystemExit as e:
        assert e.code in (0, None)
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize(
    ("recipe_name", "compiled"), [("delayed", False), ("current", False), ("current", True)]
)
def test_train_fsdp_fp8_runs(recipe_name, compiled):
    """examples/train_fsdp_fp8.py on two CPU processes (gloo): FSDP2 with the FP8 weight
    all-gather trains (the loss falls) and reports the bytes its gathers move; also with each
    sharded layer compiled (torch >= 2.11)."""
    if compiled and not compile_quantized_supported():
        pytest.skip("torch.compile with FP8 weights is tested on torch >= 2.11")
    import os
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_fsdp_fp8.py"), "--spawn", "2", "--steps", "8",
         "--recipe", recipe_name, *(["--compile"] if compiled else [])],
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines()
              if line.startswith("step")]  # fmt: skip
    assert len(losses) >= 2 and losses[-1] < losses[0], out
    assert "the FP8 all-gather moves" in out and "final loss" in out, out
