"""Wrappers of mlx-lm MoE blocks whose routing `moe_router` knows: the block's own router
computes the logits, `moe_router` the experts and weights, and the experts call takes the
weights (`weights=`, which only these wrappers pass), so that the weighted combine happens inside
the expert op (the fused decode does it in its down launch). A block with a sharding group runs
upstream's code (its experts still go through the patched switch layer). No math here."""

from __future__ import annotations

import functools

from ..kernels import Routing, moe_router
from .compiled import compiled_at_decode
from .switch_layers import bind


# One Routing per distinct configuration, so that the router's dispatch cache sees equal keys
# without rebuilding them per call.
routing = functools.lru_cache(maxsize=None)(Routing)


def routed_block(routing_of, router: str = "gate", experts: str = "switch_mlp"):
    """The wrapper of a block `__call__(x)` whose `router` linear gives the logits, routed with
    `routing_of(block)`, and whose `experts` outputs are combined with the routing weights."""

    def routed(wrapped, instance, args, kwargs):
        (x,) = bind(args, kwargs, ("x",))
        indices, weights = moe_router(instance[router](x), routing_of(instance))
        return instance[experts](x, indices, weights=weights)

    compiled_routed = compiled_at_decode(routed)

    def wrapper(wrapped, instance, args, kwargs):
        # Upstream's sharded block sums over its group after the experts: not compiled here.
        if getattr(instance, "sharding_group", None) is not None:
            return wrapped(*args, **kwargs)
        return compiled_routed(wrapped, instance, args, kwargs)

    return wrapper


# mlx_lm.models.qwen3_moe.Qwen3MoeSparseMoeBlock: softmax, top-k, optional renormalisation.
qwen3_moe = routed_block(lambda block: routing("softmax_topk", block.top_k, bool(block.norm_topk_prob)))
# mlx_lm.models.mixtral.MixtralSparseMoeBlock: top-k logits, softmax over them.
mixtral = routed_block(lambda block: routing("topk_softmax", block.num_experts_per_tok))
# mlx_lm.models.gpt_oss.MLPBlock: the same through gpt-oss's mlx_topk, with a biased router.
gpt_oss = routed_block(lambda block: routing("topk_softmax_last", block.num_experts_per_tok), "router", "experts")
