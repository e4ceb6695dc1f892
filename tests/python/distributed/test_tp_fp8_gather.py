"""FP8 all-gather, TransformerLayer / GroupedLinear tensor parallelism and torch.compile of a
TP module, on CPU with gloo: two processes run ``_tp2_worker.py`` once (every case, in order),
as test_tensor_parallel.py does with its worker."""

from __future__ import annotations

from pathlib import Path

from _launch import two_rank_suite

TIMEOUT_S = 120
_WORKER = Path(__file__).with_name("_tp2_worker.py")
_RECIPES = ("none", "delayed", "current", "mxfp8")
CASES = [
    "fp8_gather_bits", *(f"fp8_gather_fused_{r}" for r in _RECIPES), "fp8_gather_explain",
    *(f"transformer_layer_{r}_sp" for r in _RECIPES), "transformer_layer_none",
    "transformer_layer_current",
    *(f"grouped_{m}_{r}" for r in (*_RECIPES, "blockwise") for m in ("column", "row")),
    "compile_none", "compile_current",
    *(f"compile_sp_replicated_{r}" for r in ("none", "current", "delayed")), "bad_input_tp2",
]  # fmt: skip


results, test_case = two_rank_suite(_WORKER, CASES, TIMEOUT_S, "tensor-parallel", "tp2")
