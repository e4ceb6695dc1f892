"""The family tables Python reads from the core library at import (docs/architecture.md, "Family
tables"): the scaling modes, the normalization kinds and the amax algorithms agree with what the
torch operators accept, and the C API ends each table with NULL / an error."""

from __future__ import annotations

import ctypes

import pytest
import torch

from fusible import _kernels as K
from fusible._kernels._common import _LIBRARY


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_LIBRARY)
    for fn in ("fus_scaling_mode_name", "fus_norm_kind_name", "fus_amax_algo_name"):
        getattr(lib, fn).argtypes = [ctypes.c_int]
        getattr(lib, fn).restype = ctypes.c_char_p
    return lib


def test_tables_end_with_null():
    lib = _lib()
    assert lib.fus_scaling_mode_name(len(K.SCALING_MODES)) is None
    assert lib.fus_scaling_mode_name(-1) is None
    assert lib.fus_norm_kind_name(len(K.NORM_KINDS)) is None
    assert lib.fus_amax_algo_name(len(K.AMAX_ALGOS)) is None


def test_scaling_mode_layout_rejects_a_value_past_the_table():
    lib = ctypes.CDLL(_LIBRARY)
    lib.fus_scaling_mode_layout.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4
    lib.fus_last_error.restype = ctypes.c_char_p
    assert lib.fus_scaling_mode_layout(len(K.SCALING_MODES), None, None, None, None) != 0
    assert b"mode must be a fus_scaling_mode" in lib.fus_last_error()


def test_quant_modes_are_the_operators_choices():
    assert K.QUANT_MODES == ("none", *K.SCALING_MODES)
    assert (K.MXFP8_BLOCK, K.FP8_BLOCK) == (32, 128)
    x = torch.randn(33, 260)
    for quant in K.QUANT_MODES:
        # Every choice runs, and the fake kernel's layouts (Python's, from the table) are the
        # operator's.
        scale = torch.ones(1) if quant == "fp8" else None
        args = ("relu", torch.float32, quant, torch.float8_e4m3fn)
        real = K.act_fwd(x, *args, scale, True, True)
        meta = K.act_fwd(x.to("meta"), *args, None if scale is None else scale.to("meta"), True,
                         True)  # fmt: skip
        assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in meta], quant
    with pytest.raises(ValueError, match=r"argument 'quant' must be one of \('none', 'fp8'"):
        K.act_fwd(x, "relu", torch.float32, "nvfp4", torch.float8_e4m3fn, None, True, False)


def test_norm_kinds_and_amax_algos_are_the_operators_choices():
    x, gamma = torch.randn(2, 8), torch.ones(8)
    for kind in K.NORM_KINDS:
        K.norm_fwd(x, gamma, None, 1e-5, kind, False, torch.float32, "none",
                   torch.float8_e4m3fn, None, True, False)  # fmt: skip
    for algo in K.AMAX_ALGOS:
        K.delayed_scaling_update([torch.zeros(2, 3)], [torch.ones(3)], [448.0], algo, 0)
    with pytest.raises(ValueError, match="algo must be 'max' or 'most_recent', got 'mean'"):
        K.delayed_scaling_update([torch.zeros(2, 3)], [torch.ones(3)], [448.0], "mean", 0)


def test_fp8_max_is_torchs():
    for dt in K.FP8_DTYPES:
        assert K.fp8_max(dt) == torch.finfo(dt).max
