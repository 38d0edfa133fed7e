"""Where a patched SwitchGLU prefill's time goes on CUDA: routing, the two grouped GEMMs, the
combine; with the first launch of the GEMM variants (their NVRTC compile), each stage's first
call at this shape (MLX JIT-compiles some of its own kernels per shape) and stock's sorted
SwitchGLU for comparison.

    python3 -m benchmarks.prefill_split                                  # Qwen3-30B-A3B shape, T=2048
    python3 -m benchmarks.prefill_split --hidden 4096 --ffn 14336 --experts 8 --top-k 2 --tokens 2048

One layer, bf16 activations, 4-bit affine experts (group 64), random routing. Each stage is timed
alone on already-evaluated inputs (medians after warm-up at the same shape); TFLOP/s counts the
useful FLOPs (2 * pairs * in * out per projection), not the padding rows of the tiles.
"""

import argparse
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

import mlx_moe_fix
from mlx_moe_fix.kernels import Activation, ExpertLinear, MoEExperts
from mlx_moe_fix.kernels.moe_prefill import _grouped, route_kernel, route_reference, tile_height
from mlx_moe_fix.kernels.reference import combine

from .kernels import random_routing
from .timing import bench, environment, environment_line, fmt, markdown_table


def first_call(fn) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-stock", action="store_true",
                        help="skip stock SwitchGLU (its first call JIT-compiles for up to ~40 s per shape)")
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("prefill_split times the CUDA kernel stages: run it on a CUDA GPU")

    layer = SwitchGLU(args.hidden, args.ffn, args.experts)
    nn.quantize(layer, group_size=64, bits=4)
    layer.set_dtype(mx.bfloat16)
    x = (mx.random.normal((args.tokens, args.hidden)) * 0.5).astype(mx.bfloat16)
    indices = random_routing(args.tokens, args.experts, args.top_k)
    weights = mx.softmax(mx.random.normal(indices.shape), axis=-1).astype(mx.bfloat16)
    mx.eval(layer.parameters(), x, indices, weights)
    experts = MoEExperts(tuple(ExpertLinear.from_module(layer[n]) for n in ("gate_proj", "up_proj", "down_proj")),
                         Activation("swiglu"))
    gate, up, down = experts.projections
    pairs = indices.size
    tile = tile_height(pairs, args.experts)
    flat = indices.reshape(-1)

    def routing():
        return route_kernel(flat, args.experts, tile)[:2]

    def routing_reference():
        return route_reference(flat, args.experts, tile)[:2]

    compile_seconds = first_call(routing)  # this process's first launch of each kernel: its NVRTC compile
    row_pair, tile_expert, tiles = route_kernel(flat, args.experts, tile)
    mx.eval(row_pair, tile_expert)
    plan = (row_pair, tile_expert, tiles, tile)

    def gate_up():
        return _grouped(x, plan, pairs, args.top_k, (gate, up), experts.activation, None, pairs_in=True, activate=True)

    compile_seconds += first_call(gate_up)
    hidden = gate_up()
    mx.eval(hidden)

    def down_proj():
        return _grouped(hidden, plan, pairs, args.top_k, (down,), None, None, pairs_in=False, activate=False)

    compile_seconds += first_call(down_proj)
    projected = down_proj()
    mx.eval(projected)

    def combined():
        return combine(projected.reshape(*indices.shape, args.hidden), weights)

    def patched_layer():
        return (layer(x, indices) * weights[..., None]).sum(axis=-2)

    stages = [("route kernel", routing, 0), ("route with MLX ops (reference)", routing_reference, 0), ("gate+up GEMM + SwiGLU", gate_up, 2 * 2 * pairs * args.hidden * args.ffn),
              ("down GEMM", down_proj, 2 * pairs * args.hidden * args.ffn), ("combine", combined, 0)]
    rows = []
    for name, fn, flops in stages:
        cold = first_call(fn)
        stats = bench(fn, warmup=3, reps=args.reps)
        rows.append([name, fmt(cold * 1e3), fmt(stats.median * 1e6), fmt(flops / stats.median / 1e12) if flops else "-"])
    total_flops = 3 * 2 * pairs * args.hidden * args.ffn
    layers = [("patched SwitchGLU + combine", lambda: mlx_moe_fix.apply())]
    if not args.no_stock:
        layers.insert(0, ("stock SwitchGLU (sorted) + combine", mlx_moe_fix.revert))
    for name, switch in layers:
        switch()
        cold = first_call(patched_layer)
        stats = bench(patched_layer, warmup=3, reps=args.reps)
        rows.append([name, fmt(cold * 1e3), fmt(stats.median * 1e6), fmt(total_flops / stats.median / 1e12)])
    mlx_moe_fix.revert()

    print(environment_line(environment()))
    print(f"hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, top-{args.top_k}, T={args.tokens}: "
          f"{pairs} pairs, {tile}-row tiles, {tiles} tiles in the grid")
    print(f"first launch of the route kernel and the two GEMM variants (NVRTC compiles included): {compile_seconds:.2f} s")
    print(markdown_table(["stage", "first call ms", "median us", "TFLOP/s"], rows))


if __name__ == "__main__":
    main()
