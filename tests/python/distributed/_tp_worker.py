"""One rank of the tensor-parallel tests (run by test_tensor_parallel.py as a subprocess:
``python _tp_worker.py RANK WORLD PORT OUT_DIR``). Every case runs on every rank in the same
order (collectives pair up); each records "ok" or its error in OUT_DIR/rank{RANK}.json."""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import fusible
from fusible import recipe as R

S, H, F = 64, 64, 128  # tokens, hidden, ffn/out (MXFP8: 32-multiples, also per rank)
RECIPES: dict[str, Any] = {
    "none": None,
    "delayed": R.DelayedScaling(),
    "current": R.Float8CurrentScaling(),
    "mxfp8": R.MXFP8BlockScaling(),
}
CASES: list[tuple[str, Callable[[], None]]] = []
RANK = WORLD = 0
# gloo on CPU (CI); "nccl" runs the same cases on CUDA (test_nccl_world1.py: world size 1).
BACKEND = os.environ.get("FUSIBLE_TEST_DIST_BACKEND", "gloo")
DEVICE = "cuda" if BACKEND == "nccl" else "cpu"


Case = tuple[str, Callable[[], None]]


def case_adder(cases: list[Case]) -> Callable[[str], Callable[[Callable[[], None]], Any]]:
    """The ``@case(name)`` decorator of a worker: appends ``(name, fn)`` to ``cases``."""

    def case(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
        def deco(fn: Callable[[], None]) -> Callable[[], None]:
            cases.append((name, fn))
            return fn

        return deco

    return case


case = case_adder(CASES)


def rand(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # same values on every rank
    return (torch.randn(*shape, generator=g, device="cpu") * 0.5).to(DEVICE)


def exact(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or not torch.equal(a, b):
        err = (a - b).abs().max().item() if a.shape == b.shape else "shape"
        raise AssertionError(f"{what}: not bit-exact (shapes {tuple(a.shape)} / "
                             f"{tuple(b.shape)}, max err {err})")  # fmt: skip


def close(what: str, a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shapes {tuple(a.shape)} / {tuple(b.shape)}")
    err = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), 1.0)
    if err > tol * scale:
        raise AssertionError(f"{what}: max err {err} > {tol} * {scale}")


def load(module: torch.nn.Module, **tensors: torch.Tensor) -> None:
    with torch.no_grad():
        for k, v in tensors.items():
            getattr(module, k).copy_(v)


def total(xs: list[torch.Tensor]) -> torch.Tensor:
    """The sum over ranks in rank order (two ranks: a + b, order-free, so bit-exact)."""
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


def cols(n: int, r: int) -> slice:
    return slice(r * n // WORLD, (r + 1) * n // WORLD)


def toks(t: torch.Tensor, r: int) -> torch.Tensor:
    return t.chunk(WORLD, 0)[r]


def same_step(
    tag: str, m: torch.nn.Module, ref: torch.nn.Module, x: Any, dy: Any, rec: Any
) -> None:
    """One step (:func:`run`) of ``m``, then of ``ref``, on the same ``x`` and ``dy``: outputs,
    input gradients and every parameter gradient (whole tensors) bit for bit."""
    y, dx = run(m, x, dy, rec)
    y_ref, dx_ref = run(ref, x, dy, rec)
    exact(f"{tag} output", y, y_ref)
    exact(f"{tag} dx", dx, dx_ref)
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        got, want = (g.full_tensor() if hasattr(g, "full_tensor") else g for g in (p.grad, q.grad))
        exact(f"{tag} grad {n}", got, want)


def check_full(what: str, got: dict[str, Any], want: dict[str, Any], tol: float = 0.0) -> None:
    """Two state dicts: the same keys, every tensor (recipe-state dicts' too) bit for bit, or
    within ``tol`` (:func:`close`) when given."""
    if sorted(got) != sorted(want):
        raise AssertionError(f"{what}: keys {sorted(got)} != {sorted(want)}")
    for k, v in want.items():
        if isinstance(v, dict):
            check_full(f"{what} {k}", got[k], v, tol)
        elif tol:
            close(f"{what} {k}", got[k], v, tol)
        elif isinstance(v, torch.Tensor):
            exact(f"{what} {k}", got[k], v)


def qkv_rows(r: int, tp: int, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """TP rank ``r``'s rows of a full fused QKV weight (rows ``[Q; K; V]``): its block of Q's
    heads, of K's groups and of V's groups."""
    q, kv = heads * head_dim, groups * head_dim
    blk = lambda n, off: torch.arange(n)[r * n // tp : (r + 1) * n // tp] + off  # noqa: E731
    return torch.cat([blk(q, 0), blk(kv, q), blk(kv, q + kv)])


def sharded_grads_then_step(
    tag: str, comp: torch.nn.Module, eager: torch.nn.Module, opts: list[Any], backend: str
) -> int:
    """After one step of a compiled FSDP2 module (``comp``) and of the same module run eagerly:
    every gradient shard equal, then each optimizer of ``opts`` steps, then every parameter
    shard equal; returns dynamo's count of graphs so far. ``aot_eager`` runs eager's kernels:
    bit for bit. Under inductor the ATen glue is generated code: bias gradients (fp32 sums it
    reassociates; through attention's backward for a QKV bias) within 1e-4 of the larger of 1
    and the largest value (a wrong gradient is off by O(1)), and the parameters re-synchronised
    after the step; everything else bit for bit."""
    loose = {n for n, _ in comp.named_parameters() if backend == "inductor" and n.endswith("bias")}
    for (n, p), q in zip(comp.named_parameters(), eager.parameters(), strict=True):
        got, want = p.grad.to_local(), q.grad.to_local()
        close(f"{tag} grad {n}", got, want, 1e-4) if n in loose else exact(
            f"{tag} grad {n}", got, want
        )
    for o in opts:
        o.step()
        o.zero_grad()
    for (n, p), q in zip(comp.named_parameters(), eager.parameters(), strict=True):
        if n in loose:  # its gradient differed in the last ulps: start the next step equal
            with torch.no_grad():
                p.to_local().copy_(q.to_local())
        else:
            exact(f"{tag} {n} after the step", p.to_local(), q.to_local())
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def run(
    module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, rec: Any, group: Any = None,
    **kw: Any,
):  # fmt: skip
    """One forward (``module(x, **kw)`` under ``rec``, amaxes reduced over ``group``) and
    backward of ``dy``: the output and the input gradient."""
    x = x.detach().clone().requires_grad_()
    with fusible.autocast(enabled=rec is not None, recipe=rec, amax_reduction_group=group):
        y = module(x, **kw)
    y.backward(dy)
    return y.detach(), x.grad


# ---- fusible.Linear -----------------------------------------------------------------------------


def summed(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """``a`` (a sum over the ranks, by a collective) against ``b`` (the same sum in rank order):
    bit for bit on two ranks (a + b is order-free), within fp32 rounding on more (gloo's order)."""
    (exact if WORLD == 2 else close)(what, a, b)


def column_linear(rec_name: str, sp: bool, dims: tuple[int, int, int] = (S, H, F)) -> None:
    """Column-parallel Linear at sizes ``dims`` = (tokens, in, out) against each rank's shard."""
    S, H, F = dims
    rec = RECIPES[rec_name]
    W, b = rand(F, H, seed=1), rand(F, seed=2)
    x, dy = rand(S, H, seed=3), rand(S, F, seed=4)
    c = cols(F, RANK)
    tp = fusible.Linear(H, F, tp_group=dist.group.WORLD, parallel_mode="column",
                        sequence_parallel=sp)  # fmt: skip
    assert tuple(tp.weight.shape) == (F // WORLD, H), tp.weight.shape
    load(tp, weight=W[c], bias=b[c])
    y, dx = run(tp, toks(x, RANK) if sp else x, dy[:, c], rec, dist.group.WORLD)
    # Reference: each rank's shard as a single-process Linear on the full input.
    dxs, mine = [], None
    for r in range(WORLD):
        ref = fusible.Linear(H, F // WORLD)
        load(ref, weight=W[cols(F, r)], bias=b[cols(F, r)])
        yr, dxr = run(ref, x, dy[:, cols(F, r)], rec)
        dxs.append(dxr)
        if r == RANK:
            mine = (yr, ref)
    yr, ref = mine  # type: ignore[misc]
    exact("y", y, yr)
    exact("dW", tp.weight.grad, ref.weight.grad)
    exact("db", tp.bias.grad, ref.bias.grad)
    dx_ref = total(dxs)
    summed("dx", dx, toks(dx_ref, RANK) if sp else dx_ref)
    if rec is None:  # and against the full-size module (dx: a K-split sum, another order)
        full = fusible.Linear(H, F)
        load(full, weight=W, bias=b)
        yf, dxf = run(full, x, torch.cat([dy[:, cols(F, r)] for r in range(WORLD)], 1), None)
        exact("y vs full", y, yf[:, c])
        close("dx vs full", dx, toks(dxf, RANK) if sp else dxf)


def row_linear(rec_name: str, sp: bool, dims: tuple[int, int, int] = (S, H, F)) -> None:
    """Row-parallel Linear at sizes ``dims`` = (tokens, out, in) against each rank's shard."""
    S, H, F = dims
    rec = RECIPES[rec_name]
    W, b = rand(H, F, seed=5), rand(H, seed=6)
    x, dy = rand(S, F, seed=7), rand(S, H, seed=8)
    c = cols(F, RANK)
    tp = fusible.Linear(F, H, tp_group=dist.group.WORLD, parallel_mode="row",
                        sequence_parallel=sp)  # fmt: skip
    assert tuple(tp.weight.shape) == (H, F // WORLD), tp.weight.shape
    load(tp, weight=W[:, c], bias=b)
    y, dx = run(tp, x[:, c], toks(dy, RANK) if sp else dy, rec, dist.group.WORLD)
    parts, mine = [], None
    for r in range(WORLD):
        ref = fusible.Linear(F // WORLD, H, bias=False)
        load(ref, weight=W[:, cols(F, r)])
        pr, dxr = run(ref, x[:, cols(F, r)], dy, rec)
        parts.append(pr)
        if r == RANK:
            mine = (dxr, ref)
    dxr, ref = mine  # type: ignore[misc]
    y_ref = total(parts) + b
    summed("y", y, toks(y_ref, RANK) if sp else y_ref)
    exact("dx", dx, dxr)
    exact("dW", tp.weight.grad, ref.weight.grad)
    # SP: each rank's bias gradient covers its tokens; summed over the group (another order).
    close("db", tp.bias.grad, dy.sum(0))
    if rec is None:
        full = fusible.Linear(F, H)
        load(full, weight=W, bias=b)
        yf, dxf = run(full, x, dy, None)
        close("y vs full", y, toks(yf, RANK) if sp else yf)  # a K-split sum: another order
        # The CPU backend's GEMM sums in a fixed order at any shape; cuBLAS need not (NCCL runs).
        (exact if DEVICE == "cpu" else close)("dx vs full", dx, dxf[:, c])


def row_linear_return_bias(rec_name: str, sp: bool) -> None:
    """Row-parallel Linear with ``return_bias=True`` (TransformerEngine's; Megatron adds the
    bias after the reduction itself): ``out + bias`` is the plain module's output, the
    gradients its gradients (the bias's: summed by autograd, and over the group with sequence
    parallelism, so to fp32 rounding)."""
    rec = RECIPES[rec_name]
    W, b = rand(H, F, seed=5), rand(H, seed=6)
    x, dy = rand(S, F, seed=7), rand(S, H, seed=8)
    c = cols(F, RANK)
    kw: dict[str, Any] = {"tp_group": dist.group.WORLD, "parallel_mode": "row",
                          "sequence_parallel": sp}  # fmt: skip
    plain, split = fusible.Linear(F, H, **kw), fusible.Linear(F, H, return_bias=True, **kw)
    for m in (plain, split):
        load(m, weight=W[:, c], bias=b)
    y, dx = run(plain, x[:, c], toks(dy, RANK) if sp else dy, rec, dist.group.WORLD)
    xs = x[:, c].detach().clone().requires_grad_()
    with fusible.autocast(
        enabled=rec is not None, recipe=rec, amax_reduction_group=dist.group.WORLD
    ):
        out, bias = split(xs)
    assert bias.shape == (H,) and bias.dtype == out.dtype, (bias.shape, bias.dtype)
    (out + bias).backward(toks(dy, RANK) if sp else dy)
    exact("y", out + bias, y)
    exact("dx", xs.grad, dx)
    exact("dW", split.weight.grad, plain.weight.grad)
    close("db", split.bias.grad, plain.bias.grad)


for _r in RECIPES:
    for _sp in (False, True):
        _sfx = f"{_r}{'_sp' if _sp else ''}"
        case(f"linear_column_{_sfx}")(lambda r=_r, s=_sp: column_linear(r, s))
        case(f"linear_row_{_sfx}")(lambda r=_r, s=_sp: row_linear(r, s))
for _r, _sp in (("none", False), ("delayed", True)):
    case(f"linear_row_return_bias_{_r}{'_sp' if _sp else ''}")(
        lambda r=_r, s=_sp: row_linear_return_bias(r, s)
    )


# ---- LayerNormLinear, LayerNormMLP ---------------------------------------------------------------


def ln_params(seed: int) -> dict[str, torch.Tensor]:
    return {"layer_norm_weight": 1 + rand(H, seed=seed), "layer_norm_bias": rand(H, seed=seed + 1)}


def ln_linear(rec_name: str, sp: bool) -> None:
    rec = RECIPES[rec_name]
    ln, W, b = ln_params(10), rand(F, H, seed=12), rand(F, seed=13)
    x, dy = rand(S, H, seed=14), rand(S, F, seed=15)
    c = cols(F, RANK)
    tp = fusible.LayerNormLinear(H, F, tp_group=dist.group.WORLD, parallel_mode="column",
                                 sequence_parallel=sp)  # fmt: skip
    load(tp, **ln, weight=W[c], bias=b[c])
    y, dx = run(tp, toks(x, RANK) if sp else x, dy[:, c], rec, dist.group.WORLD)
    ref = fusible.LayerNormLinear(H, F // WORLD)
    load(ref, **ln, weight=W[c], bias=b[c])
    yr, _ = run(ref, x, dy[:, c], rec)
    exact("y", y, yr)
    exact("dW", tp.weight.grad, ref.weight.grad)
    full = fusible.LayerNormLinear(H, F)
    load(full, **ln, weight=W, bias=b)
    _, dxf = run(full, x, torch.cat([dy[:, cols(F, r)] for r in range(WORLD)], 1), rec)
    # The norm's backward sees the summed gradient (one LN backward of a sum, not a sum of
    # two): another order. Under FP8 the shards' weights have their own scales.
    tol = 1e-5 if rec is None else 0.25
    close("dx vs full", dx, toks(dxf, RANK) if sp else dxf, tol)
    close("dgamma vs full", tp.layer_norm_weight.grad, full.layer_norm_weight.grad, tol)
    close("dbeta vs full", tp.layer_norm_bias.grad, full.layer_norm_bias.grad, tol)


def ln_mlp(rec_name: str, sp: bool, activation: str = "gelu") -> None:
    rec = RECIPES[rec_name]
    glu = activation in ("swiglu", "geglu")
    ln = ln_params(20)
    W1, b1 = rand((2 if glu else 1) * F, H, seed=22), rand((2 if glu else 1) * F, seed=23)
    W2, b2 = rand(H, F, seed=24), rand(H, seed=25)
    x, dy = rand(S, H, seed=26), rand(S, H, seed=27)
    c = cols(F, RANK)
    # Gated: each rank holds its block of both halves of fc1 (TransformerEngine's layout).
    rows = torch.cat([torch.arange(F)[c] + h * F for h in range(2 if glu else 1)])
    tp = fusible.LayerNormMLP(H, F, activation=activation, tp_group=dist.group.WORLD,
                              sequence_parallel=sp)  # fmt: skip
    load(tp, **ln, fc1_weight=W1[rows], fc1_bias=b1[rows], fc2_weight=W2[:, c], fc2_bias=b2)
    y, dx = run(tp, toks(x, RANK) if sp else x, toks(dy, RANK) if sp else dy, rec,
                dist.group.WORLD)  # fmt: skip
    full = fusible.LayerNormMLP(H, F, activation=activation)
    load(full, **ln, fc1_weight=W1, fc1_bias=b1, fc2_weight=W2, fc2_bias=b2)
    yf, dxf = run(full, x, dy, rec)
    tol = 1e-5 if rec is None else 0.25  # FP8: per-shard scales of weights and fc2's input
    close("y vs full", y, toks(yf, RANK) if sp else yf, tol)
    close("dx vs full", dx, toks(dxf, RANK) if sp else dxf, tol)
    close("dfc1", tp.fc1_weight.grad, full.fc1_weight.grad[rows], tol)
    close("dfc2", tp.fc2_weight.grad, full.fc2_weight.grad[:, c], tol)
    close("dfc2_bias", tp.fc2_bias.grad, full.fc2_bias.grad, tol)
    close("dgamma", tp.layer_norm_weight.grad, full.layer_norm_weight.grad, tol)
    # Replicated outputs (no SP) are the same on every rank.
    if not sp:
        ys = [torch.empty_like(y) for _ in range(WORLD)]
        dist.all_gather(ys, y)
        for other in ys[1:]:
            exact("y across ranks", ys[0], other)


for _r in RECIPES:
    for _sp in (False, True):
        _sfx = f"{_r}{'_sp' if _sp else ''}"
        case(f"lnlinear_{_sfx}")(lambda r=_r, s=_sp: ln_linear(r, s))
        case(f"lnmlp_{_sfx}")(lambda r=_r, s=_sp: ln_mlp(r, s))
case("lnmlp_swiglu_sp")(lambda: ln_mlp("none", True, "swiglu"))
case("lnmlp_swiglu_current")(lambda: ln_mlp("current", False, "swiglu"))


# ---- amax reduction, explain, bad input ----------------------------------------------------------


def _scales(m: torch.nn.Module) -> torch.Tensor:
    out = []
    for op in m:
        for fwd in (True, False):
            s = op.recipe_state(fwd) if hasattr(op, "recipe_state") else None
            if s is not None and hasattr(s, "scale"):
                out.append(s.scale.detach().clone())
    return torch.cat(out)


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    ts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(ts, t)
    return ts


@case("delayed_amax_reduction")
def delayed_amax() -> None:
    rec = R.DelayedScaling()
    for group in (dist.group.WORLD, None):
        torch.manual_seed(RANK)  # the ranks' weight shards differ
        tp = fusible.LayerNormMLP(H, F, tp_group=dist.group.WORLD, sequence_parallel=True)
        x = rand(S, H, seed=30) * (1 + RANK)  # the ranks' tokens and shards differ
        for _ in range(2):
            with fusible.autocast(recipe=rec, amax_reduction_group=group):
                y = tp(toks(x, RANK))
            y.sum().backward()
        s0, s1 = _gathered(_scales(tp))
        same = torch.equal(s0, s1)
        if group is not None and not same:
            raise AssertionError("scales differ across ranks despite the amax reduction")
        if group is None and same:
            raise AssertionError("scales agree without a reduction: the test shows nothing")


@case("explain")
def explain() -> None:
    tp = fusible.LayerNormMLP(H, F, tp_group=dist.group.WORLD, sequence_parallel=True)
    text = tp.explain(recipe=R.Float8CurrentScaling())
    for want in ("AllGather", "ReduceScatter",
                 f"all_gather(dim 0) of the FP8 bytes over 2 ranks [{BACKEND}]",  # FP8 travels
                 f"reduce_scatter(sum, dim 0) over 2 ranks [{BACKEND}]"):  # fmt: skip
        if want not in text:
            raise AssertionError(f"explain() lacks {want!r}:\n{text}")
    row = fusible.Linear(F, H, tp_group=dist.group.WORLD, parallel_mode="row")
    if "all_reduce(sum) over 2 ranks" not in row.explain():
        raise AssertionError(row.explain())


def _raises(fn: Callable[[], Any], *words: str) -> None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        if missing:
            raise AssertionError(f"message {msg!r} lacks {missing}") from e
        return
    raise AssertionError(f"no error raised (expected one naming {words})")


@case("bad_input")
def bad_input() -> None:
    g = dist.group.WORLD
    _raises(lambda: fusible.Linear(H, 3, tp_group=g, parallel_mode="column"),
            "Linear", "out_features=3", "tp_size=2")  # fmt: skip
    _raises(lambda: fusible.Linear(5, H, tp_group=g, parallel_mode="row"),
            "Linear", "in_features=5", "divisible")  # fmt: skip
    _raises(lambda: fusible.LayerNormMLP(H, 7, tp_group=g), "LayerNormMLP", "ffn_hidden_size=7")
    _raises(lambda: fusible.LayerNormLinear(H, 9, tp_group=g, parallel_mode="column"),
            "LayerNormLinear", "out_features=9")  # fmt: skip
    _raises(lambda: fusible.LayerNormLinear(H, F, tp_group=g, parallel_mode="row"),
            "LayerNormLinear", "parallel_mode", "'row'")  # fmt: skip
    tp = fusible.Linear(F, H, tp_group=g, parallel_mode="row", sequence_parallel=True)
    _raises(lambda: tp(torch.randn(3, F // WORLD)), "ReduceScatter", "divisible", "3")


# ---- FSDP2 ---------------------------------------------------------------------------------------


@case("fsdp2")
def fsdp2() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # An explicit CPU mesh: without one, FSDP2 builds its mesh on the accelerator when the
    # machine has one (this case failed on the H200 machine, where CUDA is present but the
    # group is gloo and the model on CPU).
    mesh = init_device_mesh(DEVICE, (WORLD,))
    # GroupedLinear (MoE experts): every expert's weight and bias sharded; an empty expert and
    # splits of MXFP8's 32-row blocks.
    splits = [S // 2, 0, S - S // 2]
    makers = [(lambda: fusible.Linear(H, F), {}), (lambda: fusible.LayerNormMLP(H, F), {}),
              (lambda: fusible.GroupedLinear(3, H, F), {"m_splits": splits})]  # fmt: skip
    for name, rec in RECIPES.items():
        for make, kw in makers:
            torch.manual_seed(0)
            ref = make()
            model = make()
            model.load_state_dict(ref.state_dict())
            fully_shard(model, mesh=mesh)
            x = rand(S, H, seed=40 + RANK)
            outs = []
            for m in (model, ref):
                with fusible.autocast(enabled=rec is not None, recipe=rec):
                    y = m(x, **kw)
                y.float().pow(2).mean().backward()
                outs.append(y.detach())
            exact(f"{name} {type(ref).__name__} fsdp2 output", outs[0], outs[1])
            # FSDP2's gradient is the mean over ranks: all-reduce the reference's to compare.
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(),
                                      strict=True):  # fmt: skip
                g = q.grad.clone()
                dist.all_reduce(g)
                close(f"{name} fsdp2 grad {n}", p.grad.full_tensor(), g / WORLD, 1e-5)


def main(
    cases: list[tuple[str, Callable[[], None]]] | None = None,
    *,
    timeout_s: float = 60.0,
    on_start: Callable[[int, int, str], None] | None = None,
) -> None:
    """Every worker's entry point (``python WORKER RANK WORLD PORT OUT_DIR [ONLY]``): joins the
    process group, runs ``cases`` (default this module's) in order on every rank (collectives pair
    up), a barrier after each, and writes OUT_DIR/rank{RANK}.json (case -> "ok" or its error).
    ``on_start(rank, world, out_dir)`` lets a worker set its own globals first; ``timeout_s`` is
    the collectives' (the launcher's per-process timeout still catches a hang)."""
    global RANK, WORLD
    RANK, WORLD, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if on_start is not None:
        on_start(RANK, WORLD, out)
    if DEVICE == "cuda":
        torch.cuda.set_device(RANK)
        torch.set_default_device("cuda")  # the cases build modules and tensors without device=
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=RANK,
                            world_size=WORLD, timeout=timeout)  # fmt: skip
    torch.manual_seed(0)
    only = set(sys.argv[5].split(",")) if len(sys.argv) > 5 else None
    results: dict[str, str] = {}
    for name, fn in CASES if cases is None else cases:
        if only is not None and name not in only:
            continue
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=4)
        dist.barrier()
    with open(f"{out}/rank{RANK}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
