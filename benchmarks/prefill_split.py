"""Where a patched SwitchGLU prefill's time goes on CUDA: routing, the two grouped GEMMs, the
combine (the kernel, and the MLX ops it replaced); with the first launch of the GEMM variants (their NVRTC compile), each stage's first
call at this shape (MLX JIT-compiles some of its own kernels per shape) and stock's sorted
SwitchGLU for comparison.

    python3 -m benchmarks.prefill_split                                  # Qwen3-30B-A3B shape, T=2048
    python3 -m benchmarks.prefill_split --hidden 4096 --ffn 14336 --experts 8 --top-k 2 --tokens 2048
    python3 -m benchmarks.prefill_split --hidden 2880 --ffn 2880 --experts 32 --top-k 4 --mode mxfp4   # gpt-oss-20b

One layer, bf16 activations, 4-bit affine experts (group 64; `--mode mxfp4`: gpt-oss's mxfp4),
random routing. Each stage is timed
alone on already-evaluated inputs, `--launches` copies of it per evaluated graph (medians after
warm-up at the same shape, divided by the copies; 1 times single launches, each with its own
eval round trip); TFLOP/s counts the useful FLOPs (2 * pairs * in * out per projection), not the
padding rows of the tiles.
"""

import argparse
import time

import mlx.core as mx

import mlx_moe_fix
from mlx_moe_fix.kernels.moe_prefill import combine_kernel, grouped, grid_tiles, route_kernel, route_reference, tile_height
from mlx_moe_fix.kernels.reference import combine

from .kernels import random_routing
from .switch_glu import add_shape_arguments, experts_of, quantized_switch_glu
from .timing import bench, environment, environment_line, fmt, markdown_table, repeated


def first_call(fn):
    """(seconds, output) of one call, evaluated."""
    start = time.perf_counter()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    return time.perf_counter() - start, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--mode", choices=("affine", "mxfp4"), default="affine",
                        help="the experts' quantization: affine 4-bit g64, or mxfp4 (gpt-oss's)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--launches", type=int, default=8, help="copies of a stage per timed graph")
    parser.add_argument("--no-stock", action="store_true",
                        help="skip stock SwitchGLU (its first call JIT-compiles for up to ~40 s per shape)")
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("prefill_split times the CUDA kernel stages: run it on a CUDA GPU")

    layer = quantized_switch_glu(args)
    x = (mx.random.normal((args.tokens, args.hidden)) * 0.5).astype(mx.bfloat16)
    indices = random_routing(args.tokens, args.experts, args.top_k)
    weights = mx.softmax(mx.random.normal(indices.shape), axis=-1).astype(mx.bfloat16)
    mx.eval(x, indices, weights)
    experts = experts_of(layer)
    pairs = indices.size
    tile = tile_height(pairs, args.experts)
    flat = indices.reshape(-1)

    def routing():
        return route_kernel(flat, args.experts, tile)[:2]

    def routing_reference():
        return route_reference(flat, args.experts, tile)[:2]

    # This process's first launch of each kernel: its NVRTC compile.
    compile_seconds, (row_pair, tile_expert) = first_call(routing)
    tiles = grid_tiles(pairs, args.experts, tile)
    plan = (row_pair, tile_expert, tiles, tile)

    def gate_up():
        return grouped(x, plan, pairs, args.top_k, experts, "first")

    seconds, hidden = first_call(gate_up)
    compile_seconds += seconds

    def down_proj():
        return grouped(hidden, plan, pairs, args.top_k, experts, "last")

    seconds, projected = first_call(down_proj)
    compile_seconds += seconds

    def combined():
        return combine_kernel(projected, weights)

    def combined_reference():
        return combine(projected.reshape(*indices.shape, args.hidden), weights)

    def stock_layer():
        return (layer(x, indices) * weights[..., None]).sum(axis=-2)

    def patched_layer():  # weights= as the patched MoE blocks pass them: the combine is the op's
        return layer(x, indices, weights=weights)

    stages = [("route kernel", routing, 0), ("route with MLX ops (reference)", routing_reference, 0), ("gate+up GEMM + SwiGLU", gate_up, 2 * 2 * pairs * args.hidden * args.ffn),
              ("down GEMM", down_proj, 2 * pairs * args.hidden * args.ffn), ("combine kernel", combined, 0),
              ("combine with MLX ops (reference)", combined_reference, 0)]
    rows = []
    for name, fn, flops in stages:
        cold, _ = first_call(fn)
        seconds = bench(repeated(fn, args.launches), warmup=3, reps=args.reps).median / args.launches
        rows.append([name, fmt(cold * 1e3), fmt(seconds * 1e6), fmt(flops / seconds / 1e12) if flops else "-"])
    total_flops = 3 * 2 * pairs * args.hidden * args.ffn
    layers = [("patched SwitchGLU + combine", mlx_moe_fix.apply, patched_layer)]
    if not args.no_stock:
        layers.insert(0, ("stock SwitchGLU (sorted) + combine", mlx_moe_fix.revert, stock_layer))
    for name, switch, fn in layers:
        switch()
        cold, _ = first_call(fn)
        seconds = bench(repeated(fn, args.launches), warmup=3, reps=args.reps).median / args.launches
        rows.append([name, fmt(cold * 1e3), fmt(seconds * 1e6), fmt(total_flops / seconds / 1e12)])
    mlx_moe_fix.revert()

    print(environment_line(environment()))
    print(f"{args.mode} experts, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, top-{args.top_k}, T={args.tokens}: "
          f"{pairs} pairs, {tile}-row tiles, {tiles} tiles in the grid")
    print(f"first launch of the route kernel and the two GEMM variants (NVRTC compiles included): {compile_seconds:.2f} s")
    print(f"{args.launches} launches per timed graph")
    print(markdown_table(["stage", "first call ms", "median us per launch", "TFLOP/s"], rows))


if __name__ == "__main__":
    main()
