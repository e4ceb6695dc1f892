"""One rank of the world-size-3 tests (run by test_world3.py as a subprocess:
``python _w3_worker.py RANK WORLD PORT OUT_DIR [ONLY]``). Every case runs on every rank in the
same order (collectives pair up); each records "ok" or its error in OUT_DIR/rank{RANK}.json.

Three ranks, unlike two, split a sum in an order of their own (gloo adds three partial results
in an order that need not be the reference's ``(a + b) + c``), so sums over ranks are compared
within ``1e-5`` of the largest value; everything a rank computes alone (a column-parallel
output, a row-parallel input gradient, the weight gradients) is compared bit for bit against the
single-process module of its shard, as the two-rank tests do."""

from __future__ import annotations

from collections.abc import Callable

import _tp_worker as base
import torch
import torch.distributed as dist
from _tp_worker import RECIPES, _raises, close, cols, exact, load, rand, run, toks

import fusible
from fusible import recipe as R

# tokens, hidden, ffn/out: divisible by 3, and per rank (32, 32, 64) by MXFP8's 32-blocks.
S, H, F = 96, 96, 192
CASES: list[tuple[str, Callable[[], None]]] = []
RANK = WORLD = 0


case = base.case_adder(CASES)


def ln_mlp(rec_name: str) -> None:
    """SP LayerNormMLP (column fc1 + row fc2) against the full-size module of the same
    weights, and, bit for bit, fc1's output shard against the single-process fc1 shard."""
    rec = RECIPES[rec_name]
    gamma, beta = 1 + rand(H, seed=20), rand(H, seed=21)
    W1, b1 = rand(F, H, seed=22), rand(F, seed=23)
    W2, b2 = rand(H, F, seed=24), rand(H, seed=25)
    x, dy = rand(S, H, seed=26), rand(S, H, seed=27)
    c = cols(F, RANK)
    tp = fusible.LayerNormMLP(H, F, tp_group=dist.group.WORLD, sequence_parallel=True)
    assert tuple(tp.fc1_weight.shape) == (F // WORLD, H), tp.fc1_weight.shape
    assert tuple(tp.fc2_weight.shape) == (H, F // WORLD), tp.fc2_weight.shape
    load(tp, layer_norm_weight=gamma, layer_norm_bias=beta, fc1_weight=W1[c], fc1_bias=b1[c],
         fc2_weight=W2[:, c], fc2_bias=b2)  # fmt: skip
    y, dx = run(tp, toks(x, RANK), toks(dy, RANK), rec, dist.group.WORLD)
    full = fusible.LayerNormMLP(H, F)
    load(full, layer_norm_weight=gamma, layer_norm_bias=beta, fc1_weight=W1, fc1_bias=b1,
         fc2_weight=W2, fc2_bias=b2)  # fmt: skip
    yf, dxf = run(full, x, dy, rec)
    tol = 1e-5 if rec is None else 0.25  # FP8: per-shard scales of weights and fc2's input
    close("y vs full", y, toks(yf, RANK), tol)
    close("dx vs full", dx, toks(dxf, RANK), tol)
    close("dfc1", tp.fc1_weight.grad, full.fc1_weight.grad[c], tol)
    close("dfc1_bias", tp.fc1_bias.grad, full.fc1_bias.grad[c], tol)
    close("dfc2", tp.fc2_weight.grad, full.fc2_weight.grad[:, c], tol)
    close("dfc2_bias", tp.fc2_bias.grad, full.fc2_bias.grad, tol)
    close("dgamma", tp.layer_norm_weight.grad, full.layer_norm_weight.grad, tol)
    close("dbeta", tp.layer_norm_bias.grad, full.layer_norm_bias.grad, tol)
    # fc1 alone (norm + gather + fc1 + bias): this rank's shard is computed as the
    # single-process LayerNormLinear of the shard computes it on the full input.
    ln1 = fusible.LayerNormLinear(H, F, tp_group=dist.group.WORLD, parallel_mode="column",
                                  sequence_parallel=True)  # fmt: skip
    load(ln1, layer_norm_weight=gamma, layer_norm_bias=beta, weight=W1[c], bias=b1[c])
    y1, _ = run(ln1, toks(x, RANK), torch.ones(S, F // WORLD), rec, dist.group.WORLD)
    ref1 = fusible.LayerNormLinear(H, F // WORLD)
    load(ref1, layer_norm_weight=gamma, layer_norm_bias=beta, weight=W1[c], bias=b1[c])
    y1r, _ = run(ref1, x, torch.ones(S, F // WORLD), rec)
    exact("fc1 shard output", y1, y1r)


for _r in RECIPES:
    for _sp in (False, True):
        _sfx = f"{_r}{'_sp' if _sp else ''}"
        case(f"linear_column_{_sfx}")(lambda r=_r, s=_sp: base.column_linear(r, s, (S, H, F)))
        case(f"linear_row_{_sfx}")(lambda r=_r, s=_sp: base.row_linear(r, s, (S, H, F)))
    case(f"lnmlp_{_r}_sp")(lambda r=_r: ln_mlp(r))


@case("delayed_amax_reduction")
def delayed_amax() -> None:
    """With ``amax_reduction_group`` the three ranks' delayed-scaling scales are identical."""
    torch.manual_seed(RANK)  # the ranks' weight shards differ
    tp = fusible.LayerNormMLP(H, F, tp_group=dist.group.WORLD, sequence_parallel=True)
    x = rand(S, H, seed=30) * (1 + RANK)
    for _ in range(2):
        with fusible.autocast(recipe=R.DelayedScaling(), amax_reduction_group=dist.group.WORLD):
            y = tp(toks(x, RANK))
        y.sum().backward()
    scales = torch.cat([s.scale for op in tp for fwd in (True, False)
                        if (s := getattr(op, "recipe_state", lambda f: None)(fwd)) is not None
                        and hasattr(s, "scale")])  # fmt: skip
    got = [torch.empty_like(scales) for _ in range(WORLD)]
    dist.all_gather(got, scales)
    for r in range(1, WORLD):
        exact(f"scales rank 0 / rank {r}", got[0], got[r])


@case("fsdp2_current")
def fsdp2() -> None:
    """``fully_shard`` on a ``fusible.Linear`` under current scaling over 3 ranks: output equal
    to the unsharded module's bit for bit, gradients its mean over ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    rec = R.Float8CurrentScaling()
    torch.manual_seed(0)  # the same full weights on every rank
    ref = fusible.Linear(H, F)
    model = fusible.Linear(H, F)
    model.load_state_dict(ref.state_dict())
    fully_shard(model, mesh=mesh)
    local = model.weight.to_local()
    if tuple(local.shape) != (F // WORLD, H):
        raise AssertionError(f"FSDP2 shard {tuple(local.shape)}, expected {(F // WORLD, H)}")
    x = rand(S, H, seed=40 + RANK)
    outs = []
    for m in (model, ref):
        with fusible.autocast(recipe=rec):
            y = m(x)
        y.float().pow(2).mean().backward()
        outs.append(y.detach())
    exact("fsdp2 output", outs[0], outs[1])
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        g = q.grad.clone()
        dist.all_reduce(g)
        close(f"fsdp2 grad {n}", p.grad.full_tensor(), g / WORLD, 1e-5)


@case("bad_input")
def bad_input() -> None:
    """Sizes that do not divide by 3 raise on every rank at construction (before any
    collective: no hang), naming the module, the argument and tp_size=3."""
    g = dist.group.WORLD
    _raises(lambda: fusible.Linear(H, 64, tp_group=g, parallel_mode="column"),
            "Linear", "out_features=64", "tp_size=3")  # fmt: skip
    _raises(lambda: fusible.Linear(128, H, tp_group=g, parallel_mode="row"),
            "Linear", "in_features=128", "tp_size=3")  # fmt: skip
    _raises(lambda: fusible.LayerNormMLP(H, 256, tp_group=g, sequence_parallel=True),
            "LayerNormMLP", "ffn_hidden_size=256", "tp_size=3")  # fmt: skip
    _raises(lambda: fusible.LayerNormLinear(H, 100, tp_group=g, parallel_mode="column"),
            "LayerNormLinear", "out_features=100", "tp_size=3")  # fmt: skip
    # A sequence-parallel input of 64 tokens does not split over 3 ranks.
    tp = fusible.Linear(F, H, tp_group=g, parallel_mode="row", sequence_parallel=True)
    _raises(lambda: tp(torch.randn(64, F // WORLD)), "ReduceScatter", "divisible")


def _start(rank: int, world: int, out: str) -> None:
    global RANK, WORLD
    RANK, WORLD = rank, world


def main() -> None:
    base.main(CASES, on_start=_start)


if __name__ == "__main__":
    main()
