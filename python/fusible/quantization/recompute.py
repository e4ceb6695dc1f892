"""``fusible.checkpoint``: activation recomputation that quantizes like the forward it replays.

``torch.utils.checkpoint`` recomputes a region's forward during backward. Backward usually runs
after the ``fusible.autocast`` region has exited, so torch's checkpoint alone would recompute in
high precision (and then raise ``CheckpointError``: the recomputed saved tensors differ), and
with delayed scaling the step's update has changed the scales since the forward. This wrapper
gives the recomputation the forward's autocast state and, through a :class:`ScaleLog`, the very
delayed-scaling scales the forward cast with; the recomputation records no amaxes and registers
no state updates. Current scaling and MXFP8 are functions of the tensor alone and need no log.
Gradients then equal those of the same step without checkpointing, bit for bit.

A plain ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` gets the same treatment
without asking (:func:`adopt_torch_checkpoint`, called by ``Sequential.forward``): the first
fusible container that runs under a recipe inside such a region attaches a log to torch's
checkpoint frame, records its scale reads there, and wraps the frame's recomputation in the
context :func:`checkpoint` would have given it. torch offers no hook for this but ``context_fn``,
which a caller passes; the frame is found through the closure of torch's saved-tensor pack hook
(``torch.utils.checkpoint._checkpoint_hook``), a private structure: where it is not as expected
(another torch version), nothing is adopted and such a region behaves as before (torch's
``CheckpointError`` when backward runs outside the autocast region). The reentrant variant has
no frame and is not adopted.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint

from fusible.quantization.autocast import AutocastState, get_autocast_state, restored_state
from fusible.quantization.quantizers import SNAPSHOT_SCALES, ScaleLog, scale_log

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_current_node = torch._C._current_autograd_node

__all__ = [
    "adopt_torch_checkpoint",
    "checkpoint",
    "in_reentrant_recompute",
    "warn_reentrant_recompute",
]


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
        # Compiled code recomputes from its own functional graph (the autocast state is traced
        # into it), and dynamo cannot trace fusible's context_fn. The delayed-scaling scales
        # are graph inputs that the step's update changes in place before backward, and
        # AOTAutograd recomputes a read of them there (pytorch/pytorch PR #197039): inside the
        # region the quantizers read them as copies (SNAPSHOT_SCALES), which torch's selective
        # checkpointing saves; everything else is recomputed as plain checkpointing does.
        SNAPSHOT_SCALES[0] = True
        try:
            return torch.utils.checkpoint.checkpoint(
                function, *args, use_reentrant=False,
                context_fn=functools.partial(
                    torch.utils.checkpoint.create_selective_checkpoint_contexts, _save_scales
                ),
                **kwargs,
            )  # fmt: skip
        finally:
            SNAPSHOT_SCALES[0] = False
    state = get_autocast_state()
    log = ScaleLog()
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (scale_log(log, replaying=False), _Replay(state, log)), **kwargs,
    )  # fmt: skip


def _save_scales(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpoint policy of a compiled fusible.checkpoint: save the scale copies
    (``fusible::scale_snapshot``), recompute everything else."""
    policy = torch.utils.checkpoint.CheckpointPolicy
    if op is torch.ops.fusible.scale_snapshot.default:
        return policy.MUST_SAVE
    return policy.MUST_RECOMPUTE


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


# torch.utils.checkpoint's non-reentrant pack hook: a closure over the region's _CheckpointFrame.
_PACK_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"


def _torch_checkpoint_frame() -> Any:
    """The frame of the innermost non-reentrant ``torch.utils.checkpoint`` region whose forward
    is running, or None (no such region, or torch's structures are not the expected ones)."""
    hooks = _top_hooks(False)
    if hooks is None:
        return None
    pack = hooks[0]
    if getattr(pack, "__qualname__", None) != _PACK_HOOK:
        return None
    cells = getattr(pack, "__closure__", None)
    try:
        frame = cells[pack.__code__.co_freevars.index("frame")].cell_contents  # type: ignore[index]
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
    return frame if callable(getattr(frame, "recompute_fn", None)) else None


def adopt_torch_checkpoint() -> ScaleLog | None:
    """Inside the forward of a plain non-reentrant ``torch.utils.checkpoint`` region, under an
    enabled autocast and outside any scale log: the region's :class:`ScaleLog` (made, and the
    frame's recomputation wrapped in the forward's autocast state and this log, on the first
    call of the region), which the caller records into while it runs; else None."""
    frame = _torch_checkpoint_frame()
    if frame is None:
        return None
    log = getattr(frame, "_fusible_scale_log", None)
    if log is None:
        log = ScaleLog()
        replay = _Replay(get_autocast_state(), log)
        inner = frame.recompute_fn

        def recompute_fn(*args: Any) -> None:
            with replay:
                inner(*args)

        frame.recompute_fn = recompute_fn
        frame._fusible_scale_log = log
    return log


def in_reentrant_recompute() -> bool:
    """Whether this runs inside the recomputation of a reentrant ``torch.utils.checkpoint``
    (which has no frame to adopt: its recomputation runs outside the forward's autocast)."""
    node = _current_node()
    return node is not None and type(node).__name__ == "CheckpointFunctionBackward"


def warn_reentrant_recompute(owner: str) -> None:
    warnings.warn(
        f"{owner}: a reentrant torch.utils.checkpoint (use_reentrant=True) recomputes this "
        "module outside the fusible.autocast region of its forward, so its backward runs "
        "without the recipe, in high precision. Use use_reentrant=False (fusible then "
        "recomputes with the forward's recipe and scales) or fusible.checkpoint.",
        stacklevel=3,
    )
