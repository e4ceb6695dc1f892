"""``fusible.checkpoint``: activation recomputation that quantizes like the forward it replays.

``torch.utils.checkpoint`` recomputes a region's forward during backward. Backward usually runs
after the ``fusible.autocast`` region has exited, so a plain checkpoint would recompute in high
precision (and torch then raises ``CheckpointError``: the recomputed saved tensors differ), and
with delayed scaling the step's update has changed the scales since the forward. This wrapper
gives the recomputation the forward's autocast state and, through a :class:`ScaleLog`, the very
delayed-scaling scales the forward cast with; the recomputation records no amaxes and registers
no state updates. Current scaling and MXFP8 are functions of the tensor alone and need no log.
Gradients then equal those of the same step without checkpointing, bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint

from fusible.quantization.autocast import AutocastState, get_autocast_state, restored_state
from fusible.quantization.quantizers import ScaleLog, scale_log

__all__ = ["checkpoint"]


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``
    whose recomputation runs under the quantization of the original forward (see the module
    docstring), wherever backward runs. Eager mode; keyword arguments other than
    ``context_fn`` are passed through (``use_reentrant=True`` is refused: the reentrant variant
    has no recomputation context)."""
    if kwargs.pop("use_reentrant", False):
        raise ValueError("fusible.checkpoint: use_reentrant=True is not supported (use False)")
    if "context_fn" in kwargs:
        raise ValueError("fusible.checkpoint: 'context_fn' is set by fusible.checkpoint itself")
    if torch.compiler.is_compiling():
        # Compiled code recomputes from its own functional graph (the autocast state and scales
        # are graph inputs there), and dynamo cannot trace a context_fn.
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    state = get_autocast_state()
    log = ScaleLog()
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (scale_log(log, replaying=False), _Replay(state, log)), **kwargs,
    )  # fmt: skip


class _Replay:
    """The recomputation context: the forward's autocast state and its scales. Re-enterable."""

    def __init__(self, state: AutocastState, log: ScaleLog) -> None:
        self.state, self.log = state, log
        self._stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(restored_state(self.state))
        stack.enter_context(scale_log(self.log, replaying=True))
        self._stack.append(stack)

    def __exit__(self, *exc_info: object) -> None:
        self._stack.pop().close()
