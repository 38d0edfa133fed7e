"""Which implementation each op picks per backend, checked on any machine by pretending the
backend (the kernels themselves are not called here)."""

import pytest

from mlx_moe_fix.kernels import backend, moe_prefill_implementation, moe_router_implementation
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
