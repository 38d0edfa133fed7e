"""Bytes each prefill GEMM launch moves from L2 into its blocks, per FLOP, from the kernels'
geometry (no GPU): "count FLOPs and bytes first" for issue 4's cases.

    PYTHONPATH=. python3 docs/experiments/prefill_l2_traffic_model.py
    PYTHONPATH=. python3 docs/experiments/prefill_l2_traffic_model.py --rates qwen3:2048:down=226.3,mixtral:2048:down=279.4
    PYTHONPATH=<tree> python3 docs/experiments/prefill_l2_traffic_model.py   # the geometry of the tree's package

Per case (benchmarks.prefill_ab's shapes, 4-bit g64 bf16, random routing as the benchmarks draw
it, averaged over --draws routings): the tile height and each launch's GEMM as moe_prefill
chooses them on a Hopper GPU (the gate+up on wgmma at 64-row tiles), the tiles the routing fills,
and per block what it copies from global memory: its tile's activation rows (BM x in_dim values
of 2 bytes), its weight rows (block_n per matrix, in_dim / 2 bytes each), their scales and biases
(2 + 2 bytes a group), and what it stores (the live rows' outputs). The gate+up gathers its
tile's live rows of x; the down copies its tile's rows of the hidden whole, padding included. No block shares a copy with
another, so each tile's activations are read once per column block and each expert's weights once
per tile: L2-to-SM bytes, which DRAM serves only once where L2 keeps them. "B/FLOP" counts the
FLOPs of the live rows (as the benchmarks' TFLOP/s do). With --rates (case:part=TFLOP/s, measured
elsewhere, e.g. docs/benchmarks.md), the L2-to-SM bandwidth that rate implies.

Against ncu on an H100 (docs/benchmarks.md, eighty-third stop, item 4): Qwen3 T=2048's down read
1.01 GB of L2 sectors where this counts 0.78 GB of reads, its gate+up 1.12 GB against 0.97.
"""

import argparse
import importlib
import inspect

import mlx.core as mx
import numpy as np

from benchmarks.kernels import random_routing
from benchmarks.prefill_ab import SHAPES

# the module (the package exports the dispatcher under the same name)
prefill = importlib.import_module("mlx_moe_fix.kernels.moe_prefill")
# a tree whose block width also depends on the tile and the matrices (as
# prefill-down-192-columns.patch's) is asked with them
BLOCK_N_BY_TILE = "tile" in inspect.signature(prefill.block_n).parameters
GROUP, BITS, VALUE_BYTES = 64, 4, 2


def expert_rows(tokens: int, experts: int, top_k: int, draws: int) -> list:
    """Per draw, the pairs each expert gets under the benchmarks' random routing."""
    mx.random.seed(0)
    return [np.bincount(np.array(random_routing(tokens, experts, top_k)).ravel(), minlength=experts) for _ in range(draws)]


def launch_bytes(rows: np.ndarray, tile: int, in_dim: int, out_dim: int, gated: bool, gemm: str) -> dict:
    """Bytes one launch's blocks read and write, summed over its blocks."""
    tiles = int(np.ceil(rows / tile).sum())
    columns = prefill.block_n(gemm, in_dim, tile, gated) if BLOCK_N_BY_TILE else prefill.block_n(gemm, in_dim)  # per matrix
    column_blocks = -(-out_dim // columns)
    matrices = 2 if gated else 1
    blocks = tiles * column_blocks
    # the gate+up gathers its tile's live rows of x (padding rows zero-filled, not read); the down
    # copies its tile's rows of the hidden whole, padding included
    activations = column_blocks * (int(rows.sum()) if gated else tiles * tile) * in_dim * VALUE_BYTES
    weights = blocks * matrices * columns * in_dim * BITS // 8
    scales = blocks * matrices * columns * (in_dim // GROUP) * 2 * VALUE_BYTES
    stored = int(rows.sum()) * out_dim * VALUE_BYTES  # live rows only: both GEMMs skip padding rows' stores
    return {"tiles": tiles, "blocks": blocks, "activations": activations, "weights": weights, "scales": scales,
            "stored": stored}


def case_rows(shape: str, tokens: int, draws: int) -> list:
    hidden, ffn, experts, top_k = SHAPES[shape]
    pairs = tokens * top_k
    tile = prefill.tile_height(pairs, experts)
    draws_rows = expert_rows(tokens, experts, top_k, draws)
    # moe_prefill.gemm_kernel's choice on a GPU with wgmma (which it asks the GPU for)
    gate_up_gemm = "grouped_wgmma" if tile >= prefill.WGMMA_MIN_TILE else "grouped"
    parts = {"gate_up": (hidden, ffn, True, gate_up_gemm), "down": (ffn, hidden, False, "grouped")}
    table = []
    for part, (in_dim, out_dim, gated, gemm) in parts.items():
        totals = [launch_bytes(rows, tile, in_dim, out_dim, gated, gemm) for rows in draws_rows]
        mean = {key: float(np.mean([t[key] for t in totals])) for key in totals[0]}
        flops = (2 if gated else 1) * 2 * pairs * in_dim * out_dim
        moved = mean["activations"] + mean["weights"] + mean["scales"] + mean["stored"]
        table.append((f"{shape}:{tokens}", part, gemm, tile, mean["tiles"], mean["blocks"], mean, moved, flops))
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="qwen3:512,qwen3:2048,qwen3:8192,mixtral:512,mixtral:2048,dsv3:512")
    parser.add_argument("--draws", type=int, default=8, help="routings averaged")
    parser.add_argument("--rates", default="", help="case:part=TFLOP/s,... measured rates to turn into L2-to-SM TB/s")
    args = parser.parse_args(argv)
    rates = {}
    for item in filter(None, args.rates.split(",")):
        key, _, value = item.partition("=")
        rates[key] = float(value)
    print("| case | part | GEMM | tile | tiles | blocks | activations GB | weights GB | scales GB | stored GB "
          "| B/FLOP | at the rate given |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape_tokens in args.cases.split(","):
        shape, tokens = shape_tokens.split(":")
        for case, part, gemm, tile, tiles, blocks, mean, moved, flops in case_rows(shape, int(tokens), args.draws):
            rate = rates.get(f"{case}:{part}")
            implied = f"{rate:.1f} TF/s: {moved / (flops / (rate * 1e12)) / 1e12:.2f} TB/s" if rate else "-"
            print(f"| {case} | {part} | {gemm} | {tile} | {tiles:.1f} | {blocks:.0f} | {mean['activations'] / 1e9:.3f} "
                  f"| {mean['weights'] / 1e9:.3f} | {mean['scales'] / 1e9:.3f} | {mean['stored'] / 1e9:.3f} "
                  f"| {moved / flops:.4f} | {implied} |")


if __name__ == "__main__":
    main()
