"""Random MoE layer cases: a stock upstream layer, its inputs, and its MoEExperts description."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mlx_moe_fix.kernels import ExpertLinear, MoEExperts
from mlx_moe_fix.patches.activations import recognise

PRIMES = (3, 5, 7, 11, 13, 37)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# (bits, group size[, mode]): affine unless a mode is given.
QUANTIZATIONS = (None, (4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128), (4, 32, "mxfp4"), (4, 16, "nvfp4"))

# Hypothesis settings of the op tests. MLX_MOE_FIX_EXAMPLES trims the GPU runs, where each new
# kernel variant costs an NVRTC compile.
CASES = settings(max_examples=int(os.environ.get("MLX_MOE_FIX_EXAMPLES", "60")), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@dataclass
class Case:
    layer: nn.Module
    experts: MoEExperts
    x: mx.array
    indices: mx.array
    weights: Optional[mx.array]
    dtype: object
    label: str

    def stock(self) -> mx.array:
        y = self.layer(self.x, self.indices)
        if self.weights is None:
            return y
        return (y * self.weights[..., None].astype(y.dtype)).sum(axis=-2)


# stock_activation's kinds for SwitchGLU: mlx-lm's SwiGLU, DeepSeek-V4's, gpt-oss's, DeepSeek-V4.1's,
# Step-3.5's, Gemma 4's and Kimi-K3's.
GATED_KINDS = ("swiglu", "swiglu_limited", "swiglu_oai", "swiglu_fp32_limited", "swiglu_clamped_silu", "swiglu_capped_silu",
               "geglu_approx", "situ")


# The kinds whose stock_activation takes the drawn limit.
LIMITED_KINDS = ("swiglu_limited", "swiglu_oai", "swiglu_fp32_limited", "swiglu_clamped_silu", "situ")


def stock_activation(kind: str, limit: float):
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwiGLU

    if kind == "swiglu":
        return SwiGLU()
    if kind == "swiglu_limited":
        from mlx_vlm.models.deepseek_v4.language import LimitedSwiGLU

        return LimitedSwiGLU(limit)
    if kind == "swiglu_oai":
        return SwigluOAI(alpha=1.702, limit=limit)
    if kind == "swiglu_fp32_limited":
        from mlx_lm.models.deepseek_v41 import DeepseekV41SwiGLU

        return DeepseekV41SwiGLU(limit)
    if kind == "swiglu_clamped_silu":
        from mlx_lm.models.step3p5 import ClampedSwiGLU

        return ClampedSwiGLU(limit)
    if kind == "swiglu_capped_silu":  # Kimi-VL's function, its clip fixed at +-100 (it binds in tests/test_cuda_activation.py)
        from mlx_vlm.models.kimi_vl.language import clipped_silu

        return clipped_silu
    if kind == "geglu_approx":
        from mlx_lm.models.gemma4_text import GeGLU

        return GeGLU()
    if kind == "situ":  # Kimi-K3's, the limit its linear_beta (0.25 binds, 50 leaves `up` about as it is)
        from mlx_lm.models.kimi_k3 import SiTU

        return SiTU(beta=2.0, linear_beta=limit)
    if kind == "relu2":
        return nn.ReLU2()
    return nn.GELU(approx={"gelu": "none", "gelu_approx": "precise", "gelu_fast": "fast"}[kind])


def build_layer(glu: bool, kind: str, limit: float, dims: int, hidden: int, experts: int, scaled: bool,
                bias: bool = False):
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    if scaled:
        from mlx_vlm.models.inkling.language import InklingSwitchGLU

        layer = InklingSwitchGLU(dims, hidden, experts)
        layer.gate_scale = mx.random.uniform(0.5, 2.0, (experts,))
        layer.out_scale = mx.random.uniform(0.5, 2.0, (experts,))
        return layer
    kind_of_layer = SwitchGLU if glu else SwitchMLP
    layer = kind_of_layer(dims, hidden, experts, activation=stock_activation(kind, limit), bias=bias)
    for projection in layer.children().values():
        if isinstance(projection, nn.Module) and "bias" in projection:  # upstream starts them at zero
            projection.bias = 0.5 * mx.random.normal(projection.bias.shape)
    return layer


def describe(layer, glu: bool, scaled: bool) -> MoEExperts:
    names = ("gate_proj", "up_proj", "down_proj") if glu else ("fc1", "fc2")
    return MoEExperts(
        tuple(ExpertLinear.from_module(layer[n]) for n in names),
        recognise(layer.activation),
        layer.gate_scale if scaled else None,
        layer.out_scale if scaled else None,
    )


# On a GPU, MLX JIT-compiles many of stock's kernels per shape (about a second each) and each new
# kernel variant of ours is an NVRTC compile: there the cases keep to a few shapes (top-3: a k
# that does not divide the combining decode launch's 8 warps).
GPU_SHAPES = {"quantizations": ((4, 64), (8, 64), (4, 32, "mxfp4"), (4, 16, "nvfp4")), "dims": (128,), "experts": (8,), "top_k": (2, 3, 8), "tokens": (1, 2, 40)}


@st.composite
def layer_cases(draw, max_pairs: int = 200) -> Case:
    on_gpu = mx.default_device() == mx.gpu
    dtype = draw(st.sampled_from(DTYPES))
    quantization = draw(st.sampled_from(GPU_SHAPES["quantizations"] if on_gpu else QUANTIZATIONS))
    if quantization is None and mx.default_device() == mx.cpu:
        dtype = mx.float32  # MLX's CPU gather_mm (stock's unquantized path) supports only float32
    glu = draw(st.booleans())
    kind = draw(st.sampled_from(GATED_KINDS if glu else ("gelu", "gelu_approx", "gelu_fast", "relu2")))
    # A limit of 0.25 binds for most gate / up values here, 50 for none.
    limit = draw(st.sampled_from((0.25, 50.0)))
    scaled = glu and kind == "swiglu" and draw(st.booleans())
    if on_gpu:
        dims = hidden = draw(st.sampled_from(GPU_SHAPES["dims"]))
        num_experts = draw(st.sampled_from(GPU_SHAPES["experts"]))
        top_k = draw(st.sampled_from(GPU_SHAPES["top_k"]))
        batch, tokens = 1, draw(st.sampled_from(GPU_SHAPES["tokens"]))
    else:
        if quantization is None:
            dims, hidden = draw(st.sampled_from(PRIMES + (16, 64))), draw(st.sampled_from(PRIMES + (24, 64)))
        else:
            group = quantization[1]
            dims, hidden = group * draw(st.integers(1, 3)), group * draw(st.integers(1, 2))
        num_experts = draw(st.sampled_from((1, 2, 3, 5, 7, 8)))
        top_k = draw(st.integers(1, num_experts))
        batch = draw(st.integers(1, 3))
        tokens = draw(st.integers(1, max(1, max_pairs // (batch * top_k))))
    return make_case(
        dtype, quantization, glu, kind, limit, scaled, dims, hidden, num_experts, top_k, batch, tokens,
        routing=draw(st.sampled_from(("random", "one_expert", "few_experts"))),
        with_weights=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        bias=not scaled and draw(st.booleans()),
    )


def make_case(
    dtype, quantization, glu, kind, limit, scaled, dims, hidden, num_experts, top_k, batch, tokens,
    *, routing="random", with_weights=False, seed=0, bias=False, down_bits=None,
) -> Case:
    """routing: "random"; "one_expert": expert 0 is every token's first choice (with top_k 1,
    every pair is on it); "few_experts": the upper half of the experts gets no pairs unless k
    needs them. down_bits: the down projection quantized to these bits (the others to
    `quantization`'s), as mixed-precision checkpoints do."""
    mx.random.seed(seed)
    layer = build_layer(glu, kind, limit, dims, hidden, num_experts, scaled, bias)
    if quantization is not None:
        if down_bits is not None:
            nn.quantize(layer, group_size=quantization[1], bits=down_bits, mode=(*quantization, "affine")[2],
                        class_predicate=lambda path, module: path.endswith("down_proj"))
        nn.quantize(layer, group_size=quantization[1], bits=quantization[0], mode=(*quantization, "affine")[2])
    layer.set_dtype(dtype)
    layer.eval()

    scores = mx.random.uniform(shape=(batch, tokens, num_experts))
    if routing == "one_expert":
        scores = scores + mx.where(mx.arange(num_experts) == 0, 2.0, 0.0)
    elif routing == "few_experts":
        scores = scores + mx.where(mx.arange(num_experts) < max(top_k, num_experts // 2), 2.0, 0.0)
    indices = mx.argsort(-scores, axis=-1)[..., :top_k].astype(mx.uint32)
    x = mx.random.normal((batch, tokens, dims)).astype(dtype)
    weights = mx.softmax(mx.random.normal((batch, tokens, top_k)), axis=-1).astype(dtype) if with_weights else None
    label = (
        f"{'glu' if glu else 'mlp'}/{kind}{'(limit %g)' % limit if kind in LIMITED_KINDS else ''}"
        f"{'/scaled' if scaled else ''} q={quantization} {dtype} D={dims} F={hidden} E={num_experts} "
        f"k={top_k} B={batch} T={tokens} pairs={indices.size} {routing} weights={weights is not None} bias={bias}"
    )
    return Case(layer, describe(layer, glu, scaled), x, indices, weights, dtype, label)
