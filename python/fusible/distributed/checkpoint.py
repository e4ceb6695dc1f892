"""Checkpoints of tensor-parallel modules across a change of world size.

A tensor-parallel ``fusible.Linear`` / ``LayerNormLinear`` / ``LayerNormMLP`` /
``GroupedLinear`` / ``TransformerLayer`` holds plain local tensors of TransformerEngine's local
shapes (``weight`` ``[out/tp, in]`` for column-parallel, ``[out, in/tp]`` for row-parallel; a
fused QKV weight the rank's rows of Q, of K and of V; docs/distributed.md), not ``DTensor``s, so
``torch.distributed.checkpoint`` cannot reshard them. These functions turn the local shards into
the *full* state dict (the one the single-process module of the same sizes has) and back:

* :func:`tp_full_state_dict` -- collective over each module's ``tp_group``: every rank returns
  the full state dict (save it from rank 0 with ``torch.save``, or with DCP as replicated
  tensors);
* :func:`tp_shard_state_dict` -- no communication: this rank's local state dict cut from a full
  one (any world size, 1 included);
* :func:`tp_load_full_state_dict` -- :func:`tp_shard_state_dict` then ``load_state_dict``.

FSDP2 (``fully_shard``) parameters are ``DTensor``s, which ``torch.distributed.checkpoint``
reshards itself; :func:`init_recipe_state` gives a fresh module the recipe-state entries for DCP
to fill. A tensor-parallel module that is also ``fully_shard``-ed over a data-parallel mesh
(2-D: a ``DTensor`` of the TP-local shape) goes through these functions too: the full state dict
first gathers each ``DTensor`` (``full_tensor()``, over its mesh) and then the TP shards; a load
cuts this rank's TP shard and then its ``DTensor`` shard (``distribute_tensor`` with the
parameter's own mesh and placements, from the full tensor every rank holds: no communication).
DCP cannot save such a model itself: every tp rank's ``DTensor`` has the same name and global
shape but other values.

Recipe state (``_extra_state``: delayed scaling's ``amax_history`` and ``scale``) is one per
Linear on every rank. Gathered, the amax histories are max-reduced element by element and the
scales min-reduced over the group: the state a run with ``amax_reduction_group=tp_group`` has
(there the ranks' states are equal already, and unchanged by the reduction), and the state of
the single-process module of the full weights, whose per-tensor amax is the maximum of the
shards'. Loaded, every rank gets that state. Other recipe-state fields are taken from the
group's first rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "init_recipe_state",
    "tp_full_state_dict",
    "tp_load_full_state_dict",
    "tp_load_sharded_state_dict",
    "tp_shard_state_dict",
    "tp_sharded_state_dict",
]


@dataclass(frozen=True)
class _Split:
    """How a state-dict entry is split over a module's group: along ``dim``, in parts of the
    relative sizes ``parts`` (each rank holds its block of every part, in part order: both
    halves of a gated fc1, ``(1, 1)``; Q, K and V of a fused QKV projection, ``(heads, groups,
    groups)``), or replicated (``dim is None``); ``extra``: a recipe-state dict."""

    group: Any
    size: int
    rank: int
    dim: int | None = None
    parts: tuple[int, ...] = (1,)
    extra: bool = False

    def part_sizes(self, n: int, key: str) -> list[int]:
        """The sizes of the parts of entry ``key``'s length ``n`` along ``dim``."""
        total = sum(self.parts)
        if n % total:
            raise ValueError(
                f"{key!r}: length {n} along dim {self.dim} does not split into parts of "
                f"relative sizes {self.parts}"
            )
        return [n // total * w for w in self.parts]


def _specs(module: torch.nn.Module, what: str, parts_too: bool = False) -> dict[str, _Split]:
    """The split of every entry of ``module.state_dict()`` that is not replicated across ranks
    without a group (the tensor-parallel modules' weights, biases and recipe states).
    ``parts_too``: also the entries made of parts in modules that are not tensor-parallel (a
    gated fc1, a fused QKV projection: ``size`` 1, no group), which a sharded checkpoint keeps
    part by part at every tensor-parallel size."""
    import torch.distributed as dist

    from fusible.modules import GroupedLinear, LayerNormLinear, LayerNormMLP, Linear
    from fusible.modules._common import GLU
    from fusible.modules.transformer_layer import MultiheadAttention

    out: dict[str, _Split] = {}
    # A fused QKV projection holds its rank's block of Q, of K and of V (each rank whole heads
    # and K/V groups): its rows split in those three parts. named_modules() visits the
    # attention before its QKV module.
    qkv_parts: dict[str, tuple[int, ...]] = {}
    for path, m in module.named_modules():
        if isinstance(m, MultiheadAttention):
            child = "layernorm_qkv" if m.input_layernorm else "qkv"
            # In lowest terms: tp divides both counts, hence their gcd, so a rank's local
            # length (heads + 2 groups) / tp * kv_channels always splits in these parts.
            heads, g = m.num_attention_heads, m.num_gqa_groups
            d = math.gcd(heads, g)
            qkv_parts[f"{path}.{child}" if path else child] = (heads // d, g // d, g // d)
        tp = getattr(m, "tp", None)
        active = tp is not None and getattr(tp, "active", False)
        pre = f"{path}." if path else ""
        if not active and parts_too and path in qkv_parts:
            for key in ("weight", "bias"):
                out[pre + key] = _Split(None, 1, 0, 0, qkv_parts[path])
        if not active and parts_too and isinstance(m, LayerNormMLP) and m.activation in GLU:
            for key in ("fc1_weight", "fc1_bias"):
                out[pre + key] = _Split(None, 1, 0, 0, (1, 1))
        if tp is None or not active or isinstance(m, MultiheadAttention):
            continue  # MultiheadAttention: its QKV and projection modules are visited
        if not isinstance(m, (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear)):
            raise NotImplementedError(
                f"{what}: {pre or '<root>'} ({type(m).__name__}) is tensor-parallel; only "
                "Linear, LayerNormLinear, LayerNormMLP, GroupedLinear and MultiheadAttention "
                "(TransformerLayer) shards are gathered / scattered"
            )
        size, rank = int(tp.size), int(dist.get_rank(tp.group))
        entries: list[tuple[str, int | None, tuple[int, ...], bool]]
        if isinstance(m, LayerNormMLP):
            h = (1, 1) if m.activation in GLU else (1,)
            entries = [("fc1_weight", 0, h, False), ("fc1_bias", 0, h, False),
                       ("fc2_weight", 1, (1,), False), ("fc1._extra_state", None, (1,), True),
                       ("fc2._extra_state", None, (1,), True)]  # fmt: skip
        else:  # Linear, LayerNormLinear, GroupedLinear (weight<i>, bias<i>)
            col = tp.mode == "column"
            parts = qkv_parts.get(path, (1,))
            n = m.num_gemms if isinstance(m, GroupedLinear) else None
            names = [""] if n is None else [str(i) for i in range(n)]
            entries = [("_extra_state", None, (1,), True)]
            for i in names:
                entries.append((f"weight{i}", 0 if col else 1, parts, False))
                if col:
                    entries.append((f"bias{i}", 0, parts, False))
        for key, dim, parts, extra in entries:
            out[pre + key] = _Split(tp.group, size, rank, dim, parts, extra)
    return out


def _check_plain(key: str, v: Any, what: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        raise TypeError(
            f"{what}: {key!r} is a DTensor; a full state dict holds plain tensors (make it with "
            "tp_full_state_dict, which gathers FSDP2's DTensors, or load a DTensor checkpoint "
            "with torch.distributed.checkpoint)"
        )


def _full(v: Any) -> Any:
    """A ``DTensor`` (an FSDP2 parameter, here of its TP-local shape) as the plain tensor it
    shards (collective over its mesh); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return v.full_tensor() if isinstance(v, DTensor) else v


def _like(v: Any, want: Any) -> Any:
    """``v`` (a plain tensor of ``want``'s global shape) sharded as ``want`` is when that is a
    ``DTensor``: each rank keeps its own shard of the tensor every rank holds (no
    communication); else ``v`` as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(want, DTensor) or not isinstance(v, torch.Tensor):
        return v
    v = v.to(device=want.device)
    return distribute_tensor(v, want.device_mesh, want.placements, src_data_rank=None)


def _gather(t: torch.Tensor, s: _Split) -> list[torch.Tensor]:
    import torch.distributed as dist

    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(s.size)]
    dist.all_gather(parts, t, group=s.group)
    return parts


def _gather_extra(key: str, state: Any, s: _Split, what: str) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    state = dict(state or {})
    if any(str(k).startswith("weight.") for k in state):
        raise NotImplementedError(
            f"{what}: {key!r} holds a quantized weight's data (quantized_model_init); gathering "
            "quantized weight shards is not supported (save a high-precision model)"
        )
    names = sorted(state)
    all_names: list[Any] = [None] * s.size
    dist.all_gather_object(all_names, names, group=s.group)
    if any(n != names for n in all_names):
        raise ValueError(
            f"{what}: the ranks of {key!r}'s group hold different recipe states {all_names} "
            "(run every rank under the same recipe)"
        )
    out: dict[str, torch.Tensor] = {}
    for k in names:
        v = state[k]
        parts = _gather(v, s)
        if k.endswith("amax_history"):
            out[k] = torch.stack(parts).amax(0)
        elif k.endswith("scale"):
            out[k] = torch.stack(parts).amin(0)
        else:
            out[k] = parts[0]
    return out


def tp_full_state_dict(
    module: torch.nn.Module, *, cpu_offload: bool = False, rank0_only: bool = False
) -> dict[str, Any]:
    """The state dict of the single-process module with the same (full) sizes, on every rank.

    Collective: every rank of every tensor-parallel module's ``tp_group`` must call it (in the
    same order). Sharded weights and biases are all-gathered and concatenated in rank order
    (column-parallel: along the rows, a gated fc1 half by half, a fused QKV projection Q, K
    and V part by part; row-parallel: along the columns; a GroupedLinear expert by expert);
    replicated entries (norms, a row-parallel bias, anything outside a
    tensor-parallel module) are this rank's. ``DTensor`` entries (``fully_shard``, also of a
    tensor-parallel module: 2-D) are gathered over their mesh first (``full_tensor()``: every
    rank of that mesh takes part). Recipe states: see the module docstring. Raises
    ``NotImplementedError`` for other tensor-parallel modules and quantized weights.

    ``cpu_offload`` moves each full tensor to the CPU as soon as it is made (the accelerator
    holds one gathered entry at a time, not the whole model); ``rank0_only`` returns an empty
    dict on every rank but the global rank 0 (every rank still takes part in the gathers; no
    effect without a process group). Together they are what torch's ``StateDictOptions(
    full_state_dict=True, cpu_offload=True)`` gives for DTensor state dicts."""
    what = "tp_full_state_dict"
    import torch.distributed as dist

    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    specs = _specs(module, what)
    out: dict[str, Any] = {}
    for key, v in module.state_dict().items():
        v = _full(v)
        s = specs.get(key)
        if s is None or (s.dim is None and not s.extra):
            full = v.detach().clone() if isinstance(v, torch.Tensor) else v
        elif s.extra:
            full = _gather_extra(key, v, s, what)
        else:
            assert s.dim is not None
            blocks = [p.split(s.part_sizes(p.shape[s.dim], key), s.dim) for p in _gather(v, s)]
            full = torch.cat([b[i] for i in range(len(s.parts)) for b in blocks], s.dim)
        if keep:
            out[key] = _to_cpu(full) if cpu_offload else full
    return out


def _to_cpu(v: Any) -> Any:
    """``v`` with every tensor (a recipe-state dict's too) on the CPU."""
    if isinstance(v, torch.Tensor):
        return v.cpu()
    if isinstance(v, dict):
        return {k: _to_cpu(t) for k, t in v.items()}
    return v


def tp_shard_state_dict(module: torch.nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's local state dict of ``module`` cut from the full ``state_dict`` (as
    :func:`tp_full_state_dict` returns, or the single-process module's ``state_dict()``): its TP
    shard of each tensor-parallel entry, and where ``module`` holds a ``DTensor`` (FSDP2, 2-D
    included) this rank's shard of that as a ``DTensor`` of the same mesh and placements. No
    communication. Raises ``ValueError`` naming the key when a sharded entry's full size is not
    the module's ``tp_size`` times its local size, ``TypeError`` for a ``DTensor`` in
    ``state_dict``."""
    what = "tp_shard_state_dict"
    specs = _specs(module, what)
    local = module.state_dict()
    out: dict[str, Any] = {}
    for key, v in state_dict.items():
        if isinstance(v, torch.Tensor):
            _check_plain(key, v, what)
        s = specs.get(key)
        want = local.get(key)
        if s is None or s.extra or s.dim is None or not isinstance(v, torch.Tensor):
            out[key] = _like(v, want)
            continue
        if want is not None and (
            v.dim() != want.dim() or v.shape[s.dim] != want.shape[s.dim] * s.size
        ):
            raise ValueError(
                f"{what}: {key!r} has shape {tuple(v.shape)}; this module (tp_size={s.size}) "
                f"holds {tuple(want.shape)} per rank, so the full tensor needs "
                f"{want.shape[s.dim] * s.size if v.dim() == want.dim() else '?'} along dim {s.dim}"
            )
        sizes = s.part_sizes(v.shape[s.dim], key)  # raises, naming the key, if no parts fit
        if any(p % s.size for p in sizes):
            raise ValueError(
                f"{what}: {key!r} ({tuple(v.shape)}) does not split into parts of relative "
                f"sizes {s.parts}, each into {s.size} blocks, along dim {s.dim}"
            )
        mine = [p.chunk(s.size, s.dim)[s.rank] for p in v.split(sizes, s.dim)]
        out[key] = _like(torch.cat(mine, s.dim), want)
    return out


def tp_load_full_state_dict(
    module: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True
) -> Any:
    """Load the full ``state_dict`` into tensor-parallel ``module`` (any ``tp_size``): each
    rank loads its shards (:func:`tp_shard_state_dict`) and the full recipe state. Returns
    ``load_state_dict``'s result."""
    return module.load_state_dict(tp_shard_state_dict(module, state_dict), strict=strict)


# ---- sharded checkpoints (torch.distributed.checkpoint) ------------------------------------------


def _part_names(key: str, s: _Split) -> list[str]:
    """The checkpoint keys of entry ``key``: itself, or ``key.part<i>`` per part."""
    return [key] if len(s.parts) == 1 else [f"{key}.part{i}" for i in range(len(s.parts))]


def _as_dtensor(piece: torch.Tensor, s: _Split, meshes: dict[Any, Any]) -> Any:
    """This rank's block ``piece`` of a part as the ``DTensor`` of the whole part, sharded along
    ``s.dim`` over a 1-D mesh of ``s.group`` (no copy, no communication)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    assert s.dim is not None
    mesh = meshes.get(s.group)
    if mesh is None:
        mesh = meshes[s.group] = DeviceMesh.from_group(s.group, piece.device.type)
    shape = list(piece.shape)
    shape[s.dim] *= s.size
    full = torch.empty(shape, device="meta")  # the whole part's shape and contiguous strides
    return DTensor.from_local(piece, mesh, [Shard(s.dim)], run_check=False,
                              shape=full.shape, stride=full.stride())  # fmt: skip


def tp_sharded_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """A state dict of ``module`` for ``torch.distributed.checkpoint`` (DCP) that reshards
    across tensor-parallel sizes without gathering a weight: each rank's shard of a
    tensor-parallel weight or bias is a ``DTensor`` of the full tensor (``Shard`` along its
    split dimension over a 1-D mesh of the module's ``tp_group``; a view of the parameter, no
    copy), so DCP writes each rank's shard and reads back whichever shard a rank of another
    size needs. An entry made of parts (a gated fc1: its two halves; a fused QKV projection: Q,
    K and V) is kept part by part under ``<key>.part<i>``, at every tensor-parallel size (also
    in a module that is neither tensor-parallel nor ``fully_shard``-ed): a rank holds its block
    of each part, which is not one block of the whole. FSDP2 ``DTensor`` entries pass as they
    are (DCP reshards them itself), so a ``fully_shard``-ed module with parts keeps them whole:
    its checkpoint loads into ``fully_shard``-ed models, not into TP or single-process ones.
    Recipe states are merged over the group as in
    :func:`tp_full_state_dict` (collective: every rank of every ``tp_group`` calls it).

    Save: ``dcp.save(tp_sharded_state_dict(model), checkpoint_id=path)``. Load, at any
    tensor-parallel size (1 and a single process included): ``sd =
    tp_sharded_state_dict(model)`` (after ``init_recipe_state`` for a recipe state to fill),
    ``dcp.load(sd, checkpoint_id=path)``, ``tp_load_sharded_state_dict(model, sd)``. Raises
    ``NotImplementedError`` for a tensor-parallel module that is also ``fully_shard``-ed (2-D:
    use :func:`tp_full_state_dict`)."""
    from torch.distributed.tensor import DTensor

    what = "tp_sharded_state_dict"
    specs = _specs(module, what, parts_too=True)
    meshes: dict[Any, Any] = {}
    out: dict[str, Any] = {}
    for key, v in module.state_dict().items():
        s = specs.get(key)
        if s is None or (s.dim is None and not s.extra):
            out[key] = v
            continue
        if s.extra:
            out[key] = _gather_extra(key, v, s, what)
            continue
        if isinstance(v, DTensor):
            if s.size > 1:
                raise NotImplementedError(
                    f"{what}: {key!r} is tensor-parallel and fully_shard-ed (2-D); save such a "
                    "model with tp_full_state_dict"
                )
            out[key] = v  # FSDP2 alone: DCP reshards it whole (see the docstring)
            continue
        assert s.dim is not None
        pieces = v.split(s.part_sizes(v.shape[s.dim], key), s.dim)
        for name, piece in zip(_part_names(key, s), pieces, strict=True):
            out[name] = piece if s.size == 1 else _as_dtensor(piece, s, meshes)
    return out


def tp_load_sharded_state_dict(
    module: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True
) -> Any:
    """Load ``state_dict`` -- :func:`tp_sharded_state_dict` of ``module``, filled by
    ``torch.distributed.checkpoint.load`` -- into ``module``: each entry's local shard (parts
    put back together), and the recipe states. No communication. Returns
    ``load_state_dict``'s result."""
    from torch.distributed.tensor import DTensor

    specs = _specs(module, "tp_load_sharded_state_dict", parts_too=True)
    made: dict[str, tuple[str, _Split]] = {}  # checkpoint key -> (entry, split) for TP entries
    for key, s in specs.items():
        if s.dim is not None and not s.extra:
            made.update({n: (key, s) for n in _part_names(key, s)})

    def local(name: str, t: Any) -> Any:
        # Only the DTensors tp_sharded_state_dict made (TP shards) become their local shard;
        # FSDP2's stay DTensors, which its parameters load from.
        tp = name in made and made[name][1].size > 1
        return t.to_local() if tp and isinstance(t, DTensor) else t

    out: dict[str, Any] = {}
    taken: set[str] = set()
    for key, s in specs.items():
        names = _part_names(key, s)
        if s.dim is None or len(names) == 1 or not all(n in state_dict for n in names):
            continue
        assert s.dim is not None
        out[key] = torch.cat([local(n, state_dict[n]) for n in names], s.dim)
        taken.update(names)
    for key, v in state_dict.items():
        if key not in taken:
            out[key] = local(key, v)
    return module.load_state_dict(out, strict=strict)


def init_recipe_state(module: torch.nn.Module, recipe: Any) -> None:
    """Build every op's recipe state for ``recipe`` (initial values: delayed scaling's zero
    amax history and unit scales) without running the module, so that ``state_dict()`` holds
    recipe-state tensors of the right shapes for ``torch.distributed.checkpoint.load`` to fill
    in place (DCP loads only the entries the given state dict has; a module never run under a
    recipe has an empty ``_extra_state``). States already built for ``recipe`` are kept; a run
    under an equal recipe uses them."""
    from fusible.ops.op import BasicOperation

    for m in module.modules():
        if isinstance(m, BasicOperation):
            m.ensure_recipe_state(recipe)
