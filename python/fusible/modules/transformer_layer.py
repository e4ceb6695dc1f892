"""``fusible.MultiheadAttention`` and ``fusible.TransformerLayer``: pre-norm self-attention and
MLP blocks composed of fusible's modules (one implementation of the math, no second code path).

A layer is, for an input ``x`` of shape ``(batch, seq, hidden)`` (``attn_input_format="bshd"``,
the default; ``"sbhd"`` takes ``(seq, batch, hidden)`` as TransformerEngine does by default)::

    q, k, v = split(self_attention.layernorm_qkv(x))      # fusible.LayerNormLinear, name "qkv"
    q, k = rope(q), rope(k)                                # optional rotary position embedding
    a = scaled_dot_product_attention(q, k, v)              # torch, high precision (see below)
    x = x + dropout(self_attention.proj(a))                # fusible.Linear "proj" + AddExtraInput
    x = x + dropout(layernorm_mlp(x))                      # fusible.LayerNormMLP + AddExtraInput

The residual adds are ``ops.AddExtraInput`` ops appended to the projection and MLP modules, so
under every recipe they fuse into the last GEMM of each block (``linear_bias_add``: the GEMM
accumulates into the residual, no separate add kernel; with ``hidden_dropout > 0`` a ``Dropout``
op sits between GEMM and add and the add runs as its own op). Attention itself is torch's
``scaled_dot_product_attention`` in the input's dtype: no quantizers. The role names
``qkv:dpa`` and ``s:dpa`` (attention inputs and softmax output of a dot-product attention) are
reserved for a future FP8 attention; today ``get_quantizer_roles`` lists only the Linears'
roles (``...:layernorm_linear:qkv``, ``...:linear:proj``, ``...:layernorm_mlp:fc1`` / ``fc2``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fusible.modules._common import check_bias, resolve_params_dtype
from fusible.modules._tp import TensorParallel
from fusible.modules.layernorm_linear import LayerNormLinear
from fusible.modules.layernorm_mlp import LayerNormMLP
from fusible.modules.linear import Linear
from fusible.ops import AddExtraInput, Dropout, Sequential
from fusible.ops.op import TORCH_VERSION
from fusible.ops.sequential import _NO_RECIPE, OwnForwardModule
from fusible.quantization import QuantizerRole

__all__ = ["MultiheadAttention", "RotaryPositionEmbedding", "TransformerLayer"]

#: Roles reserved for a future FP8 dot-product attention (not quantized today).
RESERVED_ATTENTION_ROLES = ("qkv:dpa", "s:dpa")
MASK_TYPES = ("causal", "no_mask", "arbitrary")
FORMATS = ("bshd", "sbhd")
# scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5 on.
_SDPA_GQA = TORCH_VERSION >= (2, 5)


class RotaryPositionEmbedding(torch.nn.Module):
    """Rotary position embedding angles, as TransformerEngine's module of this name:
    ``forward(max_seq_len, offset=0)`` returns ``[max_seq_len, 1, 1, dim]`` float32 angles
    ``pos * base ** (-2i / dim)``, each frequency twice (``cat(freqs, freqs)``, the
    non-interleaved layout). Pass them to ``TransformerLayer.forward(rotary_pos_emb=...)`` /
    ``MultiheadAttention.forward``; ``dim`` may be smaller than the head dimension (the first
    ``dim`` features of each head rotate, the rest pass through). Holds no parameters or buffers
    (the frequencies are computed per call), so it builds on ``meta`` and adds nothing to
    ``state_dict()``."""

    def __init__(self, dim: int, rotary_base: float = 10000.0) -> None:
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"RotaryPositionEmbedding: dim must be positive and even, got {dim}")
        self.dim, self.rotary_base = int(dim), float(rotary_base)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rotary_base={self.rotary_base}"

    def forward(
        self, max_seq_len: int, offset: int = 0, device: torch.device | str | None = None
    ) -> torch.Tensor:
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        inv_freq = 1.0 / (self.rotary_base**exponent)
        pos = torch.arange(max_seq_len, dtype=torch.float32, device=device) + offset
        freqs = torch.outer(pos, inv_freq)
        return torch.cat((freqs, freqs), dim=-1).view(max_seq_len, 1, 1, self.dim)


def _rotate(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE of ``t`` ``[batch, heads, seq, head_dim]`` with angles ``freqs`` (``[seq, 1, 1, d]``
    or ``[seq, d]``, ``d <= head_dim``): TransformerEngine's non-interleaved rule
    ``t * cos + rotate_half(t) * sin`` on the first ``d`` features, in ``t``'s dtype."""
    seq, d = t.shape[-2], freqs.shape[-1]
    if freqs.shape[0] < seq or d > t.shape[-1] or d % 2:
        raise ValueError(
            f"rotary_pos_emb: expected angles of shape [>= {seq}, 1, 1, d] with an even "
            f"d <= {t.shape[-1]}, got {tuple(freqs.shape)}"
        )
    f = freqs.reshape(freqs.shape[0], d)[:seq]
    cos, sin = f.cos().to(t.dtype), f.sin().to(t.dtype)
    rot, rest = t[..., :d], t[..., d:]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rot if rest.shape[-1] == 0 else torch.cat((rot, rest), dim=-1)


