"""The distributed cases at world size 1: on one GPU through NCCL (the same workers with
``FUSIBLE_TEST_DIST_BACKEND=nccl``: CUDA tensors, NCCL collectives; skipped without a GPU and
NCCL), and on CPU through gloo (the tp, fsdp and ddp suites: one rank is what users run to
debug, and FSDP2 takes another path there). With one rank every split is the whole tensor, so
this checks the single-rank paths and, on NCCL, the CUDA side of the parallel ops; the two-rank
numerics are the two-rank suites'."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import test_ddp
import test_fsdp_fp8
import test_tensor_parallel
import test_tp_fp8_gather
import torch
from _launch import check_case, run_workers

_SUITES = {"tp": test_tensor_parallel, "tp2": test_tp_fp8_gather, "fsdp": test_fsdp_fp8,
           "ddp": test_ddp}  # fmt: skip
# Cases written for two ranks: they check what only happens over more than one rank (a split
# that does not divide, bytes moved by a collective FSDP2 skips on one rank, the amaxes agreed
# between ranks, the comm ops in explain()), or build their inputs for two ranks' shapes.
_TWO_RANKS = {
    ("tp", "delayed_amax_reduction"),
    ("tp", "explain"),
    ("tp", "bad_input"),
    ("tp2", "fp8_gather_bits"),
    *(("tp2", f"fp8_gather_fused_{r}") for r in ("none", "delayed", "current", "mxfp8")),
    ("tp2", "compile_none"),
    ("tp2", "compile_current"),
    *(("tp2", f"compile_sp_replicated_{r}") for r in ("none", "current", "delayed")),
    ("tp2", "bad_input_tp2"),
    ("fsdp", "all_gather_bytes"),
    ("fsdp", "bad_input"),
    *(("ddp", f"delayed_amax_group_{k}") for k in ("linear", "lnmlp", "seq")),
}

_NCCL = (torch.cuda.is_available() and torch.distributed.is_available()
         and torch.distributed.is_nccl_available())  # fmt: skip
_GLOO_SUITES = ("tp", "fsdp", "ddp")


Results = Callable[[str, str], list[dict[str, str]]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """(backend, suite) -> every rank's results, run on first use with only the cases listed
    here (a pytest-xdist worker runs only the suites of its tests)."""
    got: dict[tuple[str, str], list[dict[str, str]]] = {}

    def get(backend: str, suite: str) -> list[dict[str, str]]:
        if (backend, suite) not in got:
            m = _SUITES[suite]
            got[backend, suite] = run_workers(
                m._WORKER, tmp_path_factory.mktemp(f"{backend}-{suite}"), m.TIMEOUT_S,
                f"{backend} world-1 {suite}", world=1, backend=backend,
                only=[c for c in m.CASES if (suite, c) not in _TWO_RANKS],
            )  # fmt: skip
        return got[backend, suite]

    return get


@pytest.mark.parametrize(
    "backend,suite,name",
    [(b, k, c) for b in ("gloo", "nccl") for k, m in _SUITES.items() for c in m.CASES
     if (k, c) not in _TWO_RANKS and (b == "nccl" or k in _GLOO_SUITES)],
)  # fmt: skip
def test_case_world1(results: Results, backend: str, suite: str, name: str) -> None:
    if backend == "nccl" and not _NCCL:
        pytest.skip("needs a CUDA GPU and NCCL")
    skip = getattr(_SUITES[suite], "_SKIP", {})  # cases this torch cannot pass, by the suite
    if name in skip:
        pytest.skip(skip[name])
    check_case(results(backend, suite), name)
