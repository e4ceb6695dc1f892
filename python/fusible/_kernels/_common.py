"""What the kernel families share: the operator library (loaded once), the dtype constants, and
the helpers of the fake kernels (argument checks a fake tensor can make, empty outputs).

The fake kernels (``torch.library.register_fake``) run under torch.compile, FakeTensorMode and
meta tensors: they give each operator's outputs' shapes, dtypes and devices (with symbolic
shapes), plus the device checks that a mix of meta and real tensors needs. The C++ operators
allocate the same outputs; torch.library.opcheck (tests/python/test_kernels_*.py) checks that the
two agree.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import math
import os
from collections.abc import Sequence
from typing import Any

import torch


def _load_operators() -> tuple[Any, str]:
    # The library lies next to the package, in python/fusible/.
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = glob.glob(os.path.join(here, "libfusible_torch*.so"))
    if not found:
        raise ImportError(
            f"fusible: the torch operator library (libfusible_torch.so) is missing from {here}; "
            "build fusible with `bash scripts/setup.sh`"
        )
    if not hasattr(torch.ops.fusible, "gemm"):
        torch.ops.load_library(found[0])
    return torch.ops.fusible, found[0]


_ops, _LIBRARY = _load_operators()


def _c_names(library: str, function: str) -> tuple[str, ...]:
    """The names the core library's ``function`` (``const char* fus_<x>_name(value)``: a family
    table's names, NULL past the last row) gives for the values 0, 1, ..., in the C enum's order."""
    fn = getattr(ctypes.CDLL(library), function)
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_char_p
    names: list[str] = []
    while (name := fn(len(names))) is not None:
        names.append(name.decode())
    return tuple(names)


# The mirror of ``fus_dtype`` (common.h) in value order, checked against ``fus_dtype_size`` at
# import; ``FUS_E8M0`` (MXFP8 scales) is stored as torch.uint8.
_FUS_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
               torch.float8_e5m2, torch.uint8)  # fmt: skip


def _check_fus_dtypes(library: str) -> None:
    lib = ctypes.CDLL(library)
    lib.fus_dtype_size.argtypes = [ctypes.c_int]
    lib.fus_dtype_size.restype = ctypes.c_size_t
    for code, dt in enumerate(_FUS_DTYPES):  # the mirror of fus_dtype agrees with the library
        if lib.fus_dtype_size(code) != dt.itemsize:
            raise ImportError(f"fusible: fus_dtype {code} is not {dt} (the mirror in _common.py)")


_check_fus_dtypes(_LIBRARY)

HIGH_PRECISION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_HAS_CUDA = bool(_ops.has_cuda())


def has_cuda() -> bool:
    """True if the core library was built with its CUDA backend."""
    return _HAS_CUDA


def _fake(name: str) -> Any:
    return torch.library.register_fake(f"fusible::{name}")


def _nothing(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def _check_choice(op: str, name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"fusible.{op}: argument '{name}' must be one of {choices}, got {value!r}")


def _matrix_shape(op: str, x: torch.Tensor, name: str = "x") -> tuple[int, int]:
    if x.dim() == 0:
        raise ValueError(
            f"fusible.{op}: argument '{name}' must have at least one dimension, got a scalar"
        )
    return math.prod(x.shape[:-1]), x.shape[-1]


def _check_same_device(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    # Also called by the fake kernels: a mix of meta and real tensors dispatches to them, and they
    # must not hand back uninitialised real tensors.
    if t.device != device:
        raise ValueError(
            f"fusible.{op}: argument '{name}' is on {t.device}, expected the input's device "
            f"{device}"
        )


def _check_devices(op: str, device: torch.device, named: Sequence[tuple[str, Any]]) -> None:
    """``_check_same_device`` of every tensor given (None: an absent optional argument)."""
    for name, t in named:
        if t is not None:
            _check_same_device(op, name, t, device)


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _group_mats(
    op: str, name: str, x: Sequence[torch.Tensor], m_splits: Sequence[Any]
) -> list[tuple[Any, Any]]:
    """(rows, cols) of each group of ``x`` (see ``grouped_quantize_fp8``), with the C++ checks a
    fake tensor can make: counts, devices, dtypes, the packed rows."""
    if len(x) == 0:
        raise ValueError(f"fusible.{op}: argument '{name}' must hold at least one tensor, got none")
    dev = x[0].device
    if len(m_splits) == 0 or (len(x) > 1 and len(x) == len(m_splits)):
        out = []
        for i, t in enumerate(x):
            _check_same_device(op, f"{name}[{i}]", t, dev)
            if t.dtype != x[0].dtype:
                raise TypeError(
                    f"fusible.{op}: argument '{name}[{i}]' has dtype {t.dtype}, expected "
                    f"{name}[0]'s {x[0].dtype} (one dtype per group)"
                )
            rows, cols = _matrix_shape(op, t, f"{name}[{i}]")
            out.append((rows, cols) if len(m_splits) == 0 or m_splits[i] else (0, cols))
        return out
    if len(x) != 1:
        raise ValueError(
            f"fusible.{op}: argument '{name}' must be one packed tensor when m_splits is given "
            f"({len(m_splits)} groups), got {len(x)} tensors"
        )
    rows, cols = _matrix_shape(op, x[0], f"{name}[0]")
    torch._check(
        sum(m_splits) == rows,
        lambda: f"fusible.{op}: argument 'm_splits' must sum to the rows of {name}[0] ({rows})",
    )
    return [(m, cols) for m in m_splits]


# ---- quantized outputs (fus_quantized, common.h) ------------------------------------------------
# The layouts of a quantized copy, which the quantize family writes and the normalization and
# activation kernels write too (their quantized outputs, chosen by ``quant``).


@dataclasses.dataclass(frozen=True)
class ScalingMode:
    """One row of the core library's scaling-mode table (``FUS_SCALING_MODE_TABLE``, common.h):
    the name (the fused kernels' ``quant``), the block of the rowwise copy one scale covers
    (``0 x 0``: the whole tensor), the scales' dtype and whether the columnwise copy is stored
    transposed (``[cols, rows]``)."""

    name: str
    block_rows: int
    block_cols: int
    scale_dtype: torch.dtype
    transposed: bool


def _scaling_modes(library: str) -> tuple[ScalingMode, ...]:
    """The scaling modes in ``fus_scaling_mode`` order, read through the library's C API."""
    lib = ctypes.CDLL(library)
    i64, i32 = ctypes.c_int64, ctypes.c_int
    lib.fus_scaling_mode_layout.argtypes = [i32] + [ctypes.POINTER(t) for t in (i64, i64, i32, i32)]
    lib.fus_scaling_mode_layout.restype = i32
    modes = []
    for value, name in enumerate(_c_names(library, "fus_scaling_mode_name")):
        br, bc, dt, tr = i64(), i64(), i32(), i32()
        if lib.fus_scaling_mode_layout(value, br, bc, dt, tr) != 0:
            raise ImportError(f"fusible: fus_scaling_mode_layout({value}) failed")
        modes.append(ScalingMode(name, br.value, bc.value, _FUS_DTYPES[dt.value], bool(tr.value)))
    return tuple(modes)


#: The scaling modes of a quantized output, by name (``FUS_SCALING_MODE_TABLE``, read at import).
SCALING_MODES = {m.name: m for m in _scaling_modes(_LIBRARY)}
# The choices of the fused kernels' ``quant``: "none", then the modes in the C enum's order.
QUANT_MODES = ("none", *SCALING_MODES)


def _check_fused_choices(op: str, kind: str, kinds: Sequence[str], quant: str) -> None:
    """The string arguments of a normalization / activation kernel: ``kind`` and ``quant``."""
    _check_choice(op, "kind", kind, kinds)
    _check_choice(op, "quant", quant, QUANT_MODES)


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix ``[rows, cols]`` of a tensor of ``shape`` (a scalar is ``[1, 1]``)."""
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) else (1, 1)


def _or_nothing(
    want: bool, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A new tensor of ``shape`` if ``want``, else an empty one (an output not asked for)."""
    return torch.empty(shape, dtype=dtype, device=device) if want else _nothing(dtype, device)


def _fp8_copies(
    shape: Sequence[int], dev: torch.device, fp8_dtype: torch.dtype, rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(data, data_t) of a per-tensor FP8 cast of a tensor of ``shape``."""
    shape = tuple(shape)
    rows, cols = _rows_cols(shape)
    return (
        _or_nothing(rowwise, shape, fp8_dtype, dev),
        _or_nothing(columnwise, (cols, rows), fp8_dtype, dev),
    )


def _mx_copies(
    shape: Sequence[int], dev: torch.device, fp8_dtype: torch.dtype, rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(data, scale, col_data, col_scale) of an MXFP8 cast of a tensor of ``shape``."""
    shape = tuple(shape)
    rows, cols = _rows_cols(shape)
    e8m0 = SCALING_MODES["mxfp8"].scale_dtype
    return (
        _or_nothing(rowwise, shape, fp8_dtype, dev),
        _or_nothing(rowwise, (rows, _ceil_div(cols, MXFP8_BLOCK)), e8m0, dev),
        _or_nothing(columnwise, shape, fp8_dtype, dev),
        _or_nothing(columnwise, (_ceil_div(rows, MXFP8_BLOCK), cols), e8m0, dev),
    )


def block_scale_shape(block_dim: int, r: int, c: int) -> tuple[int, int]:
    """Shape of the scale_inv matrix of a blockwise copy ``[r, c]`` (see ``quantize``)."""
    if block_dim == 1:
        return (_ceil_div(c, FP8_BLOCK), r)
    return (_ceil_div(r, FP8_BLOCK), _ceil_div(c, FP8_BLOCK))


def _block_outputs(
    shape: Sequence[int],
    dev: torch.device,
    fp8_dtype: torch.dtype,
    block_dim: int,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale_inv, data_t, col_scale_inv) of a blockwise cast of a tensor of ``shape``."""
    shape = tuple(shape)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    f32 = SCALING_MODES[_BLOCK_QUANT[block_dim]].scale_dtype
    data, data_t = _fp8_copies(shape, dev, fp8_dtype, rowwise, columnwise)
    scale = _or_nothing(rowwise, block_scale_shape(block_dim, rows, cols), f32, dev)
    col_scale = _or_nothing(columnwise, block_scale_shape(block_dim, cols, rows), f32, dev)
    return data, scale, data_t, col_scale


def _quant_outputs(
    shape: Sequence[int],
    device: torch.device,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, data_t_or_col, scale_inv_or_mx_scale, col_scale, amax) for an output of `shape`."""
    u8, f32 = torch.uint8, torch.float32
    if quant == "none":
        e = _nothing(u8, device)
        f = _nothing(f32, device)
        return e, _nothing(u8, device), f, _nothing(u8, device), _nothing(f32, device)
    amax = torch.empty(1, dtype=f32, device=device)
    if quant in _BLOCK_QUANT.values():
        bd = 1 if quant == _BLOCK_QUANT[1] else 2
        data, s, data_t, cs = _block_outputs(shape, device, fp8_dtype, bd, rowwise, columnwise)
        return data, data_t, s, cs, amax
    if quant == "fp8":
        data, data_t = _fp8_copies(shape, device, fp8_dtype, rowwise, columnwise)
        s = torch.empty(1, dtype=SCALING_MODES["fp8"].scale_dtype, device=device)
        return data, data_t, s, _nothing(u8, device), amax
    data, s, col, cs = _mx_copies(shape, device, fp8_dtype, rowwise, columnwise)
    return data, col, s, cs, amax


def _fused_outputs(
    shape: Sequence[int],
    device: torch.device,
    out_dtype: torch.dtype | None,
    dtype: torch.dtype,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, ...]:
    """``(y, *quantized)`` of a normalization / activation kernel with an output of ``shape``:
    ``y`` of ``out_dtype`` (empty of ``dtype`` when None) and the quantized outputs."""
    y = _or_nothing(out_dtype is not None, shape, out_dtype or dtype, device)
    return (y, *_quant_outputs(shape, device, quant, fp8_dtype, rowwise, columnwise))


def _accumulated(
    op: str, outs: tuple[torch.Tensor, ...], at: int, quant: str, amax_into: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """``outs`` of a fused kernel whose amax is ``outs[at]``, as the kernel returns them when it
    max-combines its amax into ``amax_into`` (float32, one value): that amax empty."""
    if amax_into is None:
        return outs
    if quant == "none":
        raise ValueError(
            f"fusible.{op}: argument 'amax_into' must be None for quant='none' (no cast, no amax)"
        )
    empty = torch.empty(0, dtype=torch.float32, device=outs[at].device)
    return (*outs[:at], empty, *outs[at + 1 :])


# The quant of a blockwise copy by ``block_dim`` (1: 1x128 blocks, 2: 128x128 blocks).
_BLOCK_QUANT = {1: "block1d", 2: "block2d"}


def _check_scaling_modes(modes: dict[str, ScalingMode]) -> tuple[int, int]:
    """``(MXFP8_BLOCK, FP8_BLOCK)`` from the table, after checking that its rows are the modes
    the layouts above are written for (``_quant_outputs``): a per-tensor "fp8"; an "mxfp8" of
    1 x n blocks with E8M0 scales and its columnwise copy stored as X; blockwise "block1d" /
    "block2d" of 1 x n / n x n blocks with float32 scales, their columnwise copies transposed."""
    mx = modes["mxfp8"].block_cols if "mxfp8" in modes else 0
    n = modes["block1d"].block_cols if "block1d" in modes else 0
    expected = {
        "fp8": ScalingMode("fp8", 0, 0, torch.float32, True),
        "mxfp8": ScalingMode("mxfp8", 1, mx, torch.uint8, False),
        _BLOCK_QUANT[1]: ScalingMode(_BLOCK_QUANT[1], 1, n, torch.float32, True),
        _BLOCK_QUANT[2]: ScalingMode(_BLOCK_QUANT[2], n, n, torch.float32, True),
    }
    if modes != expected or mx < 1 or n < 1:
        raise ImportError(
            f"fusible: the core library's scaling modes {tuple(modes.values())} "
            "(FUS_SCALING_MODE_TABLE, common.h) are not the ones the quantized outputs' layouts "
            "of fusible._kernels._common are written for"
        )
    return mx, n


# MXFP8 block size along the scaled dimension; blockwise FP8 block edge (1x128, 128x128).
MXFP8_BLOCK, FP8_BLOCK = _check_scaling_modes(SCALING_MODES)