def _check_choice(owner: str, arg: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {arg} must be one of {list(choices)}, got {value!r}")


def _check_mask(owner: str, mask: torch.Tensor, full: tuple[int, int, int, int]) -> None:
    """``attention_mask`` must be bool (True masks out, TransformerEngine's convention) and
    4-D, broadcastable to ``full`` = ``[batch, heads, seq, seq]``. A 0/1 mask of another dtype
    is refused rather than read as bool: Hugging Face's padding masks use 1 for "attend", the
    opposite meaning, and would be inverted without a word."""
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{owner}.forward: attention_mask must be a bool tensor (True masks a position out, "
            f"TransformerEngine's convention), got dtype {mask.dtype}; a 0/1 padding mask with "
            "1 for tokens to attend (Hugging Face's) converts as mask == 0, an additive 0 / -inf "
            "mask as mask.isinf()"
        )
    ok = mask.dim() == 4 and all(m in (1, n) for m, n in zip(mask.shape, full, strict=True))
    if not ok:
        raise ValueError(
            f"{owner}.forward: attention_mask must have 4 dimensions broadcastable to "
            f"[batch, heads, seq, seq] = {list(full)} (e.g. [batch, 1, 1, seq] for padding, "
            f"[batch, 1, seq, seq]), got shape {tuple(mask.shape)}"
        )


def _residual_tail(module: Sequential, hidden_dropout: float) -> None:
    """Append ``[Dropout,] AddExtraInput`` to ``module`` (the residual add of a pre-norm block:
    ``module(x, residual)``; fused into the preceding GEMM when no dropout sits between)."""
    if hidden_dropout > 0.0:
        module.append(Dropout(hidden_dropout))
    module.append(AddExtraInput())


def _explain_of(module: Sequential, **kw: Any) -> str:
    return "\n".join("  " + line for line in module.explain(**kw).splitlines())


class _Block(OwnForwardModule):
    """A module of fusible modules (``MultiheadAttention``, ``TransformerLayer``): its quantizers
    are theirs, and ``explain()`` lists their plans (``_explain``, which a block that holds
    another calls with the attribute path as ``prefix``)."""

    def get_quantizer_roles(self, fwd: bool) -> list[QuantizerRole]:
        raise NotImplementedError

    def num_quantizers(self, fwd: bool) -> int:
        return len(self.get_quantizer_roles(fwd))

    def explain(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        recipe: Any = _NO_RECIPE,
    ) -> str:
        """The fusion plans of the fusible modules (``ops.Sequential.explain``, same arguments:
        by default the plan of the last run), and how attention runs."""
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        if recipe is not _NO_RECIPE:
            kw["recipe"] = recipe
        return self._explain("", kw)

    def _explain(self, prefix: str, kw: dict[str, Any]) -> str:
        raise NotImplementedError


class MultiheadAttention(_Block):
    """Self-attention: QKV projection (``fusible.LayerNormLinear`` named ``qkv`` when
    ``input_layernorm``, else ``fusible.Linear``), torch's ``scaled_dot_product_attention`` in
    high precision, output projection (``fusible.Linear`` named ``proj``). Arguments after
    TransformerEngine's ``MultiheadAttention``:

    - ``kv_channels``: head dimension (default ``hidden_size // num_attention_heads``);
      ``num_gqa_groups``: K/V heads (grouped-query attention; default: one per query head).
      The QKV weight's rows are ``[Q (heads * kv_channels); K; V (groups * kv_channels each)]``.
    - ``attn_mask_type``: ``"causal"`` (default), ``"no_mask"`` or ``"arbitrary"`` (forward's
      ``attention_mask``: bool, True masks a position out, TE's convention; 4-D, broadcastable
      to ``[batch, heads, seq, seq]``; another dtype raises ``TypeError``, another shape
      ``ValueError``).
    - ``qkv_format``: ``"bshd"`` (default: ``(batch, seq, hidden)`` input) or ``"sbhd"``
      (``(seq, batch, hidden)``, TransformerEngine's default).
    - ``rotary``: build a ``RotaryPositionEmbedding(kv_channels, rotary_base)`` and apply it to
      Q and K when forward gets no ``rotary_pos_emb`` (positions ``0 .. seq - 1``).
    - ``residual_connection`` (fusible's): return ``hidden_states + dropout(proj(...))``, the
      add fused into the projection GEMM (``AddExtraInput`` appended to ``proj``);
      ``hidden_dropout`` applies to the projection output before the add.

    ``attention_dropout`` is SDPA's ``dropout_p`` (training mode only). ``state_dict()`` keys are
    TransformerEngine's: ``layernorm_qkv.*`` (or ``qkv.*``) and ``proj.*``. ``init_method`` /
    ``output_layer_init_method``: the QKV / projection weight initialisers, as
    :class:`fusible.Linear`'s ``init_method``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        kv_channels: int | None = None,
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        layernorm_epsilon: float = 1e-5,
        input_layernorm: bool = False,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        bias: bool = True,
        attn_mask_type: str = "causal",
        qkv_format: str = "bshd",
        rotary: bool = False,
        rotary_base: float = 10000.0,
        residual_connection: bool = False,
        hidden_dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
        name: str | None = None,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        output_layer_init_method: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        dtype = resolve_params_dtype(type(self).__name__, dtype, params_dtype)
        check_bias(type(self).__name__, bias)
        super().__init__()
        owner = type(self).__name__
        tp = TensorParallel.resolve(owner, tp_group, None if tp_group is None else "column",
                                    sequence_parallel)  # fmt: skip
        _check_choice(owner, "attn_mask_type", attn_mask_type, MASK_TYPES)
        _check_choice(owner, "qkv_format", qkv_format, FORMATS)
        if num_attention_heads <= 0:
            raise ValueError(f"{owner}: num_attention_heads must be positive, got "
                             f"{num_attention_heads}")  # fmt: skip
        if kv_channels is None:
            if hidden_size % num_attention_heads:
                raise ValueError(
                    f"{owner}: hidden_size ({hidden_size}) must be divisible by "
                    f"num_attention_heads ({num_attention_heads}), or pass kv_channels"
                )
            kv_channels = hidden_size // num_attention_heads
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if groups <= 0 or num_attention_heads % groups:
            raise ValueError(
                f"{owner}: num_gqa_groups ({groups}) must divide num_attention_heads "
                f"({num_attention_heads})"
            )
        for arg, p in (("attention_dropout", attention_dropout),
                       ("hidden_dropout", hidden_dropout)):  # fmt: skip
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{owner}: {arg} must be in [0, 1), got {p}")
        for arg, count in (("num_attention_heads", num_attention_heads),
                           ("num_gqa_groups", groups)):  # fmt: skip
            if count % tp.size:
                raise ValueError(
                    f"{owner}: {arg}={count} must be divisible by tp_size={tp.size} (the size "
                    "of tp_group): each rank holds whole heads and K/V groups"
                )
        self.tp, self.tp_size, self.sequence_parallel = tp, tp.size, sequence_parallel
        #: This rank's query heads and K/V groups (all of them without tensor parallelism).
        self.heads_per_rank = num_attention_heads // tp.size
        self.groups_per_rank = groups // tp.size
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.kv_channels, self.num_gqa_groups = kv_channels, groups
        self.attention_dropout, self.attn_mask_type = float(attention_dropout), attn_mask_type
        self.qkv_format, self.input_layernorm = qkv_format, input_layernorm
        self.residual_connection, self.name = residual_connection, name
        q_dim, kv_dim = num_attention_heads * kv_channels, groups * kv_channels
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        col: dict[str, Any] = {}
        row: dict[str, Any] = {}
        if tp_group is not None:
            col = {"tp_group": tp_group, "parallel_mode": "column",
                   "sequence_parallel": sequence_parallel}  # fmt: skip
            row = {**col, "parallel_mode": "row"}
        qkv: Sequential
        if input_layernorm:
            qkv = LayerNormLinear(hidden_size, q_dim + 2 * kv_dim, bias, eps=layernorm_epsilon,
                                  normalization=normalization,
                                  zero_centered_gamma=zero_centered_gamma, name="qkv",
                                  init_method=init_method, **kw, **col)  # fmt: skip
            self.layernorm_qkv = qkv
        else:
            qkv = Linear(hidden_size, q_dim + 2 * kv_dim, bias, name="qkv",
                         init_method=init_method, **kw, **col)  # fmt: skip
            self.qkv = qkv
        self.proj = Linear(q_dim, hidden_size, bias, name="proj",
                           init_method=output_layer_init_method, **kw, **row)  # fmt: skip
        if residual_connection:
            _residual_tail(self.proj, hidden_dropout)
        elif hidden_dropout > 0.0:
            self.proj.append(Dropout(hidden_dropout))
        self.rotary_pos_emb = RotaryPositionEmbedding(kv_channels, rotary_base) if rotary else None

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, heads={self.num_attention_heads}, "
            f"gqa_groups={self.num_gqa_groups}, kv_channels={self.kv_channels}, "
            f"attn_mask_type={self.attn_mask_type!r}, qkv_format={self.qkv_format!r}"
            + (f", name={self.name!r}" if self.name else "")
        )

    @property
    def _qkv_module(self) -> Sequential:
        """``layernorm_qkv`` or ``qkv`` (a property: a second attribute would register the
        module twice)."""
        return self.layernorm_qkv if self.input_layernorm else self.qkv  # type: ignore[no-any-return]

    # ---- conventions ------------------------------------------------------------------------

    def _fusible_modules(self) -> list[Sequential]:
        return [self._qkv_module, self.proj]

    def get_quantizer_roles(self, fwd: bool) -> list[QuantizerRole]:
        """The roles of the QKV and output projections, in that order (attention itself runs in
        high precision; ``qkv:dpa`` / ``s:dpa`` are reserved for a future FP8 attention)."""
        return [r for m in self._fusible_modules() for r in m.get_quantizer_roles(fwd)]

    def reset_parameters(self) -> None:
        """Re-initialise the projections (see ``ops.Sequential.reset_parameters``)."""
        for m in self._fusible_modules():
            m.reset_parameters()

    def _explain(self, prefix: str, kw: dict[str, Any]) -> str:
        qkv_name = "layernorm_qkv" if self.input_layernorm else "qkv"
        return "\n".join([
            f"{prefix}{qkv_name} ({type(self._qkv_module).__name__}, name 'qkv'):",
            _explain_of(self._qkv_module, **kw),
            f"{prefix}core_attention: {self.attention_summary()}",
            f"{prefix}proj (Linear, name 'proj'"
            + (", + residual add" if self.residual_connection else "") + "):",
            _explain_of(self.proj, **kw),
        ])  # fmt: skip

    def attention_summary(self) -> str:
        mask = self.attn_mask_type
        return (
            f"torch scaled_dot_product_attention ({mask}, {self.num_attention_heads} heads, "
            f"{self.num_gqa_groups} KV groups, head dim {self.kv_channels}"
            + (", RoPE" if self.rotary_pos_emb is not None else "")
            + ") in high precision (the input's dtype, no quantizers; roles "
            + " and ".join(RESERVED_ATTENTION_ROLES)
            + " are reserved for a future FP8 attention)"
        )

    # ---- forward ----------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        """``hidden_states``: ``(batch, seq, hidden)`` (``qkv_format="bshd"``) or
        ``(seq, batch, hidden)``; returns the same shape. ``rotary_pos_emb``: RoPE angles
        ``[seq, 1, 1, d]`` (``RotaryPositionEmbedding``'s output) applied to Q and K."""
        owner = type(self).__name__
        try:  # (free unless it catches)
            dims = hidden_states.dim()
        except AttributeError:
            raise TypeError(
                f"{owner}.forward: hidden_states must be a torch.Tensor, got "
                f"{type(hidden_states).__name__}"
            ) from None
        if dims != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{owner}.forward: expected hidden_states of shape "
                f"{'(batch, seq' if self.qkv_format == 'bshd' else '(seq, batch'}, "
                f"{self.hidden_size}), got {tuple(hidden_states.shape)}"
            )
        if (attention_mask is not None) != (self.attn_mask_type == "arbitrary"):
            raise ValueError(
                f"{owner}.forward: attention_mask is used with attn_mask_type='arbitrary' "
                f"(and needed there); this module's attn_mask_type is {self.attn_mask_type!r}"
            )
        h, g, d = self.heads_per_rank, self.groups_per_rank, self.kv_channels
        qkv = self._qkv_module(hidden_states, is_first_microbatch=is_first_microbatch)
        if self.qkv_format == "sbhd":
            qkv = qkv.transpose(0, 1)  # [batch, seq, ...]
        b, s = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
        # [batch, heads, seq, head_dim], SDPA's layout.
        q = q.reshape(b, s, h, d).transpose(1, 2)
        k = k.reshape(b, s, g, d).transpose(1, 2)
        v = v.reshape(b, s, g, d).transpose(1, 2)
        if rotary_pos_emb is None and self.rotary_pos_emb is not None:
            rotary_pos_emb = self.rotary_pos_emb(s, device=q.device)
        if rotary_pos_emb is not None:
            q, k = _rotate(q, rotary_pos_emb), _rotate(k, rotary_pos_emb)
        if attention_mask is not None:
            _check_mask(owner, attention_mask, (b, h, s, s))
        a = self._attention(q, k, v, attention_mask)  # [batch, heads, seq, head_dim]
        a = a.transpose(1, 2) if self.qkv_format == "bshd" else a.permute(2, 0, 1, 3)
        a = a.reshape(*a.shape[:2], h * d)
        if self.residual_connection:
            return self.proj(a, hidden_states, is_first_microbatch=is_first_microbatch)  # type: ignore[no-any-return]
        return self.proj(a, is_first_microbatch=is_first_microbatch)  # type: ignore[no-any-return]

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        kw: dict[str, Any] = {}
        rep = self.heads_per_rank // self.groups_per_rank
        if rep > 1:
            if _SDPA_GQA:
                kw["enable_gqa"] = True
            else:  # older torch: expand the K/V heads (head i reads group i // rep)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is not None:
            kw["attn_mask"] = ~mask.to(torch.bool)  # TE: True masks out; SDPA: True attends
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=self.attn_mask_type == "causal", scale=1.0 / math.sqrt(self.kv_channels),
            **kw,
        )  # fmt: skip


