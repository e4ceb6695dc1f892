"""One rank of the FSDP2 + torch.compile, FSDP2 + ``quantized_model_init`` and FSDP2 + weight
workspace cache tests (test_fsdp_compile.py). Same harness as _tp_worker.py (whose helpers and
``main`` it reuses): ``python _fsdpc_worker.py RANK WORLD PORT OUT_DIR [CASES]``.

Compiled cases: ``torch.compile(model, fullgraph=True)`` of a ``fully_shard``-ed module runs
FSDP2's hooks outside dynamo (torch 2.13's ``OptimizedModule`` calls the module's ``__call__``
eagerly and compiles the inner ``forward`` frame; the hooks are also ``_dynamo_disable``-d), so
the forward is one graph and the all-gathers / reduce-scatters stay eager. Compared against the
same module under eager FSDP2 over two SGD steps. ``aot_eager`` runs the very kernels eager runs:
bit for bit. Under inductor the ATen glue is generated code: bias gradients (an fp32 ``sum(0)``
reduction that inductor reassociates) within 1e-4 of max(1, the largest value)
(``_tp_worker.sharded_grads_then_step``),
everything else bit for bit. The cases compile many modules in one process without
``torch._dynamo.reset()`` in between: that is what broke before (see docs/distributed.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _tp_worker as base
import torch
import torch.distributed as dist
from _tp_worker import RECIPES, exact, rand
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fusible
from fusible import recipe as R
from fusible.quantization.tensor import QuantizedTensor

S, H, F = base.S, base.H, base.F
# Every fusible module compiled in a frame of its own is one more cache entry of
# Sequential.forward (its plan ids are constants of the graph): more than dynamo's default 8
# here, as in any model with more than 8 fully_shard-ed fusible layers (docs/distributed.md).
torch._dynamo.config.recompile_limit = 64
LR = 0.5
CASES: list[Any] = []
MAKERS: dict[str, Callable[[], torch.nn.Module]] = {
    "linear": lambda: fusible.Linear(H, F),
    "lnmlp": lambda: fusible.LayerNormMLP(H, F),
}


case = base.case_adder(CASES)


def mesh() -> Any:
    return init_device_mesh(base.DEVICE, (base.WORLD,))


def step(m: Any, x: torch.Tensor, dy: torch.Tensor, rec: Any) -> tuple[Any, Any]:
    x = x.detach().clone().requires_grad_()
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = m(x)
    y.backward(dy)
    return y.detach(), x.grad


def step_both(tag: str, a: Any, b: Any, seed: int, out_dim: int, rec: Any) -> None:
    """One step of ``a``, then of ``b``, on the same input and output gradient (this rank's,
    from ``seed``): outputs and input gradients bit for bit."""
    x = rand(S, H, seed=seed + base.RANK)
    dy = rand(S, out_dim, seed=seed + 1 + base.RANK)
    ya, dxa = step(a, x, dy, rec)
    yb, dxb = step(b, x, dy, rec)
    exact(f"{tag} output", ya, yb)
    exact(f"{tag} dx", dxa, dxb)


def compiled(kind: str, rec_name: str, backend: str) -> None:
    """Two SGD steps of ``fully_shard(m)`` compiled (``fullgraph=True``) against the same
    module under eager FSDP2: outputs, input gradients, every gradient shard and every
    parameter shard after each step."""
    rec = RECIPES[rec_name]
    torch.manual_seed(0)
    eager, comp = MAKERS[kind](), MAKERS[kind]()
    comp.load_state_dict(eager.state_dict())
    fully_shard(eager, mesh=mesh())
    fully_shard(comp, mesh=mesh())
    c = torch.compile(comp, fullgraph=True, backend=backend)
    graphs = []
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (eager, comp)]
    out_dim = H if kind == "lnmlp" else F
    for k in range(2):
        tag = f"{kind} {rec_name} {backend} step {k}"
        step_both(tag, eager, c, 80 + 10 * k, out_dim, rec)
        graphs.append(base.sharded_grads_then_step(tag, comp, eager, opts, backend))
    if graphs[1] != graphs[0]:
        raise AssertionError(f"{kind} {rec_name} {backend}: the second step recompiled")


for _kind in MAKERS:
    for _rec in RECIPES:
        case(f"compile_{_kind}_{_rec}")(lambda k=_kind, r=_rec: compiled(k, r, "aot_eager"))
    case(f"compile_{_kind}_current_inductor")(lambda k=_kind: compiled(k, "current", "inductor"))


@case("compile_root_of_sharded_layers")
def root_of_sharded_layers() -> None:
    """A root that is compiled as a whole while its children are ``fully_shard``-ed: each
    child's FSDP2 hooks are ``_dynamo_disable``-d, so ``fullgraph=True`` fails on them (dynamo's
    "Attempted to call function marked as skipped ... `disable`"); without ``fullgraph``
    dynamo breaks the graph at the hooks and the result equals eager FSDP2 bit for bit."""
    rec = R.Float8CurrentScaling()
    torch.manual_seed(0)

    def make() -> torch.nn.Module:
        root = torch.nn.Sequential(fusible.Linear(H, F), fusible.Linear(F, H))
        for layer in root:
            fully_shard(layer, mesh=mesh())
        fully_shard(root, mesh=mesh())
        return root

    eager = make()
    comp = make()
    comp.load_state_dict(eager.state_dict())
    x, dy = rand(S, H, seed=90 + base.RANK), rand(S, H, seed=91 + base.RANK)
    try:
        step(torch.compile(comp, fullgraph=True, backend="aot_eager"), x, dy, rec)
    except Exception as e:  # torch._dynamo.exc.Unsupported, raised at the child's hook
        if "marked as skipped" not in str(e) or "`disable`" not in str(e):
            raise
    else:
        raise AssertionError("fullgraph compile of a root over sharded layers ran; update docs")
    for m in comp.modules():
        m.zero_grad(set_to_none=True)
    c = torch.compile(comp, backend="aot_eager")
    base.same_step("root", c, eager, x, dy, rec)


def qinit(kind: str, rec: Any) -> None:
    """``fully_shard`` on a module built under ``quantized_model_init``: FSDP2 chunks each
    weight with ``torch.chunk``, which a ``QuantizedTensor`` answers with its dequantization
    (its fallback for ops it does not implement), so the shards are plain high-precision
    tensors of the nominal dtype holding the exact dequantized weight: the FP8 storage is gone.
    The sharded module then trains as the unsharded module built from those dequantized
    weights does (same recipe), bit for bit (gradients: their mean over ranks)."""
    torch.manual_seed(0)
    with fusible.quantized_model_init(recipe=rec):
        q = MAKERS[kind]()
    qnames = [n for n, p in q.named_parameters() if isinstance(p, QuantizedTensor)]
    if not qnames:
        raise AssertionError("quantized_model_init built no quantized weight")
    ref = MAKERS[kind]()
    with torch.no_grad():
        for p, r in zip(q.parameters(), ref.parameters(), strict=True):
            r.copy_(p.dequantize() if isinstance(p, QuantizedTensor) else p)
    fully_shard(q, mesh=mesh())
    for n, p in q.named_parameters():
        local = p.to_local()
        if type(local) is not torch.Tensor:
            raise AssertionError(f"{n}: shard is {type(local).__name__}; update the docs")
        full = p.full_tensor()
        exact(f"{n} gathered == dequantized", full, ref.get_parameter(n))
    out_dim = H if kind == "lnmlp" else F
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (q, ref)]
    for k in range(2):
        tag = f"qinit {kind} {type(rec).__name__} step {k}"
        step_both(tag, q, ref, 100 + 10 * k, out_dim, rec)
        for (n, p), r in zip(q.named_parameters(), ref.parameters(), strict=True):
            g = r.grad.clone()
            dist.all_reduce(g)
            base.close(f"{tag} grad {n}", p.grad.full_tensor(), g / base.WORLD, 1e-6)
            r.grad.copy_(p.grad.full_tensor())  # the same update on both sides
        for o in opts:
            o.step()
            o.zero_grad()
        for n, p in q.named_parameters():
            exact(f"{tag} {n} after the step", p.full_tensor(), ref.get_parameter(n))


case("qinit_linear_current")(lambda: qinit("linear", R.Float8CurrentScaling()))
case("qinit_lnmlp_current")(lambda: qinit("lnmlp", R.Float8CurrentScaling()))
case("qinit_linear_mxfp8")(lambda: qinit("linear", R.MXFP8BlockScaling()))


def cache(rec_name: str, keep_unsharded: bool) -> None:
    """The weight workspace cache (``is_first_microbatch`` True, False, False: three
    micro-batches of one step) of a ``fully_shard``-ed Linear against the unsharded module with
    the same flags: outputs and input gradients bit for bit, the accumulated gradient its mean
    over ranks. Kept unsharded across the micro-batches (``reshard_after_forward=False``,
    ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)`` until the last
    one) the cached copy is reused (the same object), under every recipe. Resharded (FSDP2's
    default) the weight is gathered again into freshly allocated storage, written with its
    version counter preserved; the cache keys it by its sharded parameter (fsdp_param_of in
    fusible/ops/workspace.py), so ``False`` reuses the cached copy there too (the same object),
    under every recipe (delayed scaling included: a miss would quantize with the scale updated
    since the first micro-batch). After optimizer steps: _fsdpw_worker.py."""
    rec = RECIPES[rec_name]
    torch.manual_seed(0)
    ref, m = fusible.Linear(H, F), fusible.Linear(H, F)
    m.load_state_dict(ref.state_dict())
    fully_shard(m, mesh=mesh(), reshard_after_forward=not keep_unsharded)
    op = m[0]
    wss = []
    for k, first in enumerate((True, False, False)):
        last = k == 2
        if keep_unsharded:
            m.set_reshard_after_backward(last)
            m.set_requires_gradient_sync(last)
        x, dy = rand(S, H, seed=120 + k + base.RANK), rand(S, F, seed=123 + k + base.RANK)
        outs = []
        for mod in (m, ref):
            xx = x.clone().requires_grad_()
            with fusible.autocast(recipe=rec):
                y = mod(xx, is_first_microbatch=first)
            y.backward(dy)
            outs.append((y.detach(), xx.grad))
        exact(f"cache {rec_name} mb {k} output", outs[0][0], outs[1][0])
        exact(f"cache {rec_name} mb {k} dx", outs[0][1], outs[1][1])
        wss.append(op.workspace_cache.workspace)
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        g = q.grad.clone()
        dist.all_reduce(g)
        base.close(f"cache {rec_name} grad {n}", p.grad.full_tensor(), g / base.WORLD, 1e-6)
    if not (wss[1] is wss[0] and wss[2] is wss[0]):
        raise AssertionError(f"cache {rec_name}: the weight was quantized again")


for _rec in ("delayed", "current", "mxfp8"):
    case(f"cache_{_rec}")(lambda r=_rec: cache(r, False))
for _rec in ("delayed", "current", "mxfp8"):
    case(f"cache_{_rec}_kept_unsharded")(lambda r=_rec: cache(r, True))


def main() -> None:
    """The shared main with a longer collective timeout (180 s, not 60): compiling on a loaded
    CPU, one rank may reach the barrier after a case more than a minute after the other (the
    launcher's per-process timeout still catches a hang)."""
    base.main(CASES, timeout_s=180.0)


if __name__ == "__main__":
    main()
