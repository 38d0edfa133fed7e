"""Patch targets in mlx-vlm: its switch layers (with the weights / shared / residual combine and
the decode-block path of its SwitchGLU, which the decode kernel takes whole), and Inkling's experts
with per-expert scales and its routing.
DeepSeek-V4's experts are mlx-vlm SwitchGLUs with a LimitedSwiGLU activation (see activations)."""

import sys

from ..kernels import current_backend, moe_router
from ..kernels.blocks import inkling_block
from . import switch_layers
from .compiled import compiled_per_shape
from .methods import wrapper_of
from . import moe_blocks
from .moe_blocks import routing
from .switch_layers import GLU_PROJECTIONS, bind, choose, describe, describe_shared, routed_experts_call, shared_experts_call
from .targets import Target

SWITCH_LAYERS = "mlx_vlm.models.switch_layers"
INKLING = "mlx_vlm.models.inkling.language"


def switch_glu_call(wrapped, instance, args, kwargs):
    """SwitchGLU.__call__(x, indices, weights=None, shared=None, residual=None)"""
    x, indices, weights, shared, residual = bind(
        args, kwargs, ("x", "indices", "weights", "shared", "residual")
    )
    # Upstream's decode-block path (1 < L <= DECODE_BLOCK_SIZE: a block of drafted tokens) must
    # give each token what decoding it alone gives (kernels.plan's token_by_token).
    decode_block = sys.modules[SWITCH_LAYERS].DECODE_BLOCK_SIZE
    block = not instance.training and x.ndim == 3 and 1 < x.shape[1] <= decode_block
    experts, why_not = describe(instance, GLU_PROJECTIONS)
    chosen = choose("SwitchGLU[vlm]", x, indices, experts, why_not, token_by_token=block)
    if chosen.function is None:
        return wrapped(*args, **kwargs)
    routed = chosen.function(x, indices, experts, weights)
    return instance._combine(routed, None, shared, residual)


# The fused block ops (switch_layers.shared_experts_call) may take its calls' place.
switch_glu = switch_layers.register_expert_block(
    compiled_per_shape(switch_glu_call), switch_layers.ExpertBlock("SwitchGLU[vlm]", GLU_PROJECTIONS, switch_layers.no_expert_scales))


def inkling_expert_scales(layer) -> tuple:
    """InklingSwitchGLU's (gate_scale, out_scale); none where all ones, as upstream then runs
    plain SwitchGLU."""
    return (None, None) if layer.scales_trivial() else (layer.gate_scale, layer.out_scale)


# InklingSwitchGLU.__call__(x, indices): SwitchGLU with per-expert gate_scale / out_scale.
inkling_switch_glu = switch_layers.expert_block_wrapper("InklingSwitchGLU", GLU_PROJECTIONS, inkling_expert_scales)


def runs_upstream_block(instance) -> bool:
    """On Metal upstream's own routing and down-combine kernels stay; so does upstream's block
    where the class routes by a `_route` of its own."""
    return current_backend() == "metal" or wrapper_of(type(instance)._route) is not inkling_route


def inkling_block_call(wrapped, instance, args, kwargs):
    """InklingSparseMoE.__call__(x): upstream's steps (kernels.blocks.inkling_block); at decode,
    where one op takes them, its routing, experts and shared experts after the router's matmul
    (switch_layers.routed_experts_call); else routed by moe_router, with the routing weights handed
    to the experts call, so that the expert op does the weighted sum, and the shared experts too
    where one op takes both (switch_layers.shared_experts_call)."""
    (x,) = bind(args, kwargs, ("x",))
    experts, shared = instance.switch_mlp, instance.shared_experts
    # one weight a shared expert (shared_width 1): the fused ops read them so, and the block
    # repeats them for upstream's shared module only where that runs
    per_expert = inkling_routing(instance, shared_width=1)
    correction_bias, global_scale = instance.e_score_correction_bias, instance.global_scale
    described = describe_shared(shared, instance.n_shared)
    return inkling_block(
        x, instance.gate_weight,
        lambda x, logits: routed_experts_call(experts, x, logits, per_expert, shared=described,
                                              correction_bias=correction_bias, global_scale=global_scale),
        lambda logits: moe_router(logits, per_expert, correction_bias, global_scale),
        lambda rows, indices, weights: experts(rows, indices, weights=weights), shared, instance.intermediate_size,
        lambda rows, indices, weights, shared_weights: shared_experts_call(experts, rows, indices, weights, described,
                                                                           shared_weights))


# The patched method's wrapper is the compiled one itself, so that a decode step finds the
# layer's last step first (patches/methods.py), before any check of its own.
inkling_sparse_moe = compiled_per_shape(inkling_block_call, runs_as_is=runs_upstream_block)


def inkling_routing(instance, shared_width: int):
    """InklingSparseMoE's Routing, its shared experts' weights repeated over `shared_width` columns."""
    return routing("sigmoid_topk", instance.top_k, shared=instance.n_shared, shared_width=shared_width,
                   scale=float(instance.route_scale))


def inkling_route(wrapped, instance, args, kwargs):
    """InklingSparseMoE._route(logits) -> (experts, routing weights, shared experts' weights
    repeated over their intermediate columns). On Metal upstream's own routing kernel stays."""
    if current_backend() == "metal":
        return wrapped(*args, **kwargs)
    (logits,) = bind(args, kwargs, ("logits",))
    return moe_router(logits, inkling_routing(instance, instance.intermediate_size), instance.e_score_correction_bias,
                      instance.global_scale)


TARGETS = (
    Target(SWITCH_LAYERS, "SwitchGLU", "__call__", switch_glu),
    Target(SWITCH_LAYERS, "SwitchMLP", "__call__", switch_layers.switch_mlp),
    Target(SWITCH_LAYERS, "QuantizedSwitchLinear", "__call__", switch_layers.quantized_switch_linear),
    Target(SWITCH_LAYERS, "MoE", "__call__", moe_blocks.shared_experts_block),
    Target(INKLING, "InklingSwitchGLU", "__call__", inkling_switch_glu),
    Target(INKLING, "InklingSparseMoE", "_route", inkling_route),
    Target(INKLING, "InklingSparseMoE", "__call__", inkling_sparse_moe),
)