class TransformerLayer(_Block):
    """A pre-norm transformer layer of fusible modules (arguments after TransformerEngine's
    ``TransformerLayer``)::

        x = x + dropout(self_attention(x))    # MultiheadAttention(input_layernorm=True)
        x = x + dropout(layernorm_mlp(x))     # fusible.LayerNormMLP

    - Input ``(batch, seq, hidden)`` by default (``attn_input_format="bshd"``); ``"sbhd"`` takes
      ``(seq, batch, hidden)`` (TransformerEngine's default layout). The output has the
      input's shape and dtype.
    - ``normalization``: ``"LayerNorm"`` / ``"RMSNorm"`` (both norms), ``layernorm_epsilon``,
      ``zero_centered_gamma``; ``activation``: any of ``LayerNormMLP``'s (``gelu`` (tanh),
      ``relu``, ``silu``, ``swiglu``, ``geglu``); ``bias``: every Linear's bias.
    - ``num_gqa_groups``: K/V heads (grouped-query attention), ``kv_channels``: head dimension;
      ``self_attn_mask_type``: ``"causal"`` (default), ``"no_mask"`` or ``"arbitrary"`` (with
      forward's ``attention_mask``, True masks out).
    - RoPE: forward's ``rotary_pos_emb`` (angles from ``RotaryPositionEmbedding``, TE's format),
      or ``rotary=True`` (with ``rotary_base``) to build the layer's own, positions ``0 .. seq-1``.
    - ``attention_dropout`` (SDPA), ``hidden_dropout`` (each block's output, before its residual
      add); both only in training mode. Both default to 0.0, where TransformerEngine's default
      to 0.1.
    - ``init_method`` (``qkv``, ``fc1``) and ``output_layer_init_method`` (``proj``, ``fc2``):
      weight initialisers, TransformerEngine's split (see :class:`fusible.Linear`).
    - ``name``: a label for ``explain()`` and ``repr``; the Linears' role names are always
      ``qkv``, ``proj``, ``fc1``, ``fc2``, so a ``CustomRecipe`` rule such as ``"weight:*:fc2"``
      reaches the same Linear in every layer.

    Quantizer roles (``get_quantizer_roles``): ``{input,weight,output}`` forward and
    ``{grad_output,grad_input}`` backward of ``layernorm_linear:qkv``, ``linear:proj``,
    ``layernorm_mlp:fc1``, ``layernorm_mlp:fc2``, in that order. Attention runs in high
    precision (``qkv:dpa`` / ``s:dpa`` are reserved for a future FP8 attention). Both residual
    adds fuse into the preceding GEMM (``linear_bias_add``) when the block has no hidden
    dropout. ``state_dict()`` keys are TransformerEngine's
    (``self_attention.layernorm_qkv.weight``, ``self_attention.proj.weight``,
    ``layernorm_mlp.fc1_weight``, ...). MXFP8 needs the hidden, QKV and FFN sizes and the token
    count (batch * seq) to be multiples of 32.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        *,
        num_gqa_groups: int | None = None,
        kv_channels: int | None = None,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        bias: bool = True,
        self_attn_mask_type: str = "causal",
        attention_dropout: float = 0.0,
        hidden_dropout: float = 0.0,
        layernorm_epsilon: float = 1e-5,
        zero_centered_gamma: bool = False,
        attn_input_format: str = "bshd",
        rotary: bool = False,
        rotary_base: float = 10000.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
        name: str | None = None,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        output_layer_init_method: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        dtype = resolve_params_dtype(type(self).__name__, dtype, params_dtype)
        super().__init__()
        owner = type(self).__name__
        TensorParallel.resolve(owner, tp_group, None if tp_group is None else "column",
                               sequence_parallel)  # fmt: skip
        _check_choice(owner, "self_attn_mask_type", self_attn_mask_type, MASK_TYPES)
        _check_choice(owner, "attn_input_format", attn_input_format, FORMATS)
        norm: dict[str, Any] = {"normalization": normalization,
                                "zero_centered_gamma": zero_centered_gamma}  # fmt: skip
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels=kv_channels,
            num_gqa_groups=num_gqa_groups, attention_dropout=attention_dropout,
            layernorm_epsilon=layernorm_epsilon, input_layernorm=True, bias=bias,
            attn_mask_type=self_attn_mask_type, qkv_format=attn_input_format, rotary=rotary,
            rotary_base=rotary_base, residual_connection=True, hidden_dropout=hidden_dropout,
            tp_group=tp_group, sequence_parallel=sequence_parallel, init_method=init_method,
            output_layer_init_method=output_layer_init_method, **norm, **kw,
        )  # fmt: skip
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, bias,
                                          activation=activation, eps=layernorm_epsilon,
                                          tp_group=tp_group, sequence_parallel=sequence_parallel,
                                          init_method=init_method,
                                          output_layer_init_method=output_layer_init_method,
                                          **norm, **kw)  # fmt: skip
        self.tp_size, self.sequence_parallel = self.self_attention.tp_size, sequence_parallel
        _residual_tail(self.layernorm_mlp, hidden_dropout)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_attention_heads = num_attention_heads
        self.activation, self.normalization = activation, normalization
        self.attn_input_format, self.name = attn_input_format, name

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"heads={self.num_attention_heads}, activation={self.activation!r}, "
            f"normalization={self.normalization!r}, attn_input_format={self.attn_input_format!r}"
            + (f", name={self.name!r}" if self.name else "")
        )

    # ---- conventions ------------------------------------------------------------------------

    def get_quantizer_roles(self, fwd: bool) -> list[QuantizerRole]:
        """Roles of ``qkv``, ``proj``, ``fc1``, ``fc2``, in slot order (see the class doc)."""
        return self.self_attention.get_quantizer_roles(fwd) + (
            self.layernorm_mlp.get_quantizer_roles(fwd)
        )

    def reset_parameters(self) -> None:
        """Re-initialise every parameter (norm weights 1 (0 with ``zero_centered_gamma``),
        biases 0, Linear weights kaiming-uniform as ``torch.nn.Linear``), in the order
        qkv, proj, MLP: with ``to_empty()`` this materialises a layer built on ``meta``."""
        self.self_attention.reset_parameters()
        self.layernorm_mlp.reset_parameters()

    def _explain(self, prefix: str, kw: dict[str, Any]) -> str:
        title = f"TransformerLayer{f' {self.name!r}' if self.name else ''}"
        return "\n".join([
            f"{title}: x = x + self_attention(x); x = x + layernorm_mlp(x)",
            self.self_attention._explain(f"{prefix}self_attention.", kw),
            f"{prefix}layernorm_mlp (LayerNormMLP, names 'fc1' / 'fc2', + residual add):",
            _explain_of(self.layernorm_mlp, **kw),
        ])  # fmt: skip

    # ---- forward ----------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        """``hidden_states``: ``(batch, seq, hidden)`` (or ``(seq, batch, hidden)`` with
        ``attn_input_format="sbhd"``); returns the same shape. ``attention_mask``: with
        ``self_attn_mask_type="arbitrary"`` (True masks out). ``rotary_pos_emb``: RoPE angles
        ``[seq, 1, 1, d]``. ``is_first_microbatch``: the weight workspace cache of every Linear
        (see ``ops.Sequential.forward``)."""
        x = self.self_attention(hidden_states, attention_mask, rotary_pos_emb,
                                is_first_microbatch=is_first_microbatch)  # fmt: skip
        return self.layernorm_mlp(x, x, is_first_microbatch=is_first_microbatch)  # type: ignore[no-any-return]
