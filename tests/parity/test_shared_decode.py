"""moe_shared_decode: a block's routed experts and its always-on shared experts (Inkling's) in one op.
ref_*: the reference against upstream's modules; cuda_*: the kernel against a float32 oracle of the
reference; the rest: which calls the kernel declines (to upstream's separate calls)."""

import dataclasses
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_moe_fix.kernels import Activation, ExpertLinear, MoEExperts, SharedExperts, moe_shared_decode, moe_shared_decode_reference
from mlx_moe_fix.kernels.moe_shared_decode import cuda_unsupported_reason, moe_shared_decode_call_reason

from .cases import CASES
from .test_ops import float32_oracle
from .tolerance import assert_close


@dataclasses.dataclass
class SharedCase:
    routed: nn.Module  # InklingSwitchGLU
    shared_module: nn.Module  # InklingSharedExpertsDense
    experts: MoEExperts
    shared: SharedExperts
    x: mx.array
    indices: mx.array
    weights: mx.array
    shared_weights: mx.array
    dtype: object
    label: str

    def stock(self) -> mx.array:
        """What Inkling's block adds: its routed experts' weighted sum and its shared experts' output."""
        routed = (self.routed(self.x, self.indices) * self.weights[..., None]).sum(axis=-2)
        return routed + self.shared_module(self.x, mx.repeat(self.shared_weights, self.shared.width, axis=-1))


def make_shared_case(dtype, bits, dims, width, num_experts, top_k, count, tokens, scaled, seed) -> SharedCase:
    from mlx_vlm.models.inkling.language import InklingSharedExpertsDense, InklingSwitchGLU

    mx.random.seed(seed)
    routed = InklingSwitchGLU(dims, width, num_experts)
    if scaled:
        routed.gate_scale = mx.random.uniform(0.5, 2.0, (num_experts,))
        routed.out_scale = mx.random.uniform(0.5, 2.0, (num_experts,))
    shared_module = InklingSharedExpertsDense(dims, width, count)
    for module in (routed, shared_module):
        nn.quantize(module, group_size=64, bits=bits)
        module.set_dtype(dtype)
        module.eval()
    experts = MoEExperts(tuple(ExpertLinear.from_module(routed[name]) for name in ("gate_proj", "up_proj", "down_proj")),
                         Activation("swiglu"), routed.gate_scale if scaled else None, routed.out_scale if scaled else None)
    shared = SharedExperts.from_module(shared_module, count)
    indices = mx.argsort(mx.random.uniform(shape=(tokens, num_experts)), axis=-1)[:, :top_k].astype(mx.uint32)
    x = mx.random.normal((tokens, dims)).astype(dtype)
    routing = mx.softmax(mx.random.normal((tokens, top_k + count)), axis=-1) * 2
    weights, shared_weights = routing[:, :top_k].astype(dtype), routing[:, top_k:].astype(dtype)
    label = f"{dtype} {bits}-bit D={dims} F={width} E={num_experts} k={top_k} shared={count} T={tokens} scaled={scaled}"
    return SharedCase(routed, shared_module, experts, shared, x, indices, weights, shared_weights, dtype, label)


