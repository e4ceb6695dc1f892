"""Distributed training helpers on ``torch.distributed``: FSDP2 with an FP8 weight all-gather
(:func:`fully_shard_fp8`, its batched scale agreement :func:`precompute_fp8_scales`); full state
dicts of tensor-parallel modules, for checkpoints across a change of world size
(:func:`tp_full_state_dict`, :func:`tp_load_full_state_dict`), and sharded ones for
``torch.distributed.checkpoint`` (:func:`tp_sharded_state_dict`,
:func:`tp_load_sharded_state_dict`). Tensor and sequence parallelism
live on the modules (``tp_group=``) and the communication ops (``fusible.ops.AllGather`` /
``ReduceScatter`` / ``AllReduce``)."""

from fusible.distributed.checkpoint import (
    init_recipe_state,
    tp_full_state_dict,
    tp_load_full_state_dict,
    tp_load_sharded_state_dict,
    tp_shard_state_dict,
    tp_sharded_state_dict,
)
from fusible.distributed.fsdp import Float8AllGatherWeight, fully_shard_fp8, precompute_fp8_scales

__all__ = [
    "Float8AllGatherWeight",
    "fully_shard_fp8",
    "init_recipe_state",
    "precompute_fp8_scales",
    "tp_full_state_dict",
    "tp_load_full_state_dict",
    "tp_load_sharded_state_dict",
    "tp_shard_state_dict",
    "tp_sharded_state_dict",
]
