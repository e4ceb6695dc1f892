"""One rank of the DistributedDataParallel tests (test_ddp.py). Same harness as _tp_worker.py
(whose helpers and ``main`` it reuses): ``python _ddp_worker.py RANK WORLD PORT OUT_DIR [CASES]``.

Each rank feeds its own tokens. DDP averages the ranks' gradients (each bucket divided by the
world size, then summed: on two ranks ``g0/2 + g1/2``, exact and order-free), so the reference
is the single-process module run on each rank's input -- under a per-tensor FP8 recipe each
rank quantizes its own input with its own scale, which a single run of the concatenated batch
would not -- and the gradients averaged: **bit for bit** under every recipe. Several SGD steps
keep the ranks' parameters identical (and equal to the reference's); a small ``bucket_cap_mb``
spreads the parameters over several buckets (counted by a comm hook)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import _tp_worker as base
import torch
import torch.distributed as dist
from _fsdpw_worker import counting
from _tp_worker import exact, rand
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import fusible
from fusible import ops
from fusible import recipe as R
from fusible.optim import MasterWeightOptimizer
from fusible.quantization.data import qdata_tensors
from fusible.quantization.tensor import QuantizedTensor

S, H, F = base.S, base.H, base.F  # per rank: 64 tokens (MXFP8 / blockwise: 32-multiples)
LR = 0.25
BUCKET_MB = 0.01  # 10 kB: the 32 kB weights get a bucket each, the small tensors share one
RECIPES: dict[str, Any] = {**base.RECIPES, "blockwise": R.Float8BlockScaling()}
MAKERS: dict[str, Callable[[], torch.nn.Module]] = {
    "linear": lambda: fusible.Linear(H, F),
    "lnmlp": lambda: fusible.LayerNormMLP(H, F),
    "seq": lambda: ops.Sequential(ops.LayerNorm(H), ops.Linear(H, F), ops.GELU(), ops.Linear(F, H)),
}
# Two fusible modules of a 1 MiB weight each (fp32 4096 x 64): at bucket_cap_mb=1 dynamo's
# DDPOptimizer splits the compiled graph between them.
MAKERS["seqbig"] = lambda: torch.nn.Sequential(fusible.Linear(H, 4096), fusible.Linear(4096, H))
MAKERS["opsbig"] = lambda: ops.Sequential(ops.Linear(H, 4096), ops.GELU(), ops.Linear(4096, H))
OUT = {"linear": F, "lnmlp": H, "seq": H, "seqbig": H, "opsbig": H}
# Weights quantized through the workspace cache (one per Linear).
CACHED = {"linear": 1, "lnmlp": 2, "seq": 2}
CASES: list[Any] = []
case = base.case_adder(CASES)


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    ts = [torch.empty_like(t) for _ in range(base.WORLD)]
    dist.all_gather(ts, t.contiguous())
    return ts


def same_on_ranks(what: str, t: torch.Tensor) -> None:
    ts = gathered(t)
    for r, other in enumerate(ts[1:], 1):
        exact(f"{what}: rank {r} vs rank 0", other, ts[0])


def mean(gs: list[torch.Tensor]) -> torch.Tensor:
    """What DDP's all-reduce computes: each rank's gradient divided by the world size, summed
    (two ranks: ``a/2 + b/2``, exact and order-free)."""
    out = gs[0] / base.WORLD
    for g in gs[1:]:
        out = out + g / base.WORLD
    return out


def inputs(step: int, r: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Rank r's tokens (scaled per rank, so their amaxes and per-tensor scales differ).
    x = rand(S, H, seed=1000 + 10 * step + r) * (1 + r)
    return x, rand(S, out, seed=2000 + 10 * step + r)


def fwd_bwd(m: Any, x: torch.Tensor, dy: torch.Tensor, rec: Any, first: bool | None = None,
            group: Any = None) -> torch.Tensor:  # fmt: skip
    x = x.detach().clone().requires_grad_()
    kw = {} if first is None else {"is_first_microbatch": first}
    with fusible.autocast(enabled=rec is not None, recipe=rec, amax_reduction_group=group):
        y = m(x, **kw)
    y.backward(dy)
    return y.detach()


def build(kind: str, **ddp_kw: Any) -> tuple[Any, Any, list[torch.nn.Module]]:
    """(the DDP model, the module it wraps, one single-process reference per rank), all with
    the same weights (DDP broadcasts rank 0's at construction; the seed makes them equal
    anyway)."""
    torch.manual_seed(0)
    src = MAKERS[kind]()
    module = MAKERS[kind]()
    module.load_state_dict(src.state_dict())
    refs = []
    for _ in range(base.WORLD):
        ref = MAKERS[kind]()
        ref.load_state_dict(src.state_dict())
        refs.append(ref)
    ddp = DDP(module, bucket_cap_mb=ddp_kw.pop("bucket_cap_mb", BUCKET_MB), **ddp_kw)
    return ddp, module, refs


def counting_allreduce(state: list[int], bucket: Any) -> Any:
    """A comm hook (``state``: a list) that is DDP's default all-reduce (divide by the world size,
    sum over the default group) and records the index of each bucket it reduces in ``state``."""
    state.append(bucket.index())
    return allreduce_hook(None, bucket)  # type: ignore[arg-type]


# DDP checks that a hook's annotations are these objects (this module's are strings).
counting_allreduce.__annotations__ = {"state": list, "bucket": dist.GradBucket,
                                      "return": torch.futures.Future[torch.Tensor]}  # fmt: skip


def check_grads(what: str, module: Any, refs: list[torch.nn.Module]) -> None:
    for (name, p), *qs in zip(module.named_parameters(), *(r.parameters() for r in refs),
                              strict=True):  # fmt: skip
        if p.grad is None:
            raise AssertionError(f"{what}: {name} has no gradient")
        exact(f"{what} grad {name}", p.grad, mean([q.grad for q in qs]))
        same_on_ranks(f"{what} grad {name}", p.grad)


def check_params(what: str, module: Any, ref: torch.nn.Module) -> None:
    for (name, p), q in zip(module.named_parameters(), ref.parameters(), strict=True):
        exact(f"{what} {name}", p.detach(), q.detach())
        same_on_ranks(f"{what} {name}", p.detach())


def sgd_step(opts: list[torch.optim.Optimizer], module: Any, refs: list[torch.nn.Module]) -> None:
    """Each reference steps with the averaged gradient (what DDP hands the optimizer)."""
    for ps in zip(*(r.parameters() for r in refs), strict=True):
        g = mean([p.grad for p in ps])
        for p in ps:
            p.grad = g.clone()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def train(kind: str, rec_name: str, steps: int = 3, **ddp_kw: Any) -> None:
    """``steps`` SGD steps of DDP against the per-rank references averaged: gradients bit for
    bit and identical on the ranks, parameters after each step likewise; the parameters spread
    over several buckets (``bucket_cap_mb``)."""
    rec = RECIPES[rec_name]
    ddp, module, refs = build(kind, **ddp_kw)
    buckets: list[int] = []
    ddp.register_comm_hook(buckets, counting_allreduce)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (module, *refs)]
    for k in range(steps):
        tag = f"{kind} {rec_name} step {k}"
        buckets.clear()
        x, dy = inputs(k, base.RANK, OUT[kind])
        y = fwd_bwd(ddp, x, dy, rec)
        for r, ref in enumerate(refs):
            xr, dyr = inputs(k, r, OUT[kind])
            yr = fwd_bwd(ref, xr, dyr, rec)
            if r == base.RANK:
                exact(f"{tag} output", y, yr)
        check_grads(tag, module, refs)
        # Step 0 reduces one bucket (without find_unused_parameters DDP buckets nothing before
        # it has seen the backward's order), then DDP rebuilds them at bucket_cap_mb (after
        # step 0; static_graph: after step 1): several by the last step.
        if k == steps - 1 and len(set(buckets)) < 2:
            raise AssertionError(f"{tag}: buckets {buckets}, wanted several")
        sgd_step(opts, module, refs)
        check_params(f"{tag} after the step", module, refs[base.RANK])


for _kind in ("linear", "lnmlp", "seq"):
    for _rec in RECIPES:
        case(f"train_{_kind}_{_rec}")(lambda k=_kind, r=_rec: train(k, r))
# DDP's other reducer settings: .grad a view of the bucket; the graph declared static; the
# autograd graph searched for unused parameters (every fusible parameter gets a gradient).
case("train_lnmlp_current_bucket_view")(
    lambda: train("lnmlp", "current", gradient_as_bucket_view=True)
)
case("train_seq_mxfp8_static_graph")(lambda: train("seq", "mxfp8", static_graph=True))
case("train_lnmlp_delayed_find_unused")(
    lambda: train("lnmlp", "delayed", find_unused_parameters=True)
)


# ---- no_sync + is_first_microbatch --------------------------------------------------------------


def accumulate(kind: str, rec_name: str, micro: int = 3) -> None:
    """``micro`` micro-batches, all but the last under ``no_sync()`` (no all-reduce), the first
    ``is_first_microbatch=True``, the others ``False``: the accumulated gradients equal the
    per-rank references' accumulations (same flags) averaged, bit for bit; the later
    micro-batches hit the weight workspace cache (no weight quantized again). Then an SGD step
    and one more accumulation: ``True`` quantizes the stepped weights again."""
    rec = RECIPES[rec_name]
    ddp, module, refs = build(kind)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (module, *refs)]
    n_cached = CACHED[kind] if rec is not None else 0
    for s in range(2):
        for k in range(micro):
            tag = f"{kind} {rec_name} step {s} micro-batch {k}"
            first = k == 0
            x, dy = inputs(10 * s + k, base.RANK, OUT[kind])
            with ddp.no_sync() if k < micro - 1 else nullcontext(), counting() as n:
                y = fwd_bwd(ddp, x, dy, rec, first)
            wanted = {"hit": 0, "store": n_cached} if first else {"hit": n_cached, "store": 0}
            if n != wanted:
                raise AssertionError(f"{tag}: workspace cache {n}, wanted {wanted}")
            for r, ref in enumerate(refs):
                xr, dyr = inputs(10 * s + k, r, OUT[kind])
                yr = fwd_bwd(ref, xr, dyr, rec, first)
                if r == base.RANK:
                    exact(f"{tag} output", y, yr)
            if k < micro - 1:  # not synchronised yet: this rank's own accumulation
                for (name, p), q in zip(module.named_parameters(), refs[base.RANK].parameters(),
                                        strict=True):  # fmt: skip
                    exact(f"{tag} local grad {name}", p.grad, q.grad)
        check_grads(f"{kind} {rec_name} step {s} accumulated", module, refs)
        sgd_step(opts, module, refs)
        check_params(f"{kind} {rec_name} step {s} after the step", module, refs[base.RANK])


for _kind in ("linear", "lnmlp", "seq"):
    for _rec in ("delayed", "current", "mxfp8", "blockwise"):
        case(f"nosync_{_kind}_{_rec}")(lambda k=_kind, r=_rec: accumulate(k, r))
case("nosync_lnmlp_none")(lambda: accumulate("lnmlp", "none"))


# ---- delayed scaling: the recipe state is not a buffer -------------------------------------------


def delayed_state(m: torch.nn.Module) -> torch.Tensor:
    """Every delayed-scaling state of ``m`` (forward and backward): scales and amax histories."""
    out = []
    for op in m.modules():
        if not hasattr(op, "recipe_state"):
            continue
        for fwd in (True, False):
            st = op.recipe_state(fwd)
            if st is not None and hasattr(st, "scale"):
                out += [st.scale.detach().flatten(), st.amax_history.detach().flatten()]
    if not out:
        raise AssertionError("no delayed-scaling state found")
    return torch.cat(out)


def delayed_amax(kind: str) -> None:
    """DDP (``broadcast_buffers=True``, the default) under ``DelayedScaling``. fusible's recipe
    state (amax history, scale) is no buffer -- it lives on the ops and in ``_extra_state`` --
    so DDP neither broadcasts nor averages it: without ``amax_reduction_group`` each rank
    records its own tokens' amaxes and the scales drift apart. With
    ``autocast(amax_reduction_group=WORLD)`` the amaxes are max-reduced: after each of three
    steps the state is identical on the ranks and equals, bit for bit, the state of a
    single-process module fed the concatenated batch (the max of the ranks' amaxes is the whole
    batch's; its parameters are set to the DDP module's after each step). Gradients: that
    module's divided by 2 within 1e-5 of the largest value (a GEMM over all the tokens against
    two halves summed: another order)."""
    rec = RECIPES["delayed"]
    for group in (dist.group.WORLD, None):
        ddp, module, (full, _) = build(kind)
        if list(module.buffers()):
            raise AssertionError(f"{kind}: buffers {[n for n, _ in module.named_buffers()]}")
        if not any(k.endswith("_extra_state") for k in module.state_dict()):
            raise AssertionError(f"{kind}: no _extra_state in state_dict()")
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        for k in range(3):
            tag = f"{kind} delayed step {k} group {group is not None}"
            x, dy = inputs(k, base.RANK, OUT[kind])
            fwd_bwd(ddp, x, dy, rec, group=group)
            state = delayed_state(module)
            states = gathered(state)
            if group is None:
                continue
            for r, other in enumerate(states[1:], 1):
                exact(f"{tag}: state on rank {r} vs rank 0", other, states[0])
            xs, dys = zip(*(inputs(k, r, OUT[kind]) for r in range(base.WORLD)), strict=True)
            fwd_bwd(full, torch.cat(xs), torch.cat(dys), rec)
            exact(f"{tag}: state vs the concatenated batch's", state, delayed_state(full))
            for (name, p), q in zip(module.named_parameters(), full.parameters(), strict=True):
                base.close(f"{tag} grad {name}", p.grad, q.grad / base.WORLD)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, q in zip(module.parameters(), full.parameters(), strict=True):
                    q.copy_(p)
                    q.grad = None
        if group is None and torch.equal(states[0], states[1]):
            raise AssertionError(f"{kind}: the ranks' states agree without a reduction "
                                 "(the case shows nothing)")  # fmt: skip


for _kind in ("linear", "lnmlp", "seq"):
    case(f"delayed_amax_group_{_kind}")(lambda k=_kind: delayed_amax(k))


# ---- torch.compile -----------------------------------------------------------------------------


def cmp(what: str, a: torch.Tensor, b: torch.Tensor, loose: bool) -> None:
    if not loose:
        exact(what, a, b)
    elif not torch.allclose(a, b, rtol=1e-6, atol=1e-5):
        raise AssertionError(f"{what}: max err {(a - b).abs().max().item()}")


def compiled(kind: str, rec_name: str, backend: str = "aot_eager", graphs_wanted: int = 1) -> None:
    """``torch.compile`` of the DDP-wrapped module against eager DDP of the same weights, two SGD
    steps: outputs, gradients and parameters bit for bit (``aot_eager`` runs the eager kernels;
    under inductor the bias gradient -- an fp32 ``sum(0)`` inductor reassociates -- and what
    follows from it, the bias and the next output, within rtol 1e-6 / atol 1e-5, as in
    _fsdpc_worker.py), identical on the ranks, no recompilation at step 1.

    ``bucket_cap_mb=1``: dynamo's DDPOptimizer refuses a bucket cap below DDP's 1 MiB first
    bucket (torch 2.13). It splits the graph at bucket boundaries between graph nodes into
    ``graphs_wanted`` compiled graphs (a fusible ``Sequential``'s run is one node, so the split
    falls between fusible modules, not inside one)."""
    # Each compiled DDP model is one more cache entry of DDP.forward's code object: past
    # dynamo's default limit of 8 the later ones would run eagerly (silently, but for the graph
    # count below), as for FSDP2 (docs/distributed.md).
    torch._dynamo.config.recompile_limit = 64
    rec = RECIPES[rec_name]
    ddp, module, _ = build(kind, bucket_cap_mb=1)
    eager, emod, _ = build(kind, bucket_cap_mb=1)
    comp = torch.compile(ddp, backend=backend)
    loose = backend == "inductor"
    from torch._dynamo.utils import counters

    graphs = counters["aot_autograd"]["total"]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (module, emod)]
    for k in range(2):
        tag = f"compile {kind} {rec_name} {backend} step {k}"
        x, dy = inputs(k, base.RANK, OUT[kind])
        y = fwd_bwd(comp, x, dy, rec)
        ye = fwd_bwd(eager, x, dy, rec)
        cmp(f"{tag} output", y, ye, loose and k > 0)
        for (name, p), q in zip(module.named_parameters(), emod.parameters(), strict=True):
            cmp(f"{tag} grad {name}", p.grad, q.grad, loose and name.endswith("bias"))
            same_on_ranks(f"{tag} grad {name}", p.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(module.named_parameters(), emod.parameters(), strict=True):
            cmp(f"{tag} {name} after the step", p.detach(), q.detach(), loose and "bias" in name)
            same_on_ranks(f"{tag} {name} after the step", p.detach())
    graphs = counters["aot_autograd"]["total"] - graphs  # two steps: no recompilation
    if graphs != graphs_wanted:
        raise AssertionError(f"compile {kind} {rec_name}: {graphs} graphs, wanted {graphs_wanted}")


for _rec in ("none", "delayed", "current", "mxfp8"):
    case(f"compile_linear_{_rec}")(lambda r=_rec: compiled("linear", r))
for _rec in ("none", "current"):
    case(f"compile_seqbig_{_rec}")(lambda r=_rec: compiled("seqbig", r, graphs_wanted=2))
case("compile_opsbig_current")(lambda: compiled("opsbig", "current"))
case("compile_linear_current_inductor")(lambda: compiled("linear", "current", "inductor"))


# ---- quantized_model_init weights ---------------------------------------------------------------


def qbytes(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A quantized weight's stored tensors (FP8 data as bytes, scales) by field name."""
    return {k: (t.view(torch.uint8) if t.element_size() == 1 else t)
            for k, t in qdata_tensors(w.qdata).items()}  # fmt: skip


