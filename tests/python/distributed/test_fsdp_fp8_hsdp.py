"""FSDP2's HSDP with the FP8 weight all-gather: four processes (gloo, CPU) on a (replicate=2,
shard=2) mesh run ``_fsdp_worker.py``'s ``hsdp_*`` cases: ``fully_shard_fp8`` of a
``LayerNormMLP`` under current and delayed scaling, two SGD steps, against the unsharded module
with the same FP8 weights, bit for bit but for the gradients (within 1e-6: HSDP sums over the
shard, then the replicas), and ``precompute_fp8_scales`` (one collective, same bits as the
gathers agreeing themselves). The scales are agreed over the shard dimension: the replicas hold
the same shards. Every process has a timeout."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import check_case, run_workers

TIMEOUT_S = 180
_WORKER = Path(__file__).with_name("_fsdp_worker.py")
CASES = ["hsdp_lnmlp_current", "hsdp_lnmlp_delayed", "hsdp_precompute_current",
         "hsdp_precompute_delayed"]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("fsdp_fp8_hsdp")
    return run_workers(_WORKER, out, TIMEOUT_S, "HSDP FP8", world=4, only=CASES)


@pytest.mark.parametrize("name", CASES)
def test_case(results: list[dict[str, str]], name: str) -> None:
    check_case(results, name)
