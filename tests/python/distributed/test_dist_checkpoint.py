"""Checkpoints across a change of world size (gloo, CPU): tensor-parallel modules through
``fusible.distributed.tp_full_state_dict`` / ``tp_load_full_state_dict`` (a full state dict,
``torch.save``), FSDP2 ``fully_shard``-ed and ``fully_shard_fp8``-ed modules through
``torch.distributed.checkpoint`` (the FP8 all-gather's checkpoint holds the master shards, as
plain FSDP2's: it also loads into a ``fully_shard`` model).
Four runs of ``_ckpt_worker.py``, sharing one checkpoint folder: world 2 saves; world 3 loads
world 2's and saves; world 1 loads world 2's and 3's and saves; world 2 loads world 3's and 1's.
Every process has a timeout."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import check_case, run_workers

TIMEOUT_S = 90
_WORKER = Path(__file__).with_name("_ckpt_worker.py")
_SAVE = ["tp_save", "tpdcp_save", "fsdp_save", "fsdp8_save"]


def _loads(w: int) -> list[str]:
    return [f"tp_load_w{w}", f"tpdcp_load_w{w}", f"fsdp_load_w{w}", f"fsdp8_load_w{w}"]


# (world size, cases): the runs in order, each loading what the earlier ones saved. fsdp8: the
# modules under fully_shard_fp8 (FP8 weight all-gather).
RUNS: list[tuple[int, list[str]]] = [
    (2, [*_SAVE, "tp_merge_unreduced", "tp_bad_shapes", "tp_layer", "tpdcp_mixed"]),
    (3, [*_loads(2), *_SAVE, "tp_merge_unreduced", "tp_bad_shapes", "tp_layer"]),
    (1, [*_loads(2), *_loads(3), "fsdp_from8_w2", *_SAVE, "tp_layer"]),
    (2, [*_loads(3), *_loads(1), "fsdp_from8_w3"]),
]
CASES = [(i, name) for i, (_, names) in enumerate(RUNS) for name in names]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, str]]]:
    root = tmp_path_factory.mktemp("ckpt")
    out = []
    for i, (world, names) in enumerate(RUNS):
        d = root / f"run{i}_w{world}"
        d.mkdir()
        out.append(run_workers(_WORKER, d, TIMEOUT_S, f"checkpoint (world {world})", world=world,
                               only=names))  # fmt: skip
    return out


@pytest.mark.parametrize(("run", "name"), CASES, ids=[f"w{RUNS[i][0]}-{n}" for i, n in CASES])
def test_case(results: list[list[dict[str, str]]], run: int, name: str) -> None:
    check_case(results[run], name)
