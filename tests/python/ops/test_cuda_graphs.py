"""CUDA graphs: a whole training step (forward, backward, optimizer) captured with
``torch.cuda.graph``, and a module graphed with ``torch.cuda.make_graphed_callables``, under every
recipe, against eager.

Replays run the very kernels eager runs (same cuBLASLt algorithms: the heuristic is cached by
shape, type and alignment, not by capture), so outputs, parameters, gradients and recipe state
must match eager bit for bit. Delayed-scaling updates are captured too: the forward states'
update runs when the outermost ``fusible.autocast`` exits, the backward states' update at the end
of the autograd graph task, both inside the captured region, so each replay rolls the amax
history on the device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from ops_helpers import RECIPES

import fusible
from fusible import ops

pytestmark = pytest.mark.cuda

TOKENS, HIDDEN, FFN = 64, 64, 128  # multiples of 32: MXFP8 blocks and FP8 GEMM alignment
WARMUP, REPLAYS = 3, 4


def _block() -> ops.Sequential:
    return ops.Sequential(
        ops.LayerNorm(HIDDEN),
        ops.Linear(HIDDEN, FFN),
        ops.GELU(),
        ops.Linear(FFN, HIDDEN),
        ops.AddExtraInput(),
    )


def _data(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(TOKENS, HIDDEN, generator=g).cuda(),
         torch.randn(TOKENS, HIDDEN, generator=g).cuda())
        for _ in range(n)
    ]  # fmt: skip


def _snapshot(model: torch.nn.Module, y: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"y": y.detach().clone()}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        if p.grad is not None:
            out[f"{name}.grad"] = p.grad.detach().clone()
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):  # recipe state lives under <op>._extra_state
            out[f"state:{name}"] = t.detach().clone()
        elif isinstance(t, dict):
            out.update({f"state:{name}.{k}": v.clone() for k, v in t.items()
                        if isinstance(v, torch.Tensor)})  # fmt: skip
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, a in got.items():
        assert torch.equal(a, want[k]), f"{what}: {k} differs from eager"


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_whole_step_graph_replay_matches_eager(recipe_name: str) -> None:
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = _block().cuda()
    twin = copy.deepcopy(model)
    opt, twin_opt = _optimizer(model), _optimizer(twin)
    data = _data(WARMUP + REPLAYS)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer, x: torch.Tensor, r: torch.Tensor,
             dy: torch.Tensor) -> torch.Tensor:  # fmt: skip
        o.zero_grad(set_to_none=False)
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = m(x, r)
        y.backward(dy)
        o.step()
        return y

    static_x = torch.zeros(TOKENS, HIDDEN, device="cuda", requires_grad=True)
    static_r = torch.zeros(TOKENS, HIDDEN, device="cuda")
    static_dy = torch.zeros(TOKENS, HIDDEN, device="cuda")

    def load(i: int) -> None:
        with torch.no_grad():
            static_x.copy_(data[i][0])
            static_r.copy_(data[i][1])
            static_dy.copy_(data[i][0].flip(0))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (recipe states, momentum buffers) off the capture
        for i in range(WARMUP):
            load(i)
            step(model, opt, static_x, static_r, static_dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step(model, opt, static_x, static_r, static_dy)

    for i in range(WARMUP):
        step(twin, twin_opt, data[i][0], data[i][1], data[i][0].flip(0))
    for i in range(WARMUP, WARMUP + REPLAYS):
        load(i)
        graph.replay()
        want_y = step(twin, twin_opt, data[i][0], data[i][1], data[i][0].flip(0))
        torch.cuda.synchronize()
        _assert_equal(_snapshot(model, static_y), _snapshot(twin, want_y), f"replay {i}")


class _Autocasted(torch.nn.Module):
    """The model with ``fusible.autocast`` inside its forward, so that both state updates fall
    inside the graphs ``make_graphed_callables`` captures."""

    def __init__(self, inner: torch.nn.Module, rec: Any) -> None:
        super().__init__()
        self.inner, self.rec = inner, rec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fusible.autocast(enabled=self.rec is not None, recipe=self.rec):
            return self.inner(x)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("module", ["LayerNormMLP", "LayerNormLinear"])
def test_make_graphed_callables_matches_eager(recipe_name: str, module: str) -> None:
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    build: Callable[[], torch.nn.Module] = {
        "LayerNormMLP": lambda: fusible.LayerNormMLP(HIDDEN, FFN),
        "LayerNormLinear": lambda: fusible.LayerNormLinear(HIDDEN, FFN),
    }[module]
    model = _Autocasted(build().cuda(), rec)
    twin = copy.deepcopy(model)
    sample = torch.randn(TOKENS, HIDDEN, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(model, (sample,))
    # make_graphed_callables' warm-up runs backward with uninitialised gradients; start the twin
    # from the state it left (parameters are untouched, delayed-scaling state is not).
    twin.load_state_dict(model.state_dict())
    opt, twin_opt = _optimizer(model), _optimizer(twin)
    g = torch.Generator().manual_seed(2)
    for i in range(REPLAYS):
        x = torch.randn(TOKENS, HIDDEN, generator=g).cuda().requires_grad_(True)
        x_twin = x.detach().clone().requires_grad_(True)
        for m, o, xi in ((graphed, opt, x), (twin, twin_opt, x_twin)):
            # set_to_none: the graphed backward returns static gradient buffers, which
            # AccumulateGrad may adopt as .grad; zeroing them in place would make the next
            # replay's accumulation add the buffer to itself (PyTorch's documented usage).
            o.zero_grad(set_to_none=True)
            y = m(xi)
            y.backward(torch.ones_like(y).cumsum(0) / TOKENS)
            o.step()
            if m is graphed:
                got = _snapshot(model, y)
                got["x.grad"] = x.grad.clone()
            else:
                want = _snapshot(twin, y)
                want["x.grad"] = x_twin.grad.clone()
        torch.cuda.synchronize()
        _assert_equal(got, want, f"step {i}")
