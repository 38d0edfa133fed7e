"""Experiment: the grouped prefill GEMMs (`grouped`, dequantising through shared memory, and
`grouped_registers`, dequantising in registers) and their knobs (tile height, two-lane
dequantisation) at the shapes of benchmarks/prefill_split.py, each variant checked against the
first variant's output.

    python3 -m benchmarks.prefill_sweep                       # Qwen3 T=512/2048/8192, Mixtral T=512/2048

One SwitchGLU layer (4-bit g64, bf16), gate+up and down GEMMs timed alone (and the routed
experts' weight bytes over their sum, for the batched-decode shapes): each timed call
builds `--launches` launches of the GEMM into one graph, so that the per-launch time is not
dominated by one `mx.eval` round trip (timing one launch per eval gave identical variants up
to 1.7x apart); median of `--reps` calls after warm-up, divided by the launches. TFLOP/s of
useful FLOPs as in prefill_split. "rel err" is the layer output against the first variant's
(`grouped` at the rule's tile height), which the GPU tests check against a float32 oracle.
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
# Prefill shapes, and batched-decode ones (T = 16, 64: few rows per expert, where 16-row tiles read
# each routed expert's weights once and the per-pair decode GEMV reads them once per pair).
CASES = [("qwen3", 512), ("qwen3", 2048), ("qwen3", 8192), ("mixtral", 512), ("mixtral", 2048),
         ("qwen3", 16), ("qwen3", 64), ("mixtral", 16)]
# (GEMM, tile knob, two-lane dequantisation in `grouped`, pipeline stages of `grouped_registers`)
VARIANTS = [("grouped", None, False, 3), ("grouped", None, True, 3), ("registers", None, False, 3),
            ("registers", 32, False, 3), ("registers", 64, False, 3), ("registers", 128, False, 3),
            ("registers", None, False, 4), ("registers", 16, False, 3)]


def run_variant(x, indices, experts, variant, reps, launches):
    gemm, prefill.FIXED_TILE, prefill.HALF2_DEQUANT, prefill.REGISTERS_STAGES = variant
    prefill.REGISTER_DEQUANT = gemm == "registers"
    pairs, top_k = indices.size, indices.shape[-1]
    tile = prefill.tile_height(pairs, experts.num_experts)
    row_pair, tile_expert, tiles = prefill.route_kernel(indices.reshape(-1).astype(mx.uint32), experts.num_experts, tile)
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
    return tile, bench(repeated(gate_up, launches), 3, reps), bench(repeated(down_proj, launches), 3, reps), out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--launches", type=int, default=8, help="GEMM launches per timed graph")
    parser.add_argument("--cases", default=",".join(f"{s}:{t}" for s, t in CASES), help="shape:tokens,...")
    parser.add_argument("--variants", default=",".join(map(str, range(len(VARIANTS)))),
                        help="indices into VARIANTS (the first one given is the error reference)")
    args = parser.parse_args(argv)
    cases = [(shape, int(tokens)) for shape, tokens in (c.split(":") for c in args.cases.split(","))]
    variants = [VARIANTS[int(i)] for i in args.variants.split(",")]
    if not mx.cuda.is_available():
        raise SystemExit("prefill_sweep times the CUDA kernel: run it on a CUDA GPU")
    columns = ["case", "GEMM", "tile knob", "tile", "two-lane", "stages", "gate+up TF/s", "down TF/s",
               "weights GB/s", "rel err"]
    rows = []
    for shape, tokens in cases:
        hidden, ffn, experts_count, top_k = SHAPES[shape]
        experts = experts_of(quantized_switch_glu(SimpleNamespace(hidden=hidden, ffn=ffn, experts=experts_count)))
        x = (mx.random.normal((tokens, hidden)) * 0.5).astype(mx.bfloat16)
        indices = random_routing(tokens, experts_count, top_k)
        mx.eval(x, indices)
        flops = 2 * indices.size * hidden * ffn
        # Bytes of the routed experts' packed weights, scales and biases (each read once at best).
        routed = len(set(indices.reshape(-1).tolist()))
        weight_bytes = 3 * routed * hidden * ffn * (4 / 8 + 2 * 2 / 64)
        reference = None
        for variant in variants:
            tile, gate_up, down, out = run_variant(x, indices, experts, variant, args.reps, args.launches)
            if reference is None:
                reference = out
            error = relative_error(out, reference)
            gemm, fixed, half2, stages = variant
            rows.append([f"{shape} T={tokens}", gemm, "rule" if fixed is None else fixed, tile, half2, stages,
                         fmt(2 * flops * args.launches / gate_up.median / 1e12),
                         fmt(flops * args.launches / down.median / 1e12),
                         fmt(weight_bytes * args.launches / (gate_up.median + down.median) / 1e9), f"{error:.1e}"])
            print(markdown_table(columns, rows[-1:]), flush=True)
    prefill.FIXED_TILE, prefill.HALF2_DEQUANT, prefill.REGISTER_DEQUANT, prefill.REGISTERS_STAGES = None, False, False, 3
    print(markdown_table(columns, rows))


if __name__ == "__main__":
    main()
