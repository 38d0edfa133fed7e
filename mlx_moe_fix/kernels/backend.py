"""Which implementation of an op runs on the current device, and why."""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx


def current_backend() -> str:
    """'cuda', 'metal' or 'cpu': where MLX runs ops on the default device."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "cpu"


class Implementation(NamedTuple):
    function: Callable
    path: str  # "kernel" or "reference"
    reason: str


def reference_implementation(op_name: str, reference: Callable) -> Implementation:
    """The reference, for backends without a kernel for this op."""
    backend = current_backend()
    if backend == "cpu":
        return Implementation(reference, "reference", "CPU: the pure-MLX reference is the implementation")
    return Implementation(reference, "reference", f"no {backend} kernel for {op_name} yet")
