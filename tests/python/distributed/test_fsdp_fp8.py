"""FSDP2 with an FP8 weight all-gather (``fusible.distributed.fully_shard_fp8``) on CPU with
gloo: two processes run ``_fsdp_worker.py`` once (every case, in order), as
test_tensor_parallel.py does with its worker; every process under a timeout."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import two_rank_suite

from fusible.ops.basic.quantized_weight import compile_quantized_supported

TIMEOUT_S = 240
_WORKER = Path(__file__).with_name("_fsdp_worker.py")
CASES = [
    *(f"train_{k}_{r}" for k in ("linear", "lnlinear", "lnmlp", "tlayer", "grouped")
      for r in ("current", "delayed")),
    "train_lnmlp_delayed_no_reshard", "grouped_shared_weight",
    "delayed_state_checkpoint", "all_gather_bytes", "mixed_group",
    "plain_fully_shard_unchanged", "bad_input", "precompute_scales",
    "precompute_scales_delayed", "precompute_scales_foreach", "precompute_scales_manual",
    *(f"compile_{k}_{r}" for k in ("linear", "lnmlp", "tlayer") for r in ("current", "delayed")),
    "compile_lnmlp_current_inductor",
    "checkpointed_layers_current", "checkpointed_layers_delayed",
]  # fmt: skip
# torch.compile reads the gathered FP8 weights through QuantizedTensor's traceable-subclass
# protocol, tested on torch >= 2.11; older releases raise a clear error (test_quantized_weights).
_OLD = "torch.compile with FP8 weights is tested on torch >= 2.11"
_SKIP = {} if compile_quantized_supported() else {
    c: _OLD for c in CASES if "compile" in c or "checkpointed" in c}  # fmt: skip
results, test_case = two_rank_suite(_WORKER, CASES, TIMEOUT_S, "FSDP", "fsdp", skip=_SKIP)


def test_fully_shard_fp8_needs_a_module() -> None:
    from fusible.distributed import fully_shard_fp8

    with pytest.raises(TypeError, match=r"fully_shard_fp8: 'module' must be a torch.nn.Module"):
        fully_shard_fp8("model")  # type: ignore[arg-type]
