"""FSDP2 with an FP8 weight all-gather: :func:`fully_shard_fp8`.

``torch.distributed.fsdp.fully_shard`` all-gathers each parameter as it is stored (fp32 / bf16).
``fully_shard_fp8`` makes every Linear weight of the module (``BasicLinear`` inside
``fusible.Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``TransformerLayer``; each expert's
weight of a ``GroupedLinear``) a :class:`Float8AllGatherWeight` --
a tensor subclass holding the high-precision master *shard* -- and then calls ``fully_shard``.
FSDP2 calls the subclass's all-gather extension points (torch's ``FSDPParam``:
``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` on the sharded local
tensor before the all-gather, ``fsdp_post_all_gather(outputs, metadata, param_dtype, *,
out=None)`` after it, the same pair torchao's float8 training and TransformerEngine's
``Float8Tensor`` implement):

- ``fsdp_pre_all_gather`` quantizes this rank's shard to per-tensor FP8 with the scale agreed
  across the FSDP group and returns its bytes (``uint8``, 1 byte per element) and its
  ``scale_inv`` (4 bytes) as the all-gather inputs. Current scaling: the shard's amax is
  ``all_reduce(MAX)``-ed over the group *before* the cast (as torchao's float8 FSDP2 path does),
  so every rank casts with the whole weight's scale. Delayed scaling: the weight's own
  one-slot state; the cast uses its scale and records this rank's amax; the recorded amaxes
  are max-reduced over the group once per forward all-gather (a step's, or each micro-batch's),
  before its scale update (or for every weight in one collective by
  :func:`precompute_fp8_scales`), so every rank's history, hence scale, is the same.
- ``fsdp_post_all_gather`` wraps the gathered bytes and rank 0's ``scale_inv`` (views of FSDP's
  all-gather output, no copy) in a ``Float8Tensor``: the unsharded parameter the Linear sees is
  FP8, and ``BasicLinear`` uses a stored per-tensor FP8 weight as its GEMM operand as it is (no
  weight quantize, no dequantize) when the autocast recipe's weight quantizer is per-tensor FP8
  of the same FP8 dtype. The weight gradient is a plain tensor; FSDP2 reduce-scatters it into
  the master shard's gradient as for any parameter.

Everything else (the sharding, the flat all-gather buffer, the reduce-scatter, resharding,
prefetching) is FSDP2's own. See docs/distributed.md, "FSDP2 with an FP8 weight all-gather".
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from fusible import _kernels as K
from fusible._kernels import HIGH_PRECISION_DTYPES
from fusible.ops.basic.grouped_linear import GroupedLinear
from fusible.ops.basic.linear import BasicLinear
from fusible.ops.op import GATHER_KEY
from fusible.ops.workspace import OPTIMIZER_STEPS, count_optimizer_steps
from fusible.quantization.data import Float8Data
from fusible.quantization.quantizers import Float8Quantizer
from fusible.quantization.recipe import DelayedScaling, Float8CurrentScaling
from fusible.quantization.roles import QuantizerRole
from fusible.quantization.state import (
    DelayedScalingRecipeState,
    RecipeState,
    load_recipe_state,
    recipe_state_to_dict,
    update_delayed_scaling,
)
from fusible.quantization.tensor import Float8Tensor, QuantizedTensor

__all__ = ["Float8AllGatherWeight", "fully_shard_fp8", "precompute_fp8_scales"]

_aten = torch.ops.aten

# Ops whose result stays a Float8AllGatherWeight: what FSDP2 does to a parameter while sharding
# it (chunk -> split, new_zeros + narrow -> slice + copy_, view) and moving it (_to_copy,
# _pin_memory), and detach / clone / empty_like. Every other op sees the high-precision shard
# and returns a plain tensor (the optimizer's in-place updates write into the shard).
_PRESERVE = frozenset(
    {
        _aten.empty_like.default,
        _aten.new_zeros.default,
        _aten.slice.Tensor,
        _aten.copy_.default,
        _aten.view.default,
        _aten.as_strided.default,
        _aten._to_copy.default,
        _aten._pin_memory.default,
        _aten.split.Tensor,
        _aten.clone.default,
    }
)


@dataclass(eq=False)
class _GatherSpec:
    """How one weight is gathered: shared by every Float8AllGatherWeight made from it (the
    shard, its padded copy, ...)."""

    where: str  # "<Module>.<path>.weight", for messages
    fp8_dtype: torch.dtype
    margin: int
    delayed: RecipeState | None = None  # DelayedScaling: the weight's own one-slot state
    gathers: int = field(default=0)  # forward all-gathers so far (for tests and messages)
    # Current scaling, by precompute_fp8_scales: (scale, what it is valid for, see
    # _shard_key); used while the shard is unchanged (no optimizer step since).
    precomputed: tuple[torch.Tensor, Any, tuple[int, int, int]] | None = None
    # Delayed scaling: the amax slot of ``delayed`` holds the group's max (precompute_fp8_scales
    # reduced it, and no gather recorded since), so the next forward gather need not reduce it.
    agreed: bool = False


def _shard_mesh(mesh: Any) -> Any:
    """The dimension of ``mesh`` FSDP2 shards over: the mesh itself (FSDP), its last dimension
    (HSDP: ``(replicate, shard)``, as FSDP2 names it). The FP8 scales are agreed over it; the
    replicas hold the same shards, so the same amaxes."""
    return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]


def _gathered_local(v: Any) -> Float8AllGatherWeight | None:
    """The ``Float8AllGatherWeight`` shard behind a sharded (``DTensor``) parameter or state-dict
    value, or None for anything else."""
    from torch.distributed.tensor import DTensor

    if not isinstance(v, DTensor):
        return None
    local = v.to_local()
    return local if isinstance(local, Float8AllGatherWeight) else None


def _delayed_on(spec: _GatherSpec, device: torch.device) -> RecipeState:
    """``spec``'s delayed-scaling state on ``device``: moved there, or built anew (zero history,
    scale 1) when it lives on ``meta`` (a model built on meta and materialised with
    ``to_empty``: a meta state holds no values)."""
    state = spec.delayed
    assert state is not None
    if state.device.type == "meta":
        assert state.roles is not None  # made by _one_slot_state, with its role
        state = spec.delayed = _one_slot_state(state.recipe, state.roles[0], device)
    elif state.device != device:
        state.to(device)
    return state


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass (FSDP2's pre-backward all-gather
    of a resharded weight)."""
    return bool(torch._C._current_graph_task_id() != -1)


