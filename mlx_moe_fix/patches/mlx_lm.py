"""Patch targets in mlx-lm."""

from . import switch_layers
from .targets import Target

SWITCH_LAYERS = "mlx_lm.models.switch_layers"

TARGETS = (
    Target(SWITCH_LAYERS, "SwitchGLU", "__call__", switch_layers.switch_glu),
    Target(SWITCH_LAYERS, "SwitchMLP", "__call__", switch_layers.switch_mlp),
    Target(SWITCH_LAYERS, "QuantizedSwitchLinear", "__call__", switch_layers.quantized_switch_linear),
)
