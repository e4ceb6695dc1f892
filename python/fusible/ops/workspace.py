"""Quantized weight workspaces, cached across micro-batches outside the autograd function.

The cache lives on the op (``BasicLinear``); what crosses the autograd function is tensors: the
cached workspace goes in as tensors, the new one comes out as tensors, and ``Sequential`` updates
the cache afterwards. So no module is an argument of the function and ``torch.compile`` traces it.

``is_first_microbatch``: ``True`` quantizes the weight and caches the result; ``False`` reuses
the cache (no weight quantization kernel runs) unless it is invalid; ``None`` never caches.
A cache is invalid when the weight was modified in place (its version counter moved), a
``torch.optim`` optimizer stepped (any optimizer: see ``OPTIMIZER_STEPS``), the weight was
replaced (another tensor, or new storage through ``.data =``), or the quantizer changed (recipe
kind, format, or the state was rebuilt). Under ``torch.compile`` in-place updates cannot be
seen (see ``WorkspaceCache.key_for``): pass ``True`` after changing weights there. A weight that
is FSDP2's unsharded parameter (``fully_shard``) is keyed by its sharded parameter instead (see
``fsdp_param_of``): FSDP2's all-gathers write it without moving its version.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from fusible.quantization.quantizers import (
    Float8BlockData,
    Float8BlockQuantizer,
    Float8Data,
    MXFP8Data,
    MXFP8Quantizer,
    Quantizer,
)

__all__ = [
    "WorkspaceCache",
    "flatten_workspace",
    "fsdp_param_of",
    "quantize_weight",
    "unflatten_workspace",
    "workspace_len",
    "workspace_meta",
]

QuantizedData = Float8Data | MXFP8Data | Float8BlockData


def quantize_weight(
    weight: torch.Tensor,
    quantizer: Quantizer,
    workspace: QuantizedData | None,
    update: bool,
    *,
    columnwise: bool = True,
) -> tuple[QuantizedData, QuantizedData | None]:
    """``(weight_q, new_workspace)``: the one place of cache hit / miss logic.

    ``workspace`` given and not ``update``: a hit, returned as is (no kernel runs).
    Otherwise the weight is quantized and returned as the new workspace when ``update`` (then with
    both copies, so any later GEMM can use the cache), else not kept (``None``; the transposed
    copy only if ``columnwise``: dgrad needs it).
    """
    if workspace is not None and not update:
        return workspace, workspace
    q = quantizer.quantize(weight, rowwise=True, columnwise=columnwise or update)
    return q, (q if update else None)


def flatten_workspace(ws: QuantizedData | None) -> tuple[list[torch.Tensor | None], Any]:
    """Tensors (to pass through the autograd function) and a hashable description."""
    if ws is None:
        return [], None
    if isinstance(ws, Float8Data):
        return [ws.data, ws.data_t, ws.scale_inv], ("fp8", ws.fp8_dtype, tuple(ws.shape))
    if isinstance(ws, Float8BlockData):
        meta = ("block", ws.fp8_dtype, tuple(ws.shape), ws.block_dim)
        return [ws.data, ws.scale_inv, ws.data_t, ws.col_scale_inv], meta
    return [ws.data, ws.scale, ws.col_data, ws.col_scale], ("mx", ws.fp8_dtype, tuple(ws.shape))


def workspace_len(meta: Any) -> int:
    """Number of tensors ``flatten_workspace`` produces for a description."""
    return 0 if meta is None else (3 if meta[0] == "fp8" else 4)


def workspace_meta(quantizer: Quantizer, weight: torch.Tensor) -> Any:
    """The description of the workspace ``quantize_weight`` makes for ``weight``."""
    if isinstance(quantizer, Float8BlockQuantizer):
        return ("block", quantizer.dtype, tuple(weight.shape), quantizer.block_dim)
    kind = "mx" if isinstance(quantizer, MXFP8Quantizer) else "fp8"
    return (kind, quantizer.dtype, tuple(weight.shape))


def unflatten_workspace(tensors: list[torch.Tensor | None], meta: Any) -> QuantizedData | None:
    if meta is None:
        return None
    kind, fp8_dtype, shape = meta[:3]
    if kind == "block":
        data, scale_inv, data_t, col_scale_inv = tensors
        return Float8BlockData(data, scale_inv, data_t, col_scale_inv, fp8_dtype,
                               torch.Size(shape), meta[3])  # fmt: skip
    if kind == "fp8":
        data, data_t, scale_inv = tensors
        assert scale_inv is not None
        return Float8Data(data, data_t, scale_inv, fp8_dtype, torch.Size(shape))
    data, scale, col_data, col_scale = tensors
    return MXFP8Data(data, scale, col_data, col_scale, fp8_dtype, torch.Size(shape))


# torch.optim optimizer steps, counted from the first cached workspace or precomputed FSDP2 scale
# on (a global step post-hook: one integer increment per step). Weight keys include the count
# because a parameter's version misses optimizer writes: a ``foreach`` step (PyTorch's default on
# CUDA) writes ``DTensor`` parameters, FSDP2's sharded ones, without bumping their version
# (torch 2.11 and 2.13).
OPTIMIZER_STEPS = [0]
_STEP_HOOK: list[Any] = []


def count_optimizer_steps() -> None:
    """Start counting ``torch.optim`` steps in ``OPTIMIZER_STEPS`` (once per process)."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def bump(*_: Any) -> None:
            OPTIMIZER_STEPS[0] += 1

        _STEP_HOOK.append(register_optimizer_step_post_hook(bump))