class Float8AllGatherWeight(torch.Tensor):
    """A Linear weight's high-precision master shard whose FSDP2 all-gather moves FP8.

    Made by :func:`fully_shard_fp8` (before ``fully_shard`` shards it: FSDP2 keeps the subclass
    as the local tensor of the sharded ``DTensor`` parameter). It behaves as the high-precision
    tensor it holds (``.master``) for every op -- the optimizer updates the master in place --
    and implements FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (see the module
    docstring): the unsharded parameter is a ``Float8Tensor`` of the whole weight.
    """

    _tensor: torch.Tensor
    _spec: _GatherSpec

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, spec: _GatherSpec) -> Float8AllGatherWeight:
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=False,
        )
        self._tensor = tensor
        self._spec = spec
        return self

    @property
    def master(self) -> torch.Tensor:
        """The high-precision tensor held (this rank's master shard under FSDP2)."""
        return self._tensor

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._spec.fp8_dtype

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        kind = "delayed" if self._spec.delayed is not None else "current"
        return (
            f"Float8AllGatherWeight({self._spec.where}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, fp8_dtype={self._spec.fp8_dtype}, scaling={kind})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], spec: Any, outer_size: Any, outer_stride: Any
    ) -> Float8AllGatherWeight:
        return Float8AllGatherWeight(inner["_tensor"], spec)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _aten.detach.default:
            src = args[0]
            return cls(src._tensor.detach(), src._spec)
        spec: _GatherSpec | None = None

        def unwrap(t: Float8AllGatherWeight) -> torch.Tensor:
            nonlocal spec
            spec = spec or t._spec
            return t._tensor

        a, k = tree_map_only(cls, unwrap, (args, kwargs))
        out = func(*a, **k)
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable and args and isinstance(args[0], cls):
            return args[0]  # in place: the inner tensor was written, the wrapper is the result
        if func not in _PRESERVE or spec is None:
            return out
        final = spec
        return tree_map_only(torch.Tensor, lambda t: cls(t, final), out)

    # ---- FSDP2's all-gather extension points ------------------------------------------------

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: torch.nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's shard, quantized with the scale agreed over ``mesh``'s group: its FP8
        bytes (``uint8``, the shard's shape) and its ``scale_inv`` (4 ``uint8`` bytes). The
        master is cast as it is (an fp32 master rounds once, straight to FP8);
        ``mp_policy.param_dtype`` only sets the gathered tensor's nominal dtype."""
        import torch.distributed as dist

        spec = self._spec
        x = self._tensor.contiguous()
        mesh = _shard_mesh(mesh)
        n = int(mesh.size())
        if x.shape[0] * n != outer_size[0]:
            raise RuntimeError(
                f"fully_shard_fp8: {spec.where}: expected an even shard of {outer_size[0]} rows "
                f"over {n} ranks, got {x.shape[0]} rows on this rank"
            )
        group = mesh.get_group()
        if spec.delayed is None:
            pre = spec.precomputed
            if pre is not None and _shard_key(pre[1](), self._tensor) == pre[2]:
                scale = pre[0]  # precompute_fp8_scales: agreed already, no collective here
            else:
                amax = K.compute_amax(x)
                if n > 1:
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
                scale, _ = K.compute_scale(amax, spec.fp8_dtype, spec.margin)
            data, _, scale_inv, _ = K.quantize_fp8(x, scale, spec.fp8_dtype, True, False)
        else:
            state = _delayed_on(spec, x.device)
            if not _in_backward():
                # A new forward pass: the scale from the amaxes recorded so far (each step's
                # forward casts with the previous steps' history); the backward re-gather of a
                # resharded weight casts with its forward's scale, so dgrad reads the same bits.
                # The amaxes the gathers recorded since the last update are this rank's: their
                # max over the group first (max commutes with max: the bits of a reduction at
                # each gather), one collective a step instead of one a gather.
                if n > 1 and not spec.agreed:
                    _reduce_amax_slots([state], group)
                update_delayed_scaling([state])
            q = state.quantizers[0]
            assert isinstance(q, Float8Quantizer)
            data, _, scale_inv, amax = K.quantize_fp8(x, q.scale, spec.fp8_dtype, True, False)
            q.record_amax(amax)
            spec.agreed = False
        if not _in_backward():
            spec.gathers += 1
        if n == 1:
            # FSDP2 on one rank skips the collective and reads only the first all-gather input
            # (torch 2.11-2.13), so the scale travels in the metadata (nothing is gathered).
            return (data.view(torch.uint8),), (spec.fp8_dtype, scale_inv.reshape(1).float())
        scale_bytes = scale_inv.reshape(1).to(torch.float32).view(torch.uint8)
        return (data.view(torch.uint8), scale_bytes), (spec.fp8_dtype,)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The unsharded weight: a ``Float8Tensor`` viewing FSDP2's all-gather outputs (the
        bytes as the FP8 dtype, rank 0's ``scale_inv``: every rank's is the same). With
        ``out`` (the unsharded parameter of an earlier all-gather, whose views already alias
        the refilled outputs) nothing is left to do."""
        if len(all_gather_outputs) == 1:  # one rank: the scale came in the metadata
            (data_u8,), (fp8_dtype, scale_inv) = all_gather_outputs, metadata
            inner: tuple[torch.Tensor, ...] = (data_u8,)
        else:
            data_u8, scale_u8 = all_gather_outputs
            (fp8_dtype,) = metadata
            scale_inv = scale_u8.view(torch.float32)[:1]
            inner = (data_u8, scale_u8)
        data = data_u8.view(fp8_dtype)
        if out is not None:
            if not isinstance(out, Float8Tensor):
                raise RuntimeError(
                    f"fully_shard_fp8: {self._spec.where}: FSDP2 passed an unsharded parameter "
                    f"of type {type(out).__name__}, expected the Float8Tensor it was given"
                )
            held = out.qdata
            assert isinstance(held, Float8Data) and held.data is not None
            if held.data.data_ptr() != data.data_ptr():
                held.data.copy_(data)
            if held.scale_inv.data_ptr() != scale_inv.data_ptr():
                # One rank: the scale came in the metadata. Through .data (no version bump):
                # a backward re-gather writes the value forward saved (the same weight and
                # scale), as the collective refills the gathered buffers on more ranks.
                held.scale_inv.data.copy_(scale_inv)
            return None
        qdata = Float8Data(data, None, scale_inv, fp8_dtype, torch.Size(data.shape))
        return Float8Tensor(qdata, dtype=param_dtype), inner


def _shard_key(param: Any, master: torch.Tensor) -> tuple[int, int, int] | None:
    """What a precomputed scale is valid for: the sharded parameter's version (an in-place
    write by hand), the master shard's storage and the count of ``torch.optim`` steps (the
    version alone misses a ``foreach`` step's writes: see ``OPTIMIZER_STEPS``). None once the
    parameter is gone."""
    return None if param is None else (param._version, master.data_ptr(), OPTIMIZER_STEPS[0])


def _reduce_amax_slots(states: list[Any], group: Any) -> None:
    """Max-reduce the current amax slot (``amax_history[0]``) of every one-slot delayed state
    over ``group`` in one ``all_reduce`` (in place)."""
    import torch.distributed as dist

    assert all(isinstance(s, DelayedScalingRecipeState) for s in states)
    slots = torch.cat([s.amax_history[0] for s in states])
    dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=group)
    for i, s in enumerate(states):
        s.amax_history[0].copy_(slots[i : i + 1])


@torch.no_grad()
def precompute_fp8_scales(module: torch.nn.Module) -> int:
    """The FP8 all-gather scales of every :func:`fully_shard_fp8` weight inside ``module``,
    agreed with **one** ``all_reduce(MAX)`` per process group and recipe kind instead of one per
    weight and forward all-gather (delayed scaling) or per weight and all-gather (current
    scaling: forward, and backward when resharded); returns how many weights got one. Call it
    on every rank after each optimizer step (and before the first forward), as torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``.

    Current scaling: each scale is the one ``fsdp_pre_all_gather`` would agree on (the max over
    the ranks of each shard's amax, then the recipe's scale rule): the same bits. It is used
    until a ``torch.optim`` optimizer steps or the parameter is written in place with its
    version bumped (an update that does neither, e.g. a hand-written ``torch._foreach_*`` on
    the ``DTensor`` parameters, needs a new call); after an optimizer step without a new call the
    all-gather agrees on its scale itself again (correct, one collective per weight and
    gather). Delayed scaling: the amaxes the step's gathers recorded are max-reduced (what the
    next forward gather would do, the same bits) and that gather skips its own reduction;
    without a call, or after a gather recorded since, it reduces itself (correct, one
    collective per weight and forward gather). Call it before ``state_dict()`` too: a delayed
    weight's last amaxes are saved only once agreed (else as zeros, see
    ``_master_state_dict``)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"precompute_fp8_scales: 'module' must be a torch.nn.Module, got "
            f"{type(module).__name__}"
        )
    count_optimizer_steps()
    groups: dict[Any, list[tuple[DTensor, Float8AllGatherWeight, torch.Tensor]]] = {}
    delayed: dict[Any, list[_GatherSpec]] = {}
    for param in module.parameters():
        local = _gathered_local(param)
        if local is None:
            continue
        p: Any = param  # a DTensor (_gathered_local checked it)
        x = local.master
        key = (_shard_mesh(p.device_mesh).get_group(), x.device)
        spec = local._spec
        if spec.delayed is not None:
            _delayed_on(spec, x.device)
            delayed.setdefault(key, []).append(spec)
            continue
        groups.setdefault(key, []).append((p, local, K.compute_amax(x.contiguous())))
    count = 0
    for (group, _), specs in delayed.items():
        if dist.get_world_size(group) > 1:
            _reduce_amax_slots([s.delayed for s in specs if s.delayed is not None], group)
        for s in specs:
            s.agreed = True
        count += len(specs)
    for (group, _), items in groups.items():
        amaxes = torch.cat([a for _, _, a in items])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
        for i, (dt, local, _) in enumerate(items):
            spec = local._spec
            scale, _ = K.compute_scale(amaxes[i : i + 1], spec.fp8_dtype, spec.margin)
            valid = _shard_key(dt, local.master)
            assert valid is not None
            spec.precomputed = (scale, weakref.ref(dt), valid)
            count += 1
    return count


