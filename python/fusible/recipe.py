"""``fusible.recipe``: the recipes (re-exported from :mod:`fusible.quantization.recipe`).

from fusible import recipe
recipe.DelayedScaling(margin=0, fp8_format=recipe.Format.HYBRID, amax_history_len=1024)
"""

from fusible.quantization.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    Recipe,
    RoleRules,
)

__all__ = [
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "Recipe",
    "RoleRules",
]
