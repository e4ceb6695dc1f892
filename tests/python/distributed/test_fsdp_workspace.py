"""The weight workspace cache (``is_first_microbatch``) under FSDP2 (``fully_shard``, resharded):
it sees the optimizer's updates of the sharded parameter and not FSDP2's all-gathers. gloo,
CPU, two processes running ``_fsdpw_worker.py`` once for the module, every process under a
timeout. See the worker's cases for what each checks."""

from __future__ import annotations

from pathlib import Path

from _launch import two_rank_suite

_WORKER = Path(__file__).with_name("_fsdpw_worker.py")
CASES = [f"{c}_{r}" for r in ("delayed", "current", "mxfp8") for c in ("steps", "microbatches")]
CASES.append("steps_current_foreach")  # SGD foreach=True (the CUDA default): no version bump

results, test_case = two_rank_suite(_WORKER, CASES, 120, "FSDP2 workspace cache", "fsdpw")


def test_every_case_listed(results: list[dict[str, str]]) -> None:
    assert sorted(results[0]) == sorted(CASES)
