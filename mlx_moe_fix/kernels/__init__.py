"""MoE ops: each has `<op>_reference` (pure MLX), a dispatcher `<op>` with the same signature,
and `<op>_implementation()` saying which one the current backend runs: `moe_prefill` and
`moe_decode` (the experts), `moe_router` (a block's top-k routing), `moe_routed_decode` (the
two fused: a block's routing inside the decode kernel's first launch), `moe_shared_decode` (the
experts with a block's always-on shared experts in the same two launches).

`plan()` picks the op for a call: the sorted grouped prefill when many (token, expert) pairs are
present, the fused decode otherwise, or none (stock code) when the call is not supported or no
kernel of ours takes it (the op's reference instead where MLX_MOE_FIX_REFERENCES=1).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import mlx.core as mx

from ..env import flag, snapshot
from .backend import REFERENCES_SWITCH, current_backend
from .experts import Activation, ExpertLinear, MoEExperts, RouterLinear, SharedExperts
from .moe_decode import CUDA_KERNEL_SWITCH as DECODE_SWITCH
from .moe_decode import METAL_KERNEL_SWITCH as METAL_DECODE_SWITCH
from .moe_decode import moe_decode, moe_decode_implementation, moe_decode_reference
from .moe_prefill import CUDA_KERNEL_SWITCH as PREFILL_SWITCH
from .moe_prefill import moe_prefill, moe_prefill_implementation, moe_prefill_reference
from .moe_routed_decode import fusable_router, fused_router_reason, logits_dtype, moe_routed_decode
from .moe_routed_decode import moe_routed_decode_implementation
from .moe_routed_decode import moe_routed_decode_reference
from .moe_router import Routing, moe_router, moe_router_implementation, moe_router_reference
from .moe_shared_decode import moe_shared_decode, moe_shared_decode_call_reason, moe_shared_decode_implementation
from .moe_shared_decode import moe_shared_decode_reference
from .reference import add_residual, combine

# mlx-lm's SwitchGLU sorts at this many pairs; the references follow it so that they reproduce
# stock numerics exactly.
PREFILL_MIN_PAIRS = 64
# Below PREFILL_MIN_PAIRS the decode op reads an expert's rows once per pair. From this many pairs
# per expert on (batched decode of few-expert models: Mixtral from batch 8), the grouped prefill
# kernel takes the call where it runs: it reads each routed expert once (H200, Mixtral shapes,
# 16 tokens: 1.0-1.3 TB/s of routed weights, docs/benchmarks.md, where the decode kernel reads
# each expert about twice at batch 8 and four times at batch 16).
GROUPED_MIN_PAIRS_PER_EXPERT = 2


class Plan(NamedTuple):
    phase: str  # "prefill" or "decode"
    path: str  # "kernel", "reference" or "stock"
    reason: str
    function: Optional[Callable]  # None: run the original code


def plan(
    x: mx.array, indices: mx.array, experts: MoEExperts, *, prefill: bool = True, decode: bool = True,
    token_by_token: bool = False,
) -> Plan:
    """token_by_token: each token's result must equal what a call with that token alone gives
    (mlx-vlm's decode-block path, which verifies a block of drafted tokens against token-by-token
    decode): the decode kernel computes every (token, expert) pair alike, whatever else the call
    holds, and takes the block whole; otherwise the call stays with upstream's block path (its
    own exact kernels on Metal, per-pair projections elsewhere)."""
    switches = (current_backend(), flag(PREFILL_SWITCH), flag(DECODE_SWITCH), flag(METAL_DECODE_SWITCH),
                flag(REFERENCES_SWITCH))
    if indices.size >= PREFILL_MIN_PAIRS:
        return _plan(x, indices, experts, prefill, decode, token_by_token, switches)
    # A decode step calls every layer with the same few shapes: plan each once (a prefill's
    # shapes vary with the prompt, so its plans are not kept).
    return experts.memo(
        ("call plan", x.shape, x.dtype, indices.shape, prefill, decode, token_by_token, switches),
        lambda: _plan(x, indices, experts, prefill, decode, token_by_token, switches),
    )


def routed_plan(x: mx.array, logits, routing: Routing, experts: MoEExperts, *, decode: bool = True,
                shared: Optional[SharedExperts] = None) -> Optional[Plan]:
    """The plan of a block's call whose routing and experts (and always-on `shared` experts, where
    the block has them) one fused kernel can take (moe_routed_decode), or None: then the block
    routes (moe_router) and calls its experts, planned as any experts call (a prefill, grouped
    decode, an unsupported call, or no fused kernel on this backend). `logits`: the router's logits
    for x's tokens ([tokens, E], in x's leading shape or flat; E counting the shared experts where
    the routing weighs them), or the RouterLinear that gives them, planned only where the fused
    kernel computes them too (fused_router_reason): else None, and the caller runs its router and
    asks again with the logits."""
    router = isinstance(logits, RouterLinear)
    tokens = x.size // x.shape[-1]
    if not decode or (not router and logits.size // logits.shape[-1] != tokens):
        return None
    if not _per_pair_sized(tokens * routing.top_k, experts):
        return None
    if router and fused_router_reason(x, logits, experts, routing.top_k) is not None:
        return None
    experts_count = logits.output_dims if router else logits.shape[-1]
    dtype = logits_dtype(x, logits)
    return experts.memo(("routed plan", x.shape, x.dtype, router, experts_count, dtype, routing, shared, current_backend(),
                         snapshot()),
                        lambda: _routed_plan(x, experts_count, dtype, routing, experts, router, shared))


def shared_plan(x: mx.array, indices: mx.array, experts: MoEExperts, shared: SharedExperts, shared_weights: mx.array, *,
                decode: bool = True) -> Optional[Plan]:
    """The plan of an experts call (routing weights given) whose block adds always-on shared
    experts, where one fused kernel takes both (moe_shared_decode), or None: the caller then calls
    its experts (planned as any experts call) and its shared experts apart."""
    if not decode or not _per_pair_sized(indices.size, experts):
        return None
    if experts.unsupported_reason(x, indices) is not None or moe_shared_decode_call_reason(x, shared, shared_weights):
        return None
    implementation = moe_shared_decode_implementation(experts, shared, x.dtype)
    if implementation.path != "kernel":
        return None
    return Plan("decode", "kernel", f"{implementation.reason}: the shared experts inside the decode launches",
                implementation.function)


def _per_pair_sized(pairs: int, experts: MoEExperts) -> bool:
    """Few enough pairs for the decode kernels, which read an expert's rows once per pair: the
    fused block ops' calls."""
    return pairs < PREFILL_MIN_PAIRS and not _grouped_sized(pairs, experts)