def qinit(rec_name: str) -> None:
    """A ``Linear`` built inside ``quantized_model_init`` (its weight a ``QuantizedTensor``),
    each rank seeded differently: DDP's broadcast at construction makes every rank's stored
    weight rank 0's, byte for byte (data and scales). Three steps of
    ``MasterWeightOptimizer(SGD)``: gradients the per-rank references' averaged and the
    re-quantized weights identical across the ranks and equal to the reference's, bit for
    bit."""
    rec = RECIPES[rec_name]
    refs = []
    for _ in range(base.WORLD):
        torch.manual_seed(0)  # rank 0's seed
        with fusible.quantized_model_init(recipe=rec):
            refs.append(fusible.Linear(H, F))
    torch.manual_seed(base.RANK)
    with fusible.quantized_model_init(recipe=rec):
        module = fusible.Linear(H, F)
    if not isinstance(module.weight, QuantizedTensor):
        raise AssertionError(f"qinit {rec_name}: the weight is a {type(module.weight)}")
    ddp = DDP(module, bucket_cap_mb=BUCKET_MB)
    for k, t in qbytes(module.weight).items():
        exact(f"qinit {rec_name} broadcast weight {k}", t, qbytes(refs[0].weight)[k])
    opts = [MasterWeightOptimizer(torch.optim.SGD, m.parameters(), lr=LR)
            for m in (module, *refs)]  # fmt: skip
    for step in range(3):
        tag = f"qinit {rec_name} step {step}"
        x, dy = inputs(step, base.RANK, F)
        fwd_bwd(ddp, x, dy, rec)
        for r, ref in enumerate(refs):
            fwd_bwd(ref, *inputs(step, r, F), rec)
        check_grads(tag, module, refs)
        sgd_step(opts, module, refs)
        for k, t in qbytes(module.weight).items():
            exact(f"{tag} weight {k} after the step", t, qbytes(refs[base.RANK].weight)[k])
            same_on_ranks(f"{tag} weight {k} after the step", t)
        exact(f"{tag} bias after the step", module.bias.detach(), refs[base.RANK].bias.detach())


for _rec in ("current", "mxfp8"):
    case(f"qinit_linear_{_rec}")(lambda r=_rec: qinit(r))


if __name__ == "__main__":
    base.main(CASES)
