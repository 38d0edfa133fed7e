"""Wrappers of the switch layers that mlx-lm and mlx-vlm both define.

Each wrapper describes the layer as `MoEExperts`, asks `kernels.plan` which op takes the call and
either runs it or calls the original method. No math happens here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from .. import trace
from ..kernels import (PREFILL_MIN_PAIRS, ExpertLinear, MoEExperts, Plan, Routing, SharedExperts, combine, plan, routed_plan,
                       shared_plan)
from . import options
from .activations import recognise, shared_experts_activation
from .compiled import compiled_per_shape
from .methods import wrapper_of

GLU_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MLP_PROJECTIONS = ("fc1", "fc2")


def bind(args: tuple, kwargs: dict, names: tuple) -> list:
    """The wrapped method's first positional-or-keyword arguments `names`, in order (None where
    not given; later arguments are left to the original method)."""
    values = list(args[: len(names)]) + [None] * max(0, len(names) - len(args))
    for i, name in enumerate(names):
        if name in kwargs:
            values[i] = kwargs[name]
    return values


# Set on each described layer instance (outside its parameter tree, so it dies with the layer).
_CACHE_ATTRIBUTE = "_mlx_moe_fix_described"


# The arrays of a projection that its ExpertLinear holds.
PROJECTION_ARRAYS = ("weight", "scales", "biases", "bias")


def describe(layer, projection_names: tuple, gate_scale=None, out_scale=None):
    """(MoEExperts, None) for a layer the ops can run, else (None, why not).

    Cached on the layer while its activation, per-expert scales and every projection array
    (weight, scales, quantization biases, additive bias) are the same objects: describing costs
    more host time per decode step than the GPU spends on a layer."""
    parts = [layer.get("activation"), gate_scale, out_scale, *_projection_arrays(layer, projection_names)]
    return _cached_on(layer, _CACHE_ATTRIBUTE, parts, lambda: _describe(layer, projection_names, gate_scale, out_scale))


def _projection_arrays(layer, projection_names: tuple) -> list:
    arrays = []
    for name in projection_names:
        projection = layer.get(name)
        arrays += (None,) * len(PROJECTION_ARRAYS) if projection is None else map(projection.get, PROJECTION_ARRAYS)
    return arrays


def _cached_on(module, attribute: str, parts: list, compute: Callable):
    """compute(), kept on `module` under `attribute` while `parts` are the same objects."""
    identities = tuple(map(id, parts))
    cached = module.__dict__.get(attribute)
    if cached is not None and cached[0] == identities:
        return cached[2]
    computed = compute()
    # The cache holds `parts` itself: while it does, none of them can be freed, so equal ids
    # mean the same objects.
    object.__setattr__(module, attribute, (identities, parts, computed))
    return computed


_SHARED_CACHE_ATTRIBUTE = "_mlx_moe_fix_shared_described"


def describe_shared(module, count: int) -> Optional[SharedExperts]:
    """SharedExperts of a dense shared-experts module of a known class (quantized gate_proj,
    up_proj, down_proj; activations.KNOWN_SHARED_EXPERTS), or None; cached on the module as
    describe() caches."""
    activation = shared_experts_activation(module)
    if activation is None:
        return None
    parts = [count, activation, *_projection_arrays(module, ("gate_proj", "up_proj", "down_proj"))]
    return _cached_on(module, _SHARED_CACHE_ATTRIBUTE, parts, lambda: SharedExperts.from_module(module, count, activation))


_LINEAR_CACHE_ATTRIBUTE = "_mlx_moe_fix_linear_described"


def describe_linear(module) -> Optional[MoEExperts]:
    """MoEExperts of a lone expert projection (a QuantizedSwitchLinear), or None where it is not
    one; cached on the module as describe() caches (its calls come three a layer call, on stock's
    path too)."""
    def compute():
        linear = ExpertLinear.from_module(module)
        return None if linear is None else MoEExperts((linear,))

    return _cached_on(module, _LINEAR_CACHE_ATTRIBUTE, [module.get(name) for name in PROJECTION_ARRAYS], compute)


def _describe(layer, projection_names: tuple, gate_scale, out_scale):
    activation = None
    if len(projection_names) > 1:
        activation = recognise(layer.activation)
        if activation is None:
            # a module by its class, a function (compiled ones share one class) by its name
            name = getattr(layer.activation, "__name__", None) or type(layer.activation).__qualname__
            return None, f"activation {name} is not recognised"
    projections = tuple(
        ExpertLinear.from_module(layer[name]) if name in layer else None for name in projection_names
    )
    if any(p is None for p in projections):
        return None, "expert projections are not SwitchLinear / QuantizedSwitchLinear"
    try:
        return MoEExperts(projections, activation, gate_scale, out_scale), None
    except ValueError as error:
        return None, str(error)


def shape_class(phase: str, x, top_k: int, experts: Optional[MoEExperts]) -> tuple:
    if experts is None:
        return (phase, str(x.dtype), tuple(x.shape[-1:]), top_k)
    first = experts.projections[0]
    return (
        phase,
        str(x.dtype),
        f"{first.bits}bit/g{first.group_size}" if first.quantized else str(first.weight.dtype),
        f"{experts.input_dims}->{experts.output_dims}",
        f"E{experts.num_experts}",
        f"k{top_k}",
    )


def choose(
    layer_kind: str, x, indices, experts: Optional[MoEExperts], why_not: Optional[str], token_by_token: bool = False
) -> Plan:
    """The plan for one call (kernels.plan), counted and traced."""
    if experts is None:
        chosen = Plan("prefill" if indices.size >= PREFILL_MIN_PAIRS else "decode", "stock", why_not, None)
    else:
        prefill, decode = options.enabled()
        chosen = plan(x, indices, experts, prefill=prefill, decode=decode, token_by_token=token_by_token)
    trace.record(
        layer_kind, chosen.phase, chosen.path, chosen.reason, lambda: shape_class(chosen.phase, x, indices.shape[-1], experts)
    )
    return chosen


def stock(layer_kind: str, x, indices, reason: str, original: Callable, args: tuple, kwargs: dict):
    choose(layer_kind, x, indices, None, reason)
    return original(*args, **kwargs)


def no_expert_scales(layer) -> tuple:
    return None, None


class ExpertBlock(NamedTuple):
    """What an expert block wrapper knows of the layers it wraps."""

    kind: str
    projection_names: tuple
    expert_scales: Callable

    def describe(self, layer):
        return describe(layer, self.projection_names, *self.expert_scales(layer))


# The patched expert blocks' wrappers, each with its ExpertBlock.
_EXPERT_BLOCKS: dict = {}


def expert_block_wrapper(layer_kind: str, projection_names: tuple, expert_scales: Callable = no_expert_scales):
    """The wrapper of a `__call__(x, indices) -> [..., k, D]` expert block, whose per-expert
    (gate_scale, out_scale) are `expert_scales(layer)`. The patched MoE blocks (moe_blocks.py,
    Inkling's in mlx_vlm.py) also pass `weights=` [..., k], which upstream's method does not take:
    the call then returns the weighted sum over k, [..., D]."""
    block = ExpertBlock(layer_kind, projection_names, expert_scales)

    def wrapper(wrapped, instance, args, kwargs):
        x, indices = bind(args, kwargs, ("x", "indices"))
        weights = kwargs.pop("weights", None)
        experts, why_not = block.describe(instance)
        chosen = choose(layer_kind, x, indices, experts, why_not)
        if chosen.function is None:
            return combine(wrapped(*args, **kwargs), weights)
        return chosen.function(x, indices, experts, weights)

    return register_expert_block(compiled_per_shape(wrapper), block)


def register_expert_block(wrapper, block: ExpertBlock):
    """Makes `wrapper`, a patched expert layer's call, one that the fused block ops may take the
    place of (routed_experts_call, shared_experts_call) for layers that `block` describes."""
    _EXPERT_BLOCKS[wrapper] = block
    return wrapper


switch_glu = expert_block_wrapper("SwitchGLU", GLU_PROJECTIONS)
switch_mlp = expert_block_wrapper("SwitchMLP", MLP_PROJECTIONS)


def _patched_expert_block(layer) -> Optional[ExpertBlock]:
    """The ExpertBlock of `layer` where its call is a patched expert block wrapper's own: not a
    subclass's override, nor a tool's interception (zoo.intercepting), which must see the call."""
    return _EXPERT_BLOCKS.get(wrapper_of(type(layer).__call__))


def routed_experts_call(layer, x, logits, routing: Routing, residual=None, shared: Optional[SharedExperts] = None,
                        correction_bias=None, global_scale=None):
    """What `layer(x, indices, weights=weights)` gives for the indices and weights that `routing`
    makes of `logits` (the logits, or the RouterLinear that gives them; None: no call), plus the
    block's `shared` experts where given (describe_shared; weighted as the routing weighs them:
    Inkling's, with its correction_bias and global_scale), plus `residual` where given
    (kernels.add_residual), computed by one fused op (kernels.routed_plan); or None, and the caller
    routes and calls the layer."""
    if logits is None:
        return None
    return _fused_block_call(
        layer, x, routing.top_k,
        lambda experts, decode: routed_plan(x, logits, routing, experts, decode=decode, shared=shared),
        lambda function, experts: function(x, logits, routing, experts, residual, shared, correction_bias, global_scale))


def shared_experts_call(layer, x, indices, weights, shared: Optional[SharedExperts], shared_weights=None):
    """What the layer's routed experts' weighted sum plus its block's `shared` experts' output gives
    (describe_shared; each weighted by `shared_weights` where given), computed by one fused op
    (kernels.shared_plan); or None (also for no `shared`), and the caller makes the two calls."""
    if shared is None:
        return None
    return _fused_block_call(
        layer, x, indices.shape[-1],
        lambda experts, decode: shared_plan(x, indices, experts, shared, shared_weights, decode=decode),
        lambda function, experts: function(x, indices, experts, weights, shared, shared_weights))


def _fused_block_call(layer, x, top_k: int, plan_of: Callable, call: Callable):
    """`call(function, experts)` for the fused op that `plan_of(experts, decode)` plans for the
    layer's experts, counted as the layer's call; None where the layer's call is not a patched
    expert block's own (_patched_expert_block), its experts are not described, or no fused op
    takes the call."""
    block = _patched_expert_block(layer)
    if block is None:
        return None
    experts, _ = block.describe(layer)
    chosen = None if experts is None else plan_of(experts, options.enabled()[1])
    if chosen is None:
        return None
    trace.record(block.kind, chosen.phase, chosen.path, chosen.reason, lambda: shape_class(chosen.phase, x, top_k, experts))
    return call(chosen.function, experts)


def quantized_switch_linear(wrapped, instance, args, kwargs):
    """QuantizedSwitchLinear.__call__(x, indices, sorted_indices=False): x [..., 1, in] rows
    broadcast against indices, as the switch layers call it; returns [..., 1, out]."""
    x, indices = bind(args, kwargs, ("x", "indices"))
    experts = describe_linear(instance)
    # a projection no op takes goes to stock at once: a SwitchGLU on stock's path calls three a call
    why_not = "not a quantized expert projection" if experts is None else experts.projections_unsupported_reason
    if why_not is not None:
        return stock("QuantizedSwitchLinear", x, indices, why_not, wrapped, args, kwargs)
    rows_per_pair = x.ndim >= 2 and x.shape[-2] == 1 and x.shape[:-2] == indices.shape
    rows_per_token = (
        x.ndim >= 2 and x.shape[-2] == 1 and x.shape[:-2] == (*indices.shape[:-1], 1)
    )
    if not (rows_per_pair or rows_per_token):
        why_not = f"x {tuple(x.shape)} is not one row per token or per (token, expert) pair of indices {tuple(indices.shape)}"
        return stock("QuantizedSwitchLinear", x, indices, why_not, wrapped, args, kwargs)
    if rows_per_pair:
        tokens, pairs = x.reshape(-1, x.shape[-1]), indices.reshape(-1, 1)
    else:
        tokens, pairs = x.reshape(*indices.shape[:-1], x.shape[-1]), indices
    chosen = choose("QuantizedSwitchLinear", tokens, pairs, experts, None)
    if chosen.function is None:
        return wrapped(*args, **kwargs)
    return chosen.function(tokens, pairs, experts).reshape(*indices.shape, 1, experts.output_dims)
