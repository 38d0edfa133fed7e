"""Patch targets in mlx-lm."""

from . import decoder_layers, moe_blocks, switch_layers
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
    Target("mlx_lm.models.qwen3_moe", "Qwen3MoeDecoderLayer", "__call__", decoder_layers.qwen3_moe, "cefb6d1c140ba9f6"),
    Target("mlx_lm.models.mixtral", "MixtralDecoderLayer", "__call__", decoder_layers.mixtral, "f6a291d8fbcb0afa"),
    Target("mlx_lm.models.gpt_oss", "TransformerBlock", "__call__", decoder_layers.gpt_oss, "57d0ce715f73aa56"),
)
