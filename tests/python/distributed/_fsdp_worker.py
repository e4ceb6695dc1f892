"""One rank of the FSDP2 FP8 weight all-gather tests (test_fsdp_fp8.py): ``fully_shard_fp8``
against the unsharded module running with the same FP8 weights. Same harness as _tp_worker.py
(whose helpers and ``main`` it reuses): ``python _fsdp_worker.py RANK WORLD PORT OUT_DIR
[CASES]``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import _tp_worker as base
import torch
import torch.distributed as dist
from _tp_worker import close, exact, rand
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

import fusible
from fusible import _kernels as K
from fusible import recipe as R
from fusible.distributed import Float8AllGatherWeight, fully_shard_fp8
from fusible.ops.basic.grouped_linear import GroupedLinear as GroupedLinearOp
from fusible.ops.basic.linear import BasicLinear
from fusible.quantization.data import Float8Data
from fusible.quantization.tensor import Float8Tensor, QuantizedTensor

S, H, F = base.S, base.H, base.F
E4M3 = torch.float8_e4m3fn
LR = 0.5
CASES: list[Any] = []
MAKERS: dict[str, Callable[[], torch.nn.Module]] = {
    "linear": lambda: fusible.Linear(H, F),
    "lnlinear": lambda: fusible.LayerNormLinear(H, F),
    "lnmlp": lambda: fusible.LayerNormMLP(H, F),
    # Every BasicLinear inside converts: QKV, projection, fc1, fc2 (attention through SDPA).
    "tlayer": lambda: fusible.TransformerLayer(H, F, 4),
    "grouped": lambda: Experts(),
}
# The input of each kind ([batch, seq, hidden] for the transformer layer) and its output width.
SHAPES: dict[str, tuple[int, ...]] = {"tlayer": (2, S // 2, H)}
OUT_DIMS = {"linear": F, "lnlinear": F, "lnmlp": H, "tlayer": H, "grouped": F}


def case(name: str) -> Any:
    def deco(fn: Any) -> Any:
        CASES.append((name, fn))
        return fn

    return deco


def mesh() -> Any:
    # An explicit CPU mesh (see _tp_worker.fsdp2: the default follows the accelerator).
    return init_device_mesh(base.DEVICE, (base.WORLD,))


def linears(m: torch.nn.Module) -> list[BasicLinear]:
    return [o for o in m.modules() if isinstance(o, BasicLinear)]


class W:
    """One gathered weight of a module: ``op``'s parameter ``name`` (``weight`` of a
    BasicLinear, ``weight<i>`` of a GroupedLinear op), read and assigned as ``.value``."""

    def __init__(self, op: torch.nn.Module, name: str) -> None:
        self.op, self.name = op, name

    @property
    def value(self) -> Any:
        return getattr(self.op, self.name)

    @value.setter
    def value(self, v: Any) -> None:
        setattr(self.op, self.name, v)


def gathered(m: torch.nn.Module) -> list[W]:
    """The weights ``fully_shard_fp8`` converts in ``m``, in module order."""
    out = []
    for o in m.modules():
        if isinstance(o, BasicLinear):
            out.append(W(o, "weight"))
        elif isinstance(o, GroupedLinearOp):
            out += [W(o, f"weight{i}") for i in range(o.num_gemms)]
    return out


class Experts(torch.nn.Module):
    """An MoE expert layer: fusible.GroupedLinear(2, H, F) on an uneven token split."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = fusible.GroupedLinear(2, H, F)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, [S // 2 - 8, S // 2 + 8])


def amax(w: torch.Tensor) -> torch.Tensor:
    return K.compute_amax(w.contiguous())


def scale_of(a: torch.Tensor) -> torch.Tensor:
    return K.compute_scale(a, E4M3, 0)[0]


def fp8_param(w: torch.Tensor, scale: torch.Tensor) -> torch.nn.Parameter:
    """The whole weight ``w`` cast to E4M3 with ``scale`` (the reference's FP8 weight)."""
    data, _, scale_inv, _ = K.quantize_fp8(w.contiguous(), scale, E4M3, True, False)
    qd = Float8Data(data, None, scale_inv, E4M3, w.shape)
    return torch.nn.Parameter(Float8Tensor(qd, dtype=w.dtype), requires_grad=True)


