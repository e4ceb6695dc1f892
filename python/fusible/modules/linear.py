"""``fusible.Linear``."""

from __future__ import annotations

from fusible.ops.linear import Linear as _OpsLinear

__all__ = ["Linear"]


class Linear(_OpsLinear):
    """``y = x @ weight.T + bias`` as a module: the ops ``BasicLinear`` (+ ``Bias``), roles
    ``{input,weight,output,grad_output,grad_input}:linear``. Call as ``m(x)`` or
    ``m(x, is_first_microbatch=True|False|None)`` to use the quantized weight cache."""
