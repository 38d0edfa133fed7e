"""Which implementation each op picks per backend, checked on any machine by pretending the
backend (the kernels themselves are not called here)."""

import mlx.core as mx
import pytest

from mlx_moe_fix.kernels import Routing, backend, moe_prefill_implementation, moe_router_implementation
from mlx_moe_fix.kernels.moe_decode import METAL_KERNEL_SWITCH, moe_decode_implementation, moe_decode_kernel


@pytest.fixture
def pretend(monkeypatch):
    """pretend(name): current_backend() says `name` for the test."""
    return lambda name: monkeypatch.setattr(backend, "current_backend", lambda: name)


def test_metal_decode_kernel_is_off_until_switched_on(pretend, switch):
    pretend("metal")
    switch(METAL_KERNEL_SWITCH, "")
    off = moe_decode_implementation()
    assert off.path == "reference" and f"{METAL_KERNEL_SWITCH}=1" in off.reason
    switch(METAL_KERNEL_SWITCH, "1")
    on = moe_decode_implementation()
    assert on.path == "kernel" and on.function is moe_decode_kernel and on.reason == "Metal moe_decode kernel"


def test_metal_keeps_the_references_of_ops_without_a_metal_kernel(pretend, switch):
    pretend("metal")
    switch(METAL_KERNEL_SWITCH, "1")
    for implementation, op in ((moe_prefill_implementation(), "moe_prefill"), (moe_router_implementation(), "moe_router")):
        assert implementation.path == "reference" and implementation.reason == f"no metal kernel for {op}"


def test_the_metal_switch_does_not_touch_cuda(pretend, switch):
    pretend("cuda")
    switch(METAL_KERNEL_SWITCH, "")
    assert moe_decode_implementation().reason == "CUDA moe_decode kernel"
    switch("MLX_MOE_FIX_CUDA_DECODE", "0")
    assert moe_decode_implementation().path == "reference"


def test_routed_decode_kernel_needs_both_kernels_and_a_routing_it_knows(pretend, switch):
    from mlx_moe_fix.kernels.moe_routed_decode import (CUDA_KERNEL_SWITCH, moe_routed_decode_implementation,
                                                       moe_routed_decode_kernel)
    from tests.parity.cases import make_case

    experts = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 64, 64, 8, 2, 1, 1).experts
    top2 = Routing("topk_softmax", 2)

    def implementation(routing=top2, logits_dtype=mx.bfloat16):
        return moe_routed_decode_implementation(experts, routing, mx.bfloat16, logits_dtype)

    pretend("cuda")
    assert implementation().function is moe_routed_decode_kernel
    assert implementation(Routing("softmax_topk", 2, normalize=True)).path == "kernel"
    assert "Inkling" in implementation(Routing("sigmoid_topk", 2)).reason
    assert "one dtype" in implementation(logits_dtype=mx.float32).reason
    assert "at most 32" in implementation(Routing("topk_softmax", 33)).reason
    for name in (CUDA_KERNEL_SWITCH, "MLX_MOE_FIX_CUDA_ROUTER", "MLX_MOE_FIX_CUDA_DECODE"):
        switch(name, "0")
        off = implementation()
        assert off.path == "reference" and f"{name}=0" in off.reason, name
        switch(name, "")
    assert implementation().path == "kernel"
    pretend("metal")
    switch(METAL_KERNEL_SWITCH, "1")
    assert implementation().reason == "no metal kernel for moe_routed_decode"
