"""fusible.quantization: recipes, semantic roles, quantizers, quantized data, RecipeState, autocast.

Import direction inside the package: ``roles``, ``recipe`` <- ``data`` <- ``tensor`` <-
``quantizers`` (with ``scale_log``) <- ``state`` <- ``autocast``, ``model_init``. The user guide
is ``docs/quantization.md``.

``fusible.quantization.autocast`` is the *module* (query functions, update points); the context
manager is ``fusible.autocast`` (also ``fusible.quantization.autocast.autocast``).
"""

from fusible.quantization import recipe
from fusible.quantization.autocast import (
    DEFAULT_GROUP,
    DEFAULT_RECIPE,
    AutocastState,
    end_backward_pass,
    end_forward_pass,
    get_amax_reduction_group,
    get_autocast_state,
    get_recipe,
    is_fp8_enabled,
    pending_recipe_states,
)
from fusible.quantization.model_init import (
    get_quantized_model_init_recipe,
    quantized_model_init,
)
from fusible.quantization.quantizers import (
    Float8BlockData,
    Float8BlockQuantizer,
    Float8BlockTensor,
    Float8CurrentScalingQuantizer,
    Float8Data,
    Float8Quantizer,
    Float8Tensor,
    MXFP8Data,
    MXFP8Quantizer,
    MXFP8Tensor,
    QuantizedData,
    QuantizedTensor,
    Quantizer,
    ScalingBuffers,
    quantizer_for_recipe,
)
from fusible.quantization.recipe import *  # noqa: F403  (the recipes, in __all__ below)
from fusible.quantization.roles import (
    BACKWARD_BUCKETS,
    FORWARD_BUCKETS,
    STANDARD_BUCKETS,
    QuantizerRole,
    as_role,
    as_roles,
    backward_roles,
    forward_roles,
)
from fusible.quantization.state import (
    CustomRecipeState,
    DelayedScalingRecipeState,
    Float8BlockScalingRecipeState,
    Float8CurrentScalingRecipeState,
    MXFP8BlockScalingRecipeState,
    RecipeState,
    load_recipe_state,
    recipe_state_to_dict,
    update_delayed_scaling,
)

__all__ = [
    "BACKWARD_BUCKETS",
    "DEFAULT_GROUP",
    "DEFAULT_RECIPE",
    "FORWARD_BUCKETS",
    "STANDARD_BUCKETS",
    "AutocastState",
    "CustomRecipeState",
    "DelayedScalingRecipeState",
    "Float8BlockData",
    "Float8BlockQuantizer",
    "Float8BlockScalingRecipeState",
    "Float8BlockTensor",
    "Float8CurrentScalingQuantizer",
    "Float8CurrentScalingRecipeState",
    "Float8Data",
    "Float8Quantizer",
    "Float8Tensor",
    "MXFP8BlockScalingRecipeState",
    "MXFP8Data",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "QuantizedData",
    "QuantizedTensor",
    "Quantizer",
    "QuantizerRole",
    "RecipeState",
    "ScalingBuffers",
    "as_role",
    "as_roles",
    "backward_roles",
    "end_backward_pass",
    "end_forward_pass",
    "forward_roles",
    "get_amax_reduction_group",
    "get_autocast_state",
    "get_quantized_model_init_recipe",
    "get_recipe",
    "is_fp8_enabled",
    "load_recipe_state",
    "pending_recipe_states",
    "quantized_model_init",
    "quantizer_for_recipe",
    "recipe_state_to_dict",
    "update_delayed_scaling",
]
__all__ += recipe.__all__
