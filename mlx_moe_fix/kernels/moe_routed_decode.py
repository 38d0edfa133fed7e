"""Fused decode MoE that routes too: router logits [..., E] (or the router linear that gives
them, `RouterLinear`) and the block's Routing in, the routing-weighted sum over the k experts
out, for the blocks whose routing `moe_router` knows.

Reference: the router linear's logits where it is given, `moe_router_reference`, then
`moe_decode_reference` with the weights (what the block computes unfused). CUDA kernel
(`cuda/moe_routed_decode.cu`): moe_decode's gate+up launch with moe_router's routing done inside
it, then moe_decode's combining down launch: two launches where the unfused block makes three
(docs/decode-attribution.md: at batch 1 a launch costs more host and GPU time than the routing's
arithmetic). The experts and weights pass between the two in the hidden output's tail
(RoutingTail in cuda/moe_decode.cu), so that each launch has one output and the down launch
(moe_decode.cu's routed_down) no routing inputs. It routes with moe_router's device code, so its
experts and weights are the router kernel's, bit for bit. Given a RouterLinear at a single token
(`fused_router_reason`), the gate+up launch (`router_gate_up`) also computes the logits, bit for
bit as MLX's quantized_matmul does, so that the block is two launches and no router node; else
the router linear runs as its own node first. Every block of the launch computes the logits
whole, so only where its blocks fit one wave of the GPU (each further wave would compute them
again before its first expert load: at Mixtral's shape, 1792 blocks in ~3.4 waves, the launch took
60.6 µs against the router's 5.7 and the gate+up's 46.3; docs/benchmarks.md, thirty-first
session). It saves the host a node: qwen3_moe's batch-1 decode 0.980 of its dense equivalent
against 0.964 with the router's node in one process (docs/benchmarks.md, forty-second session;
with the logits shared by clusters of 8 blocks, 0.962-0.998 against 0.932-0.958 in four processes,
thirty-second session). No clusters since the forty-second session: MLX caches a CUDA graph's
kernel nodes without their cluster shape, and a plain MLX graph once came out unwritten after the
clustered launch had run (not reproduced since; docs/benchmarks.md, forty-first and forty-second
sessions). MLX_MOE_FIX_CUDA_FUSED_ROUTER=0 turns it off.
MLX_MOE_FIX_CUDA_ROUTED_DECODE=0 turns the fused kernel off (the block then routes and runs its
experts in separate launches).

Given a residual (the decoder layer's, patches/decoder_layers.py), the down launch adds it to its
output, bit for bit as MLX adds two arrays of the output's dtype: the layer's add is then no node of
its own (qwen3_moe at batch 1 0.989-1.030 of its dense equivalent against 0.941-0.985 without, in
six processes; docs/benchmarks.md, thirty-fourth session).

Given the block's always-on shared experts (Inkling's block: sigmoid_topk routing, its correction
bias and global scale), the two launches are moe_shared_decode's with the routing inside the
gate+up launch (`sigmoid_shared_gate_up`, then moe_decode.cu's `routed_shared_down`): the block is
its router's matmul and two launches, where it was those and the router's launch.
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx

from .. import trace
from ..env import flag
from .backend import Implementation, choose, compute_capability, current_backend, multiprocessor_count
from .experts import SUPPORTED_GROUP_SIZES, MoEExperts, RouterLinear, SharedExperts
from .launch import cuda_kernel_object, float_array, int_array, source_constants
from .moe_decode import gate_up_block_shape, gate_up_fixed_inputs, gate_up_grid, gate_up_launch, moe_decode_implementation
from .moe_decode import shared_gate_up_fixed_inputs
from .moe_decode import moe_decode_reference
from .moe_decode import routed_down_launch, shared_split_bytes
from .moe_decode import INPUTS as DECODE_INPUTS
from .moe_router import CUDA_KERNEL_SWITCH as ROUTER_SWITCH
from .moe_router import SQRTSOFTPLUS_KINDS, Routing, moe_router_reference
from .moe_router import cuda_unsupported_reason as router_unsupported_reason
from .moe_shared_decode import moe_shared_decode_implementation, moe_shared_decode_reference
from .reference import add_residual

CUDA_KERNEL_SWITCH = "MLX_MOE_FIX_CUDA_ROUTED_DECODE"
FUSED_ROUTER_SWITCH = "MLX_MOE_FIX_CUDA_FUSED_ROUTER"
# The kernels' parameters, in the order of their `inputs` / outputs.
INPUTS = {"routed_gate_up": ["x", "logits", *DECODE_INPUTS["gate_up"][2:]],
          "router_gate_up": ["x", "router_w", "router_s", "router_b", *DECODE_INPUTS["gate_up"][2:]],
          "sigmoid_shared_gate_up": ["x", "logits", "correction", "global_scale", *DECODE_INPUTS["shared_gate_up"][3:]]}
OUTPUTS = {"routed_gate_up": ["hidden"], "router_gate_up": ["hidden"], "sigmoid_shared_gate_up": ["hidden"]}
MAX_FUSED_ROUTER_EXPERTS = 256  # the logits route_token takes (32 lanes x 8 bf16)


def moe_routed_decode_reference(x: mx.array, logits, routing: Routing, experts: MoEExperts,
                                residual: Optional[mx.array] = None, shared: Optional[SharedExperts] = None,
                                correction_bias: Optional[mx.array] = None,
                                global_scale: Optional[mx.array] = None) -> mx.array:
    """x: [..., D], logits: the router's logits for x's tokens (E, then the shared experts' where
    the routing weighs them) or the RouterLinear that gives them; returns [..., out]: the experts'
    outputs weighted by the routing's weights and summed over its k, plus the block's always-on
    `shared` experts' output where given (moe_shared_decode_reference, each weighted by its
    routing weight where the routing gives them: sigmoid_topk of shared_width 1), plus `residual`
    where given (a decoder layer's add after its MoE block: add_residual). correction_bias and
    global_scale: sigmoid_topk's (moe_router)."""
    if isinstance(logits, RouterLinear):
        logits = logits(x)
    if logits.shape[:-1] != x.shape[:-1]:
        logits = logits.reshape(*x.shape[:-1], logits.shape[-1])
    indices, weights, *shared_weights = moe_router_reference(logits, routing, correction_bias, global_scale)
    if shared is None:
        out = moe_decode_reference(x, indices, experts, weights)
    else:
        out = moe_shared_decode_reference(x, indices, experts, weights, shared, *shared_weights)
    return add_residual(out, residual)


def _launches(experts: MoEExperts, routing: Routing, leading_shape: tuple, dtype, router: Optional[tuple] = None,
              residual: bool = False, shared: Optional[SharedExperts] = None) -> tuple:
    """(routed gate+up, combining down) for this call's shape, cached on the experts object;
    given `router` = (bits, group size) of a RouterLinear, the gate+up launch that computes the
    logits too (router_gate_up); with `residual`, the down launch that adds a residual input to
    its output; with `shared` (sigmoid_topk routing), the two with the block's shared experts
    (sigmoid_shared_gate_up, routed_shared_down). The down launch's output has the call's leading
    shape, so that the call adds no reshape to the graph: at batch 1 every node costs the host a
    few µs (docs/decode-attribution.md)."""

    def plan():
        tokens = math.prod(leading_shape)
        pairs = tokens * routing.top_k
        split_bytes = shared_split_bytes(experts, dtype, "cuda")
        if shared is None:
            gate_up = gate_up_launch(experts, routing.top_k, pairs, dtype, "cuda")
            fixed = gate_up_fixed_inputs(experts, routing.top_k)
            section = "routed_gate_up" if router is None else "router_gate_up"
            template = gate_up.template + [("SOFTMAX_FIRST", routing.kind == "softmax_topk"),
                                           ("NORMALIZE", routing.normalize), ("LAST_K", routing.kind != "topk_softmax")]
        else:
            gate_up = gate_up_launch(experts, routing.top_k, tokens * (routing.top_k + shared.count), dtype, "cuda", shared,
                                     weighted=True)
            fixed = shared_gate_up_fixed_inputs(experts, routing.top_k, shared)
            fixed["params"] = float_array(*fixed["params"].tolist(), routing.scale)
            section = "sigmoid_shared_gate_up"
            template = [(name, value) for name, value in gate_up.template if name != "SHARED_WEIGHTS"]
        fixed["dims"] = int_array(*fixed["dims"].tolist(), experts.num_experts)
        constants, arrays = source_constants(fixed)
        (rows, hidden_dims), itemsize = gate_up.output_shapes[0], dtype.size
        if router is not None:
            template += [("ROUTER_BITS", router[0]), ("ROUTER_GROUP", router[1])]
        routed_gate_up = gate_up._replace(
            kernel=cuda_kernel_object("moe_routed_decode.cu", section, tuple(INPUTS[section]), tuple(OUTPUTS[section]),
                                      split_bytes, gate_up_block_shape().launch_bounds(), constants),
            fixed_inputs=arrays,
            template=template,
            # each pair's row, then its expert (uint32) and weight (dtype): RoutingTail in the source
            output_shapes=[(rows * hidden_dims + pairs * (4 + itemsize) // itemsize,)],
        )
        routed_down = routed_down_launch(experts, routing.top_k, pairs, dtype, residual, shared)._replace(
            output_shapes=[(*leading_shape, experts.output_dims)])
        return routed_gate_up, routed_down

    return experts.memo(("routed decode launches", routing, leading_shape, dtype, router, residual, shared), plan)


def moe_routed_decode_kernel(x: mx.array, logits, routing: Routing, experts: MoEExperts,
                             residual: Optional[mx.array] = None, shared: Optional[SharedExperts] = None,
                             correction_bias: Optional[mx.array] = None, global_scale: Optional[mx.array] = None) -> mx.array:
    """The CUDA implementation; same contract as moe_routed_decode_reference. The kernels read x
    and the logits as rows of contiguous memory (MLX copies an input that is not), so they take
    them in the caller's shapes (the logits' rows x's tokens). A RouterLinear's logits are computed
    in the gate+up launch where fused_router_reason allows, else by the linear first. A residual of
    the output's shape and dtype is added in the down launch where the block has no shared experts
    (one node fewer: at batch 1 a node costs the host ~3.6 µs, docs/benchmarks.md, thirty-third
    session), any other by MLX after it."""
    leading_shape = x.shape[:-1]
    fused_residual = (shared is None and residual is not None and residual.shape == (*leading_shape, experts.output_dims)
                      and residual.dtype == x.dtype)
    passed_residual = (residual,) if fused_residual else ()
    router = None
    if isinstance(logits, RouterLinear):
        if fused_router_reason(x, logits, experts, routing.top_k) is None:
            router = (logits.bits, logits.group_size)
        else:
            logits = logits(x)
    gate_up, down = _launches(experts, routing, leading_shape, x.dtype, router, fused_residual, shared)
    if router is not None:
        (hidden,) = gate_up(x, logits.weight, logits.scales, logits.biases)
    elif shared is not None:
        (hidden,) = gate_up(x, logits, correction_bias, global_scale)
    else:
        (hidden,) = gate_up(x, logits)
    trace.observe_routing(lambda: routed_experts(hidden, leading_shape, routing.top_k))
    out = down(hidden, *passed_residual)[0]
    return out if fused_residual else add_residual(out, residual)


def routed_experts(hidden: mx.array, leading_shape: tuple, top_k: int) -> mx.array:
    """The experts [*leading_shape, top_k] (uint32) that a routed gate+up launch chose, from the
    RoutingTail at the end of its output `hidden` (each pair's expert, then its weight)."""
    pairs = math.prod(leading_shape) * top_k
    itemsize = hidden.dtype.size
    start = hidden.shape[0] - pairs * (4 + itemsize) // itemsize
    return mx.view(hidden[start:start + pairs * 4 // itemsize], mx.uint32).reshape(*leading_shape, top_k)


def moe_routed_decode(x: mx.array, logits, routing: Routing, experts: MoEExperts,
                      residual: Optional[mx.array] = None, shared: Optional[SharedExperts] = None,
                      correction_bias: Optional[mx.array] = None, global_scale: Optional[mx.array] = None) -> mx.array:
    """Dispatcher: the implementation for the current backend, these experts and this routing."""
    implementation = moe_routed_decode_implementation(experts, routing, x.dtype, logits_dtype(x, logits), shared)
    return implementation.function(x, logits, routing, experts, residual, shared, correction_bias, global_scale)


def logits_dtype(x: mx.array, logits):
    """The dtype of the logits, or of those a RouterLinear gives for x."""
    return logits.logits_dtype(x.dtype) if isinstance(logits, RouterLinear) else logits.dtype


def fused_router_reason(x: mx.array, router: RouterLinear, experts: MoEExperts, top_k: int) -> Optional[str]:
    """Why router_gate_up cannot compute this router's logits for this call, or None: it takes one
    token (each of its blocks computes its token's logits whole), bf16 activations and an affine
    4- or 8-bit router of bf16 scales and no additive bias, where its blocks fit one wave."""
    unavailable = fused_router_unavailable_reason()
    if unavailable is not None:
        return unavailable
    tokens = x.size // x.shape[-1]
    if tokens != 1:
        return f"{tokens} tokens: every block would compute its token's logits whole"
    if x.dtype != mx.bfloat16:
        return f"activations of {x.dtype}: the kernel reproduces MLX's bf16 quantized_matmul"
    if router.mode != "affine" or router.bits not in (4, 8) or router.group_size not in SUPPORTED_GROUP_SIZES:
        return f"a {router.mode} {router.bits}-bit router of group {router.group_size} (affine 4- or 8-bit only)"
    if router.biases is None or router.scales.dtype != mx.bfloat16 or router.biases.dtype != mx.bfloat16:
        return "router scales and biases other than bf16"
    if router.bias is not None:
        return "a router with an additive bias"
    if router.output_dims != experts.num_experts or router.input_dims != experts.input_dims:
        return f"a router of {router.input_dims} -> {router.output_dims} for experts of {experts.input_dims} x {experts.num_experts}"
    if any(p.mode != "affine" for p in experts.projections):
        return "experts not affine-quantized: router_gate_up is verified with affine experts only"
    if router.output_dims > MAX_FUSED_ROUTER_EXPERTS:
        return f"{router.output_dims} experts (at most {MAX_FUSED_ROUTER_EXPERTS})"
    return experts.memo(("fused router waves", top_k), lambda: _waves_reason(experts, top_k))


def fused_router_blocks(experts: MoEExperts, top_k: int) -> int:
    """The blocks of router_gate_up's launch at one token: the gate+up's grid along x, for each of
    the k pairs."""
    (threads_x, _, _), block = gate_up_grid(experts, top_k)
    return threads_x // block[0] * top_k


def one_wave_blocks() -> Optional[int]:
    """The gate+up launch's blocks that the GPU runs at once (its launch bounds' blocks an SM, on
    every SM), or None where the SM count is unknown."""
    sms = multiprocessor_count()
    shape = gate_up_block_shape()
    return None if sms is None else sms * (shape.resident // shape.warps)


def _waves_reason(experts: MoEExperts, top_k: int) -> Optional[str]:
    capacity = one_wave_blocks()
    if capacity is None:
        return "the GPU's SM count is unknown here (the CUDA driver was not found): one wave cannot be sized"
    blocks = fused_router_blocks(experts, top_k)
    if blocks > capacity:
        return (f"{blocks} gate+up blocks, more than the {capacity} of one wave: each wave would compute the logits "
                "again before its expert loads")
    return None


def fused_router_unavailable_reason() -> Optional[str]:
    """Why no call here can have its router's logits computed in the gate+up launch, whatever its
    router and shape, or None. The switch first: the patched blocks ask at every call
    (fusable_router)."""
    if not flag(FUSED_ROUTER_SWITCH):
        return f"switched off ({FUSED_ROUTER_SWITCH}=0)"
    if current_backend() != "cuda":
        return f"{current_backend()}: router_gate_up is a CUDA kernel"
    capability = compute_capability()
    if capability is None or capability < (8, 0):
        return "a GPU before compute capability 8.0 (the kernel's bf16x2 arithmetic; run on 9.0 only)"
    return None


def fusable_router(module) -> Optional[RouterLinear]:
    """`module` as a RouterLinear, where a routed decode here may compute its logits inside the
    gate+up launch (fused_router_reason then decides per call); else None, without reading it."""
    return RouterLinear.from_module(module) if fused_router_unavailable_reason() is None else None


def fused_router_state() -> dict:
    """For status(): whether routed decode blocks compute their router's logits inside the gate+up
    launch here (router_gate_up), and why."""
    if moe_routed_decode_implementation().path != "kernel" or not mx.cuda.is_available():
        return {"on": False, "reason": "the CUDA routed decode kernel does not run here"}
    unavailable = fused_router_unavailable_reason()
    if unavailable is not None:
        return {"on": False, "reason": unavailable}
    return {"on": True, "reason": "at a single token, for bf16 affine 4- or 8-bit routers without a bias, where the gate+up "
                                  "launch's blocks fit one wave"}


def cuda_unsupported_reason(experts: MoEExperts, routing: Routing, dtype, logits_dtype,
                            shared: Optional[SharedExperts] = None) -> Optional[str]:
    """Why the kernel cannot take these experts, this routing and these shared experts (dtype: the
    activations'), or None: it needs what the decode kernel (with shared experts: the shared decode
    kernel) and the router kernel each need, and no more."""
    if not flag(ROUTER_SWITCH):
        return f"the CUDA moe_router kernel is switched off ({ROUTER_SWITCH}=0)"
    decode = moe_decode_implementation(experts, dtype) if shared is None else moe_shared_decode_implementation(
        experts, shared, dtype)
    if decode.path != "kernel":
        return decode.reason
    return experts.memo(("routed decode", routing, dtype, logits_dtype, shared),
                        lambda: _routing_reason(experts, routing, dtype, logits_dtype, shared))


def _routing_reason(experts: MoEExperts, routing: Routing, dtype, logits_dtype, shared: Optional[SharedExperts]) -> Optional[str]:
    if len(experts.projections) == 1:
        return "a single expert projection: no gate+up launch to route in"
    if routing.kind in SQRTSOFTPLUS_KINDS:
        return f"{routing.kind} routing (DeepSeek-V4's): the kernel's routing tail holds no float32 weights"
    if (routing.kind == "sigmoid_topk") != (shared is not None):
        return ("sigmoid_topk routing (Inkling's) without its shared experts: the kernel routes it with them only"
                if shared is None else f"shared experts with {routing.kind} routing: the kernel routes shared experts by "
                "sigmoid_topk (Inkling's) only")
    if shared is not None and (routing.shared, routing.shared_width) != (shared.count, 1):
        return (f"a routing of {routing.shared} shared experts {routing.shared_width} columns a weight for "
                f"{shared.count} shared experts: the kernel weighs each by one weight")
    if logits_dtype != dtype:
        return f"router logits of {logits_dtype} for activations of {dtype}: the kernel takes one dtype"
    return router_unsupported_reason(logits_dtype, experts.num_experts + routing.shared, routing)


def moe_routed_decode_implementation(
    experts: Optional[MoEExperts] = None, routing: Optional[Routing] = None, dtype=None, logits_dtype=None,
    shared: Optional[SharedExperts] = None,
) -> Implementation:
    return choose(
        "moe_routed_decode", moe_routed_decode_reference, moe_routed_decode_kernel, CUDA_KERNEL_SWITCH,
        None if experts is None else lambda: cuda_unsupported_reason(experts, routing, dtype, logits_dtype, shared),
    )
