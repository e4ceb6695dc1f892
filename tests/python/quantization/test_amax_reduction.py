"""Delayed-scaling amax reduction across ranks (2 CPU processes, gloo)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    import fusible
    from fusible import recipe
    from fusible.quantization import RecipeState, end_forward_pass

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.new_group([0, 1])
        rec = recipe.DelayedScaling(amax_history_len=2)
        reduced = RecipeState.create(rec, "forward", 2)
        local = RecipeState.create(recipe.DelayedScaling(amax_history_len=2, reduce_amax=False),
                                   "forward", 1)  # fmt: skip
        with fusible.autocast(recipe=rec, amax_reduction_group=group):
            # rank 0 sees the larger amax in slot 0, rank 1 in slot 1
            for slot, q in enumerate(reduced.quantizers):
                q.quantize(torch.full((4, 4), 2.0 if slot == rank else 1.0))
            local.quantizers[0].quantize(torch.full((2, 2), 1.0 + rank))
            end_forward_pass([reduced, local])
        torch.save(
            {"reduced": reduced.scale, "hist": reduced.amax_history, "local": local.scale},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def _warm_up() -> None:
    from fusible import recipe
    from fusible.quantization import RecipeState

    s = RecipeState.create(recipe.DelayedScaling(), "forward", 1)
    s.quantizers[0].quantize(torch.ones(2, 2))
    s.update()


@pytest.mark.skipif(
    not dist.is_available() or not sys.platform.startswith("linux"),
    reason="needs torch.distributed (gloo) and fork",
)
def test_amax_reduced_with_max_across_ranks():
    # fork, not spawn: a spawned child re-imports torch (seconds); the children only run tiny
    # single-threaded CPU work
    ctx = multiprocessing.get_context("fork")
    _warm_up()  # the first custom-op call imports lazily (seconds): do it once, before forking
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [ctx.Process(target=_worker, args=(r, 2, init_file, d)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        for p in procs:
            if p.is_alive():
                p.kill()
        assert [p.exitcode for p in procs] == [0, 0]
        r0, r1 = (torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2))
    assert torch.equal(r0["reduced"], r1["reduced"])
    assert r0["reduced"].tolist() == [224.0, 224.0]  # 448 / max(2, 1) on both ranks
    assert r0["hist"][-1].tolist() == [2.0, 2.0]
    assert r0["local"].tolist() == [448.0] and r1["local"].tolist() == [224.0]  # not reduced
