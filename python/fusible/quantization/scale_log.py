"""Delayed-scaling scales recorded by a checkpointed forward and replayed by its recomputation
(:class:`ScaleLog`, :class:`scale_log`), and what a :class:`~fusible.quantization.quantizers.
Float8Quantizer` reads them from (:class:`ScalingBuffers`). See ``fusible.quantization.recompute``.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["ScaleLog", "ScalingBuffers", "replaying_scales", "scale_log"]


class ScalingBuffers(Protocol):
    """What a :class:`Float8Quantizer` reads and writes: a delayed-scaling state's buffers."""

    amax_history: torch.Tensor  # float32 [history_len, n]
    scale: torch.Tensor  # float32 [n]


class ScaleLog:
    """Delayed-scaling scales read by a checkpointed forward, replayed by its recomputation.

    While a log is *recording* (the forward of a :func:`fusible.checkpoint` region), every read
    of a :class:`Float8Quantizer`'s scale appends a copy to that quantizer's sequence; while it
    is *replaying* (each recomputation in backward, when the step's update has usually changed
    the state), the reads return the sequence in order, and no amax is recorded, so the
    recomputed tensors are the forward's bit for bit. A recomputation runs the forward's code,
    so it reads the scales in the forward's order (a scale updated between two uses inside the
    region replays both values). See ``fusible.quantization.recompute``."""

    def __init__(self) -> None:
        self.scales: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._cursor: dict[tuple[int, int], int] = {}

    def record(self, key: tuple[int, int], value: torch.Tensor) -> None:
        self.scales.setdefault(key, []).append(value.clone())

    def replay(self, key: tuple[int, int], live: torch.Tensor) -> torch.Tensor:
        seq, i = self.scales.get(key, []), self._cursor.get(key, 0)
        if i >= len(seq):
            return live  # not read by the forward (nothing to reproduce)
        self._cursor[key] = i + 1
        return seq[i]

    def rewind(self) -> None:
        self._cursor.clear()


#: Active logs, outermost first, each (log, replaying). Nested checkpoints stack: the innermost
#: replaying log supplies scales; every recording log above records what was used.
_log_stack: list[tuple[ScaleLog, bool]] = []
_dynamo_compiling = torch.compiler.is_dynamo_compiling

# Set (at trace time) while dynamo traces the function of a compiled fusible.checkpoint: the
# delayed-scaling quantizers then read their scale as a copy that the region's selective
# checkpoint policy saves (see recompute.checkpoint), not as a view of the state buffer that
# the recomputation in backward would read after the step's update changed it.
SNAPSHOT_SCALES = [False]


@torch.library.custom_op("fusible::scale_snapshot", mutates_args=())
def scale_snapshot(scale: torch.Tensor) -> torch.Tensor:
    """A copy of ``scale``: an operator of its own (inductor removes an ``aten.clone`` it finds
    needless, and the selective checkpoint policy of a compiled fusible.checkpoint saves the
    output of this one; see SNAPSHOT_SCALES)."""
    return scale.clone()


@scale_snapshot.register_fake
def _scale_snapshot_fake(scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(scale)


class scale_log:
    """Activate ``log`` (recording, or replaying from the start) for the region. Re-enterable:
    torch enters the same recomputation context again for a second backward."""

    def __init__(self, log: ScaleLog, replaying: bool) -> None:
        self.log, self.replaying = log, replaying

    def __enter__(self) -> None:
        if self.replaying:
            self.log.rewind()
        _log_stack.append((self.log, self.replaying))

    def __exit__(self, *exc_info: object) -> None:
        _log_stack.pop()


def replaying_scales() -> bool:
    """True inside a checkpoint recomputation (no amax recording, no state updates)."""
    return bool(_log_stack) and any(replaying for _, replaying in _log_stack)
