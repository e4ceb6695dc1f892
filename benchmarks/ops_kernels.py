"""Normalization and activation kernel benchmark: achieved bandwidth vs device copy bandwidth, vs
torch.

For each shape ``RxC`` (bf16 input) and each kernel of the ``normalization`` and ``activation``
families (``fusible._kernels.norm_fwd`` / ``norm_bwd`` / ``act_fwd`` / ``act_bwd``, called as the
fusible ops call them), measures device time (CUDA-graph replay, so Python dispatch is excluded for
every contender alike) of fusible, of PyTorch eager doing the same work, and of torch.compile of
that eager code. FP8 outputs use delayed scaling (a given per-tensor scale; the kernel writes the
amax and 1/scale): E4M3 in forward, E5M2 for the gradient (``Format.HYBRID``, the default).
SwiGLU's input is ``[R, 2C]`` (output ``[R, C]``). Bytes are the minimum each kernel must move:
every input read once and every output written once (per-tensor scalars are not counted).

The ``*_block1d*`` rows are the kernels writing blockwise FP8 output (``Float8BlockScaling``: 1x128
blocks, power-of-two fp32 scales, E4M3 for both passes; the rowwise copy, and with ``_both`` the
columnwise one, each with its scales). Their second contender, ``fusible_unfused``, is the path
they replace: the same kernel writing the bf16 output, then ``quantize_fp8_block`` of it (C must be
a multiple of 128 for the torch reference, ``torch_block_1d`` of benchmarks/kernels.py).

    python benchmarks/ops_kernels.py [--shapes 16384x4096,16384x16384] [--kernels a,b]
        [--fusible-only] [--out DIR]
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from _common import (
    bandwidth_parser,
    bandwidth_row,
    bandwidth_table,
    copy_bandwidth_gbs,
    environment,
    parse_shapes,
    write_json,
)
from fusible import _kernels as K
from kernels import _block_1d, torch_block_1d

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-5
_FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_HAS_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")  # recent torch


# ---- plain-torch versions of the same work ------------------------------------------------------


def _fp8_out(
    y: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Delayed-scaling cast of ``y``: (q, q^T or None, 1/scale, amax)."""
    amax = y.abs().amax().float()
    m = _FP8_MAX[fp8_dtype]
    q = (y.float() * scale).clamp(-m, m).to(fp8_dtype)
    return q, (q.t().contiguous() if transpose else None), scale.reciprocal(), amax


def torch_layernorm_fp8(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, scale: torch.Tensor, transpose: bool
) -> tuple[Any, ...]:
    y, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], gamma, beta, EPS)
    return (*_fp8_out(y, scale, E4M3, transpose), mean, rstd)


def _rms_norm(x: torch.Tensor, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): torch's fused RMSNorm where this torch has it, else the formula."""
    if _HAS_FUSED_RMS_NORM:
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], gamma, EPS)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def torch_rmsnorm_fp8(
    x: torch.Tensor, gamma: torch.Tensor, scale: torch.Tensor, transpose: bool
) -> tuple[Any, ...]:
    y, rstd = _rms_norm(x, gamma)
    return (*_fp8_out(y, scale, E4M3, transpose), rstd)


def torch_layernorm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = [True, True, True]  # dx, dgamma, dbeta
    return torch.ops.aten.native_layer_norm_backward(
        dy, x, [x.shape[-1]], mean, rstd, gamma, beta, mask
    )


def torch_gelu_fp8(x: torch.Tensor, scale: torch.Tensor, transpose: bool) -> tuple[Any, ...]:
    return _fp8_out(F.gelu(x, approximate="tanh"), scale, E4M3, transpose)


def torch_gelu_bwd_dbias_fp8(
    dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, transpose: bool
) -> tuple[Any, ...]:
    dx = torch.ops.aten.gelu_backward(dy, x, approximate="tanh")  # dy * gelu_tanh'(x), rounded
    dbias = dx.float().sum(0).to(dy.dtype)
    return (*_fp8_out(dx, scale, E5M2, transpose), dbias)


