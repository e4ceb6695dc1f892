"""The launcher of the distributed tests: ``world`` processes run one worker script once (every
case, in order), each writing ``rank<r>.json`` (case name -> "ok" or the error) into a folder;
every process under a timeout, so a hung collective fails the test instead of the run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_workers(
    worker: Path,
    out: Path,
    timeout_s: float,
    what: str,
    world: int = WORLD,
    backend: str = "gloo",
    only: list[str] | None = None,
) -> list[dict[str, str]]:
    """Every rank's results of ``worker`` (run as ``python worker RANK WORLD PORT OUT [ONLY]``)
    over ``backend`` (gloo: CPU tensors; nccl: CUDA tensors, one GPU per rank); ``only``: the
    cases to run (default every case)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "FUSIBLE_TEST_DIST_BACKEND": backend}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), str(world), str(port), str(out)]
            + ([",".join(only)] if only else []),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} workers did not finish within {timeout_s} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = []
    for r in range(world):
        path = out / f"rank{r}.json"
        if not path.exists():
            pytest.fail(f"rank {r} wrote no results (exit {procs[r].returncode}):\n{logs[r]}")
        res.append(json.loads(path.read_text()))
    return res


def check_case(results: list[dict[str, str]], name: str) -> None:
    for r, res in enumerate(results):
        assert name in res, f"rank {r} did not run {name}"
        assert res[name] == "ok", f"rank {r}: {res[name]}"


def two_rank_suite(
    worker: Path,
    cases: list[str],
    timeout_s: float,
    what: str,
    tag: str,
    skip: dict[str, str] | None = None,
) -> tuple[Any, Callable[..., None]]:
    """A test module's ``results`` fixture (``worker`` run once for the module on ``WORLD``
    ranks, in a temporary folder named after ``tag``) and its ``test_case`` test, one per name
    of ``cases``: bind both at module level, ``results, test_case = two_rank_suite(...)``.
    ``skip``: case name -> reason, for cases this installation cannot pass (reported skipped)."""
    skips = dict(skip or {})

    @pytest.fixture(scope="module")
    def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
        return run_workers(worker, tmp_path_factory.mktemp(tag), timeout_s, what)

    @pytest.mark.parametrize("name", cases)
    def test_case(results: list[dict[str, str]], name: str) -> None:
        if name in skips:
            pytest.skip(skips[name])
        check_case(results, name)

    return results, test_case
