"""FSDP2 with the FP8 weight all-gather: a stack of ``fusible.TransformerLayer`` trained with each
layer sharded by ``fusible.distributed.fully_shard_fp8`` (its Linear weights all-gathered in FP8,
one byte per element) and the root by ``fully_shard``, under ``fusible.autocast``; one
``precompute_fp8_scales`` call after each optimizer step agrees on every gathered weight's scale
with one collective. GPUs through NCCL when there are enough, else the CPU through gloo.

    torchrun --nproc-per-node 2 examples/train_fsdp_fp8.py [--recipe delayed|current] [--steps 20]
    python examples/train_fsdp_fp8.py --spawn 2    # the same without torchrun (CPU, gloo)
    ... --compile    # each sharded layer under torch.compile(fullgraph=True) (torch >= 2.11)

Each rank trains on its own batches of a fixed random regression task; rank 0 prints the loss
(averaged over the ranks) every few steps and the bytes one layer's FP8 all-gather moves.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fusible
from fusible.distributed import fully_shard_fp8, precompute_fp8_scales

RECIPES = {"delayed": fusible.recipe.DelayedScaling, "current": fusible.recipe.Float8CurrentScaling}


def train(
    rank: int, world: int, args: argparse.Namespace, local_rank: int, local_world: int
) -> float:
    # A GPU per process of this node (torchrun's LOCAL_RANK), else the CPU through gloo.
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        loss_val = _train(rank, world, args, device, cuda)
        # The model, its optimizer and every tensor of the steps are gone (they lived in
        # _train's frame) and collected before teardown: gloo aborted a rank at exit now and
        # then (SIGABRT, "terminate called without an active exception") while its work
        # objects still held tensors. Then every rank is done before any tears its group down.
        gc.collect()
        dist.barrier()
        return loss_val
    finally:
        dist.destroy_process_group()


def _train(
    rank: int, world: int, args: argparse.Namespace, device: torch.device, cuda: bool
) -> float:
    mesh = init_device_mesh(device.type, (world,))
    rec = RECIPES[args.recipe]()
    h, dtype = args.hidden, torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)  # the same initial weights on every rank
    layers = [fusible.TransformerLayer(h, 4 * h, args.heads, device=device, dtype=dtype)
              for _ in range(args.layers)]  # fmt: skip
    for layer in layers:
        fully_shard_fp8(layer, recipe=rec, mesh=mesh)  # FP8 gathers, scales agreed
    # Compiled per sharded layer: FSDP2's hooks (the FP8 all-gather) run eagerly around
    # each layer's one graph, which reads the gathered FP8 weights.
    model = torch.nn.Sequential(
        *(torch.compile(layer, fullgraph=True) if args.compile else layer for layer in layers)
    )
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = torch.nn.Linear(h, h, device=device, dtype=dtype).requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own data
    loss_val = float("nan")
    for step in range(args.steps):
        precompute_fp8_scales(model)  # one all_reduce for every weight's scale
        x = torch.randn(args.batch, args.seq, h, device=device, dtype=dtype, generator=g)
        with fusible.autocast(recipe=rec):
            y = model(x)
        loss = torch.nn.functional.mse_loss(y.float(), target(x).float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        loss_val = avg.item() / world
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss_val:.5f}", flush=True)
    if rank == 0:
        w = layers[0].layernorm_mlp.fc1_weight
        print(f"fc1 weight {tuple(w.shape)} ({w.dtype}): the FP8 all-gather moves "
              f"{w.numel() // world + 4} bytes a rank, a plain one "
              f"{w.numel() // world * w.element_size()}")  # fmt: skip
        print(f"final loss {loss_val:.5f}")
    return loss_val


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    train(rank, world, args, rank, world)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="delayed")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--spawn", type=int, default=0, help="start this many ranks (no torchrun)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each sharded layer")
    args = ap.parse_args(argv)
    if args.spawn:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.multiprocessing.spawn(_spawned, args=(args.spawn, args), nprocs=args.spawn)
        return
    env = os.environ
    world = int(env["WORLD_SIZE"])
    train(int(env["RANK"]), world, args, int(env.get("LOCAL_RANK", env["RANK"])),
          int(env.get("LOCAL_WORLD_SIZE", world)))  # fmt: skip


if __name__ == "__main__":
    main()
