"""Fused decode MoE: few (token, expert) pairs, each expert's rows read once per pair.

Reference: each token's row paired with its k experts directly (one GEMV per pair, no sort).
CUDA kernel (`cuda/moe_decode.cu`): two launches per layer: gate+up GEMV with the activation
(clamp stage and per-expert gate scale included), then down GEMV with the per-expert output scale
and the weighted top-k combine, so the [tokens, k, hidden] intermediate is never written.
Affine 4- / 8-bit experts, and mxfp4 / nvfp4 ones (on CUDA against bf16 / fp16 activations).
Metal kernel (`metal/moe_decode.metal`): the same two launches, one simdgroup where CUDA has one
warp, the same launchers; not yet run on Apple hardware, so off unless MLX_MOE_FIX_METAL_DECODE=1.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx

from .backend import Implementation, choose, current_backend
from .experts import MXFP4, NVFP4, ExpertLinear, MoEExperts, SharedExperts
from .launch import (Launch, absent, bias_template, cuda_kernel_object, fixed_or_absent, kernel_dims, kernel_params,
                     metal_kernel_object, fp4_activations_reason, per_pair, quantized_experts_reason, source_constants)
from .reference import combine, expert_chain


class BlockShape(NamedTuple):
    """How a decode launch lays out its blocks: `warps` a block, `rows` output rows a warp (RPW in
    cuda/moe_decode.cu: a warp loads each activation vector once for all its rows), and the
    `resident` warps an SM its launch bounds leave registers for (CUDA)."""

    warps: int
    rows: int
    resident: int

    def launch_bounds(self) -> tuple:
        """(threads a block, blocks an SM), as cuda_kernel_object takes them."""
        return (self.warps * 32, self.resident // self.warps)


# The gate+up's blocks, and the down's where ONE_PAIR_A_WARP_DOWN does not apply.
# - 4 warps: small blocks spread a decode GEMV's few warps evenly over the SMs: at Qwen3-30B-A3B's
#   shape the gate+up has 192 blocks of 8 warps for 132 SMs, so half the SMs ran two and set its
#   time; in blocks of 4 the routed gate+up took 15.2 µs where 8 took 16.4 (ncu, docs/benchmarks.md).
# - 4 rows a warp: on the H200, 4 read Mixtral's experts at 1466 GB/s where 1 read them at 1209
#   (docs/benchmarks.md).
# - 16 resident warps an SM (128 registers a thread): unbounded, the fixed-point GEMV's down
#   launch took 140 and the routed gate+up a few more than the plain one: room for fewer blocks
#   (nvcc --resource-usage for sm_90a; tests/test_cuda_sources.py checks that no bounded variant
#   spills).
GATE_UP_BLOCK = BlockShape(4, 4, 16)
DOWN_BLOCK = BlockShape(4, 4, 16)
# The combining down of 4-bit experts in fixed point at top-k 8 or more: blocks of 8 warps, a warp
# one pair's 8 rows, where 4-warp blocks gave a warp two pairs' 4 rows: as many warps, one
# activation split a warp for 8 rows instead of two for 4 each. On the H200 at Qwen3-30B-A3B's
# shape: 4-bit 6.88 -> 6.26 us, 8-bit 8.00 -> 8.54 (docs/benchmarks.md, twenty-fourth session), so
# 8-bit experts keep DOWN_BLOCK.
ONE_PAIR_A_WARP_DOWN = BlockShape(8, 8, 16)
# Shared memory reserved a vector of the gate+up's activation row split once a block (fixed point:
# 16-bit activations; SharedFixed in cuda/moe_decode.cu), and the most a launch takes for it: a
# longer row is split by each warp as it goes.
SPLIT_BYTES_PER_VECTOR = 128
MAX_SPLIT_BYTES = 48 * 1024


def moe_decode_reference(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """x: [..., D], indices: [..., k]; returns [..., k, out], or [..., out] weighted by
    `weights` [..., k]."""
    rows = x.reshape(*x.shape[:-1], 1, 1, x.shape[-1])
    y = expert_chain(rows, indices, experts, sorted_indices=False).squeeze(-2)
    return combine(y, weights)


# The kernels' parameters, in the order of their `inputs`.
INPUTS = {
    "gate_up": ["x", "indices", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b",
                "gate_bias", "up_bias", "gate_scale", "dims", "params"],
    "down": ["hidden", "indices", "weights", "w", "s", "b", "bias", "out_scale", "dims"],
    # CUDA only: down after moe_routed_decode's gate+up, the experts and weights in its output
    # (`residual`: a decoder layer's, added to the output; absent: declared in the source)
    "routed_down": ["hidden", "residual", "w", "s", "b", "bias", "out_scale", "dims"],
    # CUDA only: gate+up and down with a block's always-on shared experts (moe_shared_decode)
    "shared_gate_up": ["x", "indices", "shared_weights", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b",
                       "gate_bias", "up_bias", "gate_scale", "shared_gate_w", "shared_gate_s", "shared_gate_b",
                       "shared_up_w", "shared_up_s", "shared_up_b", "dims", "params"],
    "shared_down": ["hidden", "indices", "weights", "w", "s", "b", "bias", "out_scale", "shared_w", "shared_s", "shared_b",
                    "dims"],
    # CUDA only: shared_down after moe_routed_decode's gate+up with shared experts (Inkling's block)
    "routed_shared_down": ["hidden", "w", "s", "b", "bias", "out_scale", "shared_w", "shared_s", "shared_b", "dims"],
}
OUTPUTS = {"gate_up": ["hidden"], "down": ["out"], "routed_down": ["out"], "shared_gate_up": ["hidden"],
           "shared_down": ["out"], "routed_shared_down": ["out"]}

def gpu_kernel(stage: str, backend: str, shape: BlockShape, fixed: dict, shared_bytes: int = 0) -> tuple:
    """(the kernel object of one stage ("gate_up" or "down") on `backend` ("cuda" or "metal"), or
    None where MLX lacks that backend; the arrays of its `fixed` inputs that a launch passes). The
    two take the same inputs, templates and grid; CUDA's gate+up also SHARED_SPLIT (with
    `shared_bytes`), CUDA's launches are bounded for their block `shape` and take their params and
    absent inputs in their source (launch.source_constants)."""
    if backend == "metal":
        kernel = metal_kernel_object("moe_decode.metal", stage, tuple(INPUTS[stage]), tuple(OUTPUTS[stage]))
        return kernel, fixed_or_absent(fixed)
    constants, arrays = source_constants(fixed)
    return cuda_kernel_object("moe_decode.cu", stage, tuple(INPUTS[stage]), tuple(OUTPUTS[stage]), shared_bytes,
                              shape.launch_bounds(), constants), arrays


def shared_split_bytes(experts: MoEExperts, dtype, backend: str) -> int:
    """Shared memory of a gate+up launch that splits its activation row once a block (CUDA, in
    fixed point: 16-bit activations), or 0 where its warps split the row themselves."""
    if backend != "cuda" or dtype.size != 2:
        return 0
    first = experts.projections[0]
    size = first.input_dims * first.bits // 128 * SPLIT_BYTES_PER_VECTOR  # a vector: 128 bits of packed weights
    return size if size <= MAX_SPLIT_BYTES else 0


# The GEMV addresses a row's packed words, scales and biases with 32-bit offsets within one
# expert's matrix (rows_dot in cuda/moe_decode.cu).
MAX_EXPERT_WORDS = 2**32


# MLX passes a Metal kernel's inputs of fewer elements in the `constant` address space; the Metal
# GEMV reads the packed weights, scales and affine biases as `device` memory.
METAL_DEVICE_INPUT_ELEMENTS = 8


def cuda_unsupported_reason(experts: MoEExperts, dtype, backend: Optional[str] = None) -> Optional[str]:
    """Why the GPU decode kernel of `backend` (default: the current one; Metal's too) cannot take
    these experts against activations of `dtype`, or None. mxfp4 and nvfp4 experts on CUDA against
    16-bit activations only (the fixed-point GEMV reads their codes: cuda/moe_decode.cu,
    e2m1_bytes); Metal's fp32 loop reads them against any."""
    metal = (backend or current_backend()) == "metal"
    reason = quantized_experts_reason(experts, ("affine", MXFP4, NVFP4))
    reason = reason or fp4_activations_reason(experts, dtype, (mx.bfloat16, mx.float16, mx.float32) if metal else
                                              (mx.bfloat16, mx.float16))
    if reason is None and any(p.input_dims % (128 // p.bits) for p in experts.projections):  # all quantized here
        # a group of at least 32 4-bit (16 8-bit) values makes whole vectors; nvfp4's of 16 may not
        return "rows of packed weights not whole 16-byte vectors: the decode GEMV reads 16 bytes at a time"
    if reason is None and any(p.output_dims * p.weight.shape[-1] >= MAX_EXPERT_WORDS for p in experts.projections):
        return "an expert matrix of 2^32 packed words or more: the CUDA decode GEMV addresses one with 32-bit offsets"
    if reason is None and metal and any(a is not None and a.size < METAL_DEVICE_INPUT_ELEMENTS
                                           for p in experts.projections for a in (p.weight, p.scales, p.biases)):
        return (f"packed weights, scales or biases of fewer than {METAL_DEVICE_INPUT_ELEMENTS} elements: MLX passes "
                "them to a Metal kernel in constant memory, which the Metal decode GEMV does not read")
    return reason


def _grid(rows: int, blocks_y: int, shape: BlockShape, row_warps: Optional[int] = None) -> tuple:
    """Blocks of `shape`, each `row_warps` (default all its warps) x its rows a warp rows, and per
    y index."""
    per_block = shape.warps * 32
    row_warps = row_warps or shape.warps
    return (-(-rows // (row_warps * shape.rows)) * per_block, blocks_y, 1), (per_block, 1, 1)


def _quant_templates(linear: ExpertLinear, dtype, shape: BlockShape) -> list:
    return [("T", dtype), ("S", linear.scales.dtype), ("BITS", linear.bits), ("GROUP", linear.group_size),
            ("WARPS", shape.warps), ("RPW", shape.rows)]


def gate_up_block_shape() -> BlockShape:
    """The blocks of a gate+up launch, routed or not: GATE_UP_BLOCK (read at each launch plan, so
    that benchmarks/block_shapes.py can set it)."""
    return GATE_UP_BLOCK


def down_block_shape(pairs_a_token: int, combined: bool, bits: int, dtype, backend: str, fp4_with_shared: bool = False) -> BlockShape:
    """The blocks of a down launch: ONE_PAIR_A_WARP_DOWN for the combining down of 4-bit experts in
    fixed point (CUDA, 16-bit activations) at top-k (with the shared experts, if any) of at least
    its warps, else DOWN_BLOCK; DOWN_BLOCK too for mxfp4 / nvfp4 experts with shared experts
    (`fp4_with_shared`), whose down spilled 8-44 bytes at one pair a warp's bounds (nvcc for
    sm_90a) and none at DOWN_BLOCK's."""
    if (combined and bits == 4 and backend == "cuda" and dtype.size == 2 and pairs_a_token >= ONE_PAIR_A_WARP_DOWN.warps
            and not fp4_with_shared):
        return ONE_PAIR_A_WARP_DOWN
    return DOWN_BLOCK


def gate_up_grid(experts: MoEExperts, pairs: int) -> tuple:
    """(grid, threadgroup) of a gate+up launch: its row groups of the up (or lone first)
    projection's rows along x, per pair along y."""
    return _grid(experts.projections[1 if len(experts.projections) == 3 else 0].output_dims, pairs, gate_up_block_shape())


def gate_up_launch(experts: MoEExperts, top_k: int, pairs: int, dtype, backend: str,
                   shared: Optional[SharedExperts] = None, weighted: bool = False) -> Launch:
    """With `shared` (CUDA): the shared_gate_up section, `pairs` counting each token's shared
    experts' rows too; a call passes (x, indices) and, where `weighted`, the shared weights."""
    gated = len(experts.projections) == 3
    up = experts.projections[1 if gated else 0]
    has_scale = experts.gate_scale is not None
    shape = gate_up_block_shape()
    grid, block = gate_up_grid(experts, pairs)
    split_bytes = shared_split_bytes(experts, dtype, backend)
    if shared is None:
        fixed = gate_up_fixed_inputs(experts, top_k)
    else:
        fixed = {**({} if weighted else {"shared_weights": None}), **shared_gate_up_fixed_inputs(experts, top_k, shared)}
    kernel, fixed = gpu_kernel("gate_up" if shared is None else "shared_gate_up", backend, shape, fixed, split_bytes)
    return Launch(
        kernel, fixed,
        _quant_templates(up, dtype, shape) + [("SC", experts.gate_scale.dtype if has_scale else mx.float32),
                                              ("GATED", gated), bias_template(up)]
        + ([("SHARED_SPLIT", split_bytes > 0)] if backend == "cuda" else [])
        + ([("SHARED", shared.count), ("SHARED_WEIGHTS", weighted)] if shared is not None else []),
        grid, block, [(pairs, up.output_dims)], [dtype],
    )


def _linear_inputs(prefix: str, linear) -> dict:
    """A quantized linear's packed weight, scales and biases as kernel inputs `prefix` + w, s, b."""
    return {f"{prefix}w": linear.weight, f"{prefix}s": linear.scales, f"{prefix}b": linear.biases}


def gate_up_fixed_inputs(experts: MoEExperts, top_k: int) -> dict:
    """A gate+up launch's inputs after x and the indices, by name (None: an absent optional input)."""
    gated = len(experts.projections) == 3
    gate, up = experts.projections[:2] if gated else (experts.projections[0],) * 2
    has_scale = experts.gate_scale is not None
    return {"gate_w": gate.weight, "gate_s": gate.scales, "gate_b": gate.biases,
            "up_w": up.weight, "up_s": up.scales, "up_b": up.biases,
            "gate_bias": gate.bias, "up_bias": up.bias, "gate_scale": experts.gate_scale,
            "dims": kernel_dims(up.input_dims, up.output_dims, top_k, experts.activation, up.bias is not None, has_scale),
            "params": kernel_params(experts.activation)}


def shared_gate_up_fixed_inputs(experts: MoEExperts, top_k: int, shared: SharedExperts) -> dict:
    """gate_up_fixed_inputs with the shared experts' gate and up projections before dims and params."""
    fixed = gate_up_fixed_inputs(experts, top_k)
    dims, params = fixed.pop("dims"), fixed.pop("params")
    return {**fixed, **_linear_inputs("shared_gate_", shared.gate), **_linear_inputs("shared_up_", shared.up),
            "dims": dims, "params": params}


def _down_launch(linear: ExpertLinear, out_scale, top_k: int, pairs: int, dtype, weights_dtype,
                 input_per_pair: bool, backend: str, stage: str = "down", residual: bool = False,
                 shared: Optional[SharedExperts] = None) -> Launch:
    """residual (routed_down): whether a call passes the residual input after the hidden one;
    without it routed_down declares that input absent in its source. shared (shared_down): the
    shared experts whose down projection the launch adds, a token's hidden rows after its pairs'."""
    routed = stage == "routed_down"
    combined = weights_dtype is not None
    rows_out = pairs // top_k if combined else pairs
    slots = top_k + (0 if shared is None else shared.count)
    shape = down_block_shape(slots, combined, linear.bits, dtype, backend, shared is not None and linear.mode != "affine")
    # With the combine, a block's warps split over the token's pairs (cuda/moe_decode.cu, down).
    grid, block = _grid(linear.output_dims, rows_out, shape, shape.warps // min(slots, shape.warps) if combined else None)
    kernel, fixed = gpu_kernel(stage, backend, shape, {
        **({"residual": None} if routed and not residual else {}),
        "w": linear.weight, "s": linear.scales, "b": linear.biases, "bias": linear.bias, "out_scale": out_scale,
        **({} if shared is None else _linear_inputs("shared_", shared.down)),
        "dims": kernel_dims(linear.input_dims, linear.output_dims, top_k, None, linear.bias is not None, out_scale is not None)})
    return Launch(
        kernel, fixed,
        _quant_templates(linear, dtype, shape) + [
            ("SC", out_scale.dtype if out_scale is not None else mx.float32),
            ("WT", weights_dtype if combined else mx.float32),
            ("INPUT_PER_PAIR", input_per_pair), ("COMBINE", combined), bias_template(linear)]
        + ([("RESIDUAL", residual)] if routed else [])
        + ([("SHARED", shared.count)] if shared is not None else []),
        grid, block, [(rows_out, linear.output_dims)], [dtype],
    )


def decode_launches(experts: MoEExperts, top_k: int, pairs: int, dtype, weights_dtype, backend: str) -> tuple:
    """(gate_up or None, down) for this call's shape, cached on the experts object (itself
    cached per layer) to keep per-call host time low at decode."""
    def plan():
        single = len(experts.projections) == 1
        return (
            None if single else gate_up_launch(experts, top_k, pairs, dtype, backend),
            _down_launch(experts.projections[-1], experts.out_scale, top_k, pairs, dtype, weights_dtype,
                         input_per_pair=not single, backend=backend),
        )

    return experts.memo(("decode launches", backend, top_k, pairs, dtype, weights_dtype), plan)


def routed_down_launch(experts: MoEExperts, top_k: int, pairs: int, dtype, residual: bool,
                       shared: Optional[SharedExperts] = None) -> Launch:
    """The combining down after moe_routed_decode's gate+up (CUDA): decode_launches' down with
    weights of `dtype`, as the `routed_down` section, which reads each pair's expert and weight
    from its hidden input's RoutingTail; with `residual`, a call passes (hidden, residual) and the
    launch adds the residual to its output. With `shared` (no residual), the routed_shared_down
    section: shared_decode_launches' down reading its routing so."""
    if shared is not None and residual:
        raise ValueError("routed_shared_down adds no residual")
    return _down_launch(experts.projections[-1], experts.out_scale, top_k, pairs, dtype, dtype, input_per_pair=True,
                        backend="cuda", stage="routed_down" if shared is None else "routed_shared_down", residual=residual,
                        shared=shared)


def shared_decode_launches(experts: MoEExperts, shared: SharedExperts, top_k: int, tokens: int, dtype,
                           weighted: bool) -> tuple:
    """(shared_gate_up, shared_down) of moe_shared_decode (CUDA) for this call's shape, cached on
    the experts object: decode_launches' two with each token's shared experts after its pairs
    (`weighted`: each times its weight, an input of the gate+up launch)."""
    def plan():
        return (gate_up_launch(experts, top_k, tokens * (top_k + shared.count), dtype, "cuda", shared, weighted),
                _down_launch(experts.projections[-1], experts.out_scale, top_k, tokens * top_k, dtype, dtype,
                             input_per_pair=True, backend="cuda", stage="shared_down", shared=shared))

    return experts.memo(("shared decode launches", shared, top_k, tokens, dtype, weighted), plan)


def moe_decode_kernel(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """The GPU implementation (CUDA, or Metal where that is the backend); same contract as
    moe_decode_reference. The kernels read x, the indices and the weights as contiguous rows (MLX
    copies an input that is not), so they take them in the caller's shapes and give the output in
    its shape: no reshape nodes, each of which costs a decode step host time."""
    out_shape = (*(indices.shape if weights is None else x.shape[:-1]), experts.output_dims)
    if indices.size == 0:
        # nothing to compute: a launch of no blocks fails on CUDA (stock's gather_qmm fails so)
        return mx.zeros(out_shape, x.dtype)
    top_k = indices.shape[-1]
    pair_indices = indices.astype(mx.uint32)  # the same array where the router gave uint32
    gate_up, down = decode_launches(
        experts, top_k, indices.size, x.dtype, None if weights is None else weights.dtype, current_backend()
    )
    rows = x if gate_up is None else gate_up(x, pair_indices)[0]
    if weights is None:
        return down(rows, pair_indices, absent(), output_shapes=[out_shape])[0]
    return down(rows, pair_indices, per_pair(weights, indices), output_shapes=[out_shape])[0]


def moe_decode(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """Dispatcher: the moe_decode implementation for the current backend and these experts."""
    return moe_decode_implementation(experts, x.dtype).function(x, indices, experts, weights)


# On by default since its compiled decode steps beat stock end to end on every model measured
# (docs/benchmarks.md, seventh session: 1.05-1.35x at batch 1).
CUDA_KERNEL_SWITCH = "MLX_MOE_FIX_CUDA_DECODE"
# Off by default: nobody has run the Metal kernel yet (env.SWITCHES).
METAL_KERNEL_SWITCH = "MLX_MOE_FIX_METAL_DECODE"


def moe_decode_implementation(experts: Optional[MoEExperts] = None, dtype=None) -> Implementation:
    """dtype: the activations' (every dtype the ops support has a decode kernel)."""
    return choose(
        "moe_decode", moe_decode_reference, moe_decode_kernel, CUDA_KERNEL_SWITCH,
        None if experts is None else lambda: experts.memo(("gpu decode", current_backend(), dtype),
                                                          lambda: cuda_unsupported_reason(experts, dtype)),
        metal=(moe_decode_kernel, METAL_KERNEL_SWITCH),
    )
