"""Fused decode MoE: few (token, expert) pairs, each expert's rows read once per pair.

No sort: each token's row is paired with its k experts directly, as a GEMV per pair.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .backend import Implementation, choose
from .experts import MoEExperts
from .reference import combine, expert_chain


def moe_decode_reference(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """Same contract as moe_prefill_reference."""
    rows = x.reshape(*x.shape[:-1], 1, 1, x.shape[-1])
    y = expert_chain(rows, indices, experts, sorted_indices=False).squeeze(-2)
    return combine(y, weights)


def moe_decode(
    x: mx.array, indices: mx.array, experts: MoEExperts, weights: Optional[mx.array] = None
) -> mx.array:
    """Dispatcher: the moe_decode implementation for the current backend."""
    return moe_decode_implementation().function(x, indices, experts, weights)


def moe_decode_implementation() -> Implementation:
    return choose("moe_decode", moe_decode_reference)
