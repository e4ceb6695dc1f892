"""FP8 all-gather, TransformerLayer / GroupedLinear tensor parallelism and torch.compile of a
TP module, on CPU with gloo: two processes run ``_tp2_worker.py`` once (every case, in order),
as test_tensor_parallel.py does with its worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import check_case, run_workers

TIMEOUT_S = 120
_WORKER = Path(__file__).with_name("_tp2_worker.py")
_RECIPES = ("none", "delayed", "current", "mxfp8")
CASES = [
    "fp8_gather_bits", *(f"fp8_gather_fused_{r}" for r in _RECIPES), "fp8_gather_explain",
    *(f"transformer_layer_{r}_sp" for r in _RECIPES), "transformer_layer_none",
    "transformer_layer_current",
    *(f"grouped_{m}_{r}" for r in ("none", "current") for m in ("column", "row")),
    "compile_none", "compile_current", "bad_input_tp2",
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_workers(_WORKER, tmp_path_factory.mktemp("tp2"), TIMEOUT_S, "tensor-parallel")


@pytest.mark.parametrize("name", CASES)
def test_case(results: list[dict[str, str]], name: str) -> None:
    check_case(results, name)
