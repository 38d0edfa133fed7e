"""Sorted grouped prefill: many (token, expert) pairs.

Reference: the pairs sorted by expert so that each expert's rows are contiguous, every
projection one grouped matmul over the sorted rows (stock's sorted `gather_qmm`), then unsorted
and combined.

CUDA kernel (`cuda/moe_prefill.cu`), on by default (MLX_MOE_FIX_CUDA_PREFILL=0 turns it off)
since its greedy tokens match stock on every GPU parity model: routing in one launch (per-expert counts, each expert's run padded to the tile
height, a tile -> expert map; the grid sized for the worst case, so no host synchronisation;
`route_reference` does the same with MLX ops), then two launches of one grouped tensor-core
GEMM: gate+up with the activation in the epilogue into expert-sorted padded rows (on wgmma, its
activation rows permuted first: `gemm_rows`), and down
written back per (token, expert) pair; then, given routing weights, one launch of their
weighted sum over each token's pairs.

The GEMM dequantises the weights in registers (no dequantised copy anywhere): affine 4- / 8-bit,
or mxfp4 / nvfp4 against bf16 activations; its tile height
follows the mean rows per expert (`tile_height`). It is mma.sync's (`grouped`), but for the gate+up
launch of 4-bit experts at 64-row tiles, which takes Hopper's warpgroup MMA (`grouped_wgmma`,
`gemm_kernel`).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..env import flag
from .backend import Implementation, choose, compute_capability
from .experts import FP4_GROUP_SIZES, MoEExperts
from .launch import (ACTIVATION_CODES, Launch, bias_template, cuda_kernel_object, fp4_activations_reason, int_array, kernel_dims,
                     kernel_params, or_absent, per_pair, quantized_experts_reason)
from .reference import combine, expert_chain

# Tile heights (BM in cuda/moe_prefill.cu) and the mean rows per expert from which each pays
# (benchmarks/prefill_sweep.py on the H200, docs/benchmarks.md): short tiles waste less on
# padding where experts get few rows, 64-row tiles share each dequantised weight over more rows.
TILES = (16, 32, 64)
TILE_MIN_MEAN_ROWS = (0, 8, 32)
BLOCK_N = 128  # output columns per block (per matrix)
BLOCK_K = 64
PIPELINE_STAGES = 3
SHARED_ROW = BLOCK_K  # elements per shared-memory row of activations (LDS; swizzled, not padded)
CUDA_KERNEL_SWITCH = "MLX_MOE_FIX_CUDA_PREFILL"
# The kernel's parameters, in the order of its `inputs`.
GROUPED_INPUTS = ["a", "row_pair", "tile_expert", "w0", "s0", "b0", "w1", "s1", "b1", "bias0", "bias1", "scale", "dims",
                  "params"]
INPUTS = {"grouped": GROUPED_INPUTS, "grouped_wgmma": GROUPED_INPUTS, "route": ["indices", "sizes"],
          "k_order": ["rows", "sizes"], "combine": ["rows", "weights", "sizes"]}
OUTPUTS = {"grouped": ["out"], "grouped_wgmma": ["out"], "route": ["row_pair", "tile_expert"], "k_order": ["out"],
           "combine": ["out"]}
# The GEMM kernels: mma.sync, every launch; Hopper's warpgroup MMA (sm_90a), the gated first
# launch (gate+up) of 4-bit experts, its activation rows in wgmma_k_order (gemm_kernel).
GEMMS = ("grouped", "grouped_wgmma")
WGMMA_SWITCH = "MLX_MOE_FIX_CUDA_PREFILL_WGMMA"
WGMMA_STAGES = 5
# grouped_wgmma's activation stages start on a multiple of its swizzle pattern's 1024 bytes
WGMMA_SWIZZLE_BYTES = 1024
# grouped_wgmma's block: RBN weight rows a matrix, a warpgroup (128 threads) for each 64; 256 rows
# where the k-loop is WGMMA_WIDE_MIN_K deep or more, else 128 (wgmma_block_rows).
WGMMA_WIDE_MIN_K = 4096
# wgmma takes tiles of WGMMA_MIN_TILE rows or more; where the gate+up's input is WGMMA_WIDE_MIN_K
# wide or more, the down's of WGMMA_WIDE_MIN_TILE and the gate+up's of every height (wgmma_min_tile)
WGMMA_MIN_TILE = 64
WGMMA_WIDE_MIN_TILE = 32
COMBINE_THREADS = 256
K_ORDER_THREADS = 256
ROUTE_THREADS = 1024
ROUTE_MAX_EXPERTS = ROUTE_THREADS  # the route kernel's shared arrays; its scan takes a thread an expert
ROUTE_PAIRS_PER_BLOCK = 1024  # each route block counts every pair and scatters this many
MAX_GRID_TILES = 65535  # the grouped GEMM's grid has one y index per tile
MAX_OFFSET = 2**32  # the grouped GEMM addresses its activation rows with 32-bit offsets
QUANTIZATION_MODES = ("affine", *FP4_GROUP_SIZES)


def moe_prefill_reference(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """x: [..., D], indices: [..., k]; returns [..., k, out], or [..., out] weighted by
    `weights` [..., k]."""
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    inverse = mx.argsort(order)
    rows = x.reshape(-1, 1, x.shape[-1])[order // k]
    y = expert_chain(rows, flat[order], experts, sorted_indices=True)
    y = y[inverse].reshape(*indices.shape, experts.output_dims)
    return combine(y, weights)


def shared_bytes(tile: int, gated: bool, bits: int, gemm: str = "grouped", in_dim: int = 0) -> int:
    """The grouped GEMM's dynamic shared memory: per pipeline stage, activation rows and packed
    weight rows."""
    weights = (2 if gated else 1) * block_n(gemm, in_dim) * BLOCK_K * bits // 8
    if gemm == "grouped_wgmma":
        return WGMMA_STAGES * (tile * BLOCK_K * 2 + weights) + WGMMA_SWIZZLE_BYTES
    return PIPELINE_STAGES * (tile * SHARED_ROW * 2 + weights)


def wgmma_block_rows(in_dim: int) -> int:
    """grouped_wgmma's weight rows a block (RBN) for a k-loop over `in_dim`. 256 copy a tile's
    activations once for twice the weights (the GEMM is bound by its copies); 128 leave two blocks
    an SM, one's prologue and output stores beside the other's k-loop, which counts where the loop is
    short. On the H200 (docs/benchmarks.md, sixty-seventh stop), both with scale windows, against
    the 128-row block without them: Mixtral's gate+up (K 4096) 1.11-1.15x at 256 rows, 1.07-1.10x
    at 128; Qwen3-30B-A3B's (K 2048) 0.92-0.98x at 256, 0.99-1.01x at 128."""
    return 256 if in_dim >= WGMMA_WIDE_MIN_K else 128


