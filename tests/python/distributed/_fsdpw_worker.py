"""One rank of the FSDP2 + weight workspace cache tests (test_fsdp_workspace.py): the cache keys
a ``fully_shard``-ed weight by its sharded parameter (fusible/ops/workspace.py,
``fsdp_param_of``), so it sees the optimizer's steps and not FSDP2's all-gathers. Same harness
as _tp_worker.py: ``python _fsdpw_worker.py RANK WORLD PORT OUT_DIR [CASES]``. Eager, resharded
after forward and backward (FSDP2's default), SGD. Hits and misses are counted on the op's
``WorkspaceCache`` (a store is a miss: the weight was quantized again)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import _tp_worker as base
import torch
from _tp_worker import RECIPES, exact, rand
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fusible
from fusible.ops.workspace import WorkspaceCache

S, H, F = base.S, base.H, base.F
LR = 0.5
CASES: list[Any] = []
case = base.case_adder(CASES)


def sharded_linear(ref: torch.nn.Module | None = None) -> Any:
    m = fusible.Linear(H, F)
    if ref is not None:
        m.load_state_dict(ref.state_dict())
    fully_shard(m, mesh=init_device_mesh(base.DEVICE, (base.WORLD,)), reshard_after_forward=True)
    return m


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Hits (a lookup that returned the cached workspace) and stores (quantized and cached)."""
    n = {"hit": 0, "store": 0}
    lookup, store = WorkspaceCache.lookup, WorkspaceCache.store

    def counted_lookup(self: Any, *a: Any, **k: Any) -> Any:
        ws = lookup(self, *a, **k)
        n["hit"] += ws is not None
        return ws

    def counted_store(self: Any, *a: Any, **k: Any) -> None:
        n["store"] += 1
        store(self, *a, **k)

    WorkspaceCache.lookup, WorkspaceCache.store = counted_lookup, counted_store  # type: ignore[method-assign]
    try:
        yield n
    finally:
        WorkspaceCache.lookup, WorkspaceCache.store = lookup, store  # type: ignore[method-assign]


def micro(m: Any, x: torch.Tensor, dy: torch.Tensor, rec: Any, first: bool) -> tuple[Any, Any]:
    x = x.detach().clone().requires_grad_()
    with fusible.autocast(recipe=rec):
        y = m(x, is_first_microbatch=first)
    y.backward(dy)
    return y.detach(), x.grad


def steps(rec_name: str, foreach: bool = False) -> None:
    """Three SGD steps, one micro-batch each: ``is_first_microbatch=False`` after step 0 against
    ``True`` every step. Outputs, input gradients and parameters after each step bit for bit;
    every ``False`` after a step is a miss (the optimizer's update is seen: before, at the same
    address, it reused the FP8 weight of the step before). ``foreach``: SGD's foreach step (the
    default on CUDA), whose DTensor writes bump no version: the step count tells."""
    rec = RECIPES[rec_name]
    torch.manual_seed(0)
    ref = fusible.Linear(H, F)
    a, b = sharded_linear(ref), sharded_linear(ref)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, foreach=foreach) for m in (a, b)]
    for k in range(3):
        x, dy = rand(S, H, seed=200 + k + base.RANK), rand(S, F, seed=210 + k + base.RANK)
        with counting() as n:
            got = micro(a, x, dy, rec, first=k == 0)
        if n != {"hit": 0, "store": 1}:
            raise AssertionError(f"steps {rec_name} step {k}: {n} (wanted a miss)")
        want = micro(b, x, dy, rec, first=True)
        exact(f"steps {rec_name} step {k} output", got[0], want[0])
        exact(f"steps {rec_name} step {k} dx", got[1], want[1])
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            exact(f"steps {rec_name} step {k} {name}", p.to_local(), q.to_local())


def microbatches(rec_name: str) -> None:
    """Two micro-batches of one step (True, False; the weight resharded and gathered again in
    between, no optimizer step): the second is a cache hit (the same workspace object), outputs
    and input gradients equal the unsharded module's with the same flags bit for bit. After an
    SGD step, ``False`` is a miss."""
    rec = RECIPES[rec_name]
    torch.manual_seed(0)
    ref = fusible.Linear(H, F)
    m = sharded_linear(ref)
    op = m[0]
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    wss = []
    for k, first in enumerate((True, False)):
        x, dy = rand(S, H, seed=220 + k + base.RANK), rand(S, F, seed=230 + k + base.RANK)
        with counting() as n:
            got = micro(m, x, dy, rec, first)
        wanted = {"hit": 0, "store": 1} if first else {"hit": 1, "store": 0}
        if n != wanted:
            raise AssertionError(f"microbatches {rec_name} mb {k}: {n}, wanted {wanted}")
        want = micro(ref, x, dy, rec, first)
        exact(f"microbatches {rec_name} mb {k} output", got[0], want[0])
        exact(f"microbatches {rec_name} mb {k} dx", got[1], want[1])
        wss.append(op.workspace_cache.workspace)
    if op.workspace_cache.fsdp is None:
        raise AssertionError(f"microbatches {rec_name}: the weight was not found FSDP2's")
    if wss[1] is not wss[0]:
        raise AssertionError(f"microbatches {rec_name}: the second micro-batch quantized again")
    opt.step()
    opt.zero_grad()
    x, dy = rand(S, H, seed=240 + base.RANK), rand(S, F, seed=241 + base.RANK)
    with counting() as n:
        micro(m, x, dy, rec, False)
    if n != {"hit": 0, "store": 1}:
        raise AssertionError(f"microbatches {rec_name} after the step: {n} (wanted a miss)")


for _rec in ("delayed", "current", "mxfp8"):
    case(f"steps_{_rec}")(lambda r=_rec: steps(r))
    case(f"microbatches_{_rec}")(lambda r=_rec: microbatches(r))
case("steps_current_foreach")(lambda: steps("current", foreach=True))


if __name__ == "__main__":
    base.main(CASES)
