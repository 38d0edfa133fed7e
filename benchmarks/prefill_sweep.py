"""The grouped prefill GEMM at each tile height, at prefill and batched-decode shapes, each checked
against the output at the rule's tile height (`moe_prefill.tile_height`, which this sweep sets).

    python3 -m benchmarks.prefill_sweep          # Qwen3 T=512/2048/8192/16/64, Mixtral T=512/2048/16
    python3 -m benchmarks.prefill_sweep --gemms grouped,grouped_wgmma   # mma.sync against wgmma

One SwitchGLU layer (4-bit g64, bf16), gate+up and down GEMMs timed alone: each timed call builds
`--launches` launches of the GEMM into one graph, so that the per-launch time is not dominated by
one `mx.eval` round trip (timing one launch per eval gave identical variants up to 1.7x apart);
median of `--reps` calls after warm-up, divided by the launches. TFLOP/s of useful FLOPs as in
prefill_split; "weights GB/s": the routed experts' packed weights, scales and biases over the two
GEMMs' time (each read once at best), the measure that matters where experts get few rows.
"""

import argparse
import importlib
from types import SimpleNamespace

import mlx.core as mx

# the module, which mlx_moe_fix.kernels shadows with its dispatcher of the same name
prefill = importlib.import_module("mlx_moe_fix.kernels.moe_prefill")

from .kernels import random_routing
from .switch_glu import experts_of, quantized_switch_glu
from .timing import bench, fmt, markdown_table, relative_error, repeated

SHAPES = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2)}
# Prefill shapes, and batched-decode ones (T = 16, 64: few rows per expert).
CASES = [("qwen3", 512), ("qwen3", 2048), ("qwen3", 8192), ("mixtral", 512), ("mixtral", 2048),
         ("qwen3", 16), ("qwen3", 64), ("mixtral", 16)]


def time_tile(x, indices, experts, tile, reps, launches, gemm="grouped"):
    """(gate+up timing, down timing, layer output) of the two GEMMs at one tile height, gate+up on
    `gemm` (moe_prefill.GEMMS; down always on grouped)."""
    pairs, top_k = indices.size, indices.shape[-1]
    row_pair, tile_expert, tiles = prefill.route_kernel(indices.reshape(-1).astype(mx.uint32), experts.num_experts, tile)
    mx.eval(row_pair, tile_expert)
    plan = (row_pair, tile_expert, tiles, tile)
    x = prefill.gemm_rows(x, gemm)
    mx.eval(x)

    def gate_up():
        return prefill.grouped(x, plan, pairs, top_k, experts, "first", gemm)

    hidden = gate_up()
    mx.eval(hidden)

    def down_proj():
        return prefill.grouped(hidden, plan, pairs, top_k, experts, "last")

    out = down_proj()
    mx.eval(out)
    return bench(repeated(gate_up, launches), 3, reps), bench(repeated(down_proj, launches), 3, reps), out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--launches", type=int, default=8, help="GEMM launches per timed graph")
    parser.add_argument("--cases", default=",".join(f"{s}:{t}" for s, t in CASES), help="shape:tokens,...")
    parser.add_argument("--tiles", default=",".join(map(str, prefill.TILES)), help="tile heights to time")
    parser.add_argument("--gemms", default="grouped", help=f"gate+up GEMM kernels to time, of {','.join(prefill.GEMMS)}")
    args = parser.parse_args(argv)
    cases = [(shape, int(tokens)) for shape, tokens in (c.split(":") for c in args.cases.split(","))]
    tiles = [int(t) for t in args.tiles.split(",")]
    if not mx.cuda.is_available():
        raise SystemExit("prefill_sweep times the CUDA kernel: run it on a CUDA GPU")
    gemms = args.gemms.split(",")
    columns = ["case", "gate+up GEMM", "tile", "rule's tile", "gate+up TF/s", "down TF/s", "weights GB/s", "rel err"]
    rows = []
    for shape, tokens in cases:
        hidden, ffn, experts_count, top_k = SHAPES[shape]
        experts = experts_of(quantized_switch_glu(SimpleNamespace(hidden=hidden, ffn=ffn, experts=experts_count)))
        x = (mx.random.normal((tokens, hidden)) * 0.5).astype(mx.bfloat16)
        indices = random_routing(tokens, experts_count, top_k)
        mx.eval(x, indices)
        rule = prefill.tile_height(indices.size, experts_count)
        reference = prefill.moe_prefill_kernel(x, indices, experts)
        flops = 2 * indices.size * hidden * ffn
        routed = len(set(indices.reshape(-1).tolist()))
        weight_bytes = 3 * routed * hidden * ffn * (4 / 8 + 2 * 2 / 64)
        for gemm, tile in ((gemm, tile) for gemm in gemms for tile in tiles):
            gate_up, down, out = time_tile(x, indices, experts, tile, args.reps, args.launches, gemm)
            rows.append([f"{shape} T={tokens}", gemm, tile, "yes" if tile == rule else "",
                         fmt(2 * flops * args.launches / gate_up.median / 1e12),
                         fmt(flops * args.launches / down.median / 1e12),
                         fmt(weight_bytes * args.launches / (gate_up.median + down.median) / 1e9),
                         f"{relative_error(out.reshape(reference.shape), reference):.1e}"])
            print(markdown_table(columns, rows[-1:]), flush=True)
    print(markdown_table(columns, rows))


if __name__ == "__main__":
    main()