def fsdp_param_of(weight: torch.Tensor) -> Any:
    """FSDP2's ``FSDPParam`` whose unsharded parameter ``weight`` is, else None.

    FSDP2 writes each all-gather into the unsharded parameter under
    ``torch.autograd._unsafe_preserve_version_counter`` and, resharded, into storage allocated
    again each time, so neither its version nor its address tells whether the weight changed.
    Its sharded parameter does: the optimizer updates that in place (moving the version of its
    local tensor, a view of FSDP2's padded shard). Found by scanning the FSDP2 states alive
    (torch's registry of composable states); without FSDP2 imported, nothing is scanned. The
    unsharded parameter is one object from the first all-gather on, so this runs again only
    when the weight is another tensor (``WorkspaceCache.store``)."""
    if "torch.distributed.fsdp._fully_shard._fsdp_param" not in sys.modules:
        return None
    from torch.distributed import _composable_state

    for ref in list(_composable_state._module_state_mapping.values()):
        state = ref()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # older torch: one group, or none
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            for fp in getattr(group, "fsdp_params", ()):
                if fp.__dict__.get("_unsharded_param") is weight:
                    return fp
    return None


@dataclass
class WorkspaceCache:
    """One op's cached workspace and what it was made from."""

    workspace: QuantizedData | None = None
    key: Any = None
    # Stored under torch.inference_mode: its tensors are inference tensors, which autograd
    # refuses to save, so a step outside inference mode does not use it (a miss).
    inference: bool = False
    # The FSDP2 FSDPParam of the weight last stored (None: not FSDP2's), and that weight's id.
    fsdp: Any = None
    fsdp_for: int | None = None

    @staticmethod
    def key_for(
        weight: torch.Tensor,
        quantizer: Quantizer,
        source_dtype: torch.dtype | None = None,
        fsdp: Any = None,
    ) -> Any:
        # Eager: the version counter (in-place updates), the optimizer steps (writes that keep
        # the version, see OPTIMIZER_STEPS) and the storage address (``.data =`` reassignment,
        # e.g. ``module.to(dtype)``, which keeps the version). Under
        # torch.compile, Tensor._version is an unbacked SymInt (functionalized away, never
        # guarded on) and data_ptr() is not traceable: a traced lookup cannot see in-place
        # updates, so this part is left out there (None) and a traced
        # ``is_first_microbatch=False`` trusts the cache, as in Transformer Engine; pass True
        # after changing weights. Writes through ``weight.data`` (an alias with its own version
        # counter) are invisible to both.
        # ``fsdp``: the weight is FSDP2's unsharded parameter (``fsdp_param_of``): the address
        # (allocated again at every all-gather when resharded) is left out and the sharded
        # parameter's local tensor's version and address stand for the all-gathered data.
        if torch.compiler.is_compiling():
            state: Any = None
        elif fsdp is None:
            state = (weight._version, OPTIMIZER_STEPS[0], weight.data_ptr())
        else:
            sharded = fsdp.sharded_param
            local = getattr(sharded, "_local_tensor", sharded)
            state = (weight._version, sharded._version, local._version, OPTIMIZER_STEPS[0],
                     local.data_ptr())  # fmt: skip
        # source_dtype: the dtype the workspace was quantized from (a torch.autocast cast of the
        # weight differs from the weight itself).
        return (id(weight), state, weight.device, id(quantizer), type(quantizer),
                quantizer.dtype, source_dtype or weight.dtype)  # fmt: skip

    def lookup(
        self, weight: torch.Tensor, quantizer: Quantizer, source_dtype: torch.dtype | None = None
    ) -> QuantizedData | None:
        """The cached workspace if still valid for this weight and quantizer, else None
        (under torch.compile the weight's version is not compared, see ``key_for``)."""
        if self.workspace is None or self.key is None:
            return None
        if self.inference and not torch.is_inference_mode_enabled():
            return None  # (never set by a traced store: dynamo cannot trace the mode check)
        key = self.key_for(weight, quantizer, source_dtype, self.fsdp)
        if torch.compiler.is_compiling():
            key, stored = key[:1] + key[2:], self.key[:1] + self.key[2:]
        else:
            stored = self.key
        return self.workspace if stored == key else None

    def store(
        self,
        weight: torch.Tensor,
        quantizer: Quantizer,
        ws: QuantizedData | None,
        source_dtype: torch.dtype | None = None,
    ) -> None:
        self.workspace = ws
        if ws is None:
            self.key = None
            return
        traced = torch.compiler.is_compiling()
        self.inference = not traced and torch.is_inference_mode_enabled()
        if not traced:  # (a traced key has no step count, nor an FSDP2 parameter to find)
            count_optimizer_steps()
            if self.fsdp_for != id(weight):
                # (A held FSDPParam keeps its unsharded parameter alive: its id is not reused.)
                self.fsdp, self.fsdp_for = fsdp_param_of(weight), id(weight)
        self.key = self.key_for(weight, quantizer, source_dtype, self.fsdp)

    def clear(self) -> None:
        self.workspace, self.key = None, None
