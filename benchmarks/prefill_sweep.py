"""Experiment: the grouped prefill kernel's knobs (tile height, two-lane dequantisation) at the
shapes of benchmarks/prefill_split.py, each variant checked against the default variant's output.

    python3 -m benchmarks.prefill_sweep                       # Qwen3 T=512/2048/8192, Mixtral T=512/2048

One SwitchGLU layer (4-bit g64, bf16), gate+up and down GEMMs timed alone (median of 10 after
warm-up); TFLOP/s of useful FLOPs as in prefill_split. "rel err" is the layer output against the
default variant's (the rule's tile height, fp32 dequantisation), which the GPU tests check
against a float32 oracle.
"""

import argparse

from types import SimpleNamespace

import mlx.core as mx

import importlib

# the module, which mlx_moe_fix.kernels shadows with its dispatcher of the same name
prefill = importlib.import_module("mlx_moe_fix.kernels.moe_prefill")

from .kernels import random_routing
from .switch_glu import experts_of, quantized_switch_glu
from .timing import bench, fmt, markdown_table

SHAPES = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2)}
CASES = [("qwen3", 512), ("qwen3", 2048), ("qwen3", 8192), ("mixtral", 512), ("mixtral", 2048)]
VARIANTS = [(None, False), (None, True), (32, False), (32, True), (64, False), (64, True), (128, False), (128, True)]


def run_variant(x, indices, experts, tile, half2, reps):
    prefill.FIXED_TILE, prefill.HALF2_DEQUANT = tile, half2
    pairs, top_k = indices.size, indices.shape[-1]
    tile = prefill.tile_height(pairs, experts.num_experts)
    row_pair, tile_expert, tiles = prefill.route_kernel(indices.reshape(-1), experts.num_experts, tile)
    mx.eval(row_pair, tile_expert)
    plan = (row_pair, tile_expert, tiles, tile)
    gate, up, down = experts.projections

    def gate_up():
        return prefill._grouped(x, plan, pairs, top_k, (gate, up), experts.activation, None, pairs_in=True, activate=True)

    hidden = gate_up()
    mx.eval(hidden)

    def down_proj():
        return prefill._grouped(hidden, plan, pairs, top_k, (down,), None, None, pairs_in=False, activate=False)

    out = down_proj()
    mx.eval(out)
    return tile, bench(gate_up, 3, reps), bench(down_proj, 3, reps), out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("prefill_sweep times the CUDA kernel: run it on a CUDA GPU")
    rows = []
    for shape, tokens in CASES:
        hidden, ffn, experts_count, top_k = SHAPES[shape]
        experts = experts_of(quantized_switch_glu(SimpleNamespace(hidden=hidden, ffn=ffn, experts=experts_count)))
        x = (mx.random.normal((tokens, hidden)) * 0.5).astype(mx.bfloat16)
        indices = random_routing(tokens, experts_count, top_k)
        mx.eval(x, indices)
        flops = 2 * indices.size * hidden * ffn
        reference = None
        for fixed, half2 in VARIANTS:
            tile, gate_up, down, out = run_variant(x, indices, experts, fixed, half2, args.reps)
            if reference is None:
                reference = out.astype(mx.float32)
            error = (mx.linalg.norm(out.astype(mx.float32) - reference) / mx.linalg.norm(reference)).item()
            rows.append([f"{shape} T={tokens}", "rule" if fixed is None else fixed, tile, half2,
                         fmt(2 * flops / gate_up.median / 1e12), fmt(flops / down.median / 1e12), f"{error:.1e}"])
            print(markdown_table(["case", "tile knob", "tile", "half2", "gate+up TF/s", "down TF/s", "rel err"], rows[-1:]),
                  flush=True)
    prefill.FIXED_TILE, prefill.HALF2_DEQUANT = None, False
    print(markdown_table(["case", "tile knob", "tile", "half2", "gate+up TF/s", "down TF/s", "rel err"], rows))


if __name__ == "__main__":
    main()
