"""fusible: fusible FP8/MXFP8 operations for PyTorch (see DESIGN/README and docs/)."""

__version__ = "0.1.0"

from fusible import quantization, recipe
from fusible.quantization.autocast import autocast

__all__ = ["__version__", "autocast", "quantization", "recipe"]
