"""Tensor and sequence parallelism, and FSDP2, on CPU with gloo: two processes run
``_tp_worker.py`` once for the module (every case, in order) and each test reads its case's
result from both ranks. Every process has a timeout: a hung collective fails the tests, never
CI."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import two_rank_suite

import fusible

TIMEOUT_S = 240
_WORKER = Path(__file__).with_name("_tp_worker.py")
_RECIPES = ("none", "delayed", "current", "mxfp8")
CASES = [
    *(f"{k}_{r}{sp}" for k in ("linear_column", "linear_row", "lnlinear", "lnmlp")
      for r in _RECIPES for sp in ("", "_sp")),
    "linear_row_return_bias_none", "linear_row_return_bias_delayed_sp",
    "lnmlp_swiglu_sp", "lnmlp_swiglu_current", "delayed_amax_reduction", "explain", "bad_input",
    "fsdp2",
]  # fmt: skip


results, test_case = two_rank_suite(_WORKER, CASES, TIMEOUT_S, "tensor-parallel", "tp")


def test_bad_arguments_without_a_group() -> None:
    with pytest.raises(ValueError, match=r"Linear: parallel_mode must be 'column', 'row' or None"):
        fusible.Linear(8, 8, parallel_mode="col")
    with pytest.raises(ValueError, match=r"Linear: sequence_parallel=True needs tp_group"):
        fusible.Linear(8, 8, parallel_mode="column", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"LayerNormMLP: sequence_parallel=True needs tp_group"):
        fusible.LayerNormMLP(8, 8, sequence_parallel=True)
    with pytest.raises(TypeError, match=r"LayerNormLinear: sequence_parallel must be a bool"):
        fusible.LayerNormLinear(8, 8, sequence_parallel=1)  # type: ignore[arg-type]
    # No group: parallel_mode alone splits nothing (tp_size 1), as in TransformerEngine.
    m = fusible.Linear(8, 6, parallel_mode="column")
    assert tuple(m.weight.shape) == (6, 8) and m.tp_size == 1
