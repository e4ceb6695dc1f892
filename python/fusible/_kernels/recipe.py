"""The recipe family (cpp/include/fusible/recipe.h, cpp/bindings/ops_recipe.cpp).

``compute_scale(amax, fp8_dtype, margin) -> (scale, scale_inv)``
    Per-tensor scale from ``amax`` (scale 1 where amax is 0 or not finite).
``delayed_scaling_update(amax_histories, scales, fp8_maxes, algo, margin) -> None``
    Updates many delayed-scaling states in one launch, in place: ``amax_histories[g]`` float32
    ``[history_len, n]``, ``scales[g]`` float32 ``[n]``; ``algo`` in :data:`AMAX_ALGOS`
    (``"max"`` or ``"most_recent"``).
"""

from __future__ import annotations

from typing import Any

from fusible._kernels._common import _LIBRARY, _c_names, _check_same_device, _fake, _ops

compute_scale: Any = _ops.compute_scale.default
delayed_scaling_update: Any = _ops.delayed_scaling_update.default

# The choices of ``algo`` (the amax of a delayed-scaling update), in the C enum's order: read from
# the core library's table (FUS_AMAX_ALGO_TABLE, recipe.h), which ops_recipe.cpp reads too.
AMAX_ALGOS = _c_names(_LIBRARY, "fus_amax_algo_name")


@_fake("compute_scale")
def _compute_scale_fake(amax, fp8_dtype, margin):
    return amax.new_empty(1), amax.new_empty(1)


@_fake("delayed_scaling_update")
def _delayed_scaling_update_fake(amax_histories, scales, fp8_maxes, algo, margin):
    for g, (h, s) in enumerate(zip(amax_histories, scales, strict=False)):
        _check_same_device(
            "delayed_scaling_update", f"amax_histories[{g}]", h, amax_histories[0].device
        )
        _check_same_device("delayed_scaling_update", f"scales[{g}]", s, amax_histories[0].device)
    return None
