"""MoE blocks whose upstream code does math around its experts call, composed here from the ops
and the block's own parts, so that the routing weights reach the expert op: its CUDA decode
kernel folds the weighted sum over the k into its down launch, where upstream multiplies and
sums in two more launches. The steps and their order are upstream's, so that with the
references the result is stock's, bit for bit."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx


def inkling_block(x: mx.array, gate_weight: mx.array, fused: Callable, route: Callable, routed: Callable, shared: Callable,
                  shared_width: int, together: Callable) -> mx.array:
    """Inkling's sparse MoE block off Metal (InklingSparseMoE.__call__) on x [B, L, D]: router
    logits in x's dtype, `fused(x, logits)` gives the block's output in x's shape from them in one
    op where it can (routing, experts and shared experts), else None; then `route(logits)` ->
    (experts, weights, one weight a shared expert), `routed(rows, experts, weights)` -> the
    weighted sum over the k, `shared(rows, shared weights repeated over their shared_width columns
    each)` (upstream's module), their sum in x's shape and dtype; `together(rows, experts, weights,
    shared weights)` gives that sum in one op where it can, else None."""
    batch, length, dims = x.shape
    rows = x.reshape(-1, dims)
    if gate_weight.dtype != x.dtype:
        gate_weight = gate_weight.astype(x.dtype)
    logits = rows @ gate_weight.T
    out = fused(x, logits)
    if out is not None:
        return out
    indices, weights, shared_weights = route(logits)
    out = together(rows, indices, weights, shared_weights)
    if out is None:
        out = routed(rows, indices, weights) + shared(rows, mx.repeat(shared_weights, shared_width, axis=-1))
    return out.reshape(batch, length, dims).astype(x.dtype)
