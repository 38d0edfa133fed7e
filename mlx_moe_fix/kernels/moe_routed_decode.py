"""Fused decode MoE that routes too: router logits [..., E] and the block's Routing in, the
routing-weighted sum over the k experts out, for the blocks whose routing `moe_router` knows.

Reference: `moe_router_reference`, then `moe_decode_reference` with the weights (what the block
computes unfused). CUDA kernel (`cuda/moe_routed_decode.cu`): moe_decode's gate+up launch with
moe_router's routing done inside it, then moe_decode's combining down launch: two launches where
the unfused block makes three (docs/decode-attribution.md: at batch 1 a launch costs more host
and GPU time than the routing's arithmetic). The experts and weights pass between the two in the
hidden output's tail (RoutingTail in cuda/moe_decode.cu), so that each launch has one output and
the down launch (moe_decode.cu's routed_down) no routing inputs. It routes with moe_router's
device code, so its experts and weights are the router kernel's, bit for bit.
MLX_MOE_FIX_CUDA_ROUTED_DECODE=0 turns it off (the block then routes and runs its experts in
separate launches).
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx

from ..env import flag
from .backend import Implementation, choose
from .experts import MoEExperts
from .launch import cuda_kernel_object, int_array
from .moe_decode import gate_up_block_shape, gate_up_launch, moe_decode_implementation, moe_decode_reference
from .moe_decode import routed_down_launch, shared_split_bytes
from .moe_decode import INPUTS as DECODE_INPUTS
from .moe_router import CUDA_KERNEL_SWITCH as ROUTER_SWITCH
from .moe_router import Routing, moe_router_reference
from .moe_router import cuda_unsupported_reason as router_unsupported_reason

CUDA_KERNEL_SWITCH = "MLX_MOE_FIX_CUDA_ROUTED_DECODE"
# The kernel's parameters, in the order of its `inputs` / outputs.
INPUTS = {"routed_gate_up": ["x", "logits", *DECODE_INPUTS["gate_up"][2:]]}
OUTPUTS = {"routed_gate_up": ["hidden"]}


def moe_routed_decode_reference(x: mx.array, logits: mx.array, routing: Routing, experts: MoEExperts) -> mx.array:
    """x: [..., D], logits: [..., E]; returns [..., out]: the experts' outputs weighted by the
    routing's weights and summed over its k."""
    indices, weights = moe_router_reference(logits, routing)
    return moe_decode_reference(x, indices, experts, weights)


def _launches(experts: MoEExperts, routing: Routing, leading_shape: tuple, dtype) -> tuple:
    """(routed gate+up, combining down) for this call's shape, cached on the experts object.
    The down launch's output has the call's leading shape, so that the call adds no reshape to
    the graph: at batch 1 every node costs the host a few µs (docs/decode-attribution.md)."""

    def plan():
        tokens = math.prod(leading_shape)
        pairs = tokens * routing.top_k
        gate_up = gate_up_launch(experts, routing.top_k, pairs, dtype, "cuda")
        split_bytes = shared_split_bytes(experts, dtype, "cuda")
        *weights, dims, params = gate_up.fixed_inputs
        (rows, hidden_dims), itemsize = gate_up.output_shapes[0], dtype.size
        routed_gate_up = gate_up._replace(
            kernel=cuda_kernel_object("moe_routed_decode.cu", "routed_gate_up", tuple(INPUTS["routed_gate_up"]),
                                      tuple(OUTPUTS["routed_gate_up"]), split_bytes, gate_up_block_shape().launch_bounds()),
            fixed_inputs=[*weights, int_array(*dims.tolist(), experts.num_experts), params],
            template=gate_up.template + [("SOFTMAX_FIRST", routing.kind == "softmax_topk"),
                                         ("NORMALIZE", routing.normalize), ("LAST_K", routing.kind != "topk_softmax")],
            # each pair's row, then its expert (uint32) and weight (dtype): RoutingTail in the source
            output_shapes=[(rows * hidden_dims + pairs * (4 + itemsize) // itemsize,)],
        )
        routed_down = routed_down_launch(experts, routing.top_k, pairs, dtype)._replace(
            output_shapes=[(*leading_shape, experts.output_dims)])
        return routed_gate_up, routed_down

    return experts.memo(("routed decode launches", routing, leading_shape, dtype), plan)


def moe_routed_decode_kernel(x: mx.array, logits: mx.array, routing: Routing, experts: MoEExperts) -> mx.array:
    """The CUDA implementation; same contract as moe_routed_decode_reference. The kernels read x
    and the logits as rows of contiguous memory (MLX copies an input that is not), so they take
    them in the caller's shape."""
    leading_shape = x.shape[:-1]
    gate_up, down = _launches(experts, routing, leading_shape, x.dtype)
    if logits.shape[:-1] != leading_shape:
        logits = logits.reshape(*leading_shape, -1)
    (hidden,) = gate_up(x, logits)
    return down(hidden)[0]


def moe_routed_decode(x: mx.array, logits: mx.array, routing: Routing, experts: MoEExperts) -> mx.array:
    """Dispatcher: the implementation for the current backend, these experts and this routing."""
    return moe_routed_decode_implementation(experts, routing, x.dtype, logits.dtype).function(x, logits, routing, experts)


def cuda_unsupported_reason(experts: MoEExperts, routing: Routing, dtype, logits_dtype) -> Optional[str]:
    """Why the kernel cannot take these experts and this routing (dtype: the activations'), or
    None: it needs what the decode kernel and the router kernel each need, and no more."""
    if not flag(ROUTER_SWITCH):
        return f"the CUDA moe_router kernel is switched off ({ROUTER_SWITCH}=0)"
    decode = moe_decode_implementation(experts, dtype)
    if decode.path != "kernel":
        return decode.reason
    return experts.memo(("routed decode", routing, dtype, logits_dtype),
                        lambda: _routing_reason(experts, routing, dtype, logits_dtype))


def _routing_reason(experts: MoEExperts, routing: Routing, dtype, logits_dtype) -> Optional[str]:
    if len(experts.projections) == 1:
        return "a single expert projection: no gate+up launch to route in"
    if routing.kind == "sigmoid_topk":
        return "sigmoid_topk routing (Inkling's) also weighs shared experts: its block routes apart"
    if logits_dtype != dtype:
        return f"router logits of {logits_dtype} for activations of {dtype}: the kernel takes one dtype"
    return router_unsupported_reason(logits_dtype, experts.num_experts, routing)


def moe_routed_decode_implementation(
    experts: Optional[MoEExperts] = None, routing: Optional[Routing] = None, dtype=None, logits_dtype=None
) -> Implementation:
    return choose(
        "moe_routed_decode", moe_routed_decode_reference, moe_routed_decode_kernel, CUDA_KERNEL_SWITCH,
        None if experts is None else lambda: cuda_unsupported_reason(experts, routing, dtype, logits_dtype),
    )
