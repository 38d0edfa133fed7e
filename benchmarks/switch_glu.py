"""One quantized mlx-lm SwitchGLU at a chosen expert shape, and its MoEExperts description:
the layer the split benchmarks (decode_split.py, prefill_split.py) time. Not a script."""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_moe_fix import kernels as this_tree
from mlx_moe_fix.kernels import MoEExperts
from mlx_moe_fix.zoo import EXPERT_MODES


def add_shape_arguments(parser) -> None:
    """--hidden / --ffn / --experts / --top-k, defaulting to Qwen3-30B-A3B's expert shape."""
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)


def quantized_switch_glu(args) -> SwitchGLU:
    """Random weights, bf16, evaluated; experts affine of `args.bits` (default 4) with group size
    64, or mxfp4 (group 32) where `args.mode` says so."""
    layer = SwitchGLU(args.hidden, args.ffn, args.experts)
    if getattr(args, "mode", "affine") == "mxfp4":
        nn.quantize(layer, **EXPERT_MODES["mxfp4"])
    else:
        nn.quantize(layer, group_size=64, bits=getattr(args, "bits", 4))
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    return layer


def experts_of(layer, kernels=this_tree) -> MoEExperts:
    """`layer` described with the `kernels` package (another tree's, in prefill_ab)."""
    names = ("gate_proj", "up_proj", "down_proj")
    return kernels.MoEExperts(tuple(kernels.ExpertLinear.from_module(layer[n]) for n in names), kernels.Activation("swiglu"))
