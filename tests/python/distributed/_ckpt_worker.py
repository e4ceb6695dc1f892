"""One rank of the checkpoint tests (run by test_dist_checkpoint.py as a subprocess:
``python _ckpt_worker.py RANK WORLD PORT OUT_DIR ONLY``). The checkpoints live in
``OUT_DIR/../ckpt``, shared by the runs at world sizes 1, 2 and 3 of one test module:
``tp_w<n>.pt`` (a full state dict from :func:`fusible.distributed.tp_full_state_dict`) and
``fsdp_w<n>/`` (a ``torch.distributed.checkpoint`` of ``fully_shard``-ed modules) with
``fsdp_w<n>_ref.pt`` (its full tensors, the expected values). Loads run before saves."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import _tp_worker as base
import torch
import torch.distributed as dist
from _tp_worker import check_full, close, exact, rand

import fusible
from fusible import recipe as R
from fusible.distributed import (
    init_recipe_state,
    tp_full_state_dict,
    tp_load_full_state_dict,
    tp_load_sharded_state_dict,
    tp_shard_state_dict,
    tp_sharded_state_dict,
)

S, H, F = 96, 96, 192  # divisible by 1, 2 and 3 (and by 2*3*16 where FP8 GEMMs align)
CASES: list[tuple[str, Callable[[], None]]] = []
RANK = WORLD = 0
CKPT = Path(".")
DELAYED = R.DelayedScaling()


case = base.case_adder(CASES)


def toks(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(WORLD, 0)[RANK]


# ---- tensor parallelism: full state dicts ----------------------------------------------------
# name -> (constructor kwargs -> module, sequence parallel, input features, output features)
_TP: dict[str, tuple[Callable[..., torch.nn.Module], bool, int, int]] = {
    "col_sp": (lambda **k: fusible.Linear(H, F, parallel_mode="column", **k), True, H, F),
    "row": (lambda **k: fusible.Linear(F, H, parallel_mode="row", **k), False, F, H),
    "lnlin": (lambda **k: fusible.LayerNormLinear(H, F, parallel_mode="column", **k), False, H,
              F),
    "mlp_sp": (lambda **k: fusible.LayerNormMLP(H, F, **k), True, H, H),
    "glu": (lambda **k: fusible.LayerNormMLP(H, F, activation="swiglu", **k), False, H, H),
}  # fmt: skip


def tp_model() -> torch.nn.ModuleDict:
    g = dist.group.WORLD
    return torch.nn.ModuleDict(
        {n: make(tp_group=g, sequence_parallel=sp) for n, (make, sp, _, _) in _TP.items()}
    )


def full_model() -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict({n: make() for n, (make, _, _, _) in _TP.items()})


def _local_in(name: str, x: torch.Tensor) -> torch.Tensor:
    """The TP module's input: this rank's tokens (SP), features (row) or all of it."""
    if _TP[name][1]:
        return toks(x)
    if name == "row":
        return x.chunk(WORLD, 1)[RANK]
    return x


def _local_out(name: str, y: torch.Tensor) -> torch.Tensor:
    """The part of the full module's output this rank's TP module returns: its features
    (column-parallel, every token), its tokens (sequence-parallel MLP) or all of it."""
    if name in ("col_sp", "lnlin"):
        return y.chunk(WORLD, 1)[RANK]
    return toks(y) if _TP[name][1] else y


def step(
    tp: torch.nn.ModuleDict, full: torch.nn.ModuleDict, rec: Any, seed: int, reduce: bool = True
) -> None:
    """One forward and backward of every module, TP and full size, on the same data (delayed
    scaling: amaxes reduced over the group unless ``reduce=False``, so the TP states follow the
    full model's); the TP outputs and input gradients against the full model's."""
    tol = 1e-5
    for i, name in enumerate(_TP):
        _, _, k, n = _TP[name]
        x, dy = rand(S, k, seed=seed + 2 * i), rand(S, n, seed=seed + 2 * i + 1)
        outs = []
        for m, xin, dyin in ((tp[name], _local_in(name, x), _local_out(name, dy)),
                             (full[name], x, dy)):  # fmt: skip
            xin = xin.detach().clone().requires_grad_()
            group = dist.group.WORLD if reduce else None
            with fusible.autocast(enabled=rec is not None, recipe=rec, amax_reduction_group=group):
                y = m(xin)
            y.backward(dyin)
            outs.append((y.detach(), xin.grad))
        (y, dx), (yf, dxf) = outs
        close(f"{name} y vs full", y, _local_out(name, yf), tol)
        close(f"{name} dx vs full", dx, _local_in(name, dxf), tol)


def tp_save() -> None:
    torch.manual_seed(0)  # the same full weights on every rank, at every world size
    full = full_model()
    tp = tp_model()
    sd = full.state_dict()
    tp_load_full_state_dict(tp, sd)
    # The scatter by hand (TransformerEngine's layouts): rows of a column-parallel weight, columns
    # of a row-parallel one, this rank's block of each half of a gated fc1.
    c = slice(RANK * F // WORLD, (RANK + 1) * F // WORLD)
    exact("col_sp weight shard", tp["col_sp"].weight, sd["col_sp.weight"][c])
    exact("col_sp bias shard", tp["col_sp"].bias, sd["col_sp.bias"][c])
    exact("row weight shard", tp["row"].weight, sd["row.weight"][:, c])
    exact("row bias (whole)", tp["row"].bias, sd["row.bias"])
    w1 = sd["glu.fc1_weight"]
    exact("glu fc1 shard", tp["glu"].fc1_weight, torch.cat([w1[:F][c], w1[F:][c]]))
    exact("mlp fc2 shard", tp["mlp_sp"].fc2_weight, sd["mlp_sp.fc2_weight"][:, c])
    # Two steps under delayed scaling, so the recipe states hold amax histories and scales.
    for s in (0, 100):
        step(tp, full, DELAYED, s)
    got = tp_full_state_dict(tp)
    want = full.state_dict()
    weights = {k: v for k, v in want.items() if not k.endswith("_extra_state")}
    check_full("full state dict (weights)", {k: got[k] for k in weights}, weights)
    # The gathered recipe state (amax histories max-, scales min-reduced over the ranks) is the
    # full model's: its per-tensor amaxes are the maximum of the shards'.
    check_full("full state dict", got, want, 1e-5)
    if RANK == 0:
        torch.save(got, CKPT / f"tp_w{WORLD}.pt")


def tp_load(src: int) -> None:
    sd = torch.load(CKPT / f"tp_w{src}.pt", weights_only=True)
    tp, full = tp_model(), full_model()
    tp_load_full_state_dict(tp, sd)
    full.load_state_dict(sd)
    # Back to the full state dict at this world size: the same weights, the same recipe state.
    check_full(f"tp_full_state_dict after load from world {src}", tp_full_state_dict(tp), sd)
    # The next steps (delayed scaling from the loaded state; then no recipe) compute what the
    # single-process model of the same full weights computes.
    step(tp, full, DELAYED, 200)
    step(tp, full, None, 300)
    check_full("state after the steps", tp_full_state_dict(tp), full.state_dict(), 1e-5)


def tpdcp_save() -> None:
    """A sharded DCP checkpoint of the TP modules (``tp_sharded_state_dict``: each rank writes
    its shards, no gather) after two delayed-scaling steps, and its full state dict beside it
    (rank 0, the expected values). The dict's TP entries are DTensors that view the parameters
    (no copy); a gated fc1 is kept half by half."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    full, tp = full_model(), tp_model()
    tp_load_full_state_dict(tp, full.state_dict())
    for s in (0, 100):
        step(tp, full, DELAYED, s)
    sd = tp_sharded_state_dict(tp)
    if "glu.fc1_weight" in sd or "glu.fc1_weight.part1" not in sd:
        raise AssertionError(f"the gated fc1 is not kept by halves: {sorted(sd)}")
    w = sd["row.weight"]
    if WORLD > 1 and not (
        isinstance(w, DTensor) and w.to_local().data_ptr() == tp["row"].weight.data_ptr()
    ):
        raise AssertionError("row.weight: not a DTensor viewing the parameter")
    dcp.save(sd, checkpoint_id=str(CKPT / f"tpdcp_w{WORLD}"))
    want = tp_full_state_dict(tp)
    if RANK == 0:
        torch.save(want, CKPT / f"tpdcp_w{WORLD}_ref.pt")


def tpdcp_load(src: int) -> None:
    """World ``src``'s sharded checkpoint into the TP modules at this world size and into the
    single-process modules: each gives the saved model's full state dict back bit for bit
    (weights and recipe state), and the next steps compute what the single-process model
    computes."""
    import torch.distributed.checkpoint as dcp

    want = torch.load(CKPT / f"tpdcp_w{src}_ref.pt", weights_only=True)
    tp, full = tp_model(), full_model()
    for m in (tp, full):
        init_recipe_state(m, DELAYED)  # entries for DCP to fill
        sd = tp_sharded_state_dict(m)
        dcp.load(sd, checkpoint_id=str(CKPT / f"tpdcp_w{src}"))
        tp_load_sharded_state_dict(m, sd)
    check_full(f"TP modules from world {src}'s sharded checkpoint", tp_full_state_dict(tp), want)
    check_full(f"single-process modules from world {src}", full.state_dict(), want)
    step(tp, full, DELAYED, 200)
    check_full("state after a step", tp_full_state_dict(tp), full.state_dict(), 1e-5)


def _layer(**kw: Any) -> torch.nn.Module:
    # 12 heads, 6 K/V groups, head dim 8: at TP 3 a rank's QKV rows (4 + 2 + 2 heads of 8) are
    # no multiple of 12 + 6 + 6, only of the parts in lowest terms (2, 1, 1).
    return fusible.TransformerLayer(H, F, 12, num_gqa_groups=6, attn_input_format="sbhd", **kw)


def tp_layer() -> None:
    """A GQA TransformerLayer at this world size: the single-process state dict goes in
    (tp_load_full_state_dict) and comes back out bit for bit through tp_full_state_dict, and
    through a sharded DCP save (tp_sharded_state_dict) loaded into the single-process layer."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(3)
    sd = _layer().state_dict()
    tp = _layer(tp_group=dist.group.WORLD)
    tp_load_full_state_dict(tp, sd)
    check_full("TP layer round trip", tp_full_state_dict(tp), sd)
    path = str(CKPT / f"tl_w{WORLD}")
    dcp.save(tp_sharded_state_dict(tp), checkpoint_id=path)
    one = _layer()
    got = tp_sharded_state_dict(one)
    dcp.load(got, checkpoint_id=path)
    tp_load_sharded_state_dict(one, got)
    check_full("single-process layer from the sharded checkpoint", one.state_dict(), sd)


def tpdcp_mixed() -> None:
    """A model of a TP Linear and a fully_shard-ed gated LayerNormMLP (FSDP2 alone: its
    DTensors pass through whole, DCP reshards them): saved sharded and loaded into the same
    layout, every full tensor bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build() -> torch.nn.ModuleDict:
        m = torch.nn.ModuleDict({
            "tp": fusible.Linear(H, F, tp_group=dist.group.WORLD, parallel_mode="column"),
            "mlp": fusible.LayerNormMLP(H, F, activation="swiglu")})  # fmt: skip
        fully_shard(m["mlp"], mesh=init_device_mesh("cpu", (WORLD,)))
        return m

    torch.manual_seed(5)
    src = build()
    want = tp_full_state_dict(src)
    path = str(CKPT / f"mixed_w{WORLD}")
    dcp.save(tp_sharded_state_dict(src), checkpoint_id=path)
    torch.manual_seed(6)
    dst = build()
    sd = tp_sharded_state_dict(dst)
    dcp.load(sd, checkpoint_id=path)
    tp_load_sharded_state_dict(dst, sd)
    check_full("mixed TP / FSDP2 model from its sharded checkpoint", tp_full_state_dict(dst), want)


def tp_merge_unreduced() -> None:
    """Without ``amax_reduction_group`` the ranks' delayed-scaling states differ (each saw its
    shard's amaxes); the gathered state (amax histories max-, scales min-reduced) is still the
    full model's. One step: scale 1 everywhere, so the TP and full-size steps compute the same
    values and record the same per-tensor amaxes."""
    torch.manual_seed(0)
    full, tp = full_model(), tp_model()
    tp_load_full_state_dict(tp, full.state_dict())
    step(tp, full, DELAYED, 0, reduce=False)
    if WORLD > 1:
        h = tp["row"].state_dict()["_extra_state"]["forward.amax_history"]
        hs = [torch.empty_like(h) for _ in range(WORLD)]
        dist.all_gather(hs, h)
        if all(torch.equal(hs[0], o) for o in hs[1:]):
            raise AssertionError("the ranks' states agree without a reduction: shows nothing")
    check_full("merged recipe state", tp_full_state_dict(tp), full.state_dict(), 1e-5)


def tp_bad_shapes() -> None:
    """A full state dict of other sizes: a clear error naming the key, no collective."""
    tp = tp_model()
    sd = full_model().state_dict()
    sd["row.weight"] = torch.zeros(H, F + 6)
    try:
        tp_shard_state_dict(tp, sd)
    except ValueError as e:
        if "'row.weight'" not in str(e) or f"tp_size={WORLD}" not in str(e):
            raise AssertionError(f"unclear message: {e}") from e
    else:
        raise AssertionError("no error for a full weight of the wrong size")
    # FSDP2 parameters (DTensors): the full state dict gathers them (each equal to its
    # full_tensor()); a DTensor in a full state dict is refused, naming the key.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = fusible.Linear(H, F)
    fully_shard(m, mesh=init_device_mesh("cpu", (WORLD,)))
    got = tp_full_state_dict(m)
    for k, v in m.state_dict().items():
        if isinstance(v, torch.Tensor):
            exact(f"FSDP2 full state dict {k}", got[k], v.full_tensor())
    try:
        tp_shard_state_dict(m, m.state_dict())
    except TypeError as e:
        if "'weight' is a DTensor" not in str(e) or "tp_full_state_dict" not in str(e):
            raise AssertionError(f"unclear message: {e}") from e
    else:
        raise AssertionError("no error for a DTensor in a full state dict")


# ---- FSDP2: torch.distributed.checkpoint --------------------------------------------------------


def fsdp_model(fp8: bool = False) -> torch.nn.ModuleDict:
    """The two modules, each ``fully_shard``-ed (``fp8``: ``fully_shard_fp8``, the weights
    all-gathered in FP8 with current scaling)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"lin": fusible.Linear(H, F), "mlp": fusible.LayerNormMLP(H, F)})
    mesh = init_device_mesh("cpu", (WORLD,))
    for sub in m.values():
        if fp8:
            fusible.distributed.fully_shard_fp8(sub, mesh=mesh)
        else:
            fully_shard(sub, mesh=mesh)
    return m


# Linear under current scaling (stateless), LayerNormMLP under delayed scaling with the amaxes
# reduced over the ranks (its state is then the same on every rank: DCP saves it once). With the
# FP8 all-gather both run current scaling, the gather's own recipe: each GEMM then takes the
# gathered FP8 weight as it is, which is the single process's quantized weight (the scale comes
# from the whole weight's amax), so the outputs compare bit for bit with one process.
_FSDP_RECIPES = {"lin": R.Float8CurrentScaling(), "mlp": DELAYED}
_FSDP8_RECIPES = {"lin": R.Float8CurrentScaling(), "mlp": R.Float8CurrentScaling()}


def fsdp_run(
    m: torch.nn.ModuleDict, x: torch.Tensor, train: bool, fp8: bool = False
) -> dict[str, torch.Tensor]:
    outs = {}
    recipes = _FSDP8_RECIPES if fp8 else _FSDP_RECIPES
    for name, sub in m.items():
        with fusible.autocast(recipe=recipes[name], amax_reduction_group=dist.group.WORLD):
            y = sub(x)
        if train:
            y.float().pow(2).mean().backward()
        outs[name] = y.detach()
    return outs


def _plain(sd: dict[str, Any]) -> dict[str, Any]:
    """Full tensors of a (sharded) state dict."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = {a: b.detach().clone() for a, b in v.items()}
        elif hasattr(v, "full_tensor"):
            out[k] = v.full_tensor().detach().clone()
        else:
            out[k] = v.detach().clone()
    return out


def fsdp_save(fp8: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    tag = "fsdp8" if fp8 else "fsdp"
    m = fsdp_model(fp8)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for s in (0, 1):  # two training steps: weights moved off the initialisation, a delayed state
        fsdp_run(m, rand(S // WORLD * WORLD, H, seed=50 + 10 * s + RANK), True, fp8)
        opt.step()
        opt.zero_grad()
    sd = m.state_dict()
    if fp8:  # the shards DCP writes are the high-precision master shards
        for k, v in sd.items():
            if isinstance(v, torch.Tensor) and type(v.to_local()) is not torch.Tensor:
                raise AssertionError(f"{k}: state_dict holds a {type(v.to_local()).__name__}")
    dcp.save(sd, checkpoint_id=str(CKPT / f"{tag}_w{WORLD}"))
    ref = _plain(sd)
    if RANK == 0:
        torch.save(ref, CKPT / f"{tag}_w{WORLD}_ref.pt")


def fsdp_load(src: int, fp8: bool = False, into_fp8: bool | None = None) -> None:
    """Load world ``src``'s checkpoint (``fp8``: the fully_shard_fp8 one) into a model sharded
    by fully_shard (``into_fp8`` False) or fully_shard_fp8 (True; default: as saved)."""
    import torch.distributed.checkpoint as dcp

    tag = "fsdp8" if fp8 else "fsdp"
    ref = torch.load(CKPT / f"{tag}_w{src}_ref.pt", weights_only=True)
    m = fsdp_model(fp8 if into_fp8 is None else into_fp8)
    if not fp8:
        init_recipe_state(m["mlp"], DELAYED)  # entries for DCP to fill (a fresh module has none)
    sd = m.state_dict()
    dcp.load(sd, checkpoint_id=str(CKPT / f"{tag}_w{src}"))
    m.load_state_dict(sd)
    for name, sub in m.items():
        local = sub.state_dict()["weight" if name == "lin" else "fc1_weight"].to_local()
        rows = (F + WORLD - 1) // WORLD
        if local.shape[0] != rows:
            raise AssertionError(f"{name}: {local.shape[0]} rows per rank, expected {rows}")
    check_full(f"loaded from world {src}", _plain(m.state_dict()), ref)
    # Outputs equal the single-process model with the checkpoint's full tensors, bit for bit.
    single = torch.nn.ModuleDict({"lin": fusible.Linear(H, F), "mlp": fusible.LayerNormMLP(H, F)})
    single.load_state_dict(ref)
    x = rand(S, H, seed=60)
    got, want = fsdp_run(m, x, False, fp8), fsdp_run(single, x, False, fp8)
    for name in got:
        exact(f"{name} output after load from world {src}", got[name], want[name])


for _n in (1, 2, 3):
    case(f"tp_load_w{_n}")(lambda n=_n: tp_load(n))
    case(f"tpdcp_load_w{_n}")(lambda n=_n: tpdcp_load(n))
    case(f"fsdp_load_w{_n}")(lambda n=_n: fsdp_load(n))
    case(f"fsdp8_load_w{_n}")(lambda n=_n: fsdp_load(n, fp8=True))
    # fully_shard_fp8's checkpoint is plain FSDP2's: it loads into a fully_shard model.
    case(f"fsdp_from8_w{_n}")(lambda n=_n: fsdp_load(n, fp8=True, into_fp8=False))
case("tp_save")(tp_save)
case("tpdcp_save")(tpdcp_save)
case("tp_layer")(tp_layer)
case("tpdcp_mixed")(tpdcp_mixed)
case("fsdp_save")(fsdp_save)
case("fsdp8_save")(lambda: fsdp_save(fp8=True))
case("tp_merge_unreduced")(tp_merge_unreduced)
case("tp_bad_shapes")(tp_bad_shapes)


def _start(rank: int, world: int, out: str) -> None:
    global RANK, WORLD, CKPT
    RANK, WORLD = rank, world
    CKPT = Path(out).parent / "ckpt"
    CKPT.mkdir(exist_ok=True)


def main() -> None:
    base.main(CASES, on_start=_start)


if __name__ == "__main__":
    main()