def step(m: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, rec: Any) -> tuple[Any, Any]:
    x = x.detach().clone().requires_grad_()
    with fusible.autocast(recipe=rec):
        y = m(x)
    y.backward(dy)
    return y.detach(), x.grad


@contextlib.contextmanager
def count_dequantize() -> Iterator[list[int]]:
    """Counts calls of every dequantize of a quantized weight (the tensor subclass and the
    containers): none may run while the FSDP model computes with its gathered FP8 weights."""
    calls = [0]
    originals = {cls: cls.dequantize for cls in (QuantizedTensor, Float8Data)}

    def wrap(orig: Any) -> Any:
        def fn(self: Any, *a: Any, **k: Any) -> Any:
            calls[0] += 1
            return orig(self, *a, **k)

        return fn

    for cls, orig in originals.items():
        cls.dequantize = wrap(orig)  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        for cls, orig in originals.items():
            cls.dequantize = orig  # type: ignore[method-assign]


def hsdp_mesh() -> Any:
    """HSDP: two replicas of a 2-way shard, ``(replicate, shard)`` (four ranks)."""
    return init_device_mesh(base.DEVICE, (base.WORLD // 2, 2), mesh_dim_names=("rep", "shard"))


def train(kind: str, rec_name: str, reshard: bool = True, make_mesh: Any = mesh) -> None:
    """Two SGD steps of ``fully_shard_fp8`` (inside a root ``fully_shard``, so the weights are
    resharded after forward and all-gathered again for backward, unless ``reshard`` is False)
    against the unsharded module whose Linear weights are the reference FP8 weights:
    quantize(full master, expected scale). ``make_mesh``: FSDP's 1-D mesh, or HSDP's 2-D one
    (every rank's gradient averaged all the same; each replica holds the same shards)."""
    rec = R.Float8CurrentScaling() if rec_name == "current" else R.DelayedScaling()
    torch.manual_seed(0)
    ref = MAKERS[kind]()
    inner = MAKERS[kind]()
    inner.load_state_dict(ref.state_dict())
    masters = [w.value.detach().clone() for w in gathered(ref)]
    names = [n for n, _ in ref.named_parameters()]
    model = torch.nn.Sequential(inner)
    the_mesh = make_mesh()
    fully_shard_fp8(inner, recipe=rec, mesh=the_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=the_mesh)
    shard_mesh = the_mesh if the_mesh.ndim == 1 else the_mesh["shard"]
    shards, shard_rank = shard_mesh.size(), shard_mesh.get_local_rank()
    for w in gathered(inner):
        local = w.value.to_local()
        assert isinstance(local, Float8AllGatherWeight), type(local)
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def capture(mod: torch.nn.Module, args: Any) -> None:
        got = []
        for g in gathered(mod):
            w = g.value
            assert type(w) is Float8Tensor or isinstance(w, Float8Tensor), type(w)
            got.append((w.qdata.data.view(torch.uint8).clone(), w.qdata.scale_inv.clone()))
        seen.append(got)

    spy = SpyAllGather()
    inner.set_custom_all_gather(spy)
    inner.register_forward_pre_hook(capture)  # runs after FSDP2's (prepended) unshard hook
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history: list[torch.Tensor] = []  # delayed: the amaxes of earlier steps' weights
    shape = SHAPES.get(kind, (S, H))
    for k in range(2):
        x = rand(*shape, seed=60 + 10 * k + base.RANK)
        dy = rand(*shape[:-1], OUT_DIMS[kind], seed=61 + 10 * k + base.RANK)
        if rec_name == "current":
            scales = [scale_of(amax(w)) for w in masters]
        elif k == 0:
            scales = [torch.ones(1) for _ in masters]
        else:
            scales = [scale_of(torch.stack([h[i] for h in history]).amax(0)) for i in
                      range(len(masters))]  # fmt: skip
        history.append(torch.stack([amax(w) for w in masters]))
        for g, w, s in zip(gathered(ref), masters, scales, strict=True):
            g.value = fp8_param(w, s)
        y_ref, dx_ref = step(ref, x, dy, rec)
        with count_dequantize() as calls:
            y, dx = step(model, x, dy, rec)
        tag = f"{kind} {rec_name} step {k}"
        if calls[0]:
            raise AssertionError(f"{tag}: {calls[0]} dequantize call(s) of a quantized weight")
        # The gathered FP8 weight == quantize(full weight, agreed scale), bit for bit.
        for i, (g, (data, scale_inv)) in enumerate(zip(gathered(ref), seen[-1], strict=True)):
            exact(f"{tag} gathered weight {i} bytes", data, g.value.qdata.data.view(torch.uint8))
            exact(f"{tag} gathered weight {i} scale_inv", scale_inv, g.value.qdata.scale_inv)
        exact(f"{tag} output", y, y_ref)
        exact(f"{tag} dx", dx, dx_ref)
        # FSDP2's gradient is the mean over ranks of every rank's gradient (reduce-scatter).
        avg = {}
        for n, q in ref.named_parameters():
            g = q.grad.clone()
            dist.all_reduce(g)
            avg[n] = g / base.WORLD
        for (n, p), n_ref in zip(inner.named_parameters(), names, strict=True):
            assert n == n_ref, (n, n_ref)
            if the_mesh.ndim == 1:
                exact(f"{tag} grad {n}", p.grad.full_tensor(), avg[n])
            else:
                # HSDP reduces over the shard, then the replicas: another summation order. The
                # reference then steps with HSDP's mean, so the masters stay bit-exact.
                close(f"{tag} grad {n}", p.grad.full_tensor(), avg[n], 1e-6)
                avg[n] = p.grad.full_tensor()
        opt.step()
        opt.zero_grad()
        # The same update of the reference's masters (SGD: p += -lr * grad).
        lin_names = [n for n, q in ref.named_parameters() if isinstance(q, QuantizedTensor)]
        for n, q in ref.named_parameters():
            if n not in lin_names:
                with torch.no_grad():
                    q.add_(avg[n], alpha=-LR)
            q.grad = None
        for w, n in zip(masters, lin_names, strict=True):
            w.add_(avg[n], alpha=-LR)
        for g, w in zip(gathered(inner), masters, strict=True):
            local = g.value.to_local()
            exact(f"{tag} master shard after the step", local.master,
                  w.chunk(shards)[shard_rank])  # fmt: skip
    # Per step: forward (+ backward when resharded); FSDP2 on one rank gathers nothing.
    gathers = 0 if shards == 1 else 4 if reshard else 2
    if len(spy.inputs) != gathers:
        raise AssertionError(
            f"{kind} {rec_name}: {len(spy.inputs)} all-gathers, expected {gathers}"
        )
    if len(seen) != 2:
        raise AssertionError(f"{kind} {rec_name}: {len(seen)} forward passes seen, expected 2")


for _kind in MAKERS:
    for _rec in ("current", "delayed"):
        case(f"train_{_kind}_{_rec}")(lambda k=_kind, r=_rec: train(k, r))
# Kept unsharded from forward to backward: one all-gather per step, no backward re-gather.
case("train_lnmlp_delayed_no_reshard")(lambda: train("lnmlp", "delayed", reshard=False))
# HSDP (test_fsdp_fp8_hsdp.py runs these on four ranks).
for _rec in ("current", "delayed"):
    case(f"hsdp_lnmlp_{_rec}")(lambda r=_rec: train("lnmlp", r, make_mesh=hsdp_mesh))


class SpyAllGather(AllGather):
    """FSDP2's all-gather (the same collective), recording each input's dtype and size."""

    def __init__(self) -> None:
        self.inputs: list[tuple[torch.dtype, int]] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
        async_op: bool = False,
    ) -> Any:  # fmt: skip
        self.inputs.append((input_tensor.dtype, input_tensor.numel()))
        # all_gather_single is torch >= 2.13; all_gather_into_tensor is the same collective.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)


@case("all_gather_bytes")
def all_gather_bytes() -> None:
    """The all-gather input is the FP8 bytes plus the 4-byte scale_inv: 1 byte per element,
    half of bf16's 2, a quarter of fp32's 4; plain fully_shard moves the weight as stored."""
    n = F * H // base.WORLD  # elements of a rank's shard
    for dtype in (torch.float32, torch.bfloat16):
        moved = {}
        for how in ("fp8", "plain"):
            torch.manual_seed(0)
            m = fusible.Linear(H, F, bias=False, dtype=dtype)
            if how == "fp8":
                fully_shard_fp8(m, mesh=mesh())
            else:
                fully_shard(m, mesh=mesh())
            spy = SpyAllGather()
            m.set_custom_all_gather(spy)
            x = rand(S, H, seed=7).to(dtype)
            step(m, x, torch.ones(S, F, dtype=dtype), R.Float8CurrentScaling())
            if not spy.inputs:
                raise AssertionError(f"{how} {dtype}: no all-gather seen")
            moved[how] = spy.inputs
        for got in moved["fp8"]:
            if got != (torch.uint8, n + 4):
                raise AssertionError(
                    f"fp8 {dtype}: all-gather input {got}, expected uint8 x {n + 4}"
                )
        for got in moved["plain"]:
            if got != (dtype, n):
                raise AssertionError(
                    f"plain {dtype}: all-gather input {got}, expected {dtype} x {n}"
                )
        # bf16: half the bytes (plus the 4-byte scale); fp32: a quarter.
        ratio = (n + 4) / (n * dtype.itemsize)
        if ratio > 1 / dtype.itemsize + 4 / n:
            raise AssertionError(f"{dtype}: fp8 moved {n + 4} bytes, plain {n * dtype.itemsize}")


@case("delayed_state_checkpoint")
def delayed_state_checkpoint() -> None:
    """The delayed-scaling gather state is in the state dict (each converted op's extra state,
    ``gather.<weight>.*``), the same on every rank (a checkpoint keeps one rank's copy): the
    last step's amaxes, not yet reduced over the group, are saved as zeros; after
    ``precompute_fp8_scales`` (agreed) as they are, and a model loaded from that state dict
    holds the same histories and scales and its next step equals the trained model's bit for
    bit (it would cast with scale 1 otherwise). A model built on meta and materialised loads it
    too; a plain fully_shard model loads the same state dict strictly (the gather keys are
    skipped)."""
    from fusible.distributed import precompute_fp8_scales

    rec = R.DelayedScaling()

    def build(fp8: bool, device: str = "cpu") -> torch.nn.Module:
        torch.manual_seed(0)
        with torch.device(device):
            inner = MAKERS["lnmlp"]()
        model = torch.nn.Sequential(inner)
        if fp8:
            fully_shard_fp8(inner, recipe=rec, mesh=mesh())
        else:
            fully_shard(inner, mesh=mesh())
        fully_shard(model, mesh=mesh())
        if device == "meta":
            model.to_empty(device=base.DEVICE)
        return model

    def specs(m: torch.nn.Module) -> list[Any]:
        return [g.value.to_local()._spec for g in gathered(m)]

    def same_on_every_rank(what: str, t: torch.Tensor) -> None:
        got = [torch.empty_like(t) for _ in range(base.WORLD)]
        dist.all_gather(got, t.contiguous())
        for r, g in enumerate(got):
            exact(f"{what} (rank {r} against rank 0)", g, got[0])

    trained = build(True)
    opt = torch.optim.SGD(trained.parameters(), lr=LR)
    for k in range(2):
        step(trained, rand(S, H, seed=100 + k + base.RANK), rand(S, H, seed=110 + k), rec)
        opt.step()
        opt.zero_grad()
    pending = trained.state_dict()  # the last step's amaxes not agreed yet
    for key in ("0.fc1._extra_state", "0.fc2._extra_state"):
        hist = pending[key]["gather.weight.amax_history"]
        if hist[0].any() or not hist[1:].any():
            raise AssertionError(f"{key}: pending slot {hist[0]}, history {hist[1:]}")
        same_on_every_rank(f"{key} saved history", hist)
    precompute_fp8_scales(trained)
    sd = trained.state_dict()
    with_gather = [k for k, v in sd.items() if k.endswith("_extra_state")
                   and {"gather.weight.amax_history", "gather.weight.scale"} <= set(v)]  # fmt: skip
    if with_gather != ["0.fc1._extra_state", "0.fc2._extra_state"]:
        raise AssertionError(f"gather state in {with_gather}; keys {sorted(sd)}")
    for key in with_gather:
        same_on_every_rank(f"{key} agreed history", sd[key]["gather.weight.amax_history"])
    for device in ("cpu", "meta"):
        loaded = build(True, device)
        loaded.load_state_dict(sd)
        for a, b in zip(specs(trained), specs(loaded), strict=True):
            exact(f"loaded amax history ({device})", b.delayed.amax_history, a.delayed.amax_history)
            exact(f"loaded scale ({device})", b.delayed.scale, a.delayed.scale)
    x, dy = rand(S, H, seed=120 + base.RANK), rand(S, H, seed=121)
    base.same_step("step after loading", loaded, trained, x, dy, rec)
    build(False).load_state_dict(sd)  # strict: the gather keys are not the op's


@case("grouped_shared_weight")
def grouped_shared_weight() -> None:
    """Experts sharing one weight (weight1 = weight0) keep sharing it: one Float8AllGatherWeight
    parameter, gathered once, and two training steps give the same output and gradients as the
    unsharded layer whose experts share the FP8 weight."""
    rec = R.Float8CurrentScaling()
    torch.manual_seed(0)
    ref, inner = Experts(), Experts()
    inner.load_state_dict(ref.state_dict())
    for m in (ref, inner):
        op = gathered(m)[0].op
        op.weight1 = op.weight0
    model = torch.nn.Sequential(inner)
    fully_shard_fp8(inner, recipe=rec, mesh=mesh())
    fully_shard(model, mesh=mesh())
    op = gathered(inner)[0].op
    if op.weight0 is not op.weight1:
        raise AssertionError("the shared expert weight was split into two parameters")
    if not isinstance(op.weight0.to_local(), Float8AllGatherWeight):
        raise AssertionError(f"not converted: {type(op.weight0.to_local())}")
    ref_op = gathered(ref)[0].op
    master = ref_op.weight0.detach().clone()
    ref_op.weight0 = fp8_param(master, scale_of(amax(master)))
    ref_op.weight1 = ref_op.weight0
    x = rand(S, H, seed=90 + base.RANK)
    dy = rand(S, F, seed=91 + base.RANK)
    y, dx = step(model, x, dy, rec)
    y_ref, dx_ref = step(ref, x, dy, rec)
    exact("shared weight output", y, y_ref)
    exact("shared weight dx", dx, dx_ref)
    g = ref_op.weight0.grad.clone()
    dist.all_reduce(g)
    exact("shared weight grad", op.weight0.grad.full_tensor(), g / base.WORLD)


@case("mixed_group")
def mixed_group() -> None:
    """A module whose FSDP group mixes an FP8-gathered weight with plain parameters (norm,
    bias) and a second gathered weight: FSDP2 packs them into one uint8 buffer; the norm and
    the bias arrive as stored."""
    torch.manual_seed(0)
    m = fusible.LayerNormMLP(H, F)
    fully_shard_fp8(m, mesh=mesh())
    spy = SpyAllGather()
    m.set_custom_all_gather(spy)
    step(m, rand(S, H, seed=3), torch.ones(S, H), R.Float8CurrentScaling())
    fp8 = (F * H // base.WORLD + 4) * 2  # fc1 [F, H] and fc2 [H, F], each with its scale_inv
    plain = (H + H + F + H) * 4 // base.WORLD  # norm weight + bias, fc1 bias, fc2 bias (fp32)
    for got in spy.inputs:
        if got != (torch.uint8, fp8 + plain):
            raise AssertionError(f"all-gather input {got}, expected uint8 x {fp8 + plain}")


@case("plain_fully_shard_unchanged")
def plain_fully_shard_unchanged() -> None:
    """After fully_shard_fp8 on one model, plain fully_shard on another behaves as before: the
    output equals the unsharded module's bit for bit and its weight stays a plain DTensor."""
    torch.manual_seed(0)
    ref = fusible.Linear(H, F)
    m = fusible.Linear(H, F)
    m.load_state_dict(ref.state_dict())
    fully_shard_fp8(fusible.Linear(H, F), mesh=mesh())
    fully_shard(m, mesh=mesh())
    assert type(m.get_parameter("0.weight").to_local()) is torch.Tensor
    x, dy = rand(S, H, seed=5), rand(S, F, seed=6)
    for rec in (None, R.Float8CurrentScaling()):
        a = step(m, x, dy, rec)[0]
        b = step(ref, x, dy, rec)[0]
        exact(f"plain fully_shard output ({rec})", a, b)


@case("bad_input")
def bad_input() -> None:
    raises = base._raises
    # A tensor-parallel module over its tp peers (here the whole world) or without a mesh.
    tp = fusible.Linear(H, F, tp_group=dist.group.WORLD, parallel_mode="column")
    raises(lambda: fully_shard_fp8(tp, mesh=mesh()), "fully_shard_fp8", "tensor-parallel",
           "tensor-parallel peers")  # fmt: skip
    raises(lambda: fully_shard_fp8(tp), "tensor-parallel", "'mesh' is required")
    raises(lambda: fully_shard_fp8("model"), "fully_shard_fp8", "'module'")  # type: ignore[arg-type]
    raises(lambda: fully_shard_fp8(fusible.Linear(H, F), recipe=R.MXFP8BlockScaling(), mesh=mesh()),
           "fully_shard_fp8 (Linear)", "'recipe'", "MXFP8BlockScaling")  # fmt: skip
    raises(lambda: fully_shard_fp8(fusible.Linear(H, F), recipe=R.Float8BlockScaling(),
                                   mesh=mesh()),
           "'recipe'", "Float8BlockScaling")  # fmt: skip
    raises(lambda: fully_shard_fp8(fusible.Linear(H, 63), mesh=mesh()),
           "Linear.0.weight", "63 rows", "2 ranks")  # fmt: skip
    raises(lambda: fully_shard_fp8(fusible.LayerNormMLP(H, 63), mesh=mesh()),
           "LayerNormMLP.1.weight (fc1)", "63 rows")  # fmt: skip
    raises(lambda: fully_shard_fp8(fusible.Linear(H, F), mesh=mesh(),
                                   shard_placement_fn=lambda p: None),
           "'shard_placement_fn'")  # fmt: skip
    with fusible.quantized_model_init(recipe=R.Float8CurrentScaling()):
        qm = fusible.Linear(H, F)
    raises(lambda: fully_shard_fp8(qm, mesh=mesh()), "Linear.0.weight", "quantized_model_init")
    raises(lambda: fully_shard_fp8(torch.nn.LayerNorm(H), mesh=mesh()),
           "LayerNorm", "no Linear weight")  # fmt: skip
    two_d = init_device_mesh(base.DEVICE, (1, base.WORLD))  # HSDP needs named dimensions
    raises(lambda: fully_shard_fp8(fusible.Linear(H, F), mesh=two_d), "'mesh'", "without names")
    # Nothing was converted by a refused call: the module is still usable as it was.
    m = fusible.Linear(H, 63)
    raises(lambda: fully_shard_fp8(m, mesh=mesh()), "63 rows")
    assert type(m.get_parameter("0.weight")) is torch.nn.Parameter


@contextlib.contextmanager
def count_all_reduce() -> Iterator[list[int]]:
    calls, orig = [0], dist.all_reduce

    def fn(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return orig(*a, **k)

    dist.all_reduce = fn  # type: ignore[assignment]
    try:
        yield calls
    finally:
        dist.all_reduce = orig


def precompute_scales(rec_name: str, make_mesh: Any = mesh, update: str = "sgd") -> None:
    """precompute_fp8_scales (LayerNormMLP inside a root fully_shard, so each weight is gathered
    for forward and again for backward): three SGD steps bit for bit equal to the same model
    agreeing on its scales itself -- outputs, input and parameter gradients -- with one
    all_reduce per call and none in forward or backward (without it: current scaling 4, one per
    weight and gather; delayed 2, one per weight at its forward gather); after an optimizer step
    without a new call the gathers agree again themselves (current: stale scales are not used;
    delayed: the step's amaxes are reduced at the forward gather). ``update``: how the weights
    change between steps -- "sgd" (SGD, foreach=False), "foreach" (SGD, foreach=True: the
    default on CUDA, whose DTensor writes bump no version) or "manual" (an in-place update by
    hand, no optimizer: only the parameter's version tells)."""
    from fusible.distributed import precompute_fp8_scales

    rec = R.Float8CurrentScaling() if rec_name == "current" else R.DelayedScaling()
    torch.manual_seed(0)
    src = MAKERS["lnmlp"]()
    runs = []
    for _ in range(2):
        inner = MAKERS["lnmlp"]()
        inner.load_state_dict(src.state_dict())
        model = torch.nn.Sequential(inner)
        the_mesh = make_mesh()
        fully_shard_fp8(inner, recipe=rec, mesh=the_mesh)
        fully_shard(model, mesh=the_mesh)
        opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=update == "foreach")
        runs.append((model, opt))
    (plain, plain_opt), (pre, pre_opt) = runs
    n = 1 if base.WORLD > 1 else 0
    for k in range(3):
        x = rand(S, H, seed=80 + 10 * k + base.RANK)
        dy = rand(S, H, seed=81 + 10 * k + base.RANK)
        tag = f"precompute step {k}"
        fresh = k < 2  # step 2: the optimizer stepped, precompute not called again
        if fresh:
            with count_all_reduce() as calls:
                got = precompute_fp8_scales(pre)
            if got != 2 or calls[0] != n:
                raise AssertionError(f"{tag}: {got} weights, {calls[0]} all_reduces")
        with count_all_reduce() as calls:
            y, dx = step(pre, x, dy, rec)
        with count_all_reduce() as plain_calls:
            y_ref, dx_ref = step(plain, x, dy, rec)
        # Ours: without the call 4 (current: per weight and gather) or 2 (delayed: per weight
        # and step). HSDP's own all-reduce of the gradients over the replicas counts in both.
        ours = (4 if rec_name == "current" else 2) * n
        want = 0 if fresh else ours
        if plain_calls[0] - calls[0] != ours - want or (make_mesh is mesh and calls[0] != want):
            raise AssertionError(
                f"{tag}: {calls[0]} all_reduces in the step ({plain_calls[0]} without the "
                f"call), expected {want} of the gathers'"
            )
        exact(f"{tag} output", y, y_ref)
        exact(f"{tag} dx", dx, dx_ref)
        for (name, p), q in zip(pre.named_parameters(), plain.parameters(), strict=True):
            exact(f"{tag} grad {name}", p.grad.full_tensor(), q.grad.full_tensor())
        for opt in (pre_opt, plain_opt):
            if update == "manual":
                with torch.no_grad():
                    for group in opt.param_groups:
                        for p in group["params"]:
                            p.sub_(LR * p.grad)
            else:
                opt.step()
            opt.zero_grad()
    bad = base._raises
    bad(lambda: precompute_fp8_scales("model"), "precompute_fp8_scales", "'module'")  # type: ignore[arg-type]


case("precompute_scales")(lambda: precompute_scales("current"))
case("precompute_scales_delayed")(lambda: precompute_scales("delayed"))
for _update in ("foreach", "manual"):  # the updates a parameter version alone misses / tells
    case(f"precompute_scales_{_update}")(lambda u=_update: precompute_scales("current", update=u))
for _rec in ("current", "delayed"):  # HSDP: the scales agreed over the shard dimension
    case(f"hsdp_precompute_{_rec}")(lambda r=_rec: precompute_scales(r, hsdp_mesh))


def compiled(kind: str, rec_name: str, backend: str = "aot_eager") -> None:
    """``torch.compile(fullgraph=True)`` of a ``fully_shard_fp8`` module against the same module
    run eagerly, two SGD steps: outputs, input gradients, every gradient shard and every
    parameter shard after each step bit for bit (inductor: see
    ``_tp_worker.sharded_grads_then_step``). FSDP2's hooks -- the FP8
    all-gather included -- run eagerly around the graph; the graph reads the gathered
    ``Float8Tensor`` weights through QuantizedTensor's traceable-subclass protocol. The first
    step compiles one graph, the second none."""
    rec = R.Float8CurrentScaling() if rec_name == "current" else R.DelayedScaling()
    torch.manual_seed(0)
    eager, comp = MAKERS[kind](), MAKERS[kind]()
    comp.load_state_dict(eager.state_dict())
    for m in (eager, comp):
        fully_shard_fp8(m, recipe=rec, mesh=mesh())
    torch._dynamo.config.recompile_limit = 64
    c = torch.compile(comp, fullgraph=True, backend=backend)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (eager, comp)]
    graphs = [torch._dynamo.utils.counters["stats"]["unique_graphs"]]
    shape = SHAPES.get(kind, (S, H))
    for k in range(2):
        tag = f"compiled {kind} {rec_name} {backend} step {k}"
        x = rand(*shape, seed=90 + 10 * k + base.RANK)
        dy = rand(*shape[:-1], OUT_DIMS[kind], seed=91 + 10 * k + base.RANK)
        y_e, dx_e = step(eager, x, dy, rec)
        y_c, dx_c = step(c, x, dy, rec)
        exact(f"{tag} output", y_c, y_e)
        exact(f"{tag} dx", dx_c, dx_e)
        graphs.append(base.sharded_grads_then_step(tag, comp, eager, opts, backend))
    if not graphs[0] < graphs[1] == graphs[2]:
        raise AssertionError(f"{kind} {rec_name}: graphs before / after each step {graphs}")
    if not all(s.gathers > 0 for s in gather_specs(comp)):
        raise AssertionError(f"{kind}: a weight was not gathered in FP8")


def checkpointed_layers(rec_name: str) -> None:
    """The usual FSDP2 recipe for a transformer: a stack of layers, each ``fully_shard_fp8``-ed,
    wrapped in torch's ``checkpoint_wrapper`` (activation checkpointing, non-reentrant) and
    compiled on its own (``nn.Module.compile``, ``aot_eager``), the root ``fully_shard``-ed;
    three AdamW steps against the same stack without checkpointing: outputs bit for bit (the
    recomputation in backward, whose FSDP2 re-gather casts with its forward's scale, changes
    nothing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    rec = R.Float8CurrentScaling() if rec_name == "current" else R.DelayedScaling()

    def build(ac: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [fusible.TransformerLayer(H, F, 4) for _ in range(2)]
        model = torch.nn.Sequential(*layers)
        for i, layer in enumerate(layers):
            fully_shard_fp8(layer, recipe=rec, mesh=mesh())
            if ac:
                model[i] = checkpoint_wrapper(layer)
            model[i].compile(backend="aot_eager")
        fully_shard(model, mesh=mesh())
        return model

    outs = []
    for ac in (False, True):
        model = build(ac)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ys = []
        for k in range(3):
            x = rand(2, S // 2, H, seed=130 + 10 * k + base.RANK)
            with fusible.autocast(recipe=rec):
                y = model(x)
            y.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ys.append(y.detach())
        outs.append(ys)
    for k, (a, b) in enumerate(zip(*outs, strict=True)):
        exact(f"checkpointed {rec_name} step {k} output", b, a)


for _rec in ("current", "delayed"):
    case(f"checkpointed_layers_{_rec}")(lambda r=_rec: checkpointed_layers(r))


def gather_specs(m: torch.nn.Module) -> list[Any]:
    """The gather specs of ``m``'s converted weights."""
    return [p.to_local()._spec for p in m.parameters()
            if isinstance(p.to_local(), Float8AllGatherWeight)]  # fmt: skip


for _kind in ("linear", "lnmlp", "tlayer"):
    for _rec in ("current", "delayed"):
        case(f"compile_{_kind}_{_rec}")(lambda k=_kind, r=_rec: compiled(k, r))
case("compile_lnmlp_current_inductor")(lambda: compiled("lnmlp", "current", "inductor"))


if __name__ == "__main__":
    base.CASES[:] = CASES
    base.main()
