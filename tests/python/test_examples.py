"""The second example (train_block.py) and the quantize demo run end to end (a few steps, every
recipe; the main job, train_gpt.py, is tested in test_train_gpt.py)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

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
