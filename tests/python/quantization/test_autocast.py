"""fusible.autocast: nesting, exception safety, query functions, torch.compile, and the
delayed-scaling update points (end_forward_pass / end_backward_pass and the registry)."""

from __future__ import annotations

import pytest
import torch

import fusible
from fusible import recipe
from fusible.quantization import (
    DEFAULT_RECIPE,
    RecipeState,
    end_backward_pass,
    end_forward_pass,
    get_amax_reduction_group,
    get_autocast_state,
    get_recipe,
    is_fp8_enabled,
    pending_recipe_states,
)

CS = recipe.Float8CurrentScaling()
MX = recipe.MXFP8BlockScaling()


def test_outside_autocast():
    s = get_autocast_state()
    assert (s.enabled, s.recipe, s.amax_reduction_group, s.depth) == (False, None, None, 0)
    assert not is_fp8_enabled() and get_recipe() is None and get_amax_reduction_group() is None
    # fusible.quantization.autocast is the module; the context manager is fusible.autocast
    assert fusible.quantization.autocast.get_recipe is get_recipe
    assert fusible.autocast is fusible.quantization.autocast.autocast


def test_nesting_restores():
    with fusible.autocast():
        assert is_fp8_enabled() and get_recipe() == recipe.DelayedScaling()
        assert get_recipe() is DEFAULT_RECIPE
        with fusible.autocast(recipe=CS):
            assert get_recipe() is CS
            with fusible.autocast(enabled=False):
                assert not is_fp8_enabled() and get_recipe() is None
                assert get_autocast_state().depth == 3
            assert get_recipe() is CS
        assert get_recipe() is DEFAULT_RECIPE
    assert not is_fp8_enabled() and get_autocast_state().depth == 0


def test_exception_restores():
    with pytest.raises(KeyError), fusible.autocast(recipe=MX):
        with fusible.autocast(recipe=CS):
            raise KeyError("boom")
    assert get_autocast_state().depth == 0 and not is_fp8_enabled()
    with fusible.autocast(recipe=MX):
        with pytest.raises(RuntimeError), fusible.autocast(recipe=CS):
            raise RuntimeError
        assert get_recipe() is MX


def test_reusable_instance_and_decorator():
    ctx = fusible.autocast(recipe=CS)
    with ctx:
        with ctx:
            assert get_autocast_state().depth == 2
        assert is_fp8_enabled()
    assert not is_fp8_enabled()

    @fusible.autocast(recipe=MX)
    def f():
        return get_recipe()

    assert f() is MX and get_recipe() is None


