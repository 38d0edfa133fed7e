"""Decoder layers of mlx-lm's routed MoE families that hand their last residual add to their MoE
block (`block(x, residual)`, moe_blocks.py), so that at decode the add runs inside the fused
decode's down launch: one node fewer a layer, of the ~3.6 µs of host time an MLX node costs at
batch 1 (docs/benchmarks.md, thirty-third session: the MoE decoder layers without that add read
1.006 of their dense equivalent where the patched model read 0.989, in one process).

Each wrapper restates upstream's method (attention, residual add, norm, block, residual add), so
it is applied only where upstream's source is the one it restates, by digest (Target.source_digest):
any other version keeps its own method, reported as unsupported by status(). A layer whose block
does not take the residual (a dense MLP layer, a sharded, unpatched or overridden block) runs
upstream's method, as does every layer with MLX_MOE_FIX_RESIDUAL_IN_BLOCK=0."""

from __future__ import annotations

from ..env import flag
from .moe_blocks import takes_residual
from .switch_layers import bind

SWITCH = "MLX_MOE_FIX_RESIDUAL_IN_BLOCK"


def residual_in_block(block: str):
    """The wrapper of a decoder layer `__call__(x, mask, cache)` whose MoE block is its `block`
    child, computing `h = x + self_attn(input_layernorm(x), mask, cache)`, then
    `h + block(post_attention_layernorm(h))` as `block(post_attention_layernorm(h), h)`."""

    def wrapper(wrapped, instance, args, kwargs):
        moe = instance[block]
        if not (flag(SWITCH) and takes_residual(moe)):
            return wrapped(*args, **kwargs)
        x, mask, cache = args if len(args) == 3 and not kwargs else bind(args, kwargs, ("x", "mask", "cache"))
        h = x + instance.self_attn(instance.input_layernorm(x), mask, cache)
        return moe(instance.post_attention_layernorm(h), h)

    return wrapper


# Qwen3MoeDecoderLayer's and MixtralDecoderLayer's `r = ...; h = x + r; r = block(...); out = h + r`
# and gpt_oss TransformerBlock's `residual = x; ...; x = residual + x`, as of mlx-lm 0.32.2
qwen3_moe = residual_in_block("mlp")
mixtral = residual_in_block("block_sparse_moe")
gpt_oss = residual_in_block("mlp")
