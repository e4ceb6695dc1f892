"""``fusible.recipe``: the recipes (re-exported from :mod:`fusible.quantization.recipe`).

from fusible import recipe
recipe.DelayedScaling(margin=0, fp8_format=recipe.Format.HYBRID, amax_history_len=1024)
"""

from fusible.quantization.recipe import *  # noqa: F403  (the names in its __all__)
from fusible.quantization.recipe import __all__ as __all__
