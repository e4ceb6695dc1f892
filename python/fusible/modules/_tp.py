"""Tensor and sequence parallelism of the modules: TransformerEngine's arguments (``tp_group``,
``parallel_mode``, ``sequence_parallel``) validated into a :class:`TensorParallel`, which says
how many features each rank holds and which communication ops surround the Linear.

Layouts (as TransformerEngine, so checkpoints map): column-parallel splits ``out_features`` (the
weight's rows: rank ``r`` holds rows ``r*out/n:(r+1)*out/n`` and that slice of the bias),
row-parallel splits ``in_features`` (the weight's columns; the bias is whole, added once after
the reduction). See docs/distributed.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusible.ops import AllGather, AllReduce, ReduceScatter
from fusible.ops.grad_reduction import reduce_grad_over
from fusible.ops.op import BasicOperation

__all__ = ["TensorParallel", "reduce_grad_over"]

_MODES = (None, "column", "row")


@dataclass(frozen=True)
class TensorParallel:
    """A module's tensor-parallel configuration. ``size``: ranks in ``group`` (1 without a
    group: no split, no communication)."""

    owner: str
    group: Any
    mode: str | None
    sequence_parallel: bool
    size: int

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(
                f"{self.owner}: parallel_mode must be 'column', 'row' or None, got {self.mode!r}"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(
                f"{self.owner}: sequence_parallel must be a bool, got {self.sequence_parallel!r}"
            )
        if self.sequence_parallel and self.group is None:
            raise ValueError(
                f"{self.owner}: sequence_parallel=True needs tp_group (the tensor-parallel "
                "torch.distributed process group), got tp_group=None"
            )
        if self.sequence_parallel and self.mode is None:
            raise ValueError(
                f"{self.owner}: sequence_parallel=True needs parallel_mode 'column' or 'row', "
                "got None"
            )
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"{self.owner}: tp_size must be an int >= 1, got {self.size!r}")

    @classmethod
    def resolve(
        cls, owner: str, tp_group: Any, parallel_mode: str | None, sequence_parallel: bool
    ) -> TensorParallel:
        """Validate the arguments; the size is the group's (1 without a group)."""
        size = 1
        if tp_group is not None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"{owner}: tp_group was given but torch.distributed is not initialized"
                )
            if not isinstance(tp_group, dist.ProcessGroup):
                raise TypeError(
                    f"{owner}: tp_group must be a torch.distributed.ProcessGroup or None, got "
                    f"{type(tp_group).__name__}"
                )
            size = int(dist.get_world_size(tp_group))
        return cls(owner, tp_group, parallel_mode, sequence_parallel, size)

    @property
    def active(self) -> bool:
        """Whether the layer communicates (a mode and more than one rank... or SP on one)."""
        return self.mode is not None and self.group is not None

    def local(self, arg: str, features: int) -> int:
        """``features`` per rank, checked divisible by the group size."""
        if features % self.size:
            raise ValueError(
                f"{self.owner}: {arg}={features} must be divisible by tp_size={self.size} "
                f"(the size of tp_group) for parallel_mode={self.mode!r}"
            )
        return features // self.size

    def local_features(self, in_features: int, out_features: int) -> tuple[int, int]:
        """A Linear's ``(in_features, out_features)`` on this rank: ``out_features`` split by a
        column-parallel layer, ``in_features`` by a row-parallel one, neither when inactive."""
        if not self.active:
            return in_features, out_features
        if self.mode == "column":
            return in_features, self.local("out_features", out_features)
        return self.local("in_features", in_features), out_features

    def before_column(self) -> list[BasicOperation]:
        """What precedes a column-parallel Linear: the all-gather of the sequence-parallel
        input, or, for a replicated input, an op whose backward sums the ranks' partial input
        gradients."""
        if not self.active:
            return []
        if self.sequence_parallel:
            return [AllGather(self.group)]
        return [AllReduce(self.group, "backward")]

    def after_row(self) -> list[BasicOperation]:
        """What follows a row-parallel Linear: the sum of the ranks' partial outputs,
        reduce-scattered along the sequence (sequence parallel) or all-reduced."""
        if not self.active:
            return []
        return [ReduceScatter(self.group) if self.sequence_parallel else AllReduce(self.group)]
