"""The CUDA prefill op of another tree against this one's, in one process, rounds alternating.

Timed in two processes, the same kernel on the H200 read up to 26% apart (docs/benchmarks.md,
sixteenth session), more than most kernel changes move it. In one process, with the rounds
alternating which tree goes first, the median of the per-round ratios is the comparison (its
spread over rounds is printed with it): main against itself read 0.993-1.026 (rounds
0.976-1.050), so a median outside about 0.97-1.03 is a change on that machine. Across machines it
may not be: the same pair of trees read 0.932 on one H100 and 1.011 on another at one case, 1.044
and 0.955 at another, each tight over its rounds (docs/benchmarks.md, seventy-ninth stop): repeat
a small effect on a second machine before keeping it.

    mkdir -p scratch/main && git archive main mlx_moe_fix | tar -x -C scratch/main   # here; carry scratch/
    python3 -m benchmarks.prefill_ab --other scratch/main --cases qwen3:512,qwen3:2048,mixtral:2048

The other tree's package (its Python and its kernel sources together) is imported under another
name, `mlx_moe_fix_other`. Per case: one SwitchGLU layer (4-bit g64, bf16) and random routing
(`--routing balanced`: every expert the same number of pairs, so that at Qwen3-30B-A3B's T=2048
no expert's run ends in a partial tile: the padding's share of the time; docs/benchmarks.md,
sixty-eighth stop),
`moe_prefill_kernel` of each tree with routing weights (routing, gate+up, down, combine), and
with `--parts`, its gate+up or down GEMM launch alone (each tree's own routing and GEMM choice,
computed once a case); `--launches` layers (or launches) per timed graph, median of `--reps`
calls, `--rounds` rounds that alternate which tree goes first; the launches of a graph side by side,
or with `--in-sequence` each after the previous one's output, its routing too (as a model's router
reads the layer's input, so the route launch waits for it). The table gives each tree's TFLOP/s (the layer's useful FLOPs over the
median), the median and range over rounds of the speed ratio (this tree / the other), and
whether both trees' outputs are equal (else their relative difference).
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

from .kernels import balanced_routing, random_routing
from .switch_glu import experts_of, quantized_switch_glu
from .timing import after, bench, fmt, in_sequence, markdown_table, relative_error, repeated

OTHER = "mlx_moe_fix_other"
# (hidden, intermediate, experts, top-k). q3f1536 / q3f3072 / q3h4096: Qwen3-30B-A3B with a wider
# intermediate (the down's K) or hidden (gate+up's K), for how the rates move with the k-loop's
# length over the same tiles (docs/benchmarks.md, sixty-eighth and seventieth stops). dsv3:
# DeepSeek-V3's routed experts (256 of 2048 x 7168, top-8), where a few hundred tokens give each
# expert a few rows and every expert's weights are read: the GEMMs bound by HBM, not the tensor cores.
SHAPES = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2),
          "q3f1536": (2048, 1536, 128, 8), "q3f3072": (2048, 3072, 128, 8), "q3h4096": (4096, 768, 128, 8),
          "dsv3": (7168, 2048, 256, 8)}


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


PARTS = ("layer", "gate_up", "down")


def part_flops(part: str, shape: str, pairs: int) -> int:
    """The useful FLOPs of one launch of `part` (PARTS) on `pairs` (token, expert) pairs of `shape`:
    2 x pairs x hidden x intermediate per projection, padding rows not counted."""
    hidden, ffn = SHAPES[shape][:2]
    return {"layer": 3, "gate_up": 2, "down": 1}[part] * 2 * pairs * hidden * ffn


def in_pair_order(rows: mx.array, row_pair: mx.array, pairs: int) -> mx.array:
    """The rows of an expert-sorted launch's output (row r holds pair row_pair[r], -1: padding) in
    pair order: two trees' route kernels may place an expert's rows in different orders."""
    return rows[mx.argsort(mx.where(row_pair >= 0, row_pair, pairs))[:pairs]]


def in_natural_columns(rows: mx.array, k_order) -> mx.array:
    """`rows` written in the column order `k_order` gives (moe_prefill.wgmma_k_order: the gate+up
    on wgmma for a down on wgmma), with their columns back in their own order."""
    return rows[:, mx.argsort(k_order(mx.arange(rows.shape[1])[None])[0])]


def part_calls(prefill, experts, x, indices, weights) -> dict:
    """Per part (PARTS), a call of this tree's kernels on the case, and what its output is compared
    on: the whole layer; gate+up's launch (its rows in pair order: the route kernel places an
    expert's rows in atomic order, and neither tree writes the padding rows); the down launch on
    the gate+up's rows. Each call takes an optional array its launch must follow
    (timing.in_sequence): the layer's routing too, as a model's router reads the layer's input."""
    top_k, pairs = indices.shape[-1], indices.size
    tile = prefill.tile_height(pairs, experts.num_experts)
    routing = (*prefill.route_kernel(indices.reshape(-1).astype(mx.uint32), experts.num_experts, tile), tile)
    first = prefill.gemm_kernel(experts, "first", tile)
    rows = prefill.gemm_rows(x, first)
    mx.eval(routing[:2], rows)
    hidden = prefill.grouped(rows, routing, pairs, top_k, experts, "first", first)
    last = prefill.gemm_kernel(experts, "last", tile)
    # (a tree from before the down on wgmma has no k_ordered_hidden: its gate+up writes plain rows)
    k_ordered = getattr(prefill, "k_ordered_hidden", lambda *_: False)(first, last)
    if not k_ordered:
        hidden = prefill.gemm_rows(hidden, last)
    mx.eval(hidden)
    return {
        "layer": (lambda dependency=None: prefill.moe_prefill_kernel(after(x, dependency), after(indices, dependency),
                                                                     experts, weights),
                  lambda out: out),
        "gate_up": (lambda dependency=None: prefill.grouped(after(rows, dependency), routing, pairs, top_k, experts, "first",
                                                            first),
                    lambda out: in_pair_order(in_natural_columns(out, prefill.wgmma_k_order) if k_ordered else out,
                                              routing[0], pairs)),
        "down": (lambda dependency=None: prefill.grouped(after(hidden, dependency), routing, pairs, top_k, experts, "last", last),
                 lambda out: out),
    }