def _grouped_sized(pairs: int, experts: MoEExperts) -> bool:
    """Enough pairs for a decode call to take the grouped kernel (each routed expert read once)."""
    return pairs >= GROUPED_MIN_PAIRS_PER_EXPERT * experts.num_experts


def _routed_plan(x, experts_count: int, dtype, routing: Routing, experts: MoEExperts, router: bool,
                 shared: Optional[SharedExperts]) -> Optional[Plan]:
    # x alone: routed_plan checked that the logits have x's tokens
    if experts_count != experts.num_experts + routing.shared or experts.unsupported_reason(x) is not None:
        return None
    implementation = moe_routed_decode_implementation(experts, routing, x.dtype, dtype, shared)
    if implementation.path != "kernel":
        return None
    inside = "the router's matmul and the routing" if router else "the routing"
    with_shared = "" if shared is None else ", the shared experts in the decode launches"
    return Plan("decode", "kernel", f"{implementation.reason}: {inside} inside the gate+up launch{with_shared}",
                implementation.function)


def _plan(x, indices, experts: MoEExperts, prefill: bool, decode: bool, token_by_token: bool, switches: tuple) -> Plan:
    phase = "decode" if token_by_token else "prefill" if indices.size >= PREFILL_MIN_PAIRS else "decode"
    reason = experts.unsupported_reason(x, indices)
    if reason is None and not (prefill if phase == "prefill" else decode):
        reason = f"{phase} disabled by apply({phase}=False)"
    if reason is not None:
        return Plan(phase, "stock", reason, None)
    grouped = not token_by_token and phase == "decode" and _grouped_sized(indices.size, experts)
    return experts.memo(
        ("plan", phase, grouped, token_by_token, x.dtype, switches),
        lambda: _supported_plan(phase, experts, x.dtype, grouped, token_by_token),
    )


def _supported_plan(phase: str, experts: MoEExperts, dtype, grouped: bool, token_by_token: bool) -> Plan:
    if token_by_token:
        implementation = moe_decode_implementation(experts, dtype)
        if implementation.path == "kernel":
            return Plan(phase, "kernel", f"{implementation.reason}: every token computed as if alone", implementation.function)
        return Plan(phase, "stock", "a block that must match token-by-token decode stays on upstream's block path "
                    f"(no decode kernel: {implementation.reason})", None)
    if grouped:
        implementation = moe_prefill_implementation(experts, dtype)
        if implementation.path == "kernel":
            return Plan(phase, "kernel", f"{implementation.reason}: {GROUPED_MIN_PAIRS_PER_EXPERT}+ pairs per expert, "
                        "each routed expert read once", implementation.function)
    implementation = (moe_prefill_implementation if phase == "prefill" else moe_decode_implementation)(experts, dtype)
    if implementation.path == "reference" and not flag(REFERENCES_SWITCH):
        # the reference is upstream's math restated, with our wrappers' host time on top
        return Plan(phase, "stock", f"{implementation.reason}: upstream's code runs ({REFERENCES_SWITCH}=1: the "
                    "reference)", None)
    return Plan(phase, implementation.path, implementation.reason, implementation.function)


__all__ = [
    "Activation",
    "ExpertLinear",
    "MoEExperts",
    "PREFILL_MIN_PAIRS",
    "Plan",
    "RouterLinear",
    "Routing",
    "SharedExperts",
    "add_residual",
    "combine",
    "current_backend",
    "fusable_router",
    "moe_decode",
    "moe_decode_reference",
    "moe_prefill",
    "moe_prefill_reference",
    "moe_router",
    "moe_router_implementation",
    "moe_router_reference",
    "moe_routed_decode",
    "moe_routed_decode_implementation",
    "moe_routed_decode_reference",
    "moe_shared_decode",
    "moe_shared_decode_implementation",
    "moe_shared_decode_reference",
    "plan",
    "routed_plan",
    "shared_plan",
]
