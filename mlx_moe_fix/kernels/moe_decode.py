"""Fused decode MoE: few (token, expert) pairs, each expert's rows read once per pair.

Reference: each token's row paired with its k experts directly (one GEMV per pair, no sort).
CUDA kernel (`cuda/moe_decode.cu`): two launches per layer: gate+up GEMV with the activation
(clamp stage and per-expert gate scale included), then down GEMV with the per-expert output scale
and the weighted top-k combine, so the [tokens, k, hidden] intermediate is never written.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from .backend import Implementation, current_backend, reference_implementation
from .experts import ExpertLinear, MoEExperts
from .launch import absent, kernel_dims, kernel_params, quantized_experts_reason, switched_on
from .reference import combine, expert_chain
from .sources import sections

WARPS_PER_BLOCK = 8  # output rows per block, one warp each


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
    "down": ["hidden", "indices", "w", "s", "b", "bias", "out_scale", "weights", "dims"],
}
OUTPUTS = {"gate_up": ["hidden"], "down": ["out"]}

# Dynamic shared memory is fixed per cuda_kernel object (and each object is one NVRTC compile),
# so requests are rounded up to a few sizes.
SHARED_BUCKETS = (4096, 16384, 65536, 131072, 200 * 1024)


def _bucket(shared_bytes: int) -> int:
    return next(b for b in SHARED_BUCKETS if b >= shared_bytes)


@functools.lru_cache(maxsize=None)
def cuda_kernel(stage: str, shared_bytes: int):
    """The cuda_kernel object of one stage ("gate_up" or "down") with `shared_bytes` of dynamic
    shared memory, or None where MLX has no CUDA."""
    if not mx.cuda.is_available():
        return None
    source = sections("cuda", "moe_decode.cu")
    return mx.fast.cuda_kernel(
        name=f"mlx_moe_fix_decode_{stage}_smem{shared_bytes}",
        input_names=INPUTS[stage],
        output_names=OUTPUTS[stage],
        source=source[stage],
        header=source["header"],
        shared_memory=shared_bytes,
    )


def cuda_unsupported_reason(experts: MoEExperts) -> Optional[str]:
    reason = quantized_experts_reason(experts)
    if reason is None and max(_shared_bytes(p, 1) for p in experts.projections) > SHARED_BUCKETS[-1]:
        reason = "an activation row too wide to stage in shared memory"
    return reason


def _grid(rows: int, blocks_y: int) -> tuple:
    per_block = WARPS_PER_BLOCK * 32
    return (-(-rows // WARPS_PER_BLOCK) * per_block, blocks_y, 1), (per_block, 1, 1)


def _shared_bytes(linear: ExpertLinear, rows: int) -> int:
    """Shared memory for `rows` staged activation rows (cuda/moe_decode.cu's Layout)."""
    values = 4 * 32 // linear.bits
    return rows * linear.input_dims // values * (values + 4) * 4


def _quant_templates(linear: ExpertLinear, dtype) -> list:
    return [("T", dtype), ("S", linear.scales.dtype), ("BITS", linear.bits), ("GROUP", linear.group_size),
            ("WARPS", WARPS_PER_BLOCK)]


def _first_projection(x, flat_indices, experts: MoEExperts, top_k: int) -> mx.array:
    gated = len(experts.projections) == 3
    gate, up = experts.projections[:2] if gated else (experts.projections[0],) * 2
    has_scale = experts.gate_scale is not None
    dims = kernel_dims(up.input_dims, up.output_dims, top_k, experts.activation, up.bias is not None, has_scale)
    (grid, block), pairs = _grid(up.output_dims, flat_indices.size), flat_indices.size
    return cuda_kernel("gate_up", _bucket(_shared_bytes(up, 1)))(
        inputs=[x, flat_indices, gate.weight, gate.scales, gate.biases, up.weight, up.scales, up.biases,
                gate.bias if gate.bias is not None else absent(),
                up.bias if up.bias is not None else absent(),
                experts.gate_scale if has_scale else absent(),
                dims, kernel_params(experts.activation)],
        template=_quant_templates(up, x.dtype) + [
            ("SC", experts.gate_scale.dtype if has_scale else mx.float32), ("GATED", gated)],
        grid=grid,
        threadgroup=block,
        output_shapes=[(pairs, up.output_dims)],
        output_dtypes=[x.dtype],
    )[0]


def _last_projection(hidden, flat_indices, linear: ExpertLinear, out_scale, weights, top_k: int,
                     input_per_pair: bool) -> mx.array:
    if weights is not None and _shared_bytes(linear, top_k) > SHARED_BUCKETS[-1]:
        # The k input rows of a token do not fit in shared memory together: combine outside.
        per_pair = _last_projection(hidden, flat_indices, linear, out_scale, None, top_k, input_per_pair)
        return combine(per_pair.reshape(-1, top_k, linear.output_dims), weights.reshape(-1, top_k))
    rows_out = flat_indices.size // top_k if weights is not None else flat_indices.size
    dims = kernel_dims(linear.input_dims, linear.output_dims, top_k, None, linear.bias is not None, out_scale is not None)
    grid, block = _grid(linear.output_dims, rows_out)
    shared = _bucket(_shared_bytes(linear, top_k if weights is not None else 1))
    return cuda_kernel("down", shared)(
        inputs=[hidden, flat_indices, linear.weight, linear.scales, linear.biases,
                linear.bias if linear.bias is not None else absent(),
                out_scale if out_scale is not None else absent(),
                weights.reshape(-1) if weights is not None else absent(), dims],
        template=_quant_templates(linear, hidden.dtype) + [
            ("SC", out_scale.dtype if out_scale is not None else mx.float32),
            ("WT", weights.dtype if weights is not None else mx.float32),
            ("INPUT_PER_PAIR", input_per_pair), ("COMBINE", weights is not None)],
        grid=grid,
        threadgroup=block,
        output_shapes=[(rows_out, linear.output_dims)],
        output_dtypes=[hidden.dtype],
    )[0]


def moe_decode_kernel(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """The CUDA implementation; same contract as moe_decode_reference."""
    top_k = indices.shape[-1]
    tokens = x.reshape(-1, x.shape[-1])
    flat_indices = indices.reshape(-1).astype(mx.uint32)
    last = experts.projections[-1]
    if len(experts.projections) == 1:
        out = _last_projection(tokens, flat_indices, last, None, weights, top_k, input_per_pair=False)
    else:
        hidden = _first_projection(tokens, flat_indices, experts, top_k)
        out = _last_projection(hidden, flat_indices, last, experts.out_scale, weights, top_k, input_per_pair=True)
    lead = x.shape[:-1] if weights is not None else indices.shape
    return out.reshape(*lead, last.output_dims)


def moe_decode(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """Dispatcher: the moe_decode implementation for the current backend and these experts."""
    return moe_decode_implementation(experts).function(x, indices, experts, weights)


# Opt-in until it beats stock end to end (docs/benchmarks.md, 2026-11-30: qwen3_moe decode 0.85x).
CUDA_KERNEL_SWITCH = "MLX_MOE_FIX_CUDA_DECODE"


def moe_decode_implementation(experts: Optional[MoEExperts] = None, dtype=None) -> Implementation:
    """dtype: the activations' (every dtype the ops support has a decode kernel)."""
    if current_backend() != "cuda":
        return reference_implementation("moe_decode", moe_decode_reference)
    if not switched_on(CUDA_KERNEL_SWITCH):
        return Implementation(
            moe_decode_reference,
            "reference",
            f"the CUDA decode kernel is opt-in ({CUDA_KERNEL_SWITCH}=1) until it beats stock end to end",
        )
    reason = None if experts is None else cuda_unsupported_reason(experts)
    if reason is not None:
        return Implementation(moe_decode_reference, "reference", reason)
    return Implementation(moe_decode_kernel, "kernel", "CUDA fused decode kernel (gate+up+activation, down+combine)")