@st.composite
def shared_cases(draw) -> SharedCase:
    return make_shared_case(
        dtype=draw(st.sampled_from((mx.bfloat16, mx.float16, mx.float32))), bits=draw(st.sampled_from((4, 8))),
        dims=draw(st.sampled_from((64, 128, 256))), width=draw(st.sampled_from((64, 128))),
        num_experts=8, top_k=draw(st.integers(1, 8)), count=draw(st.integers(1, 3)),
        tokens=draw(st.sampled_from((1, 2, 5))), scaled=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def call(op, case: SharedCase) -> mx.array:
    return op(case.x, case.indices, case.experts, case.weights, case.shared, case.shared_weights)


@CASES
@given(case=shared_cases())
def test_ref_shared_decode_matches_stock(cpu_device, case):
    out = call(moe_shared_decode_reference, case)
    assert out.dtype == case.dtype
    assert_close(out, case.stock(), case.dtype, f"{case.label}: ")


def shared_float32_oracle(case: SharedCase) -> mx.array:
    """float32_oracle of moe_shared_decode_reference: the shared experts' scales and biases widened too."""

    def widen(linear):
        return dataclasses.replace(linear, scales=linear.scales.astype(mx.float32), biases=linear.biases.astype(mx.float32))

    shared = dataclasses.replace(case.shared, gate=widen(case.shared.gate), up=widen(case.shared.up), down=widen(case.shared.down))
    shared_weights = case.shared_weights.astype(mx.float32)
    return float32_oracle(lambda x, indices, experts, weights: moe_shared_decode_reference(x, indices, experts, weights, shared,
                                                                                          shared_weights), case)


@CASES
@given(case=shared_cases())
def test_cuda_shared_decode_kernel_matches_ref(cuda_device, case):
    from mlx_moe_fix.kernels.moe_shared_decode import moe_shared_decode_kernel

    assert cuda_unsupported_reason(case.experts, case.shared, case.dtype) is None, case.label
    out = call(moe_shared_decode_kernel, case)
    assert out.dtype == case.dtype and out.shape == (*case.x.shape[:-1], case.experts.output_dims)
    assert_close(out, shared_float32_oracle(case), case.dtype, f"{case.label}: ")


def test_the_dispatcher_takes_the_reference_for_shared_weights_the_kernel_cannot_read(device):
    case = make_shared_case(mx.bfloat16, 4, 128, 64, 8, 2, 2, 3, False, seed=1)
    repeated = mx.repeat(case.shared_weights, 64, axis=-1)  # [tokens, count * width], as upstream's module takes them
    assert moe_shared_decode_call_reason(case.x, case.shared, repeated) is not None
    assert moe_shared_decode_call_reason(case.x, case.shared, case.shared_weights.astype(mx.float32)) is not None
    assert moe_shared_decode_call_reason(case.x, case.shared, case.shared_weights) is None
    wrong_dtype = dataclasses.replace(case, shared_weights=case.shared_weights.astype(mx.float32))
    assert_close(call(moe_shared_decode, wrong_dtype), call(moe_shared_decode_reference, wrong_dtype), mx.bfloat16)


@pytest.mark.parametrize("change, reason", [
    ("shared_bits", "quantized otherwise"),
    ("shared_width", "columns wide each"),
    ("limited", "plain SwiGLU"),
])
def test_the_kernel_declines_shared_experts_it_cannot_read_with_the_routed_ones(monkeypatch, change, reason):
    from mlx_moe_fix.kernels.backend import Implementation

    op = sys.modules["mlx_moe_fix.kernels.moe_shared_decode"]

    # as on a GPU where moe_decode's kernel takes the routed experts: the shared experts decide
    monkeypatch.setattr(op, "moe_decode_implementation", lambda experts, dtype: Implementation(None, "kernel", "CUDA"))
    case = make_shared_case(mx.bfloat16, 4, 128, 64, 8, 2, 2, 1, False, seed=2)
    experts, shared = case.experts, case.shared
    assert cuda_unsupported_reason(experts, shared, mx.bfloat16) is None
    if change == "shared_bits":
        module = case.shared_module
        module.down_proj = nn.QuantizedLinear.from_linear(nn.Linear(128, 128, bias=False), group_size=64, bits=8)
        shared = SharedExperts.from_module(module, 2)
    elif change == "shared_width":
        shared = dataclasses.replace(shared, count=4)  # 128 columns are 4 experts of 32, not the routed 64
    else:
        experts = dataclasses.replace(experts, activation=Activation("swiglu", limit=7.0))
    assert reason in cuda_unsupported_reason(experts, shared, mx.bfloat16)


def test_shared_experts_are_read_from_quantized_dense_modules_only():
    from mlx_vlm.models.inkling.language import InklingSharedExpertsDense

    module = InklingSharedExpertsDense(128, 64, 2)
    assert SharedExperts.from_module(module, 2) is None  # unquantized
    nn.quantize(module, group_size=64, bits=4)
    shared = SharedExperts.from_module(module, 2)
    assert (shared.count, shared.width, shared.gate.output_dims, shared.down.input_dims) == (2, 64, 128, 128)
    assert SharedExperts.from_module(module, 3) is None  # 128 columns are not 3 experts
