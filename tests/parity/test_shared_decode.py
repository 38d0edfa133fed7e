"""moe_shared_decode: a block's routed experts and its always-on shared experts (Inkling's) in one op;
moe_routed_decode with them (Inkling's block from its router logits on). ref_*: the references
against upstream's modules; cuda_*: the kernels against a float32 oracle of the reference, and the
routed one against the router and shared decode kernels; the rest: which calls the kernels decline
(to upstream's separate calls)."""

import dataclasses
import sys
import types
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_moe_fix.kernels import Activation, ExpertLinear, MoEExperts, Routing, SharedExperts, moe_routed_decode_reference
from mlx_moe_fix.kernels import moe_shared_decode, moe_shared_decode_reference
from mlx_moe_fix.kernels.moe_shared_decode import cuda_unsupported_reason, moe_shared_decode_call_reason

from .cases import CASES
from .test_ops import float32_oracle
from .tolerance import assert_close


@dataclasses.dataclass
class SharedCase:
    routed: nn.Module  # InklingSwitchGLU, or mlx-vlm's SwitchGLU with DeepSeek-V4's LimitedSwiGLU
    shared_module: nn.Module  # InklingSharedExpertsDense, or DeepseekV4MLP
    experts: MoEExperts
    shared: SharedExperts
    x: mx.array
    indices: mx.array
    weights: mx.array
    shared_weights: Optional[mx.array]  # Inkling's, one a shared expert; DeepSeek-V4's: none
    dtype: object
    label: str

    def stock(self) -> mx.array:
        """What the block adds: its routed experts' weighted sum (mlx-vlm's SwitchGLU._combine) and its
        shared experts' output (Inkling's module takes their weights repeated over their columns)."""
        y = self.routed(self.x, self.indices)
        routed = (y * self.weights[..., None].astype(y.dtype)).sum(axis=-2)
        if self.shared_weights is None:
            return routed + self.shared_module(self.x)
        return routed + self.shared_module(self.x, mx.repeat(self.shared_weights, self.shared.width, axis=-1))


def make_shared_case(family, dtype, quantization, dims, width, num_experts, top_k, count, tokens, scaled=False, limit=0.0,
                     seed=0) -> SharedCase:
    """family "inkling": scaled routed experts (gate_scale / out_scale) where `scaled`, shared experts
    weighted; "deepseek_v4": SwiGLU clamped at `limit` (none at 0) in both, shared experts unweighted,
    routing weights in float32 (its gate's). quantization: (bits, group size[, mode]) of every
    projection, routed and shared."""
    mx.random.seed(seed)
    if family == "inkling":
        from mlx_vlm.models.inkling.language import InklingSharedExpertsDense, InklingSwitchGLU

        routed = InklingSwitchGLU(dims, width, num_experts)
        if scaled:
            routed.gate_scale = mx.random.uniform(0.5, 2.0, (num_experts,))
            routed.out_scale = mx.random.uniform(0.5, 2.0, (num_experts,))
        shared_module = InklingSharedExpertsDense(dims, width, count)
        activation = Activation("swiglu")
    else:
        from mlx_vlm.models.deepseek_v4.language import DeepseekV4MLP, LimitedSwiGLU
        from mlx_vlm.models.switch_layers import SwitchGLU

        routed = SwitchGLU(dims, width, num_experts, activation=LimitedSwiGLU(limit))
        config = types.SimpleNamespace(hidden_size=dims, intermediate_size=width)
        shared_module = DeepseekV4MLP(config, intermediate_size=width * count, swiglu_limit=limit)
        activation = Activation("swiglu", limit=limit or None)
    bits, group_size, *mode = quantization
    for module in (routed, shared_module):
        nn.quantize(module, group_size=group_size, bits=bits, mode=mode[0] if mode else "affine")
        module.set_dtype(dtype)
        module.eval()
    experts = MoEExperts(tuple(ExpertLinear.from_module(routed[name]) for name in ("gate_proj", "up_proj", "down_proj")),
                         activation, routed.gate_scale if scaled else None, routed.out_scale if scaled else None)
    shared = SharedExperts.from_module(shared_module, count, activation)
    indices = mx.argsort(mx.random.uniform(shape=(tokens, num_experts)), axis=-1)[:, :top_k].astype(mx.uint32)
    x = mx.random.normal((tokens, dims)).astype(dtype)
    routing = mx.softmax(mx.random.normal((tokens, top_k + count)), axis=-1) * 2
    if family == "inkling":
        weights, shared_weights = routing[:, :top_k].astype(dtype), routing[:, top_k:].astype(dtype)
    else:
        weights, shared_weights = routing[:, :top_k], None
    label = (f"{family} {dtype} {quantization} D={dims} F={width} E={num_experts} k={top_k} shared={count} T={tokens} "
             f"scaled={scaled} limit={limit}")
    return SharedCase(routed, shared_module, experts, shared, x, indices, weights, shared_weights, dtype, label)


