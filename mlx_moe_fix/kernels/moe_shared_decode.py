"""Fused decode MoE with always-on shared experts beside the routed ones (mlx-vlm's Inkling and
DeepSeek-V4): the routed experts' weighted sum plus the shared experts' output, in moe_decode's
two launches.

Reference: moe_decode_reference's weighted sum, plus the shared experts as upstream's modules
compute them (shared_experts_reference), added as upstream's blocks add the two. CUDA kernel
(`cuda/moe_decode.cu`, sections shared_gate_up and shared_down): the shared experts are more rows
of the gate+up launch (each times its weight where the block weighs them, as Inkling's applies it
before their down projection) and more pairs of the combining down launch, so that the block's
experts are the two routed launches, where they were those, the shared experts' three quantized
matmuls, their activation and the add: at batch 1 each node costs the host a few µs, more than
its GPU time (docs/decode-attribution.md, section 36: inkling 0.939-0.981 of its dense
equivalent against 0.721-0.925 with them apart). MLX_MOE_FIX_CUDA_SHARED_DECODE=0 turns it off
(the shared experts then run apart, as upstream's).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .backend import Implementation, choose
from .experts import MoEExperts, SharedExperts
from .launch import per_pair
from .moe_decode import MAX_EXPERT_WORDS, moe_decode_implementation, moe_decode_reference, shared_decode_launches
from .reference import activate

CUDA_KERNEL_SWITCH = "MLX_MOE_FIX_CUDA_SHARED_DECODE"


def moe_shared_decode_reference(x: mx.array, indices: mx.array, experts: MoEExperts, weights: mx.array,
                                shared: SharedExperts, shared_weights: Optional[mx.array] = None) -> mx.array:
    """x: [..., D], indices and weights: [..., k], shared_weights: [..., shared.count] or None (the
    shared experts unweighted); returns [..., out]."""
    return moe_decode_reference(x, indices, experts, weights) + shared_experts_reference(x, shared, shared_weights)


def shared_experts_reference(x: mx.array, shared: SharedExperts, weights: Optional[mx.array] = None) -> mx.array:
    """What upstream's dense shared-experts module computes: the activation of the gate and up
    projections, times each expert's weight repeated over its columns where given, down projected."""
    hidden = activate(shared.activation, shared.up(x), shared.gate(x))
    if weights is not None:
        hidden = hidden * mx.repeat(weights, shared.width, axis=-1)
    return shared.down(hidden)


def moe_shared_decode_kernel(x: mx.array, indices: mx.array, experts: MoEExperts, weights: mx.array,
                             shared: SharedExperts, shared_weights: Optional[mx.array] = None) -> mx.array:
    """The CUDA implementation; same contract as moe_shared_decode_reference, for shared weights of
    x's dtype (moe_shared_decode_call_reason). As moe_decode_kernel, it takes x, the indices and
    the weights in the caller's shapes and gives the output in x's leading shape."""
    top_k = indices.shape[-1]
    weighted = shared_weights is not None
    gate_up, down = shared_decode_launches(experts, shared, top_k, indices.size // top_k, x.dtype, weighted)
    pair_indices = indices.astype(mx.uint32)
    (hidden,) = gate_up(x, pair_indices, *((shared_weights,) if weighted else ()))
    return down(hidden, pair_indices, per_pair(weights, indices), output_shapes=[(*x.shape[:-1], experts.output_dims)])[0]


def moe_shared_decode(x: mx.array, indices: mx.array, experts: MoEExperts, weights: mx.array,
                      shared: SharedExperts, shared_weights: Optional[mx.array] = None) -> mx.array:
    """Dispatcher: the implementation for the current backend, these experts and this call."""
    implementation = moe_shared_decode_implementation(experts, shared, x.dtype)
    if implementation.path == "kernel" and moe_shared_decode_call_reason(x, shared, shared_weights) is not None:
        return moe_shared_decode_reference(x, indices, experts, weights, shared, shared_weights)
    return implementation.function(x, indices, experts, weights, shared, shared_weights)


def moe_shared_decode_call_reason(x: mx.array, shared: SharedExperts, shared_weights: Optional[mx.array]) -> Optional[str]:
    """Why the kernel cannot take this call's shared weights, or None: none, or one row of x's
    dtype a token."""
    expected = (*x.shape[:-1], shared.count)
    if shared_weights is not None and (shared_weights.shape != expected or shared_weights.dtype != x.dtype):
        return (f"shared weights {tuple(shared_weights.shape)} of {shared_weights.dtype}: the kernel reads "
                f"{expected} of {x.dtype}")
    return None


def cuda_unsupported_reason(experts: MoEExperts, shared: SharedExperts, dtype) -> Optional[str]:
    """Why the kernel cannot take these experts with these shared experts (dtype: the
    activations'), or None: what moe_decode's kernel needs, GLU experts whose activation the shared
    experts have too (the launch applies one), and shared experts quantized as the routed
    experts' projections they join (one mode, BITS and GROUP a launch: affine, or mxfp4 / nvfp4
    where the routed experts are), without additive biases, of the routed experts' widths."""
    decode = moe_decode_implementation(experts, dtype)
    if decode.path != "kernel":
        return decode.reason
    if len(experts.projections) != 3 or shared.activation != experts.activation:
        return (f"shared experts' {shared.activation} against the routed experts' {experts.activation}: the gate+up "
                "launch applies one activation")
    gate, up, down = experts.projections
    for name, linear, routed in (("gate", shared.gate, gate), ("up", shared.up, up), ("down", shared.down, down)):
        if linear.bias is not None:
            return f"a shared {name} projection with an additive bias"
        quantization = (linear.mode, linear.bits, linear.group_size, linear.scales.dtype, linear.biases is None)
        if quantization != (routed.mode, routed.bits, routed.group_size, routed.scales.dtype, routed.biases is None):
            return (f"shared experts quantized otherwise than the routed ones ({name}: {linear.mode} {linear.bits}-bit, "
                    f"group {linear.group_size}, {linear.scales.dtype} scales, against {routed.mode} {routed.bits}-bit, "
                    f"group {routed.group_size})")
    width = up.output_dims
    if (shared.gate.output_dims, shared.up.output_dims, shared.down.input_dims) != (shared.count * width,) * 3:
        return f"{shared.count} shared experts not {width} columns wide each, as the routed ones"
    if (shared.gate.input_dims, shared.up.input_dims, shared.down.output_dims) != (experts.input_dims,) * 2 + (experts.output_dims,):
        return "shared experts of other input or output widths than the routed ones"
    if shared.down.output_dims * shared.down.weight.shape[-1] >= MAX_EXPERT_WORDS:
        return "a shared down projection of 2^32 packed words or more: the GEMV addresses one with 32-bit offsets"
    return None


def moe_shared_decode_implementation(experts: Optional[MoEExperts] = None, shared: Optional[SharedExperts] = None,
                                     dtype=None) -> Implementation:
    """Without experts: what runs here for experts that moe_decode's kernel takes (its kernel only
    where that one's is on)."""

    def unsupported_reason():
        if experts is None:
            decode = moe_decode_implementation()
            return None if decode.path == "kernel" else decode.reason
        return experts.memo(("shared decode", shared, dtype), lambda: cuda_unsupported_reason(experts, shared, dtype))

    return choose("moe_shared_decode", moe_shared_decode_reference, moe_shared_decode_kernel, CUDA_KERNEL_SWITCH,
                  unsupported_reason)