def test_autocast_argument_errors():
    with pytest.raises(TypeError, match=r"'recipe' must be a fusible.recipe recipe"):
        fusible.autocast(recipe="delayed")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'enabled' must be a bool"):
        fusible.autocast(enabled=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'amax_reduction_group' must be a torch.distributed"):
        fusible.autocast(amax_reduction_group=0)


def test_autocast_inside_torch_compile():
    def f(x):
        with fusible.autocast(recipe=CS):
            y = x * 2 if isinstance(get_recipe(), recipe.Float8CurrentScaling) else x
        return y + (1 if is_fp8_enabled() else 0)

    cf = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.randn(3)
    assert torch.equal(cf(x), 2 * x)
    with fusible.autocast(recipe=MX):  # state read at trace time, guarded
        assert torch.equal(cf(x), 2 * x + 1)
    assert not is_fp8_enabled()


# ---- delayed-scaling update points --------------------------------------------------------------


def f32(v: float) -> float:
    """v rounded to float32 (IEEE division results round the same way)."""
    return torch.tensor(v, dtype=torch.float32).item()


def _state(mode="forward", n=2, history=4):
    return RecipeState.create(recipe.DelayedScaling(amax_history_len=history), mode, n)


def _use(state, *values):
    for q, v in zip(state.quantizers, values, strict=False):
        q.quantize(torch.full((2, 2), float(v)))


def test_forward_update_deferred_to_outermost_exit_once():
    s = _state()
    with fusible.autocast():
        with fusible.autocast(recipe=recipe.DelayedScaling(amax_history_len=4)):
            _use(s, 2.0, 4.0)
            end_forward_pass([s])
            _use(s, 8.0, 1.0)  # the same op runs again in the step: running max
            end_forward_pass([s])
        assert pending_recipe_states("forward") == [s]
        assert torch.equal(s.scale, torch.ones(2))  # not yet updated
    assert pending_recipe_states("forward") == []
    assert s.scale.tolist() == [448 / 8, 448 / 4]
    assert s.amax_history[-1].tolist() == [8.0, 4.0]  # one roll for the whole step
    assert torch.all(s.amax_history[:-1] == 0)


def test_forward_update_independent_of_module_order():
    results = []
    for order in ((0, 1), (1, 0)):
        a, b = _state(), _state()
        with fusible.autocast():
            for i in order:
                st, v = (a, (3.0, 5.0)) if i == 0 else (b, (7.0, 9.0))
                _use(st, *v)
                end_forward_pass([st])
            # the second module's quantizers still see the pre-step scale
            assert torch.equal(a.scale, torch.ones(2)) and torch.equal(b.scale, torch.ones(2))
        results.append((a.scale.clone(), b.scale.clone(), a.amax_history.clone()))
    assert all(torch.equal(x, y) for x, y in zip(*results, strict=True))


def test_forward_update_discarded_on_exception():
    s = _state()
    with pytest.raises(ValueError), fusible.autocast():
        _use(s, 5.0, 5.0)
        end_forward_pass(s)
        raise ValueError
    assert pending_recipe_states("forward") == [] and torch.equal(s.scale, torch.ones(2))
    assert s.amax_history[0].tolist() == [5.0, 5.0]  # recorded amaxes join the next step
    with fusible.autocast():
        _use(s, 1.0, 1.0)
        end_forward_pass(s)
    assert s.scale.tolist() == [f32(448 / 5)] * 2


def test_forward_update_immediate_outside_region_or_forced():
    s = _state()
    _use(s, 4.0, 4.0)
    end_forward_pass([s])
    assert s.scale.tolist() == [112.0, 112.0]
    with fusible.autocast():
        _use(s, 2.0, 2.0)
        end_forward_pass([s], defer=False)
        assert pending_recipe_states("forward") == []
        assert s.amax_history[-2:, 0].tolist() == [4.0, 2.0]  # updated now: rolled
        assert s.scale.tolist() == [112.0, 112.0]  # max over the history is still 4
    stateless = RecipeState.create(CS, "forward", 2)
    with fusible.autocast(recipe=CS):
        end_forward_pass([stateless, None])  # ops without quantizers have no state
        assert pending_recipe_states("forward") == []  # nothing to update
    with pytest.raises(TypeError, match="end_forward_pass: expected RecipeState objects"):
        end_forward_pass(["x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="mode must be 'forward' or 'backward'"):
        pending_recipe_states("both")


class _QuantizeGrad(torch.autograd.Function):
    """A stand-in for a fused op: its backward quantizes the incoming gradient with a backward
    state's quantizer and reports the end of its backward pass."""

    @staticmethod
    def forward(ctx, x, state, slot, seen):
        ctx.state, ctx.slot, ctx.seen = state, slot, seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(ctx.state.scale.clone())
        ctx.state.quantizers[ctx.slot].quantize(grad)
        end_backward_pass([ctx.state])
        return grad, None, None, None


def test_backward_update_once_at_end_of_backward_pass():
    s = _state("backward", n=1)
    seen: list[torch.Tensor] = []
    x = torch.ones(2, 2, requires_grad=True)
    # the same backward state is used by two ops (e.g. an op run twice in the step)
    y = _QuantizeGrad.apply(x, s, 0, seen) * 3.0
    z = _QuantizeGrad.apply(y, s, 0, seen) * 2.0
    z.sum().backward()
    assert [t.tolist() for t in seen] == [[1.0], [1.0]]  # no update in the middle of backward
    assert pending_recipe_states("backward") == []
    assert s.amax_history[-1].tolist() == [6.0] and torch.all(s.amax_history[:-1] == 0)
    assert s.scale.tolist() == [f32(57344 / 6)]
    # a second backward pass updates again, once
    x2 = torch.ones(2, 2, requires_grad=True)
    _QuantizeGrad.apply(x2, s, 0, seen).sum().backward()
    assert s.amax_history[-2:].tolist() == [[6.0], [1.0]]


def test_default_reduction_groups(monkeypatch):
    import fusible.quantization.autocast as ac

    calls = []
    monkeypatch.setattr(ac, "update_delayed_scaling", lambda states, group: calls.append(group))
    group = object()  # stands for a process group
    s = _state()
    with fusible.autocast(amax_reduction_group=group):
        assert get_amax_reduction_group() is group
        end_forward_pass([s], defer=False)  # default: the active region's group
        end_forward_pass([s], None, defer=False)  # explicit None: no reduction
        with fusible.autocast(enabled=False):
            assert get_amax_reduction_group() is None
    end_backward_pass([s])  # default: the group of the last enabled region entered
    assert calls == [group, None, group]
    with fusible.autocast(recipe=CS):
        pass
    end_backward_pass([s])
    assert calls[-1] is None


def test_backward_update_immediate_outside_backward():
    s = _state("backward", n=1)
    _use(s, 2.0)
    end_backward_pass(s)
    assert s.scale.tolist() == [57344 / 2]
    with pytest.raises(RuntimeError, match="defer=True needs a running autograd backward"):
        end_backward_pass(s, defer=True)
    assert pending_recipe_states("backward") == []


def test_delayed_scaling_under_torch_compile_updates_in_graph():
    s = _state(n=1)

    def step(x):
        data = s.quantizers[0].quantize(x)
        end_forward_pass([s])  # traced: immediate update inside the graph
        return data.dequantize()

    cstep = torch.compile(step, fullgraph=True, backend="aot_eager")
    ref = _state(n=1)
    for i in range(3):
        x = torch.randn(4, 8) * (i + 1)
        out = cstep(x)
        expected = ref.quantizers[0].quantize(x).dequantize()
        ref.update()
        assert torch.equal(out, expected)
        assert torch.equal(s.scale, ref.scale) and torch.equal(s.amax_history, ref.amax_history)
