"""The CUDA prefill op of another tree against this one's, in one process, rounds alternating.

Timed in two processes, the same kernel on the H200 read up to 26% apart (docs/benchmarks.md,
sixteenth session), more than most kernel changes move it. In one process, with the rounds
alternating which tree goes first, the median of the per-round ratios is the comparison (its
spread over rounds is printed with it): main against itself read 0.993-1.026 (rounds
0.976-1.050), so a median outside about 0.97-1.03 is a change.

    mkdir -p scratch/main && git archive main mlx_moe_fix | tar -x -C scratch/main   # here; carry scratch/
    python3 -m benchmarks.prefill_ab --other scratch/main --cases qwen3:512,qwen3:2048,mixtral:2048

The other tree's package (its Python and its kernel sources together) is imported under another
name, `mlx_moe_fix_other`. Per case: one SwitchGLU layer (4-bit g64, bf16) and random routing,
`moe_prefill_kernel` of each tree with routing weights (routing, gate+up, down, combine);
`--launches` layers per timed graph, median of `--reps` calls, `--rounds` rounds that alternate
which tree goes first. The table gives each tree's TFLOP/s (the layer's useful FLOPs over the
median), the median and range over rounds of the speed ratio (this tree / the other), and
whether both trees' outputs are equal.
"""

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx

from .kernels import random_routing
from .switch_glu import experts_of, quantized_switch_glu
from .timing import bench, fmt, markdown_table, repeated

OTHER = "mlx_moe_fix_other"
SHAPES = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2)}


def load_other(tree: str, into: str):
    """The `kernels` package of the tree at `tree` (a directory holding mlx_moe_fix/), copied
    under `into` and imported as mlx_moe_fix_other."""
    package = Path(tree) / "mlx_moe_fix"
    if not (package / "kernels" / "moe_prefill.py").is_file():
        raise SystemExit(f"{tree} holds no mlx_moe_fix package with kernels/moe_prefill.py")
    shutil.copytree(package, Path(into) / OTHER, ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, into)
    return importlib.import_module(f"{OTHER}.kernels")


def alternating_rounds(calls: dict, rounds: int, seconds) -> tuple:
    """`seconds(call)` of each of calls' "this" and "other" in `rounds` rounds that alternate which
    goes first: (times per name, [median, range] of the per-round ratio this / other in speed)."""
    times = {name: [] for name in calls}
    for r in range(rounds):
        for name in (list(calls) if r % 2 == 0 else list(reversed(calls))):
            times[name].append(seconds(calls[name]))
    ratios = [other / this for this, other in zip(times["this"], times["other"])]
    return times, [f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}-{max(ratios):.3f}"]


def time_case(shape: str, tokens: int, kernels: dict, rounds: int, reps: int, launches: int) -> list:
    hidden, ffn, count, top_k = SHAPES[shape]
    layer = quantized_switch_glu(SimpleNamespace(hidden=hidden, ffn=ffn, experts=count))
    x = (mx.random.normal((tokens, hidden)) * 0.5).astype(mx.bfloat16)
    indices = random_routing(tokens, count, top_k)
    weights = mx.softmax(mx.random.normal(indices.shape), axis=-1).astype(mx.bfloat16)
    mx.eval(x, indices, weights)
    layers = {}
    for name, package in kernels.items():
        prefill = importlib.import_module(f"{package.__name__}.moe_prefill")
        experts = experts_of(layer, package)
        layers[name] = lambda prefill=prefill, experts=experts: prefill.moe_prefill_kernel(x, indices, experts, weights)
    outputs = {name: fn() for name, fn in layers.items()}
    mx.eval(list(outputs.values()))
    times, ratio = alternating_rounds(layers, rounds, lambda layer: bench(repeated(layer, launches), 2, reps).median / launches)
    flops = 3 * 2 * indices.size * hidden * ffn
    return [f"{shape} T={tokens}", *(fmt(flops / statistics.median(times[n]) / 1e12) for n in ("other", "this")), *ratio,
            "yes" if mx.array_equal(outputs["this"], outputs["other"]).item() else "no"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="a directory holding the other tree's mlx_moe_fix/")
    parser.add_argument("--cases", default="qwen3:512,qwen3:2048,mixtral:512,mixtral:2048", help="shape:tokens,...")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--launches", type=int, default=4, help="layers per timed graph")
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("prefill_ab times the CUDA prefill kernels: run it on a CUDA GPU")
    with tempfile.TemporaryDirectory() as into:
        kernels = {"this": importlib.import_module("mlx_moe_fix.kernels"), "other": load_other(args.other, into)}
        columns = ["case", "other TF/s", "this TF/s", "this / other (median)", "range", "same output"]
        rows = []
        for case in args.cases.split(","):
            shape, tokens = case.split(":")
            rows.append(time_case(shape, int(tokens), kernels, args.rounds, args.reps, args.launches))
            print(markdown_table(columns, rows[-1:]), flush=True)
        print(markdown_table(columns, rows))


if __name__ == "__main__":
    main()
