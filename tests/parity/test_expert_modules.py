"""Upstream expert modules that the breadth test (test_families.py) cannot drive through a greedy
token stream: their model makes none (mlx-vlm's diffusion_gemma, a diffusion LM; its
openai_privacy_filter, a token classifier; ming_image's text encoder), or its MoE block routes
inside, where the test records routes from the block's call (moondream3). Each calls upstream's
switch layers in a way of its own: switch linears sorted by its own `_gather_sort`, float32
activations against bf16 scales with biases (the privacy filter), a SwitchGLU behind an image mask
(ming_image). Built small from its own classes and quantized as the zoo quantizes
(zoo.randomized), each module gives stock's output with the package applied, on many tokens and on
one (identical where the references run, within the op tolerance where kernels do), and the
patched layers saw both phases' calls. Under them all, the patched QuantizedSwitchLinear gives
stock's output in every call layout upstream's callers use (hypothesis), and leaves one it does not
take to upstream's code, saying why."""

import mlx.core as mx
import mlx_moe_fix
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_moe_fix import zoo

from .cases import CASES
from .test_greedy_tokens import run_dtype
from .tolerance import assert_matches, references_only

HIDDEN = 128
NUM_EXPERTS, TOP_K = 8, 2
TOKENS = (40, 1)  # prefill (80 pairs: sorted by the modules themselves), decode


def indices_for(tokens: int) -> mx.array:
    return mx.random.randint(0, NUM_EXPERTS, (tokens, TOP_K), key=mx.random.key(tokens))


def moondream3_moe():
    from mlx_vlm.models.moondream3.config import TextConfig
    from mlx_vlm.models.moondream3.language import MoEMLP

    config = TextConfig.from_dict({"hidden_size": HIDDEN, "num_experts": NUM_EXPERTS,
                                   "num_experts_per_tok": TOP_K, "moe_intermediate_size": 128})
    return MoEMLP(config), lambda module, x: module(x[None])


def diffusion_gemma_experts():
    from mlx_vlm.models.diffusion_gemma.config import TextConfig
    from mlx_vlm.models.diffusion_gemma.language import Experts

    config = TextConfig.from_dict({"hidden_size": HIDDEN, "moe_intermediate_size": 128,
                                   "num_experts": NUM_EXPERTS, "top_k_experts": TOP_K})
    return Experts(config), lambda module, x: module(x, indices_for(x.shape[0]))


