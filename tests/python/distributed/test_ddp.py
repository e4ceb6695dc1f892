"""``torch.nn.parallel.DistributedDataParallel`` over fusible modules (``Linear``,
``LayerNormMLP``, an ``ops.Sequential``): gradients averaged over the ranks and split into
several buckets, ``no_sync()`` accumulation with ``is_first_microbatch``, delayed scaling with
``amax_reduction_group``, ``torch.compile`` of the DDP model (dynamo's DDPOptimizer). gloo,
CPU, two processes running ``_ddp_worker.py`` once for the module, every process under a
timeout. See the worker's cases for what each checks."""

from __future__ import annotations

from pathlib import Path

from _launch import two_rank_suite

_WORKER = Path(__file__).with_name("_ddp_worker.py")
TIMEOUT_S = 120
_KINDS = ("linear", "lnmlp", "seq")
_RECIPES = ("none", "delayed", "current", "mxfp8", "blockwise")
CASES = [
    *(f"train_{k}_{r}" for k in _KINDS for r in _RECIPES),
    "train_lnmlp_current_bucket_view",
    "train_seq_mxfp8_static_graph",
    "train_lnmlp_delayed_find_unused",
    *(f"nosync_{k}_{r}" for k in _KINDS for r in _RECIPES[1:]),
    "nosync_lnmlp_none",
    *(f"delayed_amax_group_{k}" for k in _KINDS),
    *(f"compile_linear_{r}" for r in _RECIPES[:4]),
    "compile_seqbig_none", "compile_seqbig_current", "compile_opsbig_current",
    "compile_linear_current_inductor",
    "qinit_linear_current", "qinit_linear_mxfp8",
]  # fmt: skip

results, test_case = two_rank_suite(_WORKER, CASES, TIMEOUT_S, "DDP", "ddp")


def test_every_case_listed(results: list[dict[str, str]]) -> None:
    assert sorted(results[0]) == sorted(CASES)
