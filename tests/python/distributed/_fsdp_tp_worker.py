"""One rank of the FSDP2 + tensor parallelism (2-D) tests (test_fsdp_tp.py): four processes, a
``(dp=2, tp=2)`` mesh. Each module is tensor-parallel over the mesh's ``tp`` group (fusible's
``tp_group``: local weight shards, TransformerEngine's layout) and ``fully_shard``-ed over its
``dp`` dimension, so FSDP2 shards the TP shards again and all-gathers them over ``dp`` before
each use. Compared, on every rank, with the same TP module without FSDP2 (the same local
weights, the same input): outputs and input gradients bit for bit (the gathered weights are the
TP shards exactly); weight gradients against the TP module's averaged over ``dp`` (FSDP2's
reduce-scatter: two ranks, so bit for bit); parameters after two SGD steps bit for bit. The
``compile_*`` cases run the 2-D ``Linear`` (column, row) under ``torch.compile(fullgraph=True,
backend="aot_eager")`` against the same 2-D module run eagerly (see ``compiled``). Same harness
as _tp_worker.py: ``python _fsdp_tp_worker.py RANK WORLD PORT OUT_DIR [CASES]``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _tp_worker as base
import torch
import torch.distributed as dist
from _tp_worker import RECIPES, check_full, exact, rand
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fusible
from fusible import recipe as R
from fusible.distributed import (
    Float8AllGatherWeight,
    fully_shard_fp8,
    init_recipe_state,
    tp_full_state_dict,
    tp_load_full_state_dict,
    tp_load_sharded_state_dict,
    tp_sharded_state_dict,
)

S, H, F = base.S, base.H, base.F
DP = TP = 2
LR = 0.5
# One dynamo cache entry per compiled fusible module (docs/distributed.md, "FSDP2 under
# torch.compile"): more than the default 8 here.
torch._dynamo.config.recompile_limit = 64
CASES: list[Any] = []
case = base.case_adder(CASES)

MAKERS: dict[str, Callable[[Any, bool], torch.nn.Module]] = {
    "column": lambda g, sp: fusible.Linear(H, F, tp_group=g, parallel_mode="column",
                                           sequence_parallel=sp),
    "row": lambda g, sp: fusible.Linear(F, H, tp_group=g, parallel_mode="row",
                                        sequence_parallel=sp),
    "lnlinear": lambda g, sp: fusible.LayerNormLinear(H, F, tp_group=g, parallel_mode="column",
                                                      sequence_parallel=sp),
    "lnmlp": lambda g, sp: fusible.LayerNormMLP(H, F, tp_group=g, sequence_parallel=sp),
    # sbhd, 8 heads and 4 K/V groups (GQA): each of 2 tp ranks holds 4 heads and 2 groups
    "tlayer": lambda g, sp: fusible.TransformerLayer(H, F, 8, num_gqa_groups=4, tp_group=g,
                                                     sequence_parallel=sp,
                                                     attn_input_format="sbhd"),
    # 3 experts, tokens [32, 0, 32] (an empty expert); no SP (refused: rows grouped by expert)
    "gcolumn": lambda g, sp: fusible.GroupedLinear(3, H, F, tp_group=g, parallel_mode="column"),
    "grow": lambda g, sp: fusible.GroupedLinear(3, F, H, bias=False, tp_group=g,
                                                parallel_mode="row"),
}  # fmt: skip
# (input features, output features) as each rank sees them, before sequence parallelism.
DIMS = {"column": (H, F // TP), "row": (F // TP, H), "lnlinear": (H, F // TP), "lnmlp": (H, H),
        "tlayer": (H, H), "gcolumn": (H, F // TP), "grow": (F // TP, H)}  # fmt: skip
# Each kind's Linear weights (fully_shard_fp8 converts them all).
LINEARS = {"column": 1, "row": 1, "lnlinear": 1, "lnmlp": 2, "tlayer": 4, "gcolumn": 3, "grow": 3}
GROUPED = ("gcolumn", "grow")


def call_kw(kind: str) -> dict[str, Any]:
    """The module's call arguments besides the input: a GroupedLinear's ``m_splits``."""
    return {"m_splits": [32, 0, 32]} if kind in GROUPED else {}


def mesh2d() -> Any:
    return init_device_mesh(base.DEVICE, (DP, TP), mesh_dim_names=("dp", "tp"))


def batch(kind: str, sp: bool, seed: int, dp_rank: int, tp_rank: int) -> tuple[Any, Any]:
    """This rank's input and output gradient. Each dp rank its own batch; the tp ranks of a dp
    group the same one (SP: its slice). Features split over tp: a row-parallel input, a
    column-parallel output (and its dy)."""
    d_in, d_out = DIMS[kind]
    x_split, dy_split = kind in ("row", "grow"), kind in ("column", "lnlinear", "gcolumn")
    x = rand(S, d_in, seed=seed + 10 * dp_rank + (tp_rank if x_split else 0))
    dy = rand(S, d_out, seed=seed + 10 * dp_rank + 5 + (tp_rank if dy_split else 0))
    if sp:  # tokens split over tp: the input of a column side, the output of a row side
        tokens = S // TP
        rows = slice(tp_rank * tokens, (tp_rank + 1) * tokens)
        x = x if kind == "row" else x[rows]
        dy = dy[rows] if kind in ("row", "lnmlp", "tlayer") else dy
    if kind == "tlayer":  # tokens as (sequence, batch 2): SP splits the sequence
        x, dy = x.view(-1, 2, H), dy.view(-1, 2, H)
    return x, dy


def two_d(kind: str, rec_name: str, sp: bool, fp8_gather: bool = False) -> None:
    """``fp8_gather``: ``fusible.distributed.fully_shard_fp8`` over ``dp`` (each tp rank's
    local weight gathered in FP8 with that local weight's scale, the one the TP module casts its
    shard with), else plain ``fully_shard``."""
    if base.WORLD != DP * TP:
        raise AssertionError(f"needs {DP * TP} ranks, got {base.WORLD}")
    rec = RECIPES[rec_name]
    mesh = mesh2d()
    tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    torch.manual_seed(1234 + tp_rank)  # the TP shards differ by tp rank, agree over dp
    ref = MAKERS[kind](tp_group, sp)
    m = MAKERS[kind](tp_group, sp)
    m.load_state_dict(ref.state_dict())
    if fp8_gather:
        fully_shard_fp8(m, recipe=rec, mesh=mesh["dp"])
    else:
        fully_shard(m, mesh=mesh["dp"])
    names = [n for n, _ in ref.named_parameters()]
    for n, p in m.named_parameters():
        if p.device_mesh.mesh_dim_names != ("dp",):
            raise AssertionError(f"{n}: sharded over {p.device_mesh}, expected the dp dimension")
    opts = [torch.optim.SGD(mod.parameters(), lr=LR) for mod in (ref, m)]
    for k in range(2):
        tag = f"{kind} {rec_name}{' sp' if sp else ''} step {k}"
        x, dy = batch(kind, sp, 100 * k, dp_rank, tp_rank)
        y_ref, dx_ref = base.run(ref, x, dy, rec, **call_kw(kind))
        y, dx = base.run(m, x, dy, rec, **call_kw(kind))
        exact(f"{tag} output", y, y_ref)
        exact(f"{tag} dx", dx, dx_ref)
        for n, p in zip(names, m.parameters(), strict=True):
            want = ref.get_parameter(n).grad.clone()
            dist.all_reduce(want, group=dp_group)
            exact(f"{tag} grad {n} (mean over dp)", p.grad.full_tensor(), want / DP)
            ref.get_parameter(n).grad.copy_(p.grad.full_tensor())  # the same update both sides
        for o in opts:
            o.step()
            o.zero_grad()
        for n, p in zip(names, m.parameters(), strict=True):
            exact(f"{tag} {n} after the step", p.full_tensor(), ref.get_parameter(n))
    if fp8_gather:  # every Linear weight was gathered in FP8
        converted = [n for n, p in m.named_parameters()
                     if isinstance(p.to_local(), Float8AllGatherWeight)]  # fmt: skip
        if len(converted) != LINEARS[kind]:
            raise AssertionError(f"{kind}: converted weights {converted}")


for _kind in MAKERS:
    for _rec in RECIPES:
        case(f"{_kind}_{_rec}")(lambda k=_kind, r=_rec: two_d(k, r, False))
    # The FP8 weight all-gather over dp of the TP module (current scaling; SP too).
    case(f"fp8gather_{_kind}_current")(lambda k=_kind: two_d(k, "current", False, True))
    case(f"fp8gather_{_kind}_delayed")(lambda k=_kind: two_d(k, "delayed", False, True))
    if _kind not in GROUPED:
        case(f"{_kind}_current_sp")(lambda k=_kind: two_d(k, "current", True))
        case(f"fp8gather_{_kind}_current_sp")(lambda k=_kind: two_d(k, "current", True, True))


def compiled(
    kind: str,
    rec_name: str,
    sp: bool,
    eager_first: bool = False,
    backend: str = "aot_eager",
    fp8_gather: bool = False,
) -> None:
    """The 2-D module under ``torch.compile(fullgraph=True, backend="aot_eager")`` against the
    same 2-D module run eagerly (the same local weights, the same inputs), two SGD steps:
    outputs, input gradients, every gradient shard and every parameter shard after each step bit
    for bit (``aot_eager`` runs the very kernels eager runs; the collectives are the same ones:
    the TP ones traced as functional collectives, FSDP2's eager around the graph). The first
    step must compile a graph, the second none.

    Row-parallel SP: the bias gradient is summed over ``tp`` inside the graph (an identity whose
    backward all-reduces, ops/grad_reduction.py, applied to the parameter object each forward
    sees: FSDP2's unsharded one); while it was a parameter hook re-attached only by an eager
    forward, compiled from the first call it was this rank's tokens' share. ``eager_first``: one
    eager forward under ``no_grad`` before compiling (``reshard()`` after it, as a root
    ``fully_shard`` module stays unsharded until its backward), the old workaround, kept as a
    check that it changes nothing.

    ``backend="inductor"``: see ``_tp_worker.sharded_grads_then_step``. ``fp8_gather``:
    ``fully_shard_fp8`` over ``dp`` in place of ``fully_shard`` (the graph reads the gathered
    ``Float8Tensor`` weights; torch >= 2.13)."""
    rec = RECIPES[rec_name]
    mesh = mesh2d()
    tp_group = mesh["tp"].get_group()
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    torch.manual_seed(1234 + tp_rank)
    eager = MAKERS[kind](tp_group, sp)
    comp = MAKERS[kind](tp_group, sp)
    comp.load_state_dict(eager.state_dict())
    for mod in (eager, comp):
        if fp8_gather:
            fully_shard_fp8(mod, recipe=rec, mesh=mesh["dp"])
        else:
            fully_shard(mod, mesh=mesh["dp"])
    if eager_first:  # the root stays unsharded after a forward (until backward): reshard
        with torch.no_grad():
            comp(batch(kind, sp, 190, dp_rank, tp_rank)[0], **call_kw(kind))
        comp.reshard()
    c = torch.compile(comp, fullgraph=True, backend=backend)
    opts = [torch.optim.SGD(mod.parameters(), lr=LR) for mod in (eager, comp)]
    graphs = [torch._dynamo.utils.counters["stats"]["unique_graphs"]]
    for k in range(2):
        tag = f"compiled {kind} {rec_name}{' sp' if sp else ''} step {k}"
        x, dy = batch(kind, sp, 200 + 100 * k, dp_rank, tp_rank)
        y_e, dx_e = base.run(eager, x, dy, rec, **call_kw(kind))
        y_c, dx_c = base.run(c, x, dy, rec, **call_kw(kind))
        exact(f"{tag} output", y_c, y_e)
        exact(f"{tag} dx", dx_c, dx_e)
        graphs.append(base.sharded_grads_then_step(tag, comp, eager, opts, backend))
    if not graphs[0] < graphs[1] == graphs[2]:
        raise AssertionError(
            f"compiled {kind} {rec_name}: graphs before / after each step {graphs}"
        )


for _kind in MAKERS:
    for _rec in RECIPES:
        case(f"compile_{_kind}_{_rec}")(lambda k=_kind, r=_rec: compiled(k, r, False))
    if _kind not in GROUPED:
        case(f"compile_{_kind}_current_sp")(lambda k=_kind: compiled(k, "current", True))
    for _rec in ("current", "delayed"):
        case(f"compile_fp8gather_{_kind}_{_rec}")(
            lambda k=_kind, r=_rec: compiled(k, r, False, fp8_gather=True)
        )
    case(f"inductor_{_kind}_current")(lambda k=_kind: compiled(k, "current", False, False,
                                                                "inductor"))  # fmt: skip
case("compile_row_current_sp_eager_first")(lambda: compiled("row", "current", True, True))


# ---- 2-D checkpoints: the full state dict (fusible.distributed.checkpoint) --------------------
_DELAYED = R.DelayedScaling()


def _model(tp_group: Any, shard: Callable[[torch.nn.Module], None] | None) -> torch.nn.ModuleDict:
    """Every kind of ``MAKERS`` (tensor-parallel over ``tp_group``; ``None``: the single-process
    modules), each passed to ``shard`` (FSDP2) when given."""
    m = torch.nn.ModuleDict()
    for kind, make in MAKERS.items():
        m[kind] = make(tp_group, False) if tp_group is not None else _FULL[kind]()
        if shard is not None:
            shard(m[kind])
    return m


_FULL: dict[str, Callable[[], torch.nn.Module]] = {
    "column": lambda: fusible.Linear(H, F), "row": lambda: fusible.Linear(F, H),
    "lnlinear": lambda: fusible.LayerNormLinear(H, F), "lnmlp": lambda: fusible.LayerNormMLP(H, F),
    "tlayer": lambda: fusible.TransformerLayer(H, F, 8, num_gqa_groups=4,
                                               attn_input_format="sbhd"),
    "gcolumn": lambda: fusible.GroupedLinear(3, H, F),
    "grow": lambda: fusible.GroupedLinear(3, F, H, bias=False),
}  # fmt: skip
_COLUMN_OUT = ("column", "lnlinear", "gcolumn")  # a TP rank returns its block of the features


def _x(kind: str, seed: int) -> torch.Tensor:
    """A whole (unsplit) input of ``kind``: the tokens as (sequence, batch 2) for the layer."""
    x = rand(S, F if kind in ("row", "grow") else H, seed=seed)
    return x.view(-1, 2, H) if kind == "tlayer" else x


def _forward(m: torch.nn.ModuleDict, kind: str, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), fusible.autocast(recipe=_DELAYED):
        return m[kind](x, **call_kw(kind))


def checkpoint_2d(fp8_gather: bool) -> None:
    """A 2-D model's checkpoint through the full state dict, across layouts. The single-process
    model's state dict (after a delayed-scaling step: a recipe state that is not the initial
    one) loads into the 2-D model (``tp_load_full_state_dict``: TP shard, then this rank's
    ``DTensor`` shard over ``dp``): its weights are the hand-cut TP shards (a fused QKV
    projection's: the rank's block of Q, of K and of V), its forward equals
    the single-process model's (the TP rank's features of a column side; 1e-5; not with
    ``fp8_gather``, whose weights are cast with the gather's scale) and its full state dict
    (``tp_full_state_dict``: ``full_tensor()`` over ``dp``, then the TP gather) is the loaded
    one bit for bit. After a step of the 2-D model, its full state dict loads into a 4-rank
    FSDP2 model, a 4-rank TP model and the single-process model, and each gives it back bit for
    bit; the FSDP2 and the single-process model compute the same forward (1e-5);
    ``rank0_only`` / ``cpu_offload`` give rank 0 the same dict on the CPU, the others nothing.
    ``fp8_gather``: the 2-D model is ``fully_shard_fp8``-ed (its state dict holds the masters,
    as plain FSDP2's)."""
    mesh = mesh2d()
    tp_group = mesh["tp"].get_group()
    tp_rank = mesh.get_local_rank("tp")

    def shard_dp(mod: torch.nn.Module) -> None:
        if fp8_gather:
            fully_shard_fp8(mod, recipe=R.Float8CurrentScaling(), mesh=mesh["dp"])
        else:
            fully_shard(mod, mesh=mesh["dp"])

    torch.manual_seed(7)  # the same single-process model on every rank
    full = _model(None, None)
    for kind in _FULL:  # a delayed-scaling step: recipe state to carry
        x = _x(kind, 300)
        dy = rand(*x.shape[:-1], F if kind in _COLUMN_OUT else H, seed=301)
        base.run(full[kind], x, dy, _DELAYED, **call_kw(kind))
    sd = full.state_dict()
    m2d = _model(tp_group, shard_dp)
    tp_load_full_state_dict(m2d, sd)
    if not any(hasattr(v, "device_mesh") for v in m2d.state_dict().values()):
        raise AssertionError("the 2-D model holds no DTensor: shows nothing")
    local = m2d.state_dict()
    for key, dim in (("column.weight", 0), ("row.weight", 1), ("lnmlp.fc1_weight", 0),
                     ("gcolumn.weight1", 0), ("gcolumn.bias2", 0), ("grow.weight2", 1),
                     ("tlayer.self_attention.proj.weight", 1)):  # fmt: skip
        exact(f"2-D {key}: this tp rank's shard", local[key].full_tensor(),
              sd[key].chunk(TP, dim)[tp_rank])  # fmt: skip
    for key in ("tlayer.self_attention.layernorm_qkv.weight",
                "tlayer.self_attention.layernorm_qkv.bias"):  # fmt: skip
        exact(f"2-D {key}: this tp rank's Q, K and V", local[key].full_tensor(),
              sd[key][base.qkv_rows(tp_rank, TP, 8, 4, H // 8)])  # fmt: skip
    check_full("2-D round trip", tp_full_state_dict(m2d), sd)
    for kind in () if fp8_gather else _FULL:
        x = _x(kind, 310)
        y_full = _forward(full, kind, x)
        x_local = x.chunk(TP, -1)[tp_rank] if kind in ("row", "grow") else x
        want = y_full.chunk(TP, -1)[tp_rank] if kind in _COLUMN_OUT else y_full
        base.close(f"2-D {kind} forward after the load", _forward(m2d, kind, x_local), want)
    opt = torch.optim.SGD(m2d.parameters(), lr=LR)
    for kind in _FULL:
        x, dy = batch(kind, False, 320, mesh.get_local_rank("dp"), tp_rank)
        base.run(m2d[kind], x, dy, _DELAYED, group=dist.group.WORLD, **call_kw(kind))
    opt.step()
    saved = tp_full_state_dict(m2d)
    # The options: rank 0 alone holds it (on the CPU), the same bits.
    small = tp_full_state_dict(m2d, cpu_offload=True, rank0_only=True)
    if dist.get_rank() == 0:
        check_full("rank0_only / cpu_offload", small, saved)
        if any(t.device.type != "cpu" for t in small.values() if isinstance(t, torch.Tensor)):
            raise AssertionError("cpu_offload left a tensor off the CPU")
    elif small:
        raise AssertionError(f"rank0_only: rank {dist.get_rank()} got {len(small)} entries")
    world = init_device_mesh(base.DEVICE, (DP * TP,))
    targets = {
        "4-rank FSDP2": _model(None, lambda mod: fully_shard(mod, mesh=world)),
        "4-rank TP": _model(dist.group.WORLD, None),
        "single process": _model(None, None),
    }
    outs = {}
    for what, target in targets.items():
        tp_load_full_state_dict(target, saved)
        check_full(f"{what} round trip", tp_full_state_dict(target), saved)
        if what != "4-rank TP":
            outs[what] = [_forward(target, k, _x(k, 330)) for k in ("lnmlp", "tlayer", "grow")]
    for a, b in zip(outs["4-rank FSDP2"], outs["single process"], strict=True):
        base.close("FSDP2 vs single-process forward", a, b)


@case("tpdcp_layers")
def tpdcp_layers() -> None:
    """Sharded DCP checkpoints (``tp_sharded_state_dict``) of ``TransformerLayer`` (8 heads, 4
    K/V groups: QKV kept as its Q, K and V parts) and ``GroupedLinear`` (column, row): saved at
    TP 4 (the whole world) from the single-process modules' state (after a delayed-scaling
    step), loaded at TP 2 (each dp group its own TP 2 model) and into the single-process
    modules: each gives the saved full state dict back bit for bit."""
    import torch.distributed.checkpoint as dcp

    path = str(Path(sys.argv[4]) / "tpdcp_layers")
    kinds = ("tlayer", "gcolumn", "grow")

    def model(g: Any) -> torch.nn.ModuleDict:
        return torch.nn.ModuleDict(
            {k: MAKERS[k](g, False) if g is not None else _FULL[k]() for k in kinds}
        )

    torch.manual_seed(11)
    full = model(None)
    for kind in kinds:
        x = _x(kind, 400)
        dy = rand(*x.shape[:-1], F if kind in _COLUMN_OUT else H, seed=401)
        base.run(full[kind], x, dy, _DELAYED, **call_kw(kind))
    tp4 = model(dist.group.WORLD)
    tp_load_full_state_dict(tp4, full.state_dict())
    want = tp_full_state_dict(tp4)
    check_full("TP 4 from the single-process state", want, full.state_dict())
    dcp.save(tp_sharded_state_dict(tp4), checkpoint_id=path)
    for what, m in (("TP 2", model(mesh2d()["tp"].get_group())), ("single process", model(None))):
        init_recipe_state(m, _DELAYED)
        sd = tp_sharded_state_dict(m)
        dcp.load(sd, checkpoint_id=path)
        tp_load_sharded_state_dict(m, sd)
        check_full(f"{what} from TP 4's sharded checkpoint", tp_full_state_dict(m), want)


case("checkpoint_2d")(lambda: checkpoint_2d(False))
case("checkpoint_2d_fp8gather")(lambda: checkpoint_2d(True))


if __name__ == "__main__":
    base.main(CASES, timeout_s=120.0)
