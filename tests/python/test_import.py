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