def same_output(this: mx.array, other: mx.array) -> str:
    """"yes" where the trees' outputs are equal, else their relative difference (trees that sum in
    other orders)."""
    return "yes" if mx.array_equal(this, other).item() else f"no ({relative_error(this, other):.1e})"


ROUTINGS = {"random": random_routing, "balanced": balanced_routing}


def build_case(shape: str, tokens: int, routing: str = "random") -> tuple:
    """(one random quantized SwitchGLU layer of the shape, x [tokens, hidden], the indices of its
    `routing` (ROUTINGS) and random weights), evaluated."""
    hidden, ffn, count, top_k = SHAPES[shape]
    layer = quantized_switch_glu(SimpleNamespace(hidden=hidden, ffn=ffn, experts=count))
    x = (mx.random.normal((tokens, hidden)) * 0.5).astype(mx.bfloat16)
    indices = ROUTINGS[routing](tokens, count, top_k)
    weights = mx.softmax(mx.random.normal(indices.shape), axis=-1).astype(mx.bfloat16)
    mx.eval(x, indices, weights)
    return layer, x, indices, weights


def time_case(shape: str, tokens: int, kernels: dict, rounds: int, reps: int, launches: int, parts=("layer",),
              routing: str = "random", order=repeated):
    """A table row per part (PARTS) of one case, as each is timed; the case is built once."""
    layer, x, indices, weights = build_case(shape, tokens, routing)
    trees = {name: part_calls(importlib.import_module(f"{package.__name__}.moe_prefill"), experts_of(layer, package),
                              x, indices, weights)
             for name, package in kernels.items()}
    for part in parts:
        calls = {name: tree[part][0] for name, tree in trees.items()}
        outputs = {name: trees[name][part][1](call()) for name, call in calls.items()}
        mx.eval(list(outputs.values()))
        times, ratio = alternating_rounds(calls, rounds, lambda call: bench(order(call, launches), 2, reps).median / launches)
        flops = part_flops(part, shape, indices.size)
        yield [f"{shape} T={tokens}", part, *(fmt(flops / statistics.median(times[n]) / 1e12) for n in ("other", "this")),
               *ratio, same_output(outputs["this"], outputs["other"])]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="a directory holding the other tree's mlx_moe_fix/")
    parser.add_argument("--cases", default="qwen3:512,qwen3:2048,mixtral:512,mixtral:2048", help="shape:tokens,...")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--launches", type=int, default=4, help="layers (or launches) per timed graph")
    parser.add_argument("--parts", default="layer", help=f"what to time, of {','.join(PARTS)}")
    parser.add_argument("--routing", choices=tuple(ROUTINGS), default="random",
                        help="random: top-k distinct experts a token uniformly at random; balanced: every expert the "
                             "same number of pairs (no partial tiles where tokens x top-k / experts is a multiple of the "
                             "tile), to tell the padding's cost from the GEMM's")
    parser.add_argument("--in-sequence", action="store_true",
                        help="each launch of a graph after the previous one's output (its routing too), as a model's "
                             "layers run; else side by side")
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("prefill_ab times the CUDA prefill kernels: run it on a CUDA GPU")
    with tempfile.TemporaryDirectory() as into:
        kernels = {"this": importlib.import_module("mlx_moe_fix.kernels"), "other": load_other(args.other, into)}
        columns = ["case", "part", "other TF/s", "this TF/s", "this / other (median)", "range", "same output"]
        rows = []
        for case in args.cases.split(","):
            shape, tokens = case.split(":")
            for row in time_case(shape, int(tokens), kernels, args.rounds, args.reps, args.launches, args.parts.split(","),
                                 args.routing, in_sequence if args.in_sequence else repeated):
                rows.append(row)
                print(markdown_table(columns, rows[-1:]), flush=True)
        print(markdown_table(columns, rows))


if __name__ == "__main__":
    main()