# Affine 4- and 8-bit in groups of 64, and for 16-bit activations mxfp4 and nvfp4 (the decode
# kernel reads those against 16-bit activations only).
AFFINE, FP4 = ((4, 64), (8, 64)), ((4, 32, "mxfp4"), (4, 16, "nvfp4"))


def draw_quantization(draw, dtype) -> tuple:
    return draw(st.sampled_from(AFFINE + (FP4 if dtype != mx.float32 else ())))


@st.composite
def shared_cases(draw) -> SharedCase:
    family = draw(st.sampled_from(("inkling", "deepseek_v4")))
    dtype = draw(st.sampled_from((mx.bfloat16, mx.float16, mx.float32)))
    return make_shared_case(
        family, dtype=dtype, quantization=draw_quantization(draw, dtype),
        dims=draw(st.sampled_from((64, 128, 256))), width=draw(st.sampled_from((64, 128))),
        num_experts=8, top_k=draw(st.integers(1, 8)), count=draw(st.integers(1, 3)),
        tokens=draw(st.sampled_from((1, 2, 5))), scaled=family == "inkling" and draw(st.booleans()),
        # 0.25 binds for most gate / up values here, 50 for none
        limit=0.0 if family == "inkling" else draw(st.sampled_from((0.0, 0.25, 50.0))), seed=draw(st.integers(0, 2**16)))


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

    def widen(linear):  # FP4 scales stay bytes (no biases)
        if linear.biases is None:
            return linear
        return dataclasses.replace(linear, scales=linear.scales.astype(mx.float32), biases=linear.biases.astype(mx.float32))

    shared = dataclasses.replace(case.shared, gate=widen(case.shared.gate), up=widen(case.shared.up), down=widen(case.shared.down))
    shared_weights = None if case.shared_weights is None else case.shared_weights.astype(mx.float32)
    return float32_oracle(lambda x, indices, experts, weights: moe_shared_decode_reference(x, indices, experts, weights, shared,
                                                                                          shared_weights), case)


@CASES
@given(case=shared_cases())
def test_cuda_shared_decode_kernel_matches_ref(cuda_kernels, case):
    from mlx_moe_fix.kernels.moe_shared_decode import moe_shared_decode_kernel

    assert cuda_unsupported_reason(case.experts, case.shared, case.dtype) is None, case.label
    out = call(moe_shared_decode_kernel, case)
    assert out.dtype == case.dtype and out.shape == (*case.x.shape[:-1], case.experts.output_dims)
    assert_close(out, shared_float32_oracle(case), case.dtype, f"{case.label}: ")


@pytest.mark.parametrize("family", ["inkling", "deepseek_v4"])
@pytest.mark.parametrize("quantization", FP4)
def test_cuda_shared_decode_kernel_matches_ref_on_fp4_experts(cuda_kernels, family, quantization):
    # Routed and shared experts both mxfp4 / nvfp4, 6 + 2 of a token's pairs: the combining down
    # with the shared ones at 4-warp blocks (moe_decode.down_block_shape), every launch's FP4 path.
    from mlx_moe_fix.kernels.moe_shared_decode import moe_shared_decode_kernel

    case = make_shared_case(family, mx.bfloat16, quantization, 256, 128, 16, 6, 2, 2, scaled=family == "inkling",
                            limit=0.25 if family == "deepseek_v4" else 0.0, seed=5)
    assert cuda_unsupported_reason(case.experts, case.shared, case.dtype) is None, case.label
    assert_close(call(moe_shared_decode_kernel, case), shared_float32_oracle(case), case.dtype, f"{case.label}: ")


