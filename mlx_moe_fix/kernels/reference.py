"""Pure-MLX building blocks of the reference ops.

They call the same MLX primitives as mlx-lm's switch layers (`gather_qmm` / `gather_mm`) and
apply activations with the same operation order as the upstream activation modules, so the
references reproduce stock outputs exactly on every backend; the kernels are tested against them.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .experts import Activation, ExpertLinear, MoEExperts


# Compiled as upstream compiles its activations (mlx-lm's `swiglu` / `swiglu_oai`, mlx-vlm's
# `_limited_swiglu`), with the same bodies: one fused kernel per call as in stock, not one per op.
@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def _swiglu_limited(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def _swiglu_oai(gate: mx.array, up: mx.array, alpha: float, limit: float) -> mx.array:
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return (up + 1.0) * (gate * mx.sigmoid(alpha * gate))


# mlx-lm's DeepseekV41SwiGLU (its clamp stage uncompiled, then mlx-lm's compiled swiglu),
# step3p5's clamped_swiglu, kimi_vl's clipped_silu, gemma4_text's geglu and kimi_k3's _situ, each
# with its upstream body.
def _swiglu_fp32(gate: mx.array, up: mx.array, limit: Optional[float]) -> mx.array:
    dtype = up.dtype
    gate = gate.astype(mx.float32)
    up = up.astype(mx.float32)
    if limit:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
    return _swiglu(gate, up).astype(dtype)


@partial(mx.compile, shapeless=True)
def _swiglu_clamped_silu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    gate = mx.clip(nn.silu(gate), a_min=None, a_max=limit)
    up = mx.clip(up, a_min=-limit, a_max=limit)
    return gate * up


@partial(mx.compile, shapeless=True)
def _swiglu_capped_silu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    return mx.clip(gate * mx.sigmoid(gate), a_min=-limit, a_max=limit) * up


@partial(mx.compile, shapeless=True)
def _geglu_approx(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


@partial(mx.compile, shapeless=True)
def _situ(up: mx.array, gate: mx.array, beta: float, linear_beta: Optional[float]) -> mx.array:
    dtype = up.dtype
    gate = gate.astype(mx.float32)
    up = up.astype(mx.float32)
    a = beta * mx.tanh(gate / beta) * mx.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * mx.tanh(up / linear_beta)
    return (a * up).astype(dtype)


def activate(activation: Activation, up: mx.array, gate: Optional[mx.array] = None) -> mx.array:
    """`up` is the first projection's output (the only one for ungated kinds)."""
    kind = activation.kind
    if kind == "swiglu":
        return _swiglu(gate, up) if activation.limit is None else _swiglu_limited(gate, up, activation.limit)
    if kind == "swiglu_oai":
        return _swiglu_oai(gate, up, activation.alpha, activation.limit)
    if kind == "swiglu_fp32":
        return _swiglu_fp32(gate, up, activation.limit)
    if kind == "swiglu_clamped_silu":
        return _swiglu_clamped_silu(gate, up, activation.limit)
    if kind == "swiglu_capped_silu":
        return _swiglu_capped_silu(gate, up, activation.limit)
    if kind == "geglu_approx":
        return _geglu_approx(gate, up)
    if kind == "situ":
        return _situ(up, gate, activation.alpha, activation.limit)
    if kind == "gelu":
        return nn.gelu(up)
    if kind == "gelu_approx":
        return nn.gelu_approx(up)
    if kind == "relu2":
        return nn.relu2(up)
    return nn.gelu_fast_approx(up)


def project(x: mx.array, linear: ExpertLinear, indices: mx.array, sorted_indices: bool) -> mx.array:
    """x: [..., 1, in] rows broadcast against indices; returns [..., 1, out]."""
    if linear.quantized:
        y = mx.gather_qmm(
            x,
            linear.weight,
            linear.scales,
            linear.biases,
            rhs_indices=indices,
            transpose=True,
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
            sorted_indices=sorted_indices,
        )
    else:
        y = mx.gather_mm(
            x, linear.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
        )
    if linear.bias is not None:
        y = y + mx.expand_dims(linear.bias[indices], -2)
    return y


def _per_expert(scale: mx.array, indices: mx.array, like: mx.array) -> mx.array:
    s = scale[indices].astype(like.dtype)
    return s.reshape(s.shape + (1,) * (like.ndim - s.ndim))


def expert_chain(x: mx.array, indices: mx.array, experts: MoEExperts, sorted_indices: bool) -> mx.array:
    """Every projection, the activation and the per-expert scales, for rows x [..., 1, in]
    paired with indices; returns [..., 1, out]."""
    projections = experts.projections
    if len(projections) == 1:
        return project(x, projections[0], indices, sorted_indices)
    if len(projections) == 2:
        fc1, fc2 = projections
        hidden = activate(experts.activation, project(x, fc1, indices, sorted_indices))
        return project(hidden, fc2, indices, sorted_indices)
    gate_proj, up_proj, down_proj = projections
    up = project(x, up_proj, indices, sorted_indices)
    gate = project(x, gate_proj, indices, sorted_indices)
    if experts.gate_scale is not None:
        gate = gate * _per_expert(experts.gate_scale, indices, gate)
    y = project(activate(experts.activation, up, gate), down_proj, indices, sorted_indices)
    if experts.out_scale is not None:
        y = y * _per_expert(experts.out_scale, indices, y)
    return y


def combine(y: mx.array, weights: Optional[mx.array]) -> mx.array:
    """y: [..., k, out]; the routing-weighted sum over k, or y itself without weights."""
    if weights is None:
        return y
    return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


def add_residual(out: mx.array, residual: Optional[mx.array]) -> mx.array:
    """A decoder layer's add after its MoE block, `residual + out` as upstream writes it, or `out`
    without a residual."""
    return out if residual is None else residual + out
