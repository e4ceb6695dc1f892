"""FP8 all-gather, TransformerLayer / GroupedLinear tensor parallelism and torch.compile of a
TP module, on CPU with gloo: two processes run ``_tp2_worker.py`` once (every case, in order),
as test_tensor_parallel.py does with its worker."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORLD = 2
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    out = tmp_path_factory.mktemp("tp2")
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
