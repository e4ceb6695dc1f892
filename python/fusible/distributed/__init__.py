"""Distributed training helpers on ``torch.distributed``: FSDP2 with an FP8 weight all-gather
(:func:`fully_shard_fp8`). Tensor and sequence parallelism live on the modules (``tp_group=``)
and the communication ops (``fusible.ops.AllGather`` / ``ReduceScatter`` / ``AllReduce``)."""

from fusible.distributed.fsdp import Float8AllGatherWeight, fully_shard_fp8

__all__ = ["Float8AllGatherWeight", "fully_shard_fp8"]