def block_n(gemm: str = "grouped", in_dim: int = 0) -> int:
    """Output columns per block (per matrix) of `gemm` over `in_dim` (grouped's do not depend on it)."""
    return wgmma_block_rows(in_dim) if gemm == "grouped_wgmma" else BLOCK_N


def threads(tile: int, gemm: str = "grouped", in_dim: int = 0) -> int:
    """mma.sync: warps of 64 (or `tile`) rows x 32 columns, four across the block's 128 columns;
    wgmma: a warpgroup for each 64 columns."""
    return 2 * block_n(gemm, in_dim) if gemm == "grouped_wgmma" else max(tile // 64, 1) * 4 * 32


def wgmma_device() -> bool:
    """Whether the GPU has wgmma: compute capability 9.0 (Hopper: the instruction is sm_90a's;
    neither earlier GPUs nor Blackwell have it)."""
    return compute_capability() == (9, 0)


def wgmma_unavailable_reason() -> Optional[str]:
    """Why no launch takes grouped_wgmma here (its switch off, or a GPU without wgmma), or None."""
    if not flag(WGMMA_SWITCH):
        return f"{WGMMA_SWITCH}=0"
    if not wgmma_device():
        return "this GPU has no wgmma (compute capability 9.0 only)"
    return None


def gemm_state() -> dict:
    """For status(): the GEMM the CUDA prefill kernel's gate+up and down launches take here, and why."""
    if moe_prefill_implementation().path != "kernel" or not mx.cuda.is_available():
        return {"gemm": None, "reason": "the CUDA prefill kernel does not run here"}
    unavailable = wgmma_unavailable_reason()
    if unavailable is not None:
        return {"gemm": "grouped", "reason": f"mma.sync: {unavailable}"}
    return {"gemm": "grouped_wgmma", "reason": f"wgmma for the gate+up and down of gated 4-bit experts at tiles of "
            f"{WGMMA_MIN_TILE} rows or more (where their input is {WGMMA_WIDE_MIN_K} wide or more: the down's of "
            f"{WGMMA_WIDE_MIN_TILE}, the gate+up's of any height); mma.sync for the other launches"}


def wgmma_min_tile(experts: MoEExperts, stage: str) -> int:
    """The smallest tile height whose launch `stage` ("first": the gate+up, "last": the down) takes
    wgmma: where the gate+up's input is WGMMA_WIDE_MIN_K wide or more, any height for the gate+up
    and WGMMA_WIDE_MIN_TILE for the down; elsewhere WGMMA_MIN_TILE for both. On H100s, in one
    process: 32-row tiles made a layer 1.22-1.25x at DeepSeek-V3's shapes (7168 wide) at 256 / 512
    tokens and 1.19x at Mixtral's (4096) at 64 tokens, level at Mixtral's 128, but 0.96x at Qwen3's
    (2048) at 256 tokens (eighty-ninth stop); at 16-row tiles the gate+up on wgmma made a layer
    2.7-3.2x at DeepSeek-V3's 16-128 tokens, 2.1x at 4096 x 768 experts' 32 and 1.8-2.1x at
    Mixtral's 8 / 16, but 0.97-1.03x at Qwen3's 8-64, and the down on wgmma ran 0.92-0.95x at
    DeepSeek-V3's and Mixtral's (ninetieth stop)."""
    if experts.input_dims < WGMMA_WIDE_MIN_K:
        return WGMMA_MIN_TILE
    return TILES[0] if stage == "first" else WGMMA_WIDE_MIN_TILE


def gemm_kernel(experts: MoEExperts, stage: str, tile: int) -> str:
    """The GEMM (GEMMS) of `stage` at tile height `tile`: grouped_wgmma for the gated first launch
    (gate+up) and the last (down) of gated experts whose projection is 4-bit, at tiles of
    wgmma_min_tile rows or more on a GPU with wgmma, where its switch is on (the default), else
    grouped. On the H200 (docs/benchmarks.md, fifteenth session) wgmma's gate+up ran at Qwen3's
    shapes 203 against 185 TFLOP/s (2048 tokens) and 254 against 235 (8192), level at 512 tokens
    and on Mixtral's shapes, and slower on Qwen3's 16-row tiles. Its down ran slower than grouped's
    (fifteenth session; sixty-eighth stop, item 5) until its activation stages took the 128-byte
    swizzle (eighty-seventh stop): on an H100 Qwen3 T=2048's down 274-290 against 238-243 TF/s."""
    projection = experts.projections[-1 if stage == "last" else 0]
    wgmma = (stage in ("first", "last") and len(experts.projections) == 3 and projection.bits == 4
             and tile >= wgmma_min_tile(experts, stage) and wgmma_unavailable_reason() is None)
    return "grouped_wgmma" if wgmma else "grouped"


# Activation rows of at least this many values take the k_order launch, fewer MLX's transpose. On
# the H200 (docs/benchmarks.md, seventy-second stop) the launch ran the layer 1.03-1.07x at Qwen3's
# 2048 x 2048 and 8192 x 2048 rows, level at 1024 x 2048 and Mixtral's 512 x 4096, and 0.97x
# (twice) at Qwen3's 512 x 2048.
K_ORDER_KERNEL_MIN_VALUES = 1024 * 2048


def k_ordered_hidden(first: str, last: str) -> bool:
    """Whether the gate+up launch on GEMM `first` writes its rows in wgmma_k_order (its
    K_ORDER_OUT) for the down launch on GEMM `last`: both on grouped_wgmma."""
    return first == last == "grouped_wgmma"


def gemm_rows(rows: mx.array, gemm: str) -> mx.array:
    """The activation rows as the GEMM `gemm` reads them: grouped_wgmma's in wgmma_k_order."""
    if gemm != "grouped_wgmma":
        return rows
    return wgmma_k_order_kernel(rows) if rows.size >= K_ORDER_KERNEL_MIN_VALUES else wgmma_k_order(rows)


def wgmma_k_order(rows: mx.array) -> mx.array:
    """`rows` [n, K] (K a multiple of 64) with each 64 columns in the order grouped_wgmma reads
    them (cuda/moe_prefill.cu): column 32 half + 16 s + 8 h + 2 t + e holds column
    16 t + 8 half + 4 e + 2 s + h. The reference of wgmma_k_order_kernel."""
    n, k = rows.shape
    return rows.reshape(n, k // 64, 4, 2, 2, 2, 2).transpose(0, 1, 3, 5, 6, 2, 4).reshape(n, k)


def wgmma_k_order_kernel(rows: mx.array) -> mx.array:
    """wgmma_k_order in one launch of the `k_order` section (bf16 / fp16 rows)."""
    n, k = rows.shape
    return cuda_kernel("k_order")(
        inputs=[rows, int_array(n, k)],
        template=[("T", rows.dtype), ("THREADS", K_ORDER_THREADS)],
        grid=(n * (k // 8), 1, 1),
        threadgroup=(K_ORDER_THREADS, 1, 1),
        output_shapes=[(n, k)],
        output_dtypes=[rows.dtype],
    )[0]


def cuda_kernel(section: str, shared: int = 0, bounds: tuple = ()):
    """The cuda_kernel object of a section of cuda/moe_prefill.cu, for blocks of `shared` bytes
    of dynamic shared memory (and launch `bounds`), or None where MLX has no CUDA."""
    return cuda_kernel_object("moe_prefill.cu", section, tuple(INPUTS[section]), tuple(OUTPUTS[section]), shared, bounds)


# A one-matrix GEMM with 64-row tiles takes 176 registers a thread unbounded (2 blocks of 4 warps
# per SM); capped at 3 blocks it fits 166 without spilling (4-bit; nvcc --resource-usage), for
# 12 warps per SM: the GEMM is latency bound at 8 (ncu). On the H200 the down GEMM went from 130
# to 146 TFLOP/s (Qwen3, 2048 tokens) and 236 to 246 (Mixtral); at 512 tokens within the noise
# (docs/benchmarks.md, eighth session). The gated GEMM already needs 254.
ONE_MATRIX_MIN_BLOCKS = 3


# grouped_wgmma: 512 threads an SM (one block of four warpgroups or two of two), 128 registers a
# thread (the register file); unbounded, two warpgroups take 140.
WGMMA_THREADS_PER_SM = 512
# its down (one matrix): three blocks of two warpgroups an SM (85 registers a thread)
WGMMA_ONE_MATRIX_THREADS_PER_SM = 768


def launch_bounds_for(tile: int, gated: bool, gemm: str = "grouped", in_dim: int = 0) -> tuple:
    if gemm == "grouped_wgmma":
        block = threads(tile, gemm, in_dim)
        return (block, (WGMMA_THREADS_PER_SM if gated else WGMMA_ONE_MATRIX_THREADS_PER_SM) // block)
    return (threads(tile), ONE_MATRIX_MIN_BLOCKS) if not gated and tile == 64 else ()


def tile_height(pairs: int, num_experts: int) -> int:
    mean_rows = pairs / num_experts
    return max(t for t, rows in zip(TILES, TILE_MIN_MEAN_ROWS) if mean_rows >= rows)


def grid_tiles(pairs: int, num_experts: int, tile: int) -> int:
    """The most tiles any routing of `pairs` pairs can fill: the grid's size, known on the host.
    At most min(experts, pairs) experts have pairs, and each pads its run by at most tile - 1
    rows: at a few tokens with many experts this is well under pairs / tile + experts (DeepSeek-V3
    at 16 tokens: 128 tiles, not 264), and so is the gate+up's output, allocated whole."""
    return (pairs + min(num_experts, pairs) * (tile - 1)) // tile


def route_kernel(flat_indices: mx.array, num_experts: int, tile: int = TILES[0]):
    """route_reference's contract on CUDA in one launch (rows within an expert's run may come in
    another order)."""
    if num_experts > ROUTE_MAX_EXPERTS:
        return route_reference(flat_indices, num_experts, tile)
    pairs = flat_indices.size
    tiles = grid_tiles(pairs, num_experts, tile)
    blocks = max(1, -(-pairs // ROUTE_PAIRS_PER_BLOCK))
    chunk = -(-pairs // blocks)
    row_pair, tile_expert = cuda_kernel("route")(
        inputs=[flat_indices, int_array(pairs, num_experts, tiles, chunk)],
        template=[("TILE", tile), ("MAX_EXPERTS", ROUTE_MAX_EXPERTS)],
        grid=(blocks * ROUTE_THREADS, 1, 1),
        threadgroup=(ROUTE_THREADS, 1, 1),
        output_shapes=[(tiles * tile,), (tiles,)],
        output_dtypes=[mx.int32, mx.int32],
    )
    return row_pair, tile_expert, tiles


def route_reference(flat_indices: mx.array, num_experts: int, tile: int = TILES[0]):
    """(row_pair, tile_expert, tiles): the pairs in expert order with each expert's run padded
    to a multiple of `tile` rows (row_pair[r] is the pair in padded row r, -1 for padding), and
    the expert of each `tile`-row tile (-1 past the last run). Lazy MLX ops only."""
    pairs = flat_indices.size
    counts = mx.zeros((num_experts,), mx.int32).at[flat_indices].add(1)
    padded = (counts + tile - 1) // tile * tile
    padded_end = mx.cumsum(padded)
    order = mx.argsort(flat_indices)
    sorted_experts = flat_indices[order]
    rank = mx.arange(pairs, dtype=mx.int32) - (mx.cumsum(counts) - counts)[sorted_experts]
    padded_row = (padded_end - padded)[sorted_experts] + rank
    tiles = grid_tiles(pairs, num_experts, tile)
    row_pair = mx.zeros((tiles * tile,), mx.int32).at[padded_row].add(order.astype(mx.int32) + 1) - 1
    tile_start = mx.arange(tiles, dtype=mx.int32) * tile
    tile_expert = (padded_end[None, :] <= tile_start[:, None]).sum(axis=1).astype(mx.int32)
    tile_expert = mx.where(tile_start < padded_end[-1], tile_expert, -1)
    return row_pair, tile_expert, tiles


def combine_kernel(rows: mx.array, weights: mx.array) -> mx.array:
    """reference.combine on the down GEMM's rows [pairs, out] (pair order) and weights [..., k]:
    the weighted sum over k, [..., out], in one launch."""
    top_k, (pairs, width) = weights.shape[-1], rows.shape
    tokens = pairs // top_k
    out = cuda_kernel("combine")(
        inputs=[rows, weights.reshape(-1), int_array(tokens, top_k, width)],
        template=[("T", rows.dtype), ("WT", weights.dtype)],
        grid=(tokens * (width // 8), 1, 1),
        threadgroup=(COMBINE_THREADS, 1, 1),
        output_shapes=[(tokens, width)],
        output_dtypes=[rows.dtype],
    )[0]
    return out.reshape(*weights.shape[:-1], width)


def cuda_unsupported_reason(experts: MoEExperts, dtype) -> Optional[str]:
    if dtype not in (mx.bfloat16, mx.float16):
        return f"the grouped prefill kernel takes bfloat16 / float16 activations, not {dtype}"
    # the GEMM dequantises mxfp4 / nvfp4 to bf16 (cuda/moe_prefill.cu, dequant_pair)
    reason = quantized_experts_reason(experts, QUANTIZATION_MODES) or fp4_activations_reason(experts, dtype, (mx.bfloat16,))
    if reason is None and any(p.input_dims % BLOCK_K or p.output_dims % 32 for p in experts.projections):
        reason = f"expert input widths that are not multiples of {BLOCK_K} or output widths not of 32"
    return reason


# The grouped GEMM launches of a layer: "first" (gate+up, or an MLP's first projection, with the
# activation, written into expert-sorted padded rows), "last" (the last projection on those rows,
# written back per pair), "only" (a lone projection on the token rows, per pair).
GROUPED_STAGES = ("first", "last", "only")


def _grouped_launch(experts: MoEExperts, stage: str, tile: int, top_k: int, dtype, gemm: str) -> Launch:
    """The launch of `stage` as for one tile: a call gives the grid's tile count and the output's rows."""
    projections = experts.projections
    if stage == "first":
        matrices, activation, scale = projections[:2] if len(projections) == 3 else projections[:1], experts.activation, experts.gate_scale
    elif stage == "last":
        matrices, activation, scale = projections[-1:], None, experts.out_scale
    else:
        matrices, activation, scale = projections, None, None
    pairs_in, activate = stage != "last", stage == "first"
    first, second = matrices[0], matrices[-1]
    gated = len(matrices) == 2
    in_dim = first.input_dims
    wgmma_template = ([("RBN", block_n(gemm, in_dim)), ("K_ORDER_OUT", stage == "first" and k_ordered_hidden(gemm, gemm_kernel(experts, "last", tile)))]
                      if gemm == "grouped_wgmma" else [])
    return Launch(
        cuda_kernel(gemm, shared_bytes(tile, gated, first.bits, gemm, in_dim), launch_bounds_for(tile, gated, gemm, in_dim)),
        [first.weight, first.scales, or_absent(first.biases), second.weight, second.scales, or_absent(second.biases),
         or_absent(first.bias), or_absent(second.bias), or_absent(scale),
         kernel_dims(first.input_dims, first.output_dims, top_k, activation, first.bias is not None, scale is not None),
         kernel_params(activation)],
        [("T", dtype), ("S", first.scales.dtype), ("SC", scale.dtype if scale is not None else mx.float32),
         ("BITS", first.bits), ("GROUP", first.group_size), ("FP4", first.mode in FP4_GROUP_SIZES), ("BM", tile),
         ("PAIRS_IN", pairs_in), ("ACTIVATE", activate), ("GATED", gated),
         ("ACT", ACTIVATION_CODES[activation.kind] if activation is not None else 0),
         ("LIMITED", activation is not None and activation.limit is not None), bias_template(first), *wgmma_template],
        (-(-first.output_dims // block_n(gemm, in_dim)) * threads(tile, gemm, in_dim), 1, 1),
        (threads(tile, gemm, in_dim), 1, 1),
        [(tile, first.output_dims)],
        [dtype],
    )


def grouped(a: mx.array, routing: tuple, pairs: int, top_k: int, experts: MoEExperts, stage: str,
            gemm: str = "grouped") -> mx.array:
    """One launch of the grouped GEMM `gemm` (GEMMS; see gemm_kernel) for `experts`' `stage`
    (GROUPED_STAGES) on rows `a` (as `gemm_rows` gives them for `gemm`), with `routing` =
    (row_pair, tile_expert, tiles, tile). Its arguments but the per-call ones are built once per
    layer, tile height, dtype and GEMM (a prefill call's host time is MLX's and this package's
    Python, docs/benchmarks.md, tenth session)."""
    row_pair, tile_expert, tiles, tile = routing
    launch = experts.memo(("grouped", stage, tile, top_k, a.dtype, gemm),
                          lambda: _grouped_launch(experts, stage, tile, top_k, a.dtype, gemm))
    rows = tiles * tile if stage == "first" else pairs
    return launch(a, row_pair, tile_expert, grid=(launch.grid[0], tiles, 1),
                  output_shapes=[(rows, launch.output_shapes[0][1])])[0]


def moe_prefill_kernel(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """The CUDA implementation; same contract as moe_prefill_reference."""
    top_k, pairs = indices.shape[-1], indices.size
    tile = tile_height(pairs, experts.num_experts)
    tiles = grid_tiles(pairs, experts.num_experts, tile)
    widest = max(experts.input_dims, experts.projections[0].output_dims)
    if tiles > MAX_GRID_TILES or max(pairs, tiles * tile) * widest >= MAX_OFFSET:
        # Millions of pairs in one call (mlx-lm prefills in chunks of 2048 tokens): more tiles
        # than a CUDA grid's y dimension holds, or rows past 32-bit offsets.
        return moe_prefill_reference(x, indices, experts, weights)
    tokens = x.reshape(-1, x.shape[-1])
    routing = (*route_kernel(indices.reshape(-1).astype(mx.uint32), experts.num_experts, tile), tile)
    if len(experts.projections) == 1:
        out = grouped(tokens, routing, pairs, top_k, experts, "only")
    else:
        first = gemm_kernel(experts, "first", tile)
        hidden = grouped(gemm_rows(tokens, first), routing, pairs, top_k, experts, "first", first)
        last = gemm_kernel(experts, "last", tile)
        if not k_ordered_hidden(first, last):
            hidden = gemm_rows(hidden, last)
        out = grouped(hidden, routing, pairs, top_k, experts, "last", last)
    if weights is None:
        return out.reshape(*indices.shape, experts.output_dims)
    return combine_kernel(out, per_pair(weights, indices))


def moe_prefill(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """Dispatcher: the moe_prefill implementation for the current backend and these experts."""
    return moe_prefill_implementation(experts, x.dtype).function(x, indices, experts, weights)


def moe_prefill_implementation(experts: Optional[MoEExperts] = None, dtype=None) -> Implementation:
    """dtype: the activations' (the kernel takes bfloat16 and float16)."""
    return choose(
        "moe_prefill", moe_prefill_reference, moe_prefill_kernel, CUDA_KERNEL_SWITCH,
        None if experts is None
        else lambda: experts.memo(("cuda prefill", dtype), lambda: cuda_unsupported_reason(experts, dtype)),
    )
