"""The benchmarks run end to end at tiny sizes: benchmarks/gpt.py (every variant, eager, and its
profiler path), benchmarks/overhead.py --calls-only, benchmarks/grouped.py --tiny (with
--rounds), benchmarks/host_breakdown.py on the CPU,
benchmarks/peak_memory.py and benchmarks/act_math.py (one round), as
subprocesses (PYTHONPATH kept)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str, timeout: float = 240) -> str:
    env = dict(os.environ)  # PYTHONPATH (a python/ checkout) and everything else preserved
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=BENCHMARKS.parent, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"{script} {' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    )
    return out


def test_gpt_tiny_eager():
    out = _run("gpt.py", "--tiny", "--no-compile", "--strict",
               "--variants", "torch,bf16,delayed,current,mxfp8,head-current")  # fmt: skip
    for variant in ("torch", "bf16", "delayed", "current", "mxfp8", "head-current"):
        assert f"{variant} eager:" in out, out
    assert "speedup_vs_torch_eager" in out, out


def test_gpt_tiny_profile(tmp_path):
    out = _run("gpt.py", "--tiny", "--no-compile", "--strict", "--variants", "current",
               "--profile", str(tmp_path))  # fmt: skip
    assert (tmp_path / "gpt_current_eager.json").stat().st_size > 0
    assert "Self CPU" in out, out


def test_overhead_calls_only(tmp_path):
    out = _run("overhead.py", "--calls-only", "--out", str(tmp_path), "--calls-top", "5",
               "--profile", str(tmp_path / "prof"))  # fmt: skip
    assert "fusible mxfp8" in out and "vs_torch_eager" in out, out
    assert "most called functions" in out and "Self CPU" in out, out
    assert list(tmp_path.glob("overhead_*.json"))
    assert len(list((tmp_path / "prof").glob("overhead_*.json"))) == 5  # torch + 4 recipes


def test_overhead_host_time_cpu(tmp_path):
    """The host-time table in interleaved rounds: every row has its median time, the median of
    the rounds' ratios to torch eager and their spread."""
    import json

    _run("overhead.py", "--device", "cpu", "--iters", "2", "--rounds", "2", "--out",
         str(tmp_path))  # fmt: skip
    (path,) = tmp_path.glob("overhead_*.json")
    rows = json.loads(path.read_text())["host"]
    assert len(rows) == 6, rows
    for r in rows:
        assert r["host_us_per_step"] > 0 and r["vs_torch_eager"] > 0, r
        # The spread is printed to 3 decimals: the median may lie up to half a unit outside.
        lo, hi = (float(v) for v in r["ratio_spread"].split("-"))
        assert lo - 5e-4 <= r["vs_torch_eager"] <= hi + 5e-4, r
    assert {r["vs_torch_eager"] for r in rows if r["variant"] == "torch eager"} == {1.0}


def test_host_breakdown_cpu(tmp_path):
    """Every variant's operators timed from Python and in the replay's C++ loop, and the
    step's split against both sums."""
    out = _run("host_breakdown.py", "--device", "cpu", "--iters", "2", "--out", str(tmp_path))
    for variant in ("torch", "none", "delayed", "current"):
        assert f"--- {variant}: the operators" in out, out
    assert "fusible.gemm.default" in out and "ops_loop_us" in out, out
    (path,) = tmp_path.glob("host_breakdown_*.json")
    for r in json.loads(path.read_text())["results"]:
        assert r["ops_loop_us"] > 0, r
        assert r["outside_loop_us"] == pytest.approx(r["step_us"] - r["ops_loop_us"]), r
        gemm = [o for o in r["ops"] if o["op"] == "fusible.gemm.default"]
        assert r["variant"] == "torch" or gemm[0]["loop_us_per_call"] > 0, r


def test_grouped_tiny(tmp_path):
    out = _run("grouped.py", "--tiny", "--rounds", "2", "--out", str(tmp_path))
    for variant in ("torch eager", "fusible bf16", "fusible delayed", "fusible mxfp8"):
        assert variant in out, out
    assert "fresh gradients" in out and "accumulating into .grad" in out, out
    (path,) = tmp_path.glob("grouped_*.json")
    got = json.loads(path.read_text())
    # The fresh-gradient table has eight rows more: delayed scaling with the fusions disabled
    # and with cached weight workspaces, FP8 weights (two layouts) under delayed and current
    # scaling, and their re-quantization once per optimizer step (two rows).
    assert len(got["results"]) == len(got["results_accumulate"]) + 8 >= 13, got
    for row in (
        "fusible delayed, unfused (GELU kernel)",
        "cached weight workspaces",
        "fusible current, FP8 weights + transposes",
        "re-quantize from fp32 masters",
    ):
        assert row in out, (row, out)
    assert all(isinstance(r["ms"], float) for r in got["results"]), got
    # --rounds: the loop, delayed and current, each with its median ratio and spread.
    rounds = {r["variant"]: r for r in got["rounds"]}
    assert set(rounds) == {"torch eager (per-expert loop)", "fusible delayed", "fusible current"}
    assert rounds["torch eager (per-expert loop)"]["time_vs_bf16_loop"] == 1.0
    assert "interleaved rounds" in out, out


def test_peak_memory_tiny(tmp_path):
    out = _run("peak_memory.py", "--tokens", "64", "--hidden", "32", "--ffn", "64", "--top", "3",
               "--gpt", "layers=1,hidden=32,heads=2,seq=32,batch=2,vocab=64",
               "--out", str(tmp_path))  # fmt: skip
    for variant in ("torch", "none", "delayed", "current", "mxfp8"):
        assert f"\n{variant} " in out, out
    assert "alive then:" in out, out
    assert list(tmp_path.glob("peak_memory_*.json"))


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_act_math_one_round(tmp_path):
    out = _run("act_math.py", "--rounds", "1", "--out", str(tmp_path))
    for f in ("exp_neg_f", "gelu_tanh", "dgelu_erf", "dsilu", "tree_ns_per_elem"):
        assert f in out, out
    assert list(tmp_path.glob("act_math_*.json"))
