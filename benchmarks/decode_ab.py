"""The CUDA routed decode op (moe_routed_decode: routing, gate+up, down and combine, two launches)
of another tree against this one's, in one process, rounds alternating: prefill_ab's method at
decode (one token), where the figure is the expert weights' bandwidth.

    mkdir -p scratch/main && git archive main mlx_moe_fix | tar -x -C scratch/main   # here; carry scratch/
    python3 -m benchmarks.decode_ab --other scratch/main --shapes qwen3,mixtral
    python3 -m benchmarks.decode_ab --other scratch/main --rows-per-warp 2          # this tree's rows a warp

Per shape: --layers distinct SwitchGLU layers (4-bit g64, bf16 random weights, so that no layer's
experts are still in L2 when it runs: Qwen3's 8 routed experts are 20 MB, the H200's L2 50 MB),
each with its own token and router logits; one timed graph runs every layer's op, as a decode
step does (issue 5 measures bandwidth "with many layers in one graph"). The time is the graph's
evaluation (a call's median less its build's median: building 16 layers' eager kernel calls in
Python takes longer than Qwen3's kernels run), per layer. GB/s counts the packed weights, scales
and biases of each layer's distinct routed experts over it; the table also gives the median and
range over rounds of the speed ratio (this tree / the other) and whether both trees' outputs are
equal, and where they are not (a tree that sums in another order), their largest difference
against the largest output.
"""

import argparse
import importlib
import statistics
import tempfile
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from . import block_shapes
from .prefill_ab import SHAPES, alternating_rounds, load_other
from .switch_glu import experts_of, quantized_switch_glu
from .timing import bench, fmt, markdown_table

# The models' routings at these shapes (moe_blocks.py): Qwen3's softmax, top 8, renormalised;
# Mixtral's top 2 logits, softmax over them.
ROUTINGS = {"qwen3": ("softmax_topk", True), "mixtral": ("topk_softmax", False)}


def expert_bytes(layer, indices: mx.array) -> int:
    """Bytes of the distinct experts `indices` routes to, over the layer's three projections."""
    projections = [layer[name] for name in ("gate_proj", "up_proj", "down_proj")]
    per_expert = sum((p.weight.nbytes + p.scales.nbytes + p.biases.nbytes) // p.weight.shape[0] for p in projections)
    return per_expert * np.unique(np.array(indices)).size


def shape_routing(shape: str, package):
    """The shape's router (ROUTINGS) as `package`'s Routing: each tree's own class."""
    kind, normalize = ROUTINGS[shape]
    return package.Routing(kind, SHAPES[shape][3], normalize)


def routed_layers(shape: str, layers: int, package, bits: int = 4) -> tuple:
    """(`layers` random SwitchGLU layers of the shape, a token's router logits for each, the
    shape's routing as `package`'s Routing, the bytes of a layer's routed experts on average)."""
    hidden, ffn, count, _ = SHAPES[shape]
    built = [quantized_switch_glu(SimpleNamespace(hidden=hidden, ffn=ffn, experts=count, bits=bits)) for _ in range(layers)]
    logits = [mx.random.normal((1, count)).astype(mx.bfloat16) for _ in built]
    mx.eval(logits)
    routing = shape_routing(shape, package)
    per_layer_bytes = sum(expert_bytes(layer, package.moe_router_reference(lg, routing)[0]) for layer, lg in zip(built, logits)) / layers
    return built, logits, routing, per_layer_bytes


def time_shape(shape: str, kernels: dict, layers: int, rounds: int, reps: int, bits: int = 4) -> list:
    hidden = SHAPES[shape][0]
    built, logits, _, per_layer_bytes = routed_layers(shape, layers, kernels["this"], bits)
    xs = [(mx.random.normal((1, hidden)) * 0.5).astype(mx.bfloat16) for _ in built]
    mx.eval(xs)
    calls = {}
    for name, package in kernels.items():
        routed = importlib.import_module(f"{package.__name__}.moe_routed_decode")
        routing = shape_routing(shape, package)
        per_layer = [experts_of(layer, package) for layer in built]
        calls[name] = lambda routed=routed, routing=routing, per_layer=per_layer: [
            routed.moe_routed_decode_kernel(x, lg, routing, experts) for x, lg, experts in zip(xs, logits, per_layer)]
    outputs = {name: call() for name, call in calls.items()}
    mx.eval(list(outputs.values()))

    def evaluation(call):
        stats = bench(call, 3, reps)
        return (stats.median - stats.build_median) / layers

    times, ratio = alternating_rounds(calls, rounds, evaluation)
    same = all(mx.array_equal(a, b).item() for a, b in zip(outputs["this"], outputs["other"]))
    # a tree that sums in another order differs by rounding: how much
    difference = max((mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max() / mx.abs(b.astype(mx.float32)).max()).item()
                     for a, b in zip(outputs["this"], outputs["other"]))
    return [shape, f"{per_layer_bytes / 1e6:.1f}",
            *(f"{statistics.median(times[n]) * 1e6:.1f} ({fmt(per_layer_bytes / statistics.median(times[n]) / 1e9)})"
              for n in ("other", "this")),
            *ratio, "yes" if same else f"no (max |Δ| {difference:.1e} of max |out|)"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="a directory holding the other tree's mlx_moe_fix/")
    parser.add_argument("--shapes", default="qwen3,mixtral")
    parser.add_argument("--layers", type=int, default=16, help="distinct layers in the timed graph")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8), help="the experts' quantization bits")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rows-per-warp", type=int,
                        help="rows a warp of this tree's gate+up and plain down (moe_decode.GATE_UP_BLOCK, DOWN_BLOCK)")
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("decode_ab times the CUDA decode kernels: run it on a CUDA GPU")
    with tempfile.TemporaryDirectory() as into:
        kernels = {"this": importlib.import_module("mlx_moe_fix.kernels"), "other": load_other(args.other, into)}
        shapes = block_shapes.varied(rows=args.rows_per_warp) if args.rows_per_warp else {}
        columns = ["shape", "MB a layer", "other µs (GB/s)", "this µs (GB/s)", "this / other (median)", "range", "same output"]
        rows = []
        for shape in args.shapes.split(","):
            with block_shapes.block_shapes(shapes):
                rows.append(time_shape(shape, kernels, args.layers, args.rounds, args.reps, args.bits))
            print(markdown_table(columns, rows[-1:]), flush=True)
        print(markdown_table(columns, rows))


if __name__ == "__main__":
    main()
