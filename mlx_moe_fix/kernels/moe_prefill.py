"""Sorted grouped prefill: many (token, expert) pairs.

The pairs are sorted by expert so that each expert's rows are contiguous, every projection runs
as one grouped matmul over the sorted rows, and the result is unsorted and combined.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .backend import Implementation, reference_implementation
from .experts import MoEExperts
from .reference import combine, expert_chain


def moe_prefill_reference(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """x: [..., D], indices: [..., k]; returns [..., k, out], or [..., out] weighted by
    `weights` [..., k]."""
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    inverse = mx.argsort(order)
    rows = x.reshape(-1, 1, x.shape[-1])[order // k]
    y = expert_chain(rows, flat[order], experts, sorted_indices=True)
    y = y[inverse].reshape(*indices.shape, experts.output_dims)
    return combine(y, weights)


def moe_prefill(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """Dispatcher: the moe_prefill implementation for the current backend and these experts."""
    return moe_prefill_implementation(experts).function(x, indices, experts, weights)


def moe_prefill_implementation(experts: Optional[MoEExperts] = None) -> Implementation:
    return reference_implementation("moe_prefill", moe_prefill_reference)