def test_the_dispatcher_takes_the_reference_for_shared_weights_the_kernel_cannot_read(device):
    case = make_shared_case("inkling", mx.bfloat16, (4, 64), 128, 64, 8, 2, 2, 3, seed=1)
    repeated = mx.repeat(case.shared_weights, 64, axis=-1)  # [tokens, count * width], as upstream's module takes them
    assert moe_shared_decode_call_reason(case.x, case.shared, repeated) is not None
    assert moe_shared_decode_call_reason(case.x, case.shared, case.shared_weights.astype(mx.float32)) is not None
    assert moe_shared_decode_call_reason(case.x, case.shared, case.shared_weights) is None
    assert moe_shared_decode_call_reason(case.x, case.shared, None) is None  # unweighted (DeepSeek-V4's)
    wrong_dtype = dataclasses.replace(case, shared_weights=case.shared_weights.astype(mx.float32))
    assert_close(call(moe_shared_decode, wrong_dtype), call(moe_shared_decode_reference, wrong_dtype), mx.bfloat16)


@pytest.mark.parametrize("change, reason", [
    ("shared_bits", "quantized otherwise"),
    ("shared_mode", "quantized otherwise"),
    ("shared_width", "columns wide each"),
    ("limited", "one activation"),
])
def test_the_kernel_declines_shared_experts_it_cannot_read_with_the_routed_ones(monkeypatch, change, reason):
    from mlx_moe_fix.kernels.backend import Implementation

    op = sys.modules["mlx_moe_fix.kernels.moe_shared_decode"]

    # as on a GPU where moe_decode's kernel takes the routed experts: the shared experts decide
    monkeypatch.setattr(op, "moe_decode_implementation", lambda experts, dtype: Implementation(None, "kernel", "CUDA"))
    case = make_shared_case("inkling", mx.bfloat16, (4, 64), 128, 64, 8, 2, 2, 1, seed=2)
    experts, shared = case.experts, case.shared
    assert cuda_unsupported_reason(experts, shared, mx.bfloat16) is None
    if change in ("shared_bits", "shared_mode"):
        module = case.shared_module
        quantization = dict(group_size=64, bits=8) if change == "shared_bits" else dict(group_size=32, bits=4, mode="mxfp4")
        module.down_proj = nn.QuantizedLinear.from_linear(nn.Linear(128, 128, bias=False), **quantization)
        shared = SharedExperts.from_module(module, 2, shared.activation)
    elif change == "shared_width":
        shared = dataclasses.replace(shared, count=4)  # 128 columns are 4 experts of 32, not the routed 64
    else:
        experts = dataclasses.replace(experts, activation=Activation("swiglu", limit=7.0))
    assert reason in cuda_unsupported_reason(experts, shared, mx.bfloat16)


@pytest.mark.parametrize("quantization", [(4, 32, "mxfp4"), (4, 16, "nvfp4")])
def test_the_kernel_takes_fp4_shared_experts_beside_fp4_routed_ones(monkeypatch, quantization):
    # A block quantized whole in mxfp4 or nvfp4 (mlx-vlm's convert with --q-mode): one mode, BITS
    # and GROUP a launch, routed and shared alike.
    from mlx_moe_fix.kernels.backend import Implementation

    op = sys.modules["mlx_moe_fix.kernels.moe_shared_decode"]
    monkeypatch.setattr(op, "moe_decode_implementation", lambda experts, dtype: Implementation(None, "kernel", "CUDA"))
    case = make_shared_case("inkling", mx.bfloat16, quantization, 128, 64, 8, 2, 2, 1, seed=4)
    assert {p.mode for p in case.experts.projections} == {case.shared.down.mode} == {quantization[2]}
    assert cuda_unsupported_reason(case.experts, case.shared, mx.bfloat16) is None


