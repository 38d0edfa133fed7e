"""Patch targets in mlx-lm."""

from . import moe_blocks, switch_layers
from .targets import Target

SWITCH_LAYERS = "mlx_lm.models.switch_layers"

TARGETS = (
    Target(SWITCH_LAYERS, "SwitchGLU", "__call__", switch_layers.switch_glu),
    Target(SWITCH_LAYERS, "SwitchMLP", "__call__", switch_layers.switch_mlp),
    Target(SWITCH_LAYERS, "QuantizedSwitchLinear", "__call__", switch_layers.quantized_switch_linear),
    Target("mlx_lm.models.qwen3_moe", "Qwen3MoeSparseMoeBlock", "__call__", moe_blocks.qwen3_moe),
    Target("mlx_lm.models.mixtral", "MixtralSparseMoeBlock", "__call__", moe_blocks.mixtral),
    Target("mlx_lm.models.gpt_oss", "MLPBlock", "__call__", moe_blocks.gpt_oss),
    Target("mlx_lm.models.deepseek_v3", "DeepseekV3MoE", "__call__", moe_blocks.upstream_block),
)
