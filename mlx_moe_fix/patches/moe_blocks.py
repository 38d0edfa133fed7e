"""Wrappers of whole MoE blocks. Those whose routing `moe_router` knows (mlx-lm's qwen3_moe,
mixtral, gpt_oss): the block's own router computes the logits, `moe_router` the experts and
weights, and the experts call takes the weights (`weights=`, which only these wrappers pass), so
that the weighted combine happens inside the expert op (the fused decode does it in its down
launch); at decode, where one kernel can take both, the routing and the experts are one op
(`moe_routed_decode`: the routing inside the decode kernel's first launch), which at a single
token can also compute the logits from the router's quantized linear (`fusable_router`). The others
(DeepSeek's): upstream's code as is, except that mlx-vlm's (DeepSeek-V4's) hands its gate's
experts and weights with its shared experts to one op at decode where one takes them
(`with_shared_experts`), its gate's routing after the matmul one `moe_router` launch where that
repeats it (`deepseek_v4_routing`). All compile their calls per shape (patches/compiled.py).
A block with a sharding group runs upstream's code uncompiled (its experts still go through the
patched switch layer). The routed blocks also take the decoder layer's residual after x
(`block(x, residual)`, from decoder_layers.py only, where takes_residual(block)): they then return
`residual + block(x)`, added inside the fused decode's down launch where it runs (one node fewer a
layer) and by kernels.add_residual elsewhere. No math here."""

from __future__ import annotations

import functools
import sys
from typing import Optional

from ..kernels import Routing, add_residual, fusable_router, moe_router
from .compiled import compiled_per_shape
from .methods import wrapper_of
from .switch_layers import bind, describe_shared, routed_experts_call, shared_experts_call


# One Routing per distinct configuration, so that the router's dispatch cache sees equal keys
# without rebuilding them per call.
routing = functools.lru_cache(maxsize=None)(Routing)


def sharded(instance) -> bool:
    return getattr(instance, "sharding_group", None) is not None


def unsharded_compiled(wrapper):
    """`wrapper` with decode steps compiled (patches/compiled.py), except in a block with a
    sharding group: upstream's sharded block sums over its group after the experts."""
    return compiled_per_shape(wrapper, runs_as_is=sharded)


