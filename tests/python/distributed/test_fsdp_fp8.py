"""FSDP2 with an FP8 weight all-gather (``fusible.distributed.fully_shard_fp8``) on CPU with
gloo: two processes run ``_fsdp_worker.py`` once (every case, in order), as
test_tensor_parallel.py does with its worker; every process under a timeout."""

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
_WORKER = Path(__file__).with_name("_fsdp_worker.py")
CASES = [
    *(f"train_{k}_{r}" for k in ("linear", "lnlinear", "lnmlp") for r in ("current", "delayed")),
    "train_lnmlp_delayed_no_reshard", "all_gather_bytes", "mixed_group",
    "plain_fully_shard_unchanged", "bad_input", "compile",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    out = tmp_path_factory.mktemp("fsdp")
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
        pytest.fail(f"FSDP workers did not finish within {TIMEOUT_S} s")
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


def test_fully_shard_fp8_needs_a_module() -> None:
    from fusible.distributed import fully_shard_fp8

    with pytest.raises(TypeError, match=r"fully_shard_fp8: 'module' must be a torch.nn.Module"):
        fully_shard_fp8("model")  # type: ignore[arg-type]
