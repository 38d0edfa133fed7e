"""A decode step's MoE block against its dense equivalent's MLP, layer for layer: host graph
building vs evaluation, per layer, all layers in one graph (the per-layer split of the gap
between a MoE model's and its dense equivalent's single-stream decode).

    python3 -m benchmarks.decode_blocks                  # qwen3_moe's block (Qwen3-30B-A3B), 48 layers
    python3 -m benchmarks.decode_blocks --family mixtral --layers 32
    python3 -m benchmarks.decode_blocks --family deepseek_v4 --layers 8   # mlx-vlm's, from benchmarks.models

One token, bf16, 4-bit affine g64 weights (random), mlx-lm's own block and MLP classes (for
mlx-vlm's deepseek_v4 and inkling: the MoE blocks and dense MLPs of benchmarks.models' full-size
model and dense equivalent, built with --layers layers; their attention is built too but not
run): the MoE
block stock, patched with its decode step compiled (where it is: with its compiled step called
alone, without the wrapper, and an `mx.compile`d x * 2 with the step's captured inputs, MLX's
compiled call without the step's nodes), patched with the routing in a launch of its
own (MLX_MOE_FIX_CUDA_ROUTED_DECODE=0; mlx-lm's routed blocks), patched built in Python at every step
(MLX_MOE_FIX_COMPILED_DECODE=0), and the dense MLP of the block's active width (top-k x expert
width) stock. Same timing as decode_split (median of --reps after 3 warm-ups).
"""

import argparse
import importlib

import mlx.core as mx
import mlx.nn as nn

import mlx_moe_fix
from mlx_moe_fix.kernels.moe_routed_decode import CUDA_KERNEL_SWITCH as ROUTED_SWITCH
from mlx_moe_fix.patches import compiled

from .decode_split import per_layer_table, split, switched

# family: (module, block class, the block's ModelArgs fields, the expert width's field); the
# widths are the full-size models' of benchmarks/models.py. The dense MLP is mlx-lm's SwiGLU MLP
# (qwen3's class; llama's, mixtral's dense equivalent, is the same three projections).
FAMILIES = {
    "qwen3_moe": ("mlx_lm.models.qwen3_moe", "Qwen3MoeSparseMoeBlock",
                  dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                       norm_topk_prob=True), "moe_intermediate_size"),
    "mixtral": ("mlx_lm.models.mixtral", "MixtralSparseMoeBlock",
                dict(hidden_size=4096, num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336),
                "intermediate_size"),
}


# mlx-vlm families: the decoder layer's attribute that holds the MoE block (in the dense
# equivalent, the MLP).
VLM_FAMILIES = {"deepseek_v4": "ffn", "inkling": "mlp"}


def quantized(layer: nn.Module) -> nn.Module:
    nn.quantize(layer, group_size=64, bits=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    return layer


def build(family: str, layers: int, scale: int):
    if family in VLM_FAMILIES:
        return build_vlm(family, layers, scale)
    module, block_name, fields, width_field = FAMILIES[family]
    # Scaled widths stay whole 64-wide quantization groups.
    fields = {k: (max(64, v // scale // 64 * 64) if k in ("hidden_size", width_field) else v) for k, v in fields.items()}
    block_class = getattr(importlib.import_module(module), block_name)
    from mlx_lm.models.qwen3 import MLP as mlp_class
    top_k = fields["num_experts_per_tok"]
    args = block_args(module, fields)
    blocks = [quantized(block_class(args)) for _ in range(layers)]
    mlps = [quantized(mlp_class(fields["hidden_size"], top_k * fields[width_field])) for _ in range(layers)]
    return blocks, mlps, fields["hidden_size"]


def build_vlm(family: str, layers: int, scale: int):
    """benchmarks.models' model and dense equivalent (its tiny configs where scale > 1)."""
    from . import models

    specs = models.model_specs(scale > 1, layers)
    attribute = VLM_FAMILIES[family]
    built = [models.build_model(specs[name]) for name in (family, specs[family].dense)]
    blocks, mlps = ([getattr(layer, attribute) for layer in model.layers] for model in built)
    return blocks, mlps, specs[family].config["hidden_size"]


def block_args(module: str, fields: dict):
    """The block's ModelArgs: the class's required fields filled with harmless values."""
    args_class = importlib.import_module(module).ModelArgs
    required = {name: 1 for name, field in args_class.__dataclass_fields__.items()
                if field.default is field.default_factory}  # neither a default nor a factory
    return args_class(**{**required, **fields})


def compiled_steps(blocks) -> list:
    """(block, its compiled decode step) for each block (patches/compiled.py), or [] where steps
    are not compiled."""
    steps = [[v for v in vars(b).get(compiled._ATTRIBUTE, {}).values() if isinstance(v, compiled._Step)] for b in blocks]
    return list(zip(blocks, [found[0] for found in steps])) if all(steps) else []


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted([*FAMILIES, *VLM_FAMILIES]), default="qwen3_moe")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--scale", type=int, default=1, help="divide the hidden and expert widths (to multiples of 64; "
                        "mlx-vlm families: any scale > 1 takes benchmarks.models' tiny configs; CPU smoke)")
    args = parser.parse_args(argv)

    blocks, mlps, hidden = build(args.family, args.layers, args.scale)
    x = mx.random.normal((1, 1, hidden)).astype(mx.bfloat16)
    mx.eval(x)

    def run(layers):
        return lambda: [layer(x) for layer in layers]

    mlx_moe_fix.revert()
    rows = [("MoE block, stock", split(run(blocks), args.reps))]
    with mlx_moe_fix.patched():
        rows.append(("MoE block, patched (decode step compiled where it is)", split(run(blocks), args.reps)))
        steps = compiled_steps(blocks)
        if steps:  # what MLX's replay of the traced graph costs, without the wrapper around it
            rows.append(("the compiled step alone (no wrapper)", split(lambda: [step(block, (x,), {}) for block, step in steps], args.reps)))
            # and MLX's compiled call itself: the steps' captured inputs (each block's children,
            # flattened at every call), one elementwise node instead of the step's tape
            calls = [mx.compile(lambda x: x * 2, inputs=list(block.values())) for block in blocks]
            rows.append(("a compiled x * 2 with each step's captured inputs", split(lambda: [call(x) for call in calls], args.reps)))
        if args.family in FAMILIES:  # mlx-lm's routed blocks; mlx-vlm's keep their own routing
            with switched(ROUTED_SWITCH, "0"):
                rows.append(("MoE block, patched, routing in its own launch", split(run(blocks), args.reps)))
        with switched(compiled.SWITCH, "0"):
            rows.append(("MoE block, patched, built in Python", split(run(blocks), args.reps)))
    rows.append(("dense equivalent's MLP", split(run(mlps), args.reps)))

    print(f"{args.family} block, hidden {hidden}, {args.layers} layers, MLX {mx.__version__}, {mx.default_device()}; "
          f"compiled decode steps: {mlx_moe_fix.status()['compiled_decode_steps']['reason']}")
    print(per_layer_table("layer", rows, args.layers))


if __name__ == "__main__":
    main()