def upstream(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


# Blocks whose routing moe_router does not know (DeepSeek's group-limited or sqrt-softplus
# gates): upstream's code, its own routing included, with decode steps compiled, so that the
# routing's dozen small ops cost no Python per step (mlx-vlm's, with shared experts the fused
# decode takes: shared_experts_block).
upstream_block = unsharded_compiled(upstream)


def shared_experts_count(block):
    """The shared experts of mlx-vlm's MoE block (its config's n_shared_experts, DeepSeek-V4's), or
    None where it does not say."""
    return getattr(vars(block).get("config"), "n_shared_experts", None)


DEEPSEEK_V4 = "mlx_vlm.models.deepseek_v4.language"


def deepseek_v4_routing(gate, x) -> Optional[Routing]:
    """The Routing of DeepSeek-V4's gate (its MoEGate, that class exactly) for a call on x [B, L, D]
    where moe_router repeats it: sqrt-softplus scoring (the layer routed by its scores or by token
    hash), not a vision model's, not training, and not upstream's decode-block call (1 < L <=
    DECODE_BLOCK_SIZE, which routes token by token); else None."""
    if type(gate).__name__ != "MoEGate" or type(gate).__module__ != DEEPSEEK_V4:
        return None
    if gate.vision or gate.training or gate.scoring_func != "sqrtsoftplus" or x.ndim != 3:
        return None
    if 1 < x.shape[1] <= sys.modules[DEEPSEEK_V4].DECODE_BLOCK_SIZE:
        return None
    return routing("sqrtsoftplus_hash" if gate.hash else "sqrtsoftplus_topk", gate.top_k, bool(gate.norm_topk_prob),
                   scale=float(gate.routed_scaling_factor))


def gate_call(gate, args: tuple, kwargs: dict) -> tuple:
    """(experts, weights) of the block's gate for this call: upstream's matmul and moe_router where
    deepseek_v4_routing knows the gate (a hash layer's given its token ids), else the gate's own call."""
    gate_routing = deepseek_v4_routing(gate, args[0])
    if gate_routing is None:
        return gate(*args, **kwargs)
    logits = args[0] @ gate.weight.T
    if gate_routing.kind == "sqrtsoftplus_topk":
        return moe_router(logits, gate_routing, gate.e_score_correction_bias)
    _, input_ids = bind(args, kwargs, ("x", "input_ids"))
    if input_ids is None:
        return gate(*args, **kwargs)  # (upstream's error)
    return moe_router(logits, gate_routing, token_ids=input_ids, expert_table=gate.tid2eid)


def with_shared_experts(wrapped, instance, args, kwargs):
    """mlx-vlm's MoE.__call__(x, *gate_args, residual=None, **gate_kwargs) (DeepSeek-V4's block):
    for shared experts of a known class (describe_shared), upstream's steps (its gate's routing
    through gate_call) with its routed and shared experts one op where one takes both
    (switch_layers.shared_experts_call) and upstream's combine then adding the residual; else
    upstream's call (which then routes again: the first routing's graph is left unevaluated)."""
    count = shared_experts_count(instance)
    shared = None if count is None else describe_shared(instance.shared_experts, count)
    if not args or shared is None:
        return wrapped(*args, **kwargs)
    experts, residual = instance.switch_mlp, kwargs.get("residual")
    gate_kwargs = {name: value for name, value in kwargs.items() if name != "residual"}
    indices, weights = gate_call(instance.gate, args, gate_kwargs)
    fused = shared_experts_call(experts, args[0], indices, weights, shared)
    if fused is None:
        return wrapped(*args, **kwargs)
    return experts._combine(fused, None, None, residual)


shared_experts_block = unsharded_compiled(with_shared_experts)


def routed_block(routing_of, router: str = "gate", experts: str = "switch_mlp"):
    """The wrapper of a block `__call__(x)` whose `router` linear gives the logits, routed with
    `routing_of(block)`, and whose `experts` outputs are combined with the routing weights; also
    of `__call__(x, residual)` (see the module's docstring)."""

    def routed(wrapped, instance, args, kwargs):
        x, residual = bind(args, kwargs, ("x", "residual"))
        gate, layer, block_routing = instance[router], instance[experts], routing_of(instance)
        fused = routed_experts_call(layer, x, fusable_router(gate), block_routing, residual)
        if fused is not None:
            return fused
        logits = gate(x)
        fused = routed_experts_call(layer, x, logits, block_routing, residual)
        if fused is not None:
            return fused
        indices, weights = moe_router(logits, block_routing)
        return add_residual(layer(x, indices, weights=weights), residual)

    return unsharded_compiled(routed)


def qwen3_moe_routing(block) -> Routing:
    """mlx_lm.models.qwen3_moe.Qwen3MoeSparseMoeBlock's: softmax, top-k, optional renormalisation."""
    return routing("softmax_topk", block.top_k, bool(block.norm_topk_prob))


def mixtral_routing(block) -> Routing:
    """mlx_lm.models.mixtral.MixtralSparseMoeBlock's: top-k logits, softmax over them."""
    return routing("topk_softmax", block.num_experts_per_tok)


def gpt_oss_routing(block) -> Routing:
    """mlx_lm.models.gpt_oss.MLPBlock's: mixtral's through gpt-oss's mlx_topk, with a biased router."""
    return routing("topk_softmax_last", block.num_experts_per_tok)


qwen3_moe = routed_block(qwen3_moe_routing)
mixtral = routed_block(mixtral_routing)
gpt_oss = routed_block(gpt_oss_routing, "router", "experts")


_RESIDUAL_BLOCKS = frozenset((qwen3_moe, mixtral, gpt_oss))


def takes_residual(block) -> bool:
    """Whether `block(x, residual)` runs a routed block's wrapper above: its class's call is that
    wrapper's patched method (not a subclass's override, nor another module), and it has no
    sharding group (whose call is upstream's, of x alone)."""
    return wrapper_of(type(block).__call__) in _RESIDUAL_BLOCKS and not sharded(block)