def _gathered_weights(op: torch.nn.Module) -> list[tuple[str, QuantizerRole]]:
    """The weights of ``op`` the FP8 all-gather converts, with their quantizer roles: a
    ``BasicLinear``'s ``weight``; each expert's ``weight<i>`` of a ``GroupedLinear``."""
    if isinstance(op, BasicLinear):
        return [("weight", QuantizerRole("weight", op.scope, op.quantizer_name))]
    if isinstance(op, GroupedLinear):
        return list(op.weight_roles().items())
    return []


def _recipe_spec(recipe: Any, where: str, role: QuantizerRole, device: torch.device) -> _GatherSpec:
    dtype = recipe.fp8_format.dtype("forward")
    if isinstance(recipe, Float8CurrentScaling):
        return _GatherSpec(where, dtype, recipe.margin)
    return _GatherSpec(where, dtype, recipe.margin, delayed=_one_slot_state(recipe, role, device))


def _one_slot_state(recipe: Any, role: QuantizerRole, device: torch.device) -> RecipeState:
    """A weight's own delayed-scaling state for its all-gather: one quantizer, ``role``."""
    return RecipeState.create(recipe, mode="forward", num_quantizers=1, roles=[role],
                              device=device)  # fmt: skip


def fully_shard_fp8(
    module: torch.nn.Module, *, recipe: Any = None, mesh: Any = None, **kwargs: Any
) -> Any:
    """``torch.distributed.fsdp.fully_shard(module, mesh=mesh, **kwargs)`` with the Linear
    weights of ``module`` all-gathered in FP8 (see the module docstring); returns what
    ``fully_shard`` returns (the module, now an ``FSDPModule``).

    ``recipe``: how the weights are quantized for the all-gather -- ``Float8CurrentScaling()``
    (the default; its ``fp8_format`` forward dtype and ``margin``) or ``DelayedScaling()`` (each
    weight gets its own one-slot amax history, updated at each forward all-gather). Run the
    model under a ``fusible.autocast`` whose weight quantizer is per-tensor FP8 of the same FP8
    dtype (``Float8CurrentScaling`` or ``DelayedScaling`` with the same format): the gathered
    weight is then the GEMM's operand as it is. Under another recipe, or without autocast, the
    Linear computes with the gathered weight dequantized (correct, but the full weight exists in
    high precision for that GEMM).

    Every ``BasicLinear`` weight and ``GroupedLinear`` expert weight inside ``module`` not
    already sharded by an inner ``fully_shard`` is converted; other parameters (norms, biases)
    are gathered by FSDP2 as usual. Apply it per layer and then ``fully_shard`` (or
    ``fully_shard_fp8``) on the root, as with ``fully_shard``. Plain ``fully_shard`` is unchanged.
    A tensor-parallel module (``tp_group``) is sharded over the data-parallel mesh given: each
    tensor-parallel rank's local weight is gathered in FP8 over ``mesh`` with the scale of that
    local weight, the scale the tensor-parallel layer casts its weight shard with (its own per
    shard, as TransformerEngine's).

    Errors (``ValueError`` / ``TypeError``, on every rank, before any collective): a recipe
    other than the two above; ``shard_placement_fn`` (the FP8 gather shards the rows); a mesh
    that is neither 1-D (FSDP) nor 2-D with names (HSDP: ``(replicate, shard)``; the scales are
    agreed over the shard dimension); a weight whose rows (``out_features``) do not divide by
    the shard dimension's size; a quantized weight (``quantized_model_init``); a
    non-fp32/bf16/fp16 weight; a module without a Linear weight to gather.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    fn = "fully_shard_fp8"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{fn}: 'module' must be a torch.nn.Module, got {type(module).__name__}")
    top = type(module).__name__
    if recipe is None:
        recipe = Float8CurrentScaling()
    if not isinstance(recipe, (Float8CurrentScaling, DelayedScaling)):
        raise ValueError(
            f"{fn} ({top}): 'recipe' must be Float8CurrentScaling() or DelayedScaling() (one "
            f"per-tensor FP8 scale per weight, agreed across the ranks), got {recipe!r}; "
            "MXFP8 and blockwise weights are not gathered in FP8 (use plain fully_shard)"
        )
    if kwargs.get("shard_placement_fn") is not None:
        raise ValueError(
            f"{fn} ({top}): 'shard_placement_fn' is not supported: the FP8 all-gather shards "
            "each weight by rows (FSDP2's default Shard(0))"
        )
    if mesh is not None:
        if int(mesh.ndim) not in (1, 2) or (mesh.ndim == 2 and mesh.mesh_dim_names is None):
            raise ValueError(
                f"{fn} ({top}): 'mesh' must be a 1-D DeviceMesh (FSDP) or a 2-D one with "
                f"dimension names (HSDP: replicate, shard), got {mesh.ndim} dimensions"
                + (" without names" if mesh.ndim == 2 else "")
            )
        world = int(_shard_mesh(mesh).size())
    else:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{fn} ({top}): torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first"
            )
        world = int(dist.get_world_size())
    shard_ranks = (
        set(dist.get_process_group_ranks(_shard_mesh(mesh).get_group()))
        if mesh is not None
        else None
    )
    targets: list[tuple[torch.nn.Module, str, QuantizerRole, str]] = []
    for path, m in module.named_modules():
        at = top + (f".{path}" if path else "")
        tp = getattr(m, "tp", None)
        if tp is not None and int(getattr(tp, "size", 1) or 1) > 1:
            # Each tp rank holds a different local weight: it may be sharded only over ranks
            # that hold the same one (the data-parallel mesh), never over its tp peers.
            peers = set(dist.get_process_group_ranks(tp.group))
            if shard_ranks is None or len(peers & shard_ranks) > 1:
                raise ValueError(
                    f"{fn}: {at} is tensor-parallel (tp_size {tp.size}); shard it over the "
                    "data-parallel mesh only (mesh=mesh['dp'] of a (dp, tp) mesh), not over "
                    f"its tensor-parallel peers (ranks {sorted(peers)})"
                    + ("; 'mesh' is required" if shard_ranks is None else "")
                )
        for name, role in _gathered_weights(m):
            w = m._parameters.get(name)
            where = f"{at}.{name}" + (f" ({role.name})" if role.name else "")
            if w is None or isinstance(w, (DTensor, Float8AllGatherWeight)):
                continue  # sharded by an inner fully_shard, or already converted
            if isinstance(w, QuantizedTensor):
                raise ValueError(
                    f"{fn}: {where} is a quantized weight ({type(w).__name__}, from "
                    "quantized_model_init); the FP8 all-gather quantizes high-precision master "
                    "weights: build the model without quantized_model_init"
                )
            if w.dtype not in HIGH_PRECISION_DTYPES:
                raise ValueError(
                    f"{fn}: {where} must be float32, bfloat16 or float16, got {w.dtype}"
                )
            if w.shape[0] % world:
                raise ValueError(
                    f"{fn}: {where} has {w.shape[0]} rows (out_features), not divisible by the "
                    f"{world} ranks it is sharded over; the FP8 all-gather needs an even shard per "
                    "rank"
                )
            targets.append((m, name, role, where))
    if not targets:
        raise ValueError(
            f"{fn}: {top} has no Linear weight to all-gather in FP8 (no BasicLinear or "
            "GroupedLinear with a high-precision weight that is not already sharded)"
        )
    hooked: set[int] = set()
    made: dict[int, torch.nn.Parameter] = {}  # a weight shared by experts stays shared
    for m, name, role, where in targets:
        w = getattr(m, name)
        new = made.get(id(w))
        if new is None:
            spec = _recipe_spec(recipe, where, role, w.device)
            wrapped = Float8AllGatherWeight(w.detach(), spec)
            new = made[id(w)] = torch.nn.Parameter(wrapped, requires_grad=w.requires_grad)
        setattr(m, name, new)
        if id(m) not in hooked:
            hooked.add(id(m))
            m.register_state_dict_post_hook(_master_state_dict)
            m._register_load_state_dict_pre_hook(_load_gather_state, with_module=True)
    return fully_shard(module, mesh=mesh, **kwargs)


def _master_state_dict(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """``state_dict()`` of a converted Linear holds its weight as plain FSDP2 would: a sharded
    ``DTensor`` whose local tensor is the high-precision master shard (a view of it, so
    ``torch.distributed.checkpoint.load`` into the state dict writes the master in place), not the
    ``Float8AllGatherWeight`` wrapper. A checkpoint of ``fully_shard_fp8`` is then the checkpoint
    of ``fully_shard``: it loads into either, at any world size, or into one process through its
    full tensors. ``keep_vars=True`` (parameters themselves) is left as it is."""
    from torch.distributed.tensor import DTensor

    gather_state: dict[str, torch.Tensor] = {}
    for name, _ in _gathered_weights(module):
        key = prefix + name
        v: Any = state_dict.get(key)
        local = _gathered_local(v)
        if local is None:
            continue
        spec = local._spec
        if spec.delayed is not None:
            fields = recipe_state_to_dict(spec.delayed)
            if not spec.agreed:
                # The current slot holds this rank's amaxes of the last step, not yet reduced
                # over the group (the next forward gather would): saved as zeros, so every
                # rank saves the same state (a checkpoint keeps one rank's copy). Calling
                # precompute_fp8_scales before saving reduces them: then they are kept.
                fields["amax_history"][0].zero_()
            for field, t in fields.items():
                gather_state[f"{GATHER_KEY}.{name}.{field}"] = t
        if not isinstance(v, torch.nn.Parameter):
            state_dict[key] = DTensor.from_local(
                local.master, v.device_mesh, v.placements, run_check=False, shape=v.shape,
                stride=v.stride(),
            )  # fmt: skip
    if gather_state:
        # Delayed scaling's per-weight gather state rides in the op's extra state (a plain
        # fully_shard model's op skips these keys: BasicOperation.set_extra_state).
        extra = state_dict.get(prefix + "_extra_state")
        state_dict[prefix + "_extra_state"] = {**(extra or {}), **gather_state}


def _load_gather_state(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load pre-hook of a converted op: the delayed-scaling gather state in the incoming extra
    state (see :func:`_master_state_dict`) goes into each weight's own state, bit for bit, and
    the next forward gather agrees on it over the group again. A checkpoint without it (plain
    ``fully_shard``, current scaling, older ones) leaves the state as it is."""
    extra = state_dict.get(prefix + "_extra_state")
    if not isinstance(extra, dict):
        return
    for name, _ in _gathered_weights(module):
        local = _gathered_local(getattr(module, name, None))
        if local is None or local._spec.delayed is None:
            continue
        head = f"{GATHER_KEY}.{name}."
        fields = {k[len(head) :]: v for k, v in extra.items() if str(k).startswith(head)}
        if fields:
            load_recipe_state(_delayed_on(local._spec, local.master.device), fields)
            local._spec.agreed = False