def test_shared_experts_are_read_from_quantized_dense_modules_only():
    from mlx_vlm.models.inkling.language import InklingSharedExpertsDense

    module = InklingSharedExpertsDense(128, 64, 2)
    swiglu = Activation("swiglu")
    assert SharedExperts.from_module(module, 2, swiglu) is None  # unquantized
    nn.quantize(module, group_size=64, bits=4)
    shared = SharedExperts.from_module(module, 2, swiglu)
    assert (shared.count, shared.width, shared.gate.output_dims, shared.down.input_dims) == (2, 64, 128, 128)
    assert SharedExperts.from_module(module, 3, swiglu) is None  # 128 columns are not 3 experts


def test_a_block_whose_shared_experts_are_of_another_class_is_upstreams_call_alone(cpu_device, monkeypatch):
    """mlx-vlm's MoE block routes for the fused op only where it knows its shared experts' class
    (a subclass may compute otherwise): else upstream's call runs alone, its gate not called first."""
    from mlx_moe_fix import zoo
    from mlx_moe_fix.patches import moe_blocks

    model = zoo.build("deepseek_v4", 4, dtype=mx.bfloat16)
    block = next(m for _, m in model.named_modules() if type(m).__name__ == "DeepseekV4MoE" and not m.gate.hash)
    x = mx.random.normal((1, 1, block.gate.weight.shape[-1])).astype(mx.bfloat16)
    gate_calls = []
    gate_call = moe_blocks.gate_call
    monkeypatch.setattr(moe_blocks, "gate_call", lambda *args: gate_calls.append(1) or gate_call(*args))

    def upstream(*args, **kwargs):
        return "upstream's call"

    # a known class: routed for the fused op (which the CPU declines), then upstream's call
    assert moe_blocks.with_shared_experts(upstream, block, (x,), {}) == "upstream's call" and gate_calls == [1]
    block.shared_experts.__class__ = type("OtherMLP", (type(block.shared_experts),), {})
    assert moe_blocks.with_shared_experts(upstream, block, (x,), {}) == "upstream's call" and gate_calls == [1]


@dataclasses.dataclass
class RoutedSharedCase:
    """An Inkling block's decode from its router logits on: `case`'s experts, routed by its routing."""

    case: SharedCase
    logits: mx.array  # [tokens, E + shared]
    routing: Routing
    correction_bias: mx.array
    global_scale: mx.array

    def call(self, op) -> mx.array:
        return op(self.case.x, self.logits, self.routing, self.case.experts, shared=self.case.shared,
                  correction_bias=self.correction_bias, global_scale=self.global_scale)

    def stock(self) -> mx.array:
        """Upstream's block after its router matmul: InklingSparseMoE._route, then its experts' weighted sum
        plus its shared experts (taking their weights repeated over their columns), added."""
        from mlx_vlm.models.inkling.language import InklingSparseMoE

        case, routing = self.case, self.routing
        block = types.SimpleNamespace(
            n_routed=case.experts.num_experts, n_shared=routing.shared, top_k=routing.top_k, route_scale=routing.scale,
            intermediate_size=case.shared.width, e_score_correction_bias=self.correction_bias,
            global_scale=self.global_scale, _wscale=None)
        indices, weights, gamma = InklingSparseMoE._route(block, self.logits)
        return (case.routed(case.x, indices) * weights[..., None]).sum(axis=-2) + case.shared_module(case.x, gamma)


@st.composite
def routed_shared_cases(draw) -> RoutedSharedCase:
    dtype = draw(st.sampled_from((mx.bfloat16, mx.float16, mx.float32)))
    # (few kernel variants: each template and route scale is a compile on the GPU)
    num_experts, count, tokens = draw(st.sampled_from((8, 64))), draw(st.integers(1, 2)), draw(st.sampled_from((1, 2, 5)))
    top_k = draw(st.integers(1, min(8, 32 - count)))
    case = make_shared_case("inkling", dtype, quantization=draw_quantization(draw, dtype), dims=draw(st.sampled_from((64, 128, 256))),
                            width=draw(st.sampled_from((64, 128))), num_experts=num_experts, top_k=top_k, count=count,
                            tokens=tokens, scaled=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))
    # logits on a coarse grid where `ties`, so that equal scores meet in the top-k
    logits = mx.random.normal((tokens, num_experts + count)) * 3
    if draw(st.booleans()):
        logits = mx.round(logits)
    correction = mx.round(mx.random.uniform(-0.5, 0.5, (num_experts,)) * 4) / 4
    routing = Routing("sigmoid_topk", top_k, shared=count, shared_width=1, scale=2.5)
    return RoutedSharedCase(case, logits.astype(dtype), routing, correction, mx.array([draw(st.sampled_from((1.0, 0.75)))]))


