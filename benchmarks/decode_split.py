"""Where a decode layer's time goes: host graph building vs evaluation, stock vs patched.

    python3 -m benchmarks.decode_split                       # Qwen3-30B-A3B expert shape, 48 layers
    python3 -m benchmarks.decode_split --hidden 4096 --ffn 14336 --experts 8 --top-k 2 --layers 16

One token (batch 1), bf16, 4-bit affine experts with group size 64, one SwitchGLU per layer with
its own weights, all layers in one graph. Per layer: the median host time to build the graph and
the median time of `mx.eval` + synchronize, for stock, the patched layer (on CUDA a compiled
step, and also built in Python at every step, patches/compiled.py) and (on CUDA) the decode
kernel called directly; with the bytes of expert weights one layer must read, for comparison with
HBM bandwidth. Each layer's output is also checked against stock (relative error).
"""

import argparse
import os
import statistics

import mlx.core as mx

import mlx_moe_fix
from mlx_moe_fix.env import switched
from mlx_moe_fix.kernels import current_backend
from mlx_moe_fix.patches import compiled

from .switch_glu import add_shape_arguments, experts_of, quantized_switch_glu
from .timing import build_and_evaluation, relative_error, warm_up

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy on the H200 (baseline-h200.md)


def per_layer_table(first_column: str, rows, layers: int, layer_bytes: int = 0) -> str:
    """rows of (name, (build seconds, eval seconds)) over `layers` layers as a markdown table of
    µs per layer, with the GB/s of eval that reading `layer_bytes` per layer makes, if given."""
    extra = " expert weights GB/s (eval) |" if layer_bytes else ""
    lines = [f"| {first_column} | build us/layer | eval us/layer | total us/layer |{extra}",
             "|---|---|---|---|" + ("---|" if layer_bytes else "")]
    for name, (build, evaluate) in rows:
        bandwidth = f" {layer_bytes * layers / evaluate / 1e9:.0f} |" if layer_bytes else ""
        lines.append(f"| {name} | {build / layers * 1e6:.1f} | {evaluate / layers * 1e6:.1f} | "
                     f"{(build + evaluate) / layers * 1e6:.1f} |{bandwidth}")
    return "\n".join(lines)


def split(fn, reps, warm_ups=3):
    """Median (build seconds, eval seconds) of `reps` runs after `warm_ups` at the same shapes."""
    warm_up(fn, warm_ups)
    phases = [build_and_evaluation(fn) for _ in range(reps)]
    return statistics.median(p[0] for p in phases), statistics.median(p[1] for p in phases)


def profile_build(fn, reps, top):
    """cProfile of building fn's graph (not evaluating it), the `top` functions by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(reps):
        profiler.enable()
        out = fn()
        profiler.disable()
        mx.eval(out)
    print(f"host profile of building the patched graph, {reps} builds:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def empty_launches(decode, x, indices, described, with_header=True):
    """The decode kernel's launches of every layer (same inputs, templates, grids, and header
    unless not `with_header`) with empty kernel bodies: what a launch costs the host and the GPU
    before any work (MLX copies and hashes a kernel's whole source at every call and evaluation,
    so the header's size may count)."""
    from mlx_moe_fix.kernels.launch import absent
    from mlx_moe_fix.kernels.sources import sections

    header = sections("cuda", "moe_decode.cu")["header"] if with_header else ""
    empty = {stage: mx.fast.cuda_kernel(name=f"mlx_moe_fix_empty_{stage}_{len(header)}", input_names=decode.INPUTS[stage],
                                        output_names=decode.OUTPUTS[stage], source="", header=header)
             for stage in decode.INPUTS}
    flat = indices.reshape(-1)
    launches = [decode.decode_launches(e, indices.shape[-1], flat.size, x.dtype, None, "cuda") for e in described]

    def run():
        outs = []
        for gate_up, down in launches:
            hidden = gate_up._replace(kernel=empty["gate_up"])(x, flat)[0]
            outs.append(down._replace(kernel=empty["down"])(hidden, flat, absent())[0])
        return outs

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N functions with the most own host time while building the patched graph")
    args = parser.parse_args(argv)

    layers = [quantized_switch_glu(args) for _ in range(args.layers)]
    x = mx.random.normal((1, args.hidden)).astype(mx.bfloat16)
    indices = mx.random.permutation(args.experts)[: args.top_k].reshape(1, args.top_k).astype(mx.uint32)
    mx.eval(x, indices)

    def run_layers():
        return [layer(x, indices) for layer in layers]

    mlx_moe_fix.revert()
    rows = [("stock SwitchGLU", split(run_layers, args.reps))]
    stock_out = run_layers()
    with mlx_moe_fix.patched():
        rows.append(("patched SwitchGLU", split(run_layers, args.reps)))
        errors = [relative_error(p, s) for p, s in zip(run_layers(), stock_out)]
        if args.profile:
            profile_build(run_layers, args.reps, args.profile)
        with switched(compiled.SWITCH, "0"):
            rows.append(("patched SwitchGLU, each step built in Python (not compiled)", split(run_layers, args.reps)))
            errors += [relative_error(p, s) for p, s in zip(run_layers(), stock_out)]
    if current_backend() == "cuda":
        import importlib

        decode = importlib.import_module("mlx_moe_fix.kernels.moe_decode")
        described = [experts_of(layer) for layer in layers]
        weights = mx.softmax(mx.random.normal(indices.shape), axis=-1).astype(mx.bfloat16)
        rows.append(("decode kernel, direct", split(lambda: [decode.moe_decode_kernel(x, indices, e) for e in described], args.reps)))
        rows.append(("decode kernel + combine, direct",
                     split(lambda: [decode.moe_decode_kernel(x, indices, e, weights) for e in described], args.reps)))
        rows.append(("its two launches with empty bodies (fixed cost)",
                     split(empty_launches(decode, x, indices, described), args.reps)))
        rows.append(("the same without the header (empty sources)",
                     split(empty_launches(decode, x, indices, described, with_header=False), args.reps)))

    layer_bytes = args.top_k * 3 * (args.ffn * args.hidden // 2 + 2 * 2 * args.ffn * args.hidden // 64)
    print(f"hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, top-{args.top_k}, {args.layers} layers, "
          f"MLX {mx.__version__}, {mx.default_device()}, MLX_MOE_FIX_CUDA_DECODE={os.environ.get('MLX_MOE_FIX_CUDA_DECODE', '')!r}")
    print(f"expert weights per layer: {layer_bytes / 1e6:.1f} MB = {layer_bytes / HBM_BYTES_PER_S * 1e6:.1f} us at 4.3 TB/s")
    print(f"patched vs stock, max relative error over layers: {max(errors):.2e}")
    print(per_layer_table("path", rows, args.layers, layer_bytes))


if __name__ == "__main__":
    main()