def privacy_filter_experts():
    from mlx_vlm.models.openai_privacy_filter.config import ModelConfig
    from mlx_vlm.models.openai_privacy_filter.openai_privacy_filter import Experts

    config = ModelConfig.from_dict({"hidden_size": HIDDEN, "intermediate_size": 128,
                                    "num_local_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K})
    return Experts(config), lambda module, x: module(x, indices_for(x.shape[0]))


def ming_image_moe():
    from mlx_vlm.models.bailing_moe.config import ModelConfig
    from mlx_vlm.models.ming_image.text_encoder import MingMoeBlock

    config = ModelConfig(
        model_type="bailing_moe_v2", hidden_size=HIDDEN, intermediate_size=256, max_position_embeddings=4096,
        moe_intermediate_size=128, num_experts=NUM_EXPERTS, num_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=4, num_experts_per_tok=TOP_K, num_hidden_layers=2, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=600000.0, vocab_size=256, first_k_dense_replace=1, rope_scaling=None,
        use_qk_norm=True, partial_rotary_factor=0.5, moe_router_enable_expert_bias=True,
        routed_scaling_factor=2.5, score_function="sigmoid", n_group=2, topk_group=1)
    image_mask = lambda tokens: mx.arange(tokens)[None] % 3 == 0  # noqa: E731
    return MingMoeBlock(config), lambda module, x: module(x[None], image_mask(x.shape[0]))


EXPERT_MODULES = {"moondream3": moondream3_moe, "diffusion_gemma": diffusion_gemma_experts,
                  "openai_privacy_filter": privacy_filter_experts, "ming_image": ming_image_moe}


@pytest.mark.parametrize("name", EXPERT_MODULES)
def test_expert_module_gives_stock_output_with_the_package_applied(device, name):
    dtype = run_dtype(device)
    mx.random.seed(0)
    module, call = EXPERT_MODULES[name]()
    zoo.randomized(module, 4, dtype=dtype)
    exact = references_only()
    mlx_moe_fix.reset_path_counts()
    for tokens in TOKENS:
        x = mx.random.normal((tokens, HIDDEN), key=mx.random.key(100 + tokens)).astype(dtype)
        stock = call(module, x)
        with mlx_moe_fix.patched():
            patched = call(module, x)
        assert patched.dtype == stock.dtype and patched.shape == stock.shape
        assert_matches(patched, stock, exact, dtype, f"{name}, {tokens} tokens: ")
    records = mlx_moe_fix.path_counts()
    assert {r.phase for r in records} == {"prefill", "decode"}, records
    if exact:
        assert {r.path for r in records} == {"reference"}, records
    else:
        assert all(r.path != "stock" or r.reason for r in records), records


# How upstream's callers lay out a QuantizedSwitchLinear call, for tokens [T, D] and indices [T, k]:
# a row per token broadcast over its k experts (SwitchGLU's gate and up), a row per (token,
# expert) pair (its down), the pairs flattened and sorted by expert (`_gather_sort`, at 64 pairs
# and more) or flattened unsorted, and one the patch does not take (a row broadcast over every
# token too), which must reach upstream's code, saying why.
LAYOUTS = ("per_token", "per_pair", "sorted", "flat", "broadcast")


def switch_linear_call(layout: str, x: mx.array, indices: mx.array):
    """(x, indices, sorted_indices) of `layout` for rows x [T, D] and indices [T, k]."""
    tokens, top_k = indices.shape
    if layout == "per_token":
        return x[:, None, None, :], indices, False
    if layout == "per_pair":
        return mx.broadcast_to(x[:, None, None, :], (tokens, top_k, 1, x.shape[-1])), indices, False
    if layout == "broadcast":
        return x[:1, None, None, :], indices, False
    flat = indices.flatten()
    order = mx.argsort(flat) if layout == "sorted" else mx.arange(flat.size)
    return x[order // top_k][:, None, :], flat[order], layout == "sorted"


@st.composite
def layout_cases(draw):
    on_gpu = mx.default_device() == mx.gpu
    return dict(
        layout=draw(st.sampled_from(LAYOUTS)),
        dtype=draw(st.sampled_from((mx.bfloat16, mx.float16) if on_gpu else (mx.float32, mx.float16, mx.bfloat16))),
        quantization=draw(st.sampled_from(((4, 64), (8, 64)) if on_gpu else ((4, 32), (4, 64), (8, 64), (8, 128)))),
        widths=draw(st.sampled_from(((128, 128),) if on_gpu else ((128, 128), (128, 256), (256, 128)))),
        bias=draw(st.booleans()),
        tokens=draw(st.sampled_from((1, 2, 40) if on_gpu else (1, 2, 5, 33, 40))),
        top_k=draw(st.sampled_from((1, 2, 4))),
        seed=draw(st.integers(0, 2**16)),
    )


@CASES
@given(case=layout_cases())
def test_quantized_switch_linear_gives_stock_output_in_every_call_layout(device, case):
    from mlx_lm.models.switch_layers import SwitchLinear

    (bits, group_size), (input_dims, output_dims) = case["quantization"], case["widths"]
    key = mx.random.key(case["seed"])
    layer = SwitchLinear(input_dims, output_dims, NUM_EXPERTS, bias=case["bias"])
    if case["bias"]:
        layer.bias = 0.1 * mx.random.normal(layer.bias.shape, key=key)
    layer.set_dtype(case["dtype"])
    layer = layer.to_quantized(group_size=group_size, bits=bits)
    x = mx.random.normal((case["tokens"], input_dims), key=key).astype(case["dtype"])
    indices = mx.random.randint(0, NUM_EXPERTS, (case["tokens"], case["top_k"]), key=key).astype(mx.uint32)
    args = switch_linear_call(case["layout"], x, indices)
    stock = layer(*args)
    mlx_moe_fix.reset_path_counts()
    with mlx_moe_fix.patched():
        patched = layer(*args)
    assert patched.dtype == stock.dtype and patched.shape == stock.shape
    assert_matches(patched, stock, references_only(), case["dtype"], f"{case}: ")
    records = mlx_moe_fix.path_counts()
    assert {r.layer for r in records} == {"QuantizedSwitchLinear"}, records
    took = {r.path != "stock" for r in records}
    if case["layout"] == "broadcast" and case["tokens"] > 1:
        assert took == {False} and all("is not one row per token" in r.reason for r in records), records
    elif references_only():
        assert took == {True}, records
