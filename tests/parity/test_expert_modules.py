"""Upstream expert modules that the breadth test (test_families.py) cannot drive through a greedy
token stream: their model makes none (mlx-vlm's diffusion_gemma, a diffusion LM; its
openai_privacy_filter, a token classifier; ming_image's text encoder), or its MoE block routes
inside, where the test records routes from the block's call (moondream3). Each calls upstream's
switch layers in a way of its own: switch linears sorted by its own `_gather_sort`, float32
activations against bf16 scales with biases (the privacy filter), a SwitchGLU behind an image mask
(ming_image). Built small from its own classes and quantized as the zoo quantizes
(zoo.randomized), each module gives stock's output with the package applied, on many tokens and on
one (identical where the references run, within the op tolerance where kernels do), and the
patched layers saw both phases' calls."""

import mlx.core as mx
import mlx_moe_fix
import pytest

from mlx_moe_fix import zoo

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
