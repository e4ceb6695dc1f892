"""``import fusible`` stays light: it imports neither torch._dynamo (about a second) nor anything
else eager training does not need; the compile hooks are marked the way dynamo marks them."""

from __future__ import annotations

import subprocess
import sys

import torch

from fusible.ops import sequential


def test_import_fusible_does_not_import_dynamo():
    code = "import sys, fusible; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_constant_result_mark_is_dynamos():
    """sequential._assume_constant_result sets what torch._dynamo.assume_constant_result sets
    (a torch release that marks differently fails here, not silently under compile)."""

    def a() -> int:
        return 1

    def b() -> int:
        return 1

    torch._dynamo.assume_constant_result(a)
    sequential._assume_constant_result(b)
    assert vars(a) == vars(b) == {"_dynamo_marked_constant": True}
    for f in (sequential._traced_activate, sequential._traced_plan_id):
        assert f._dynamo_marked_constant is True


def test_constant_results_are_scalars():
    """Every function fusible marks as a constant result returns an int or a str: torch 2.11's
    dynamo fails to trace a compiled Sequential whose marked function returned a tuple (every
    compiled Sequential failed there in session 21, while torch 2.13 -- CI's -- accepted it)."""
    import inspect
    import typing

    funcs = [f for f in vars(sequential).values() if inspect.isfunction(f)]
    marked = [f for f in funcs if getattr(f, "_dynamo_marked_constant", False)]
    assert {f.__name__ for f in marked} >= {"_traced_activate", "_traced_plan_id"}, marked
    for f in marked:
        ret = typing.get_type_hints(f)["return"]
        assert ret in (int, str), f"{f.__name__} returns {ret}"
    # And what they return is one: the activation of a container and its plan id, called as
    # a trace calls them.
    from fusible import ops

    m = ops.Sequential(ops.Linear(4, 4))
    x = torch.randn(2, 4)
    m(x)
    uid = str(m._seq_uid)
    assert type(sequential._traced_activate(uid, None)) is int
    run = m._runs()[0][1]
    key = m._traced_key(0, x, (), [p for op in run for p in op.parameters()], run)
    assert type(sequential._traced_plan_id(uid, key, None)) is int
