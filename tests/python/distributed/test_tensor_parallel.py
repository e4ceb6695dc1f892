"""Tensor and sequence parallelism, and FSDP2, on CPU with gloo: two processes run
``_tp_worker.py`` once for the module (every case, in order) and each test reads its case's
result from both ranks. Every process has a timeout: a hung collective fails the tests, never
CI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusible

WORLD = 2
TIMEOUT_S = 240
_WORKER = Path(__file__).with_name("_tp_worker.py")
_RECIPES = ("none", "delayed", "current", "mxfp8")
CASES = [
    *(f"{k}_{r}{sp}" for k in ("linear_column", "linear_row", "lnlinear", "lnmlp")
      for r in _RECIPES for sp in ("", "_sp")),
    "lnmlp_swiglu_sp", "lnmlp_swiglu_current", "delayed_amax_reduction", "explain", "bad_input",
    "fsdp2",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    out = tmp_path_factory.mktemp("tp")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(_WORKER), str(r), str(WORLD), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"tensor-parallel workers did not finish within {TIMEOUT_S} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = []
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        if not path.exists():
            pytest.fail(f"rank {r} wrote no results (exit {procs[r].returncode}):\n{logs[r]}")
        res.append(json.loads(path.read_text()))
    return res


@pytest.mark.parametrize("name", CASES)
def test_case(results: list[dict[str, str]], name: str) -> None:
    for r, res in enumerate(results):
        assert name in res, f"rank {r} did not run {name}"
        assert res[name] == "ok", f"rank {r}: {res[name]}"


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
