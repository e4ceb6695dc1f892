"""Tensor and sequence parallelism and FSDP2 at world size 3 (gloo, CPU): three processes run
``_w3_worker.py`` once for the module (every case, in order), each test reads its case's result
from every rank. Every process has a timeout: a hung collective fails the tests, never CI."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import check_case, run_workers

TIMEOUT_S = 120
WORLD = 3
_WORKER = Path(__file__).with_name("_w3_worker.py")
_RECIPES = ("none", "delayed", "current", "mxfp8")
CASES = [
    *(f"linear_{k}_{r}{sp}" for k in ("column", "row") for r in _RECIPES for sp in ("", "_sp")),
    *(f"lnmlp_{r}_sp" for r in _RECIPES),
    "delayed_amax_reduction", "fsdp2_current", "bad_input",
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("w3")
    return run_workers(_WORKER, out, TIMEOUT_S, "world-size-3", world=WORLD)


@pytest.mark.parametrize("name", CASES)
def test_case(results: list[dict[str, str]], name: str) -> None:
    check_case(results, name)


def test_every_case_listed(results: list[dict[str, str]]) -> None:
    assert sorted(results[0]) == sorted(CASES)