def torch_gelu_bwd_dbias(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    dx = torch.ops.aten.gelu_backward(dy, x, approximate="tanh")
    return dx.float().sum(0).to(dy.dtype)


def torch_swiglu_fp8(x: torch.Tensor, scale: torch.Tensor, transpose: bool) -> tuple[Any, ...]:
    # The usual bf16 form (faster in eager than upcasting first); it rounds silu(a) to bf16 before
    # the product, so ~1% of the FP8 values differ from fusible's (one rounding) by one step.
    a, b = x.chunk(2, dim=-1)
    return _fp8_out(F.silu(a) * b, scale, E4M3, transpose)


# ---- the fusible calls (as fusible.ops call them: ops/basic/normalization.py, activation.py) ----


def fusible_norm_fp8(
    x: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor | None,
    kind: str,
    scale: torch.Tensor,
    transpose: bool,
) -> tuple[torch.Tensor, ...]:
    return K.norm_fwd(x, gamma, beta, EPS, kind, False, None, "fp8", E4M3, scale, True, transpose)


def fusible_layernorm_bwd(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return K.norm_bwd(dy, x, mean, rstd, gamma, "layernorm", False)


def fusible_act_fp8(
    x: torch.Tensor, kind: str, scale: torch.Tensor, transpose: bool
) -> tuple[torch.Tensor, ...]:
    return K.act_fwd(x, kind, None, "fp8", E4M3, scale, True, transpose)


def fusible_gelu_bwd_dbias_fp8(
    dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, transpose: bool
) -> tuple[torch.Tensor, ...]:
    # The fused op BackwardActivationBias ("dact_dbias_quantize") -> activation_backward(..., True)
    # with a Float8Quantizer for the preceding Linear's grad: rowwise + its columnwise flag.
    return K.act_bwd(dy, x, "gelu", None, "fp8", E5M2, scale, True, transpose, True)


def fusible_gelu_bwd_dbias(dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # act_bwd with only the bias gradient requested (no dx, no quantized copy).
    return K.act_bwd(dy, x, "gelu", None, "none", E4M3, None, True, False, True)


def fusible_norm_block(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None, kind: str, both: bool
) -> tuple[torch.Tensor, ...]:
    return K.norm_fwd(x, gamma, beta, EPS, kind, False, None, "block1d", E4M3, None, True, both)


def fusible_norm_then_block(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None, kind: str, both: bool
) -> tuple[torch.Tensor, ...]:
    y = K.norm_fwd(x, gamma, beta, EPS, kind, False, x.dtype, "none", E4M3, None, True, False)[0]
    return K.quantize_fp8_block(y, E4M3, 1, True, 0.0, True, both)


def torch_layernorm_block(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, both: bool
) -> tuple[Any, ...]:
    y = torch.native_layer_norm(x, [x.shape[-1]], gamma, beta, EPS)[0]
    return torch_block_1d(y) if both else _block_1d(y.float())


def fusible_act_block(x: torch.Tensor, kind: str, both: bool) -> tuple[torch.Tensor, ...]:
    return K.act_fwd(x, kind, None, "block1d", E4M3, None, True, both)


def fusible_act_then_block(x: torch.Tensor, kind: str, both: bool) -> tuple[torch.Tensor, ...]:
    y = K.act_fwd(x, kind, x.dtype, "none", E4M3, None, True, False)[0]
    return K.quantize_fp8_block(y, E4M3, 1, True, 0.0, True, both)


def fusible_gelu_bwd_dbias_block(
    dy: torch.Tensor, x: torch.Tensor, both: bool
) -> tuple[torch.Tensor, ...]:
    return K.act_bwd(dy, x, "gelu", None, "block1d", E4M3, None, True, both, True)


def fusible_gelu_bwd_dbias_then_block(
    dy: torch.Tensor, x: torch.Tensor, both: bool
) -> tuple[torch.Tensor, ...]:
    dx, *_, dbias = K.act_bwd(dy, x, "gelu", dy.dtype, "none", E4M3, None, True, False, True)
    return (*K.quantize_fp8_block(dx, E4M3, 1, True, 0.0, True, both), dbias)


# ---- the benchmark ------------------------------------------------------------------------------

Case = tuple[str, int, dict[str, Callable[[], Any]]]


def with_transpose(
    name: str, nbytes: int, transposed: int, contenders: dict[str, Callable[..., Any]]
) -> list[Case]:
    """The rows ``name`` and ``name_transpose``: each contender called with the transpose flag
    (its last argument), the second row moving ``transposed`` bytes more."""
    return [
        (
            f"{name}_transpose" if t else name,
            nbytes + (transposed if t else 0),
            {k: partial(f, t) for k, f in contenders.items()},
        )
        for t in (False, True)
    ]


def cases_for(r: int, c: int, dev: str, compiled: dict[str, Callable[..., Any]]) -> list[Case]:
    """(row name, minimum bytes, contenders) for shape [r, c]; n = r * c elements, bf16 = 2 B,
    fp8 = 1 B, float32 statistics = 4 B per row."""
    bf16 = torch.bfloat16
    n = r * c
    x = torch.randn(r, c, device=dev, dtype=bf16)
    dy = torch.randn(r, c, device=dev, dtype=bf16)
    x2 = torch.randn(r, 2 * c, device=dev, dtype=bf16)  # SwiGLU input [a | b]
    gamma = 1.0 + 0.1 * torch.randn(c, device=dev, dtype=bf16)
    beta = 0.1 * torch.randn(c, device=dev, dtype=bf16)
    scale = torch.tensor([2.0], device=dev)
    # Saved statistics for the backward, each contender its own (torch's are [r, 1]).
    _, *_, f_mean, f_rstd = fusible_norm_fp8(x, gamma, beta, "layernorm", scale, False)
    _, t_mean, t_rstd = torch.native_layer_norm(x, [c], gamma, beta, EPS)
    cs = compiled

    out: list[Case] = []
    for t in (False, True):
        sfx = "_transpose" if t else ""
        out += [
            (
                # read x (2n) + gamma, beta (2 * 2c); write fp8 y (n), y^T (n if transposed),
                # mean + rstd (8r)
                f"layernorm_fwd_fp8{sfx}",
                2 * n + 4 * c + n + (n if t else 0) + 8 * r,
                {
                    "fusible": partial(fusible_norm_fp8, x, gamma, beta, "layernorm", scale, t),
                    "torch_eager": partial(torch_layernorm_fp8, x, gamma, beta, scale, t),
                    "torch_compile": partial(cs["ln"], x, gamma, beta, scale, t),
                },
            ),
            (
                # read x (2n) + gamma (2c); write fp8 y (n), y^T (n if transposed), rstd (4r)
                f"rmsnorm_fwd_fp8{sfx}",
                2 * n + 2 * c + n + (n if t else 0) + 4 * r,
                {
                    "fusible": partial(fusible_norm_fp8, x, gamma, None, "rmsnorm", scale, t),
                    "torch_eager": partial(torch_rmsnorm_fp8, x, gamma, scale, t),
                    "torch_compile": partial(cs["rms"], x, gamma, scale, t),
                },
            ),
        ]
    out.append(
        (
            # read dy, x (2 * 2n), mean + rstd (8r), gamma (2c);
            # write dx (2n), dgamma + dbeta (2 * 2c)
            "layernorm_bwd",
            6 * n + 8 * r + 6 * c,
            {
                "fusible": lambda: fusible_layernorm_bwd(dy, x, f_mean, f_rstd, gamma),
                "torch_eager": lambda: torch_layernorm_bwd(dy, x, t_mean, t_rstd, gamma, beta),
                "torch_compile": lambda: cs["ln_bwd"](dy, x, t_mean, t_rstd, gamma, beta),
            },
        )
    )
    # read x (2n); write fp8 y (n), y^T (n if transposed)
    out += with_transpose("gelu_fwd_fp8", 2 * n + n, n, {
        "fusible": partial(fusible_act_fp8, x, "gelu", scale),
        "torch_eager": partial(torch_gelu_fp8, x, scale),
        "torch_compile": partial(cs["gelu"], x, scale),
    })  # fmt: skip
    # read dy, x (2 * 2n); write fp8 dx (n), dx^T (n if transposed), dbias (2c)
    out += with_transpose("gelu_bwd_dbias_fp8", 4 * n + n + 2 * c, n, {
        "fusible": partial(fusible_gelu_bwd_dbias_fp8, dy, x, scale),
        "torch_eager": partial(torch_gelu_bwd_dbias_fp8, dy, x, scale),
        "torch_compile": partial(cs["gelu_bwd"], dy, x, scale),
    })  # fmt: skip
    out.append(
        (
            # read dy, x (2 * 2n); write dbias (2c). (No dbias-only kernel of dy alone exists:
            # this is act_bwd with only the column sums of dgelu requested.)
            "gelu_bwd_dbias_only",
            4 * n + 2 * c,
            {
                "fusible": lambda: fusible_gelu_bwd_dbias(dy, x),
                "torch_eager": lambda: torch_gelu_bwd_dbias(dy, x),
                "torch_compile": lambda: cs["dbias"](dy, x),
            },
        )
    )
    # read x [r, 2c] (4n); write fp8 y [r, c] (n), y^T (n if transposed)
    out += with_transpose("swiglu_fwd_fp8", 4 * n + n, n, {
        "fusible": partial(fusible_act_fp8, x2, "swiglu", scale),
        "torch_eager": partial(torch_swiglu_fp8, x2, scale),
        "torch_compile": partial(cs["swiglu"], x2, scale),
    })  # fmt: skip
    # Blockwise FP8 output: the 1x128 scales are fp32 [c / 128, r] (rowwise) and [r / 128, c]
    # (columnwise): n / 32 bytes a copy.
    for both in (False, True):
        sfx = "_both" if both else ""
        q = n + n // 32 + ((n + n // 32) if both else 0)  # the copies and their scales
        out += [
            (
                # read x (2n) + gamma, beta (2 * 2c); write the copies, mean + rstd (8r)
                f"layernorm_fwd_block1d{sfx}",
                2 * n + 4 * c + q + 8 * r,
                {
                    "fusible": partial(fusible_norm_block, x, gamma, beta, "layernorm", both),
                    "fusible_unfused": partial(
                        fusible_norm_then_block, x, gamma, beta, "layernorm", both
                    ),
                    "torch_eager": partial(torch_layernorm_block, x, gamma, beta, both),
                },
            ),
            (
                # read x (2n) + gamma (2c); write the copies, rstd (4r)
                f"rmsnorm_fwd_block1d{sfx}",
                2 * n + 2 * c + q + 4 * r,
                {
                    "fusible": partial(fusible_norm_block, x, gamma, None, "rmsnorm", both),
                    "fusible_unfused": partial(
                        fusible_norm_then_block, x, gamma, None, "rmsnorm", both
                    ),
                },
            ),
            (
                # read x (2n); write the copies
                f"gelu_fwd_block1d{sfx}",
                2 * n + q,
                {
                    "fusible": partial(fusible_act_block, x, "gelu", both),
                    "fusible_unfused": partial(fusible_act_then_block, x, "gelu", both),
                },
            ),
            (
                # read x [r, 2c] (4n); write the copies of y [r, c]
                f"swiglu_fwd_block1d{sfx}",
                4 * n + q,
                {
                    "fusible": partial(fusible_act_block, x2, "swiglu", both),
                    "fusible_unfused": partial(fusible_act_then_block, x2, "swiglu", both),
                },
            ),
            (
                # read dy, x (2 * 2n); write the copies of dx, dbias (2c)
                f"gelu_bwd_dbias_block1d{sfx}",
                4 * n + q + 2 * c,
                {
                    "fusible": partial(fusible_gelu_bwd_dbias_block, dy, x, both),
                    "fusible_unfused": partial(fusible_gelu_bwd_dbias_then_block, dy, x, both),
                },
            ),
        ]
    return out


def compiled_references() -> dict[str, Callable[..., Any]]:
    # Static shapes: each benchmarked shape gets its own specialized kernels.
    def comp(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, dynamic=False)

    return {
        "ln": comp(torch_layernorm_fp8),
        "rms": comp(torch_rmsnorm_fp8),
        "ln_bwd": comp(torch_layernorm_bwd),
        "gelu": comp(torch_gelu_fp8),
        "gelu_bwd": comp(torch_gelu_bwd_dbias_fp8),
        "dbias": comp(torch_gelu_bwd_dbias),
        "swiglu": comp(torch_swiglu_fp8),
    }


def run(
    shapes: list[tuple[int, int]], only: set[str] | None = None, fusible_only: bool = False
) -> tuple[list[dict[str, Any]], float]:
    dev = "cuda"
    copy_gbs = copy_bandwidth_gbs(dev)
    rows_out: list[dict[str, Any]] = []
    compiled = compiled_references()
    with torch.no_grad():  # as inside fusible's autograd functions: the ops' direct path
        for r, c in shapes:
            for name, nbytes, contenders in cases_for(r, c, dev, compiled):
                if only is not None and name not in only:
                    continue
                if fusible_only:
                    contenders = {"fusible": contenders["fusible"]}
                rows_out.append(bandwidth_row(name, f"{r}x{c}", nbytes, contenders, copy_gbs))
            torch.cuda.empty_cache()
    return rows_out, copy_gbs


def main() -> None:
    ap = bandwidth_parser(__doc__)
    ap.add_argument("--kernels", default=None, help="comma-separated row names (default: all)")
    ap.add_argument(
        "--fusible-only", action="store_true", help="time fusible alone (e.g. under ncu)"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/ops_kernels.py needs a CUDA GPU")
    shapes = parse_shapes(args.shapes)
    only = set(args.kernels.split(",")) if args.kernels else None
    rows, copy_gbs = run(shapes, only, args.fusible_only)
    bandwidth_table(
        rows,
        copy_gbs,
        ["torch_eager_ms", "torch_compile_ms", "speedup_vs_torch_eager",
         "speedup_vs_torch_compile", "fusible_unfused_ms", "speedup_vs_fusible_unfused"],
    )  # fmt: skip
    if args.fusible_only and args.out is None:
        # A partial table (often timed under a profiler) never replaces the recorded results.
        print("--fusible-only without --out: results not written")
        return
    path = write_json(
        "ops_kernels", {"env": environment(), "copy_GBps": copy_gbs, "results": rows}, args.out
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