@CASES
@given(routed=routed_shared_cases())
def test_ref_routed_shared_decode_matches_stock(cpu_device, routed):
    out = routed.call(moe_routed_decode_reference)
    assert out.dtype == routed.case.dtype
    assert mx.array_equal(out, routed.stock()), routed.case.label


# At most 12 examples on the GPU: the strategy has 20 kernel variants (dtype, quantization, shared
# count), and each new one is an NVRTC compile of five kernels (~7-13 s a case on the H200).
@settings(CASES, max_examples=min(CASES.max_examples, 12))
@given(routed=routed_shared_cases())
def test_cuda_routed_shared_decode_kernel_is_the_router_and_shared_decode_kernels(cuda_kernels, routed):
    """The one-op block routes with the router kernel's device code and computes the experts with the
    shared decode kernel's: its output is theirs bit for bit, ties in the routing included."""
    from mlx_moe_fix.kernels.moe_routed_decode import cuda_unsupported_reason as routed_reason
    from mlx_moe_fix.kernels.moe_routed_decode import moe_routed_decode_kernel
    from mlx_moe_fix.kernels.moe_router import moe_router_kernel
    from mlx_moe_fix.kernels.moe_shared_decode import moe_shared_decode_kernel

    case = routed.case
    assert routed_reason(case.experts, routed.routing, case.dtype, case.dtype, case.shared) is None, case.label
    out = routed.call(moe_routed_decode_kernel)
    indices, weights, shared_weights = moe_router_kernel(routed.logits, routed.routing, routed.correction_bias,
                                                         routed.global_scale)
    apart = moe_shared_decode_kernel(case.x, indices, case.experts, weights, case.shared, shared_weights)
    assert out.dtype == case.dtype and out.shape == (*case.x.shape[:-1], case.experts.output_dims)
    assert mx.array_equal(out, apart), case.label
    # Against the float32 oracle on the CPU, of the router kernel's choice (test_router checks it
    # against moe_router_reference): on the GPU the reference calls MLX's CUDA quantized_matmul,
    # wrong at one quantization group a row and more than one row (the shared expert's 64 columns;
    # benchmarks/stock_qmm_probe.py; docs/benchmarks.md, forty-third session).
    routed_case = dataclasses.replace(case, indices=indices, weights=weights, shared_weights=shared_weights)
    assert_close(out, shared_float32_oracle(routed_case), case.dtype, f"{case.label}: ")


def test_the_routed_kernel_takes_shared_experts_with_inklings_routing_only(monkeypatch):
    from mlx_moe_fix.kernels.backend import Implementation
    from mlx_moe_fix.kernels.moe_routed_decode import cuda_unsupported_reason as routed_reason

    op = sys.modules["mlx_moe_fix.kernels.moe_routed_decode"]
    # as on a GPU where the shared decode kernel takes these experts: the routing decides
    monkeypatch.setattr(op, "moe_shared_decode_implementation", lambda *args: Implementation(None, "kernel", "CUDA"))
    case = make_shared_case("inkling", mx.bfloat16, (4, 64), 128, 64, 8, 2, 2, 1, seed=3)
    inkling = Routing("sigmoid_topk", 2, shared=2, shared_width=1)
    assert routed_reason(case.experts, inkling, mx.bfloat16, mx.bfloat16, case.shared) is None
    assert "one weight" in routed_reason(case.experts, dataclasses.replace(inkling, shared_width=64), mx.bfloat16,
                                         mx.bfloat16, case.shared)
    assert "one weight" in routed_reason(case.experts, dataclasses.replace(inkling, shared=1), mx.bfloat16, mx.bfloat16,
                                         case.shared)
    assert "sigmoid_topk" in routed_reason(case.experts, Routing("softmax_topk", 2), mx.bfloat16, mx.bfloat16, case.shared)
    assert "one dtype" in routed_reason(case.experts, inkling, mx.bfloat16, mx.float32, case.shared)
