"""Python calls per forward + backward step of the issue-11 block (benchmarks/overhead.py), for
plain-PyTorch eager and fusible under each recipe. The counts are printed (``pytest -s`` or
``-rP`` shows them); the <= 2x targets against torch eager come with the executor rewrite."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import overhead  # noqa: E402


@pytest.mark.filterwarnings("ignore:Python < 3.12")
def test_calls_per_step_counts(devices):
    rows = overhead.calls_table(devices)
    print(f"\nPython calls per step ({devices}):")
    overhead.print_table(rows, ["variant", "tokens", "calls", "vs_torch_eager"])
    names = [r["variant"] for r in rows]
    for name in ("torch eager", "fusible bf16", "fusible delayed", "fusible current",
                 "fusible mxfp8"):  # fmt: skip
        assert name in names
    for r in rows:
        assert isinstance(r["calls"], int) and r["calls"] > 0, r
        assert r["vs_torch_eager"] > 0, r


def test_calls_per_step_is_deterministic():
    # The same model and input counted twice (after the warm-up) give the same count.
    model = overhead.build("fusible", "cpu")
    x = overhead.new_input(overhead.TOKENS, "cpu")
    rec = overhead.recipes()["delayed"]
    first = overhead.calls_per_step(model, x, rec)
    assert overhead.calls_per_step(model, x, rec, warmup=0) == first
