"""End to end: full-size random-weight 4-bit mlx-lm models, stock against mlx_moe_fix.

Run from the repo root (on the GPU machine after `source .mlx-cuda/setup.sh`):

    python3 -m benchmarks.models                                      # qwen3_moe, mixtral + dense
    python3 -m benchmarks.models --models qwen3_moe --prompts 512,2048,8192 --json /tmp/m.json
    python3 -m benchmarks.models --models gpt_oss,deepseek_v3 --deepseek-layers 4
    python3 -m benchmarks.models --models inkling,deepseek_v4 --deepseek-layers 2 --batch-sizes ''
    python3 -m benchmarks.models --models gpt_oss,inkling,deepseek_v4 --deepseek-layers 2 --experts-mode shipped
    python3 -m benchmarks.models --models mixtral --stock-max-prompt 2048 --repeats 3
    python3 -m benchmarks.models --smoke --json /tmp/m.json           # tiny configs, CPU

Models are built from mlx-lm's own classes at the published configs (qwen3_moe: Qwen3-30B-A3B,
mixtral: Mixtral-8x7B, gpt_oss: gpt-oss-20b, deepseek_v3: DeepSeek-V3 with --deepseek-layers
layers, all of them MoE; from mlx-vlm's language models: inkling and deepseek_v4, with
--deepseek-layers layers too, every one MoE, no batched decode: their caches do not go through
mlx-lm's BatchGenerator), lazily initialized, cast to bf16, quantized by mlx-lm's
`quantize_model` (4-bit affine, group 64) while still lazy, then evaluated one module at a time,
so no float32 copy of the whole model ever exists. Parameters that mlx-lm initializes to zeros
(DeepSeek's router weight, expert biases, attention sinks) get random values: a zero router sends
every token to the same experts.

Each MoE model has a dense equivalent with its attention and an MLP as wide as its active
experts, built from mlx-lm classes too:
- qwen3_moe -> qwen3, intermediate 6144 = 8 x 768
- mixtral -> llama, intermediate 28672 = 2 x 14336
- gpt_oss -> the gpt_oss model itself with every MoE block swapped for llama's MLP of
  intermediate 11520 = 4 x 2880 with biases, so attention (sinks, alternating 128-token sliding
  window, rotating cache) stays identical; the MLP uses plain SwiGLU instead of gpt-oss's clamped
  one, an elementwise difference
- deepseek_v3 -> deepseek_v3 with every layer dense, intermediate 18432 = (8 routed + 1 shared)
  x 2048, the width of DeepSeek-V3's own dense layers
- inkling -> inkling with every layer Inkling's own dense MLP, intermediate 24576 = (6 routed + 2
  shared) x 3072
- deepseek_v4 -> deepseek_v4 with every block's MoE swapped for DeepSeek-V4's own dense MLP
  (clamped SwiGLU), intermediate 14336 = (6 routed + 1 shared) x 2048

Measured, with `mlx_moe_fix.revert()` (stock) and `apply()` (patched) in one process:
- prefill tok/s per prompt length: prompt tokens over the time to the first token through
  mlx-lm's `generate_step` (what `stream_generate` reports as prompt tok/s; mlx-lm feeds the last
  prompt token as the first decode step, so prompt P runs as P - 1 tokens in chunks of
  --prefill-step-size, then 1);
- decode tok/s: --decode-tokens greedy tokens after a --decode-prompt prompt, tokens after the
  first over the time after the first; the first --parity-tokens tokens of stock and patched are
  compared, and the logits the prompt ends on;
- batched decode through `BatchGenerator` at --batch-sizes: every sequence starts from a prompt
  cache built once per model (patched prefill, for speed), shared by stock and patched, so only
  decode is timed; tok/s counts all sequences.
Every measurement runs once at exactly its shapes as warm-up (MLX JIT-compiles per shape), then
--repeats times; tables show the best tok/s with half the spread ((max - min) / median / 2),
and the greedy tokens compared are those of the warm-up runs.
"""

import argparse
import contextlib
import gc
import importlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import BatchGenerator, generate_step, generation_stream
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import quantize_model

import mlx_moe_fix
from mlx_moe_fix.zoo import EXPERT_MODES

from .summary import models_report
from .timing import environment, environment_line, log, take_path_counts, write_json

GROUP_SIZE = 64
BITS = 4
# --experts-mode: the routed experts' quantization (every other linear stays 4-bit affine g64).
EXPERT_QUANTIZATIONS = {"affine": {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}, **EXPERT_MODES}
# --experts-mode shipped: each model as its published MLX checkpoints are quantized: gpt_oss's and
# inkling's routed experts as their checkpoints ship them, deepseek_v4 (and its dense equivalent)
# by its own predicate (OWN: what mlx-vlm's convert applies: mxfp4 routed experts, mxfp8 shared
# experts and attention, the rest the default 4-bit affine here); the others all affine.
SHIPPED, OWN = "shipped", "own"
SHIPPED_MODES = {"gpt_oss": "mxfp4", "inkling": "nvfp4", "deepseek_v4": OWN, "deepseek_v4_dense": OWN}


@dataclass
class ModelSpec:
    name: str
    module: str  # mlx_lm.models.<module>
    config: Dict[str, Any]
    moe: bool
    dense: Optional[str] = None  # name of the dense equivalent
    # Edits the lazily built model before quantization (the gpt_oss dense equivalent).
    customize: Optional[Callable[[nn.Module, Dict[str, Any]], None]] = None
    # "mlx_vlm": `module` is mlx_vlm.models.<module>, whose language model is built from its
    # config class (VLM_CONFIG_CLASSES) and called through LogitsOnly.
    library: str = "mlx_lm"
    experts_mode: str = "affine"  # a key of EXPERT_QUANTIZATIONS


VLM_CONFIG_CLASSES = {"inkling": "TextConfig", "deepseek_v4": "ModelConfig"}


class LogitsOnly(nn.Module):
    """An mlx-vlm language model as mlx-lm's generate_step calls a model: logits out."""

    def __init__(self, language: nn.Module):
        super().__init__()
        self.language = language

    def __call__(self, inputs, cache=None, **kwargs):
        return self.language(inputs, cache=cache, **kwargs).logits

    def make_cache(self):
        return self.language.make_cache()

    @property
    def layers(self):
        return self.language.layers


def swap_in_dense_mlp(model: nn.Module, config: Dict[str, Any]) -> None:
    """gpt_oss dense equivalent: replace each MoE block by llama's SwiGLU MLP as wide as the
    active experts (top-k x expert width), with biases like gpt-oss's experts."""
    mlp_args = llama.ModelArgs(
        model_type="llama",
        hidden_size=config["hidden_size"],
        num_hidden_layers=1,
        intermediate_size=config["num_experts_per_tok"] * config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        rms_norm_eps=config["rms_norm_eps"],
        vocab_size=config["vocab_size"],
        mlp_bias=True,
    )
    for layer in model.layers:
        layer.mlp = llama.MLP(mlp_args)


def qwen3_moe_config(hidden, layers, heads, kv_heads, head_dim, experts, top_k, ffn, vocab):
    return dict(
        model_type="qwen3_moe",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=top_k * ffn,  # dense-layer width; unused, every layer is MoE
        num_attention_heads=heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=ffn,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=1e6,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        norm_topk_prob=True,
    )


def qwen3_dense_config(moe: Dict[str, Any]) -> Dict[str, Any]:
    keep = (
        "hidden_size num_hidden_layers num_attention_heads rms_norm_eps vocab_size "
        "num_key_value_heads max_position_embeddings head_dim tie_word_embeddings rope_theta"
    ).split()
    config = {k: moe[k] for k in keep}
    config.update(
        model_type="qwen3",
        intermediate_size=moe["num_experts_per_tok"] * moe["moe_intermediate_size"],
    )
    return config


def mixtral_config(hidden, layers, heads, kv_heads, experts, top_k, ffn, vocab):
    return dict(
        model_type="mixtral",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_experts_per_tok=top_k,
        num_key_value_heads=kv_heads,
        num_local_experts=experts,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )


def llama_dense_config(moe: Dict[str, Any]) -> Dict[str, Any]:
    return dict(
        model_type="llama",
        hidden_size=moe["hidden_size"],
        num_hidden_layers=moe["num_hidden_layers"],
        intermediate_size=moe["num_experts_per_tok"] * moe["intermediate_size"],
        num_attention_heads=moe["num_attention_heads"],
        num_key_value_heads=moe["num_key_value_heads"],
        rms_norm_eps=moe["rms_norm_eps"],
        vocab_size=moe["vocab_size"],
        rope_theta=moe["rope_theta"],
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    )


def gpt_oss_config(hidden, layers, heads, kv_heads, head_dim, experts, top_k, vocab, window):
    return dict(
        model_type="gpt_oss",
        num_hidden_layers=layers,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        hidden_size=hidden,
        intermediate_size=hidden,
        head_dim=head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        sliding_window=window,
        rope_theta=150000,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
        },
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
    )


def deepseek_v3_config(
    hidden, layers, heads, experts, top_k, ffn, vocab, groups, q_rank, kv_rank, rope_dim, nope_dim
):
    return dict(
        model_type="deepseek_v3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=(top_k + 1) * ffn,  # DeepSeek-V3's dense layers: 18432 = 9 x 2048
        moe_intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=1,
        n_routed_experts=experts,
        routed_scaling_factor=2.5,
        kv_lora_rank=kv_rank,
        q_lora_rank=q_rank,
        qk_rope_head_dim=rope_dim,
        v_head_dim=nope_dim,
        qk_nope_head_dim=nope_dim,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        n_group=groups,
        topk_group=max(1, groups // 2),
        num_experts_per_tok=top_k,
        moe_layer_freq=1,
        # The real model's first 3 layers are dense; here every layer is MoE so the expert
        # path is what the few layers measure.
        first_k_dense_replace=0,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_theta=10000,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        attention_bias=False,
    )


def deepseek_dense_config(moe: Dict[str, Any]) -> Dict[str, Any]:
    return dict(moe, first_k_dense_replace=moe["num_hidden_layers"])


def inkling_config(hidden, layers, heads, kv_heads, swa_kv_heads, experts, top_k, shared, ffn, vocab, window):
    return dict(
        model_type="inkling",
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128 if hidden >= 1024 else 32,
        swa_num_attention_heads=heads,
        swa_num_key_value_heads=swa_kv_heads,
        swa_head_dim=128 if hidden >= 1024 else 32,
        sliding_window_size=window,
        rel_extent=1024 if hidden >= 1024 else 64,
        dense_mlp_idx=0,  # every layer MoE, so that the few layers measure the expert path
        intermediate_size=ffn,  # Inkling calls the expert width intermediate_size
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=shared,
        route_scale=8.0,
    )


def inkling_dense_config(moe: Dict[str, Any]) -> Dict[str, Any]:
    """Every layer Inkling's own dense MLP, as wide as the routed top-k plus the shared experts."""
    width = (moe["num_experts_per_tok"] + moe["n_shared_experts"]) * moe["intermediate_size"]
    return dict(moe, dense_mlp_idx=moe["num_hidden_layers"], dense_intermediate_size=width)


def deepseek_v4_config(hidden, layers, heads, experts, top_k, ffn, vocab, q_rank, head_dim, o_groups, o_rank, window, limit):
    return dict(
        model_type="deepseek_v4",
        vocab_size=vocab,
        hidden_size=hidden,
        moe_intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        n_shared_experts=1,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        q_lora_rank=q_rank,
        qk_rope_head_dim=64 if head_dim >= 128 else 32,
        head_dim=head_dim,
        o_groups=o_groups,
        o_lora_rank=o_rank,
        # Plain sliding-window attention in every layer (the real model compresses some layers'
        # caches; the dense equivalent has the same attention either way), and learned routing
        # in every layer (the real model's first 3 route by token id).
        compress_ratios=[0] * layers,
        num_hash_layers=0,
        sliding_window=window,
        swiglu_limit=limit,
    )


def swap_in_deepseek_v4_dense_ffn(model: nn.Module, config: Dict[str, Any]) -> None:
    """deepseek_v4 dense equivalent: each block's MoE replaced by DeepSeek-V4's own dense MLP
    (clamped SwiGLU) as wide as the active experts (routed top-k + shared)."""
    from types import SimpleNamespace

    from mlx_vlm.models.deepseek_v4.language import DeepseekV4MLP

    class DenseFFN(DeepseekV4MLP):
        def __call__(self, x, input_ids=None):  # the block passes the MoE's token ids too
            return super().__call__(x)

    width = (config["num_experts_per_tok"] + config["n_shared_experts"]) * config["moe_intermediate_size"]
    for layer in model.layers:
        layer.ffn = DenseFFN(SimpleNamespace(hidden_size=config["hidden_size"]), width, config["swiglu_limit"])


def model_specs(smoke: bool, deepseek_layers: int) -> Dict[str, ModelSpec]:
    if smoke:
        qwen = qwen3_moe_config(128, 2, 4, 2, 32, 8, 2, 64, 512)
        mixtral = mixtral_config(128, 2, 4, 2, 4, 2, 128, 512)
        gpt_oss = gpt_oss_config(128, 2, 4, 2, 32, 4, 2, 512, 8)
        deepseek = deepseek_v3_config(128, 2, 2, 8, 2, 64, 512, 2, 64, 64, 32, 64)
        inkling = inkling_config(128, 2, 2, 1, 1, 8, 2, 1, 64, 512, 8)
        deepseek4 = deepseek_v4_config(128, 2, 2, 8, 2, 64, 512, 128, 128, 2, 128, 8, 10.0)
    else:
        qwen = qwen3_moe_config(2048, 48, 32, 4, 128, 128, 8, 768, 151936)
        mixtral = mixtral_config(4096, 32, 32, 8, 8, 2, 14336, 32000)
        gpt_oss = gpt_oss_config(2880, 24, 64, 8, 64, 32, 4, 201088, 128)
        deepseek = deepseek_v3_config(
            7168, deepseek_layers, 128, 256, 8, 2048, 129280, 8, 1536, 512, 64, 128
        )
        # Inkling's TextConfig: hidden 6144, 256 experts, top-6, 2 shared, 64 / 8 heads (sliding
        # layers 64 / 16), vocab 201024, window 512. Its intermediate_size default, 24576, is
        # (6 + 2) x 3072: an expert width of 3072 is what its 975B checkpoint's size gives
        # (66 layers x 256 experts x 3 x 6144 x 3072 = 956e9 parameters).
        inkling = inkling_config(6144, deepseek_layers, 64, 8, 16, 256, 6, 2, 3072, 201024, 512)
        # DeepSeek-V4's ModelConfig: hidden 4096, 256 experts of 2048, top-6, 1 shared, 64 heads
        # of 512 with one KV head, q rank 1024, 8 output groups of rank 1024, window 128,
        # swiglu_limit 10.
        deepseek4 = deepseek_v4_config(4096, deepseek_layers, 64, 256, 6, 2048, 129280, 1024, 512, 8, 1024, 128, 10.0)
    specs = [
        ModelSpec("qwen3_moe", "qwen3_moe", qwen, True, "qwen3_dense"),
        ModelSpec("qwen3_dense", "qwen3", qwen3_dense_config(qwen), False),
        ModelSpec("mixtral", "mixtral", mixtral, True, "llama_dense"),
        ModelSpec("llama_dense", "llama", llama_dense_config(mixtral), False),
        ModelSpec("gpt_oss", "gpt_oss", gpt_oss, True, "gpt_oss_dense"),
        ModelSpec("gpt_oss_dense", "gpt_oss", gpt_oss, False, customize=swap_in_dense_mlp),
        ModelSpec("deepseek_v3", "deepseek_v3", deepseek, True, "deepseek_v3_dense"),
        ModelSpec("deepseek_v3_dense", "deepseek_v3", deepseek_dense_config(deepseek), False),
        ModelSpec("inkling", "inkling", inkling, True, "inkling_dense", library="mlx_vlm"),
        ModelSpec("inkling_dense", "inkling", inkling_dense_config(inkling), False, library="mlx_vlm"),
        ModelSpec("deepseek_v4", "deepseek_v4", deepseek4, True, "deepseek_v4_dense", library="mlx_vlm"),
        ModelSpec("deepseek_v4_dense", "deepseek_v4", deepseek4, False, customize=swap_in_deepseek_v4_dense_ffn,
                  library="mlx_vlm"),
    ]
    return {s.name: s for s in specs}


MOE_MODELS = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "inkling", "deepseek_v4"]
# Their caches (CacheList) do not go through mlx-lm's BatchGenerator: no batched decode.
NO_BATCHED_DECODE = {"inkling", "inkling_dense", "deepseek_v4", "deepseek_v4_dense"}


# ---------------------------------------------------------------- building


def randomize_zero_parameters(module: nn.Module) -> None:
    """Give parameters that are all zeros (after evaluation) random values of the scale
    mlx-lm's Linear init uses."""
    for name, value in list(module.items()):
        if not isinstance(value, mx.array) or not mx.issubdtype(value.dtype, mx.floating):
            continue
        if mx.all(value == 0).item():
            bound = value.shape[-1] ** -0.5
            module[name] = mx.random.uniform(-bound, bound, value.shape, dtype=value.dtype)
            mx.eval(module[name])


# MLX's kernels cannot draw or quantize an array of 2^31 or more elements in one go (on CUDA the
# launch fails: Inkling's experts are 256 x 3072 x 6144 = 4.8e9 per projection, DeepSeek-V4's
# 2^31): such expert weights are drawn and quantized EXPERT_CHUNK experts at a time.
HUGE_ELEMENTS = 2**31
EXPERT_CHUNK = 16


def is_expert_linear(module: nn.Module) -> bool:
    """A switch linear: one weight matrix per expert."""
    weight = module.get("weight") if hasattr(module, "to_quantized") else None
    return isinstance(weight, mx.array) and weight.ndim == 3


def quantize_huge_expert_weights(model: nn.Module, quantization_of: Callable[[str, nn.Module], Dict[str, Any]]) -> None:
    """Each switch linear of HUGE_ELEMENTS or more weights replaced by its quantized form
    (`quantization_of(path, module)`: an EXPERT_QUANTIZATIONS entry), with weights drawn as its own
    init does (uniform, bound input_dims ** -0.5) in bf16, chunk by chunk; lazy, like the rest of
    the build."""
    leaves = []
    for path, module in model.named_modules():
        if not is_expert_linear(module) or module["weight"].size < HUGE_ELEMENTS:
            continue
        quantization = quantization_of(path, module)
        experts, out_dims, in_dims = module["weight"].shape
        quantized = module.to_quantized(**quantization)  # its own quantize: never evaluated
        bound = in_dims**-0.5
        parts = [
            mx.quantize(mx.random.uniform(-bound, bound, (min(EXPERT_CHUNK, experts - e), out_dims, in_dims)).astype(mx.bfloat16),
                        **quantization)
            for e in range(0, experts, EXPERT_CHUNK)
        ]
        for i, name in enumerate(("weight", "scales", "biases")[:len(parts[0])]):  # mxfp4 has no biases
            quantized[name] = mx.concatenate([p[i] for p in parts])
        leaves.append((path, quantized))
    if leaves:
        model.update_modules(tree_unflatten(leaves))


def build_model(spec: ModelSpec) -> nn.Module:
    own_predicate = None
    if spec.library == "mlx_vlm":
        package = f"mlx_vlm.models.{spec.module}"
        config_class = getattr(importlib.import_module(f"{package}.config"), VLM_CONFIG_CLASSES[spec.module])
        language = importlib.import_module(f"{package}.language").LanguageModel
        model = LogitsOnly(language(config_class.from_dict(spec.config)))  # lazy: nothing computed
        # Their own predicates ask for mxfp4 / mxfp8 experts: affine everywhere here, as for the
        # mlx-lm models.
        own_predicate = lambda path, module: True  # noqa: E731
    else:
        module = importlib.import_module(f"mlx_lm.models.{spec.module}")
        model = module.Model(module.ModelArgs.from_dict(spec.config))  # lazy: nothing computed
    if spec.customize:
        spec.customize(model, spec.config)
    # Real checkpoints are bf16, so activations run bf16 and quantization scales come out bf16;
    # what the model keeps in float32 (its cast_predicate: DeepSeek-V4's hyper-connections,
    # sinks, router bias) stays float32, as its loader does.
    keep = getattr(getattr(model, "language", model), "cast_predicate", None)
    if keep is None:
        model.set_dtype(mx.bfloat16)
    else:
        model.update(tree_unflatten([
            (k, v.astype(mx.bfloat16) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
            for k, v in tree_flatten(model.parameters())
        ]))
    if spec.experts_mode == OWN:
        predicate = experts_quantization = model_own_predicate(model)
    else:
        quantization = EXPERT_QUANTIZATIONS[spec.experts_mode]
        experts_quantization = lambda path, module: quantization  # noqa: E731
        predicate = own_predicate
        if spec.experts_mode != "affine":
            others = own_predicate or getattr(model, "quant_predicate", None) or (lambda path, module: True)

            def predicate(path, module):
                return quantization if is_expert_linear(module) else others(path, module)
    quantize_huge_expert_weights(model, experts_quantization)
    with contextlib.redirect_stdout(sys.stderr):  # its bits-per-weight note is not a result
        quantize_model(model, {}, group_size=GROUP_SIZE, bits=BITS, quant_predicate=predicate)
    # One module at a time: only one module's float32 weights exist at any moment.
    for _, sub in model.named_modules():
        mx.eval([v for v in sub.values() if isinstance(v, mx.array)])
        randomize_zero_parameters(sub)
    mx.eval(model.parameters())  # anything nested deeper than a module's own attributes
    # In inference mode, as mlx-lm's and mlx-vlm's loaders leave a model: an nn.Module is built
    # training, and DeepSeek-V4's gate then routes (and its decode-block calls run) as in training,
    # which the patch leaves to upstream (moe_blocks.deepseek_v4_routing).
    model.eval()
    return model


def model_own_predicate(model: nn.Module) -> Callable[[str, nn.Module], Dict[str, Any]]:
    """The quantization the model's own `quant_predicate` gives each linear (mlx-vlm language
    models' paths without this benchmark's `language.` prefix), as a quantize_model predicate whose
    "quantize as the default" is this benchmark's 4-bit affine g64."""
    language = getattr(model, "language", model)
    own = getattr(language, "quant_predicate", None)
    if own is None:
        raise ValueError(f"{type(language).__name__} has no quantization predicate of its own")

    def predicate(path, module):
        chosen = own(path.removeprefix("language."), module)
        return EXPERT_QUANTIZATIONS["affine"] if chosen is True else chosen

    return predicate


def add_decode_pair_arguments(parser) -> None:
    """--model, --deepseek-layers and --prompt, for build_decode_pair."""
    parser.add_argument("--model", choices=MOE_MODELS, default="qwen3_moe")
    parser.add_argument("--deepseek-layers", type=int, default=4, help="layers of deepseek_v3, inkling, deepseek_v4")
    parser.add_argument("--prompt", type=int, default=256, help="tokens before decoding")


def build_decode_pair(args) -> tuple:
    """(the spec of args.model, {False: that MoE model, True: its dense equivalent}, args.prompt
    random tokens), for the decode benchmarks that compare the two in one process. Seeded: every
    process builds the same weights, so that processes' outputs can be compared."""
    mx.random.seed(0)
    specs = model_specs(args.smoke, args.deepseek_layers)
    spec = specs[args.model]
    built = {dense: build_model(specs[spec.dense if dense else args.model]) for dense in (False, True)}
    prompt = np.random.default_rng(0).integers(0, spec.config["vocab_size"], args.prompt).tolist()
    return spec, built, prompt


def parameter_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


# ---------------------------------------------------------------- running


def sync_all() -> None:
    """Wait for the default stream and mlx-lm's generation stream (generate_step leaves one
    extra step queued when it is closed early)."""
    mx.synchronize()
    mx.synchronize(generation_stream)


def set_mode(mode: str) -> None:
    if mode == "patched":
        mlx_moe_fix.apply()
    else:
        mlx_moe_fix.revert()


def time_prefill(model, prompt: mx.array, args) -> float:
    """Seconds to the first token."""
    sync_all()
    start = time.perf_counter()
    steps = generate_step(prompt, model, max_tokens=1, prefill_step_size=args.prefill_step_size)
    next(steps)
    seconds = time.perf_counter() - start
    steps.close()
    sync_all()
    return seconds


def time_decode(model, prompt: mx.array, args):
    """(seconds for the tokens after the first, the greedy tokens, first log-probabilities)."""
    sync_all()
    tokens, first_logprobs, first_at = [], None, None
    for token, logprobs in generate_step(
        prompt, model, max_tokens=args.decode_tokens, prefill_step_size=args.prefill_step_size
    ):
        if first_at is None:
            first_at, first_logprobs = time.perf_counter(), logprobs
        tokens.append(token)
    seconds = time.perf_counter() - first_at
    sync_all()
    return seconds, tokens, first_logprobs


def build_prompt_caches(model, prompts: List[List[int]], args) -> List[List[Any]]:
    """Each prompt but its last token, prefilled into its own cache the way generate_step
    does it (chunks, cache state evaluated after each)."""
    caches = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        body = prompt[:-1]
        for start in range(0, len(body), args.prefill_step_size):
            chunk = mx.array(body[start : start + args.prefill_step_size])[None]
            model(chunk, cache=cache)
            mx.eval([c.state for c in cache])
        caches.append(cache)
    return caches


def batch_generator(model, prompts, caches, batch: int, max_tokens: int) -> BatchGenerator:
    """A BatchGenerator decoding the first `batch` prompts from their caches (each cache holding
    its prompt but the last token, as build_prompt_caches makes them)."""
    # prefill_batch_size = batch: with the default (8) a batch of 16 would start decoding 8
    # sequences while the other 8 are still being admitted, mixing batch sizes.
    generator = BatchGenerator(
        model,
        max_tokens=max_tokens,
        completion_batch_size=batch,
        prefill_batch_size=batch,
    )
    # Given a cache, a one-token prompt goes straight to decoding: no prompt processing.
    # Merging copies the caches into a batch cache, so the originals stay reusable.
    generator.insert([[p[-1]] for p in prompts[:batch]], caches=caches[:batch])
    return generator


def time_batch_decode(model, prompts, caches, batch: int, args) -> float:
    """Seconds for the decode steps after the first, `batch` sequences at once."""
    sync_all()
    generator = batch_generator(model, prompts, caches, batch, args.batch_tokens)
    steps, first_at = 0, None
    while responses := generator.next_generated():
        steps += 1
        if first_at is None:
            first_at = time.perf_counter()
        assert len(responses) == batch
    seconds = time.perf_counter() - first_at
    mx.synchronize(generator.stream)
    generator.close()
    assert steps == args.batch_tokens
    return seconds


def summarize(rates: List[float]) -> Dict[str, Any]:
    """Tokens per second over the repeats: the best (highest), median and spread."""
    ordered = sorted(rates)
    median = float(np.median(rates))
    return {
        "best": ordered[-1],
        "median": median,
        "min": ordered[0],
        "max": ordered[-1],
        "spread": (ordered[-1] - ordered[0]) / median if median else None,
        "runs": rates,
    }


def repeat(fn: Callable[[], float], repeats: int) -> List[float]:
    """One warm-up call at exactly the timed shapes, then `repeats` timed calls."""
    fn()
    return [fn() for _ in range(repeats)]


def logits_rel_err(logprobs: mx.array, reference: mx.array) -> float:
    """||a - b|| / ||b|| over log-probabilities centred on their mean, i.e. over the logits up
    to a constant: uncentred, the shared log-normalizer would make any difference look small."""

    def centred(x):
        x = x.astype(mx.float32)
        return x - x.mean()

    a, b = centred(logprobs), centred(reference)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def first_divergence(a: List[int], b: List[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure_mode(model, spec: ModelSpec, mode: str, inputs: Dict[str, Any], args):
    """Prefill, decode and batched decode in one mode: (results, greedy tokens, first-token
    log-probabilities)."""
    set_mode(mode)
    take_path_counts()
    results: Dict[str, Any] = {"prefill": {}}
    for length, prompt in inputs["prompts"].items():
        if mode == "stock" and spec.moe and length > args.stock_max_prompt:
            results["prefill"][str(length)] = {"skipped": "prompt > --stock-max-prompt"}
            continue
        log(f"[models] {spec.name} {mode}: prefill {length}")
        prompt_array = mx.array(prompt)
        times = repeat(lambda: time_prefill(model, prompt_array, args), args.repeats)
        results["prefill"][str(length)] = summarize([length / t for t in times])

    log(f"[models] {spec.name} {mode}: decode {args.decode_tokens} after {args.decode_prompt}")
    prompt_array = mx.array(inputs["decode_prompt"])
    runs = []

    def decode_once():
        seconds, tokens, logprobs = time_decode(model, prompt_array, args)
        runs.append((tokens, logprobs))
        return seconds

    times = repeat(decode_once, args.repeats)
    tokens, logprobs = runs[0]
    results["decode"] = summarize([(args.decode_tokens - 1) / t for t in times])
    results["decode"]["tokens"] = tokens[: args.parity_tokens]

    results["batch_decode"] = {}
    for batch in [] if spec.name in NO_BATCHED_DECODE else args.batch_sizes:
        log(f"[models] {spec.name} {mode}: batched decode, batch {batch}")
        times = repeat(
            lambda: time_batch_decode(
                model, inputs["batch_prompts"], inputs["batch_caches"], batch, args
            ),
            args.repeats,
        )
        results["batch_decode"][str(batch)] = summarize(
            [batch * (args.batch_tokens - 1) / t for t in times]
        )
    results["paths"] = take_path_counts()
    return results, tokens, logprobs


def run_model(spec: ModelSpec, args, rng: np.random.Generator) -> Dict[str, Any]:
    mx.reset_peak_memory()
    start = time.perf_counter()
    log(f"[models] building {spec.name}")
    model = build_model(spec)
    build = {
        "seconds": time.perf_counter() - start,
        "weights_gb": parameter_bytes(model) / 1e9,
        "peak_gb": mx.get_peak_memory() / 1e9,
    }
    log(
        f"[models] {spec.name}: {build['weights_gb']:.2f} GB of weights, build peak "
        f"{build['peak_gb']:.2f} GB, {build['seconds']:.1f} s"
    )
    vocab = spec.config["vocab_size"]
    inputs = {
        "prompts": {n: rng.integers(0, vocab, n).tolist() for n in args.prompts},
        "decode_prompt": rng.integers(0, vocab, args.decode_prompt).tolist(),
        "batch_prompts": [
            rng.integers(0, vocab, args.batch_prompt).tolist()
            for _ in range(0 if spec.name in NO_BATCHED_DECODE else max(args.batch_sizes, default=0))
        ],
    }
    # Batched decode starts from caches made once by the patched prefill (fast); both modes
    # decode from the same ones.
    set_mode("patched" if spec.moe else "stock")
    log(f"[models] {spec.name}: prefilling {len(inputs['batch_prompts'])} batch prompts")
    inputs["batch_caches"] = build_prompt_caches(model, inputs["batch_prompts"], args)

    out = {"moe": spec.moe, "dense_equivalent": spec.dense, "config": spec.config, "build": build}
    out["modes"], tokens, logprobs = {}, {}, {}
    for mode in ["stock", "patched"] if spec.moe else ["stock"]:
        out["modes"][mode], tokens[mode], logprobs[mode] = measure_mode(
            model, spec, mode, inputs, args
        )
    mlx_moe_fix.revert()

    if spec.moe:
        n = args.parity_tokens
        stock, patched = tokens["stock"][:n], tokens["patched"][:n]
        out["parity"] = {
            "tokens_compared": n,
            "identical": stock == patched,
            "diverge_at": first_divergence(stock, patched),
            "first_logits_rel_err": logits_rel_err(logprobs["patched"], logprobs["stock"]),
        }
    out["peak_gb"] = mx.get_peak_memory() / 1e9
    return out


# ---------------------------------------------------------------- summary


def best(entry: Optional[Dict[str, Any]]) -> Optional[float]:
    return entry.get("best") if entry else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def summary_rows(models: Dict[str, Any], args) -> List[Dict[str, Any]]:
    """One row per MoE model and measurement: stock, patched, their ratio, and the dense
    equivalent with the patched/dense and stock/dense ratios."""
    rows = []
    for name, result in models.items():
        if not result["moe"]:
            continue
        dense = models.get(result["dense_equivalent"], {}).get("modes", {}).get("stock", {})
        measurements = [("prefill", str(n), f"prefill {n}") for n in args.prompts]
        measurements.append(("decode", None, f"decode after {args.decode_prompt}"))
        if result["modes"]["stock"]["batch_decode"]:  # none for NO_BATCHED_DECODE models
            measurements += [("batch_decode", str(b), f"decode batch {b}") for b in args.batch_sizes]
        for kind, key, label in measurements:

            def pick(mode_results):
                entry = mode_results.get(kind)
                return entry.get(key) if entry is not None and key is not None else entry

            stock = pick(result["modes"]["stock"])
            patched = pick(result["modes"]["patched"])
            dense_entry = pick(dense) if dense else None
            rows.append(
                {
                    "model": name,
                    "measure": label,
                    "stock": stock,
                    "patched": patched,
                    "dense": dense_entry,
                    "patched_over_stock": ratio(best(patched), best(stock)),
                    "patched_over_dense": ratio(best(patched), best(dense_entry)),
                    "stock_over_dense": ratio(best(stock), best(dense_entry)),
                }
            )
    return rows


# ---------------------------------------------------------------- CLI


def int_list(text: str) -> List[int]:
    return [int(t) for t in text.split(",") if t]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        help=f"comma-separated MoE models from {', '.join(MOE_MODELS)} (default: "
        "qwen3_moe,mixtral; with --smoke all four)",
    )
    p.add_argument("--no-dense", action="store_true", help="skip the dense equivalents")
    p.add_argument(
        "--prompts",
        type=int_list,
        default=[512, 2048],
        help="comma-separated prefill prompt lengths (default: 512,2048)",
    )
    p.add_argument(
        "--stock-max-prompt",
        type=int,
        default=1 << 30,
        help="skip stock MoE prefill above this prompt length (stock mixtral prefills "
        "~219 tok/s on an H200: 8192 tokens take ~40 s a run)",
    )
    p.add_argument("--decode-prompt", type=int, default=512, help="prompt length before decode")
    p.add_argument("--decode-tokens", type=int, default=128, help="greedy tokens decoded")
    p.add_argument(
        "--parity-tokens", type=int, default=16, help="greedy tokens compared stock vs patched"
    )
    p.add_argument(
        "--batch-sizes",
        type=int_list,
        default=[1, 4, 16],
        help="comma-separated BatchGenerator batch sizes (default: 1,4,16; '' skips batched "
        "decode)",
    )
    p.add_argument("--batch-prompt", type=int, default=512, help="prompt length per sequence")
    p.add_argument("--batch-tokens", type=int, default=64, help="tokens per sequence")
    p.add_argument("--repeats", type=int, default=2, help="timed runs after the warm-up")
    p.add_argument(
        "--prefill-step-size", type=int, default=2048, help="mlx-lm's prefill chunk size"
    )
    p.add_argument(
        "--deepseek-layers",
        type=int,
        default=4,
        help="layers of the DeepSeek-V3, Inkling and DeepSeek-V4 models (6.3, 8.1 and 3.2 GB of "
        "4-bit experts each)",
    )
    p.add_argument("--experts-mode", choices=[*EXPERT_QUANTIZATIONS, SHIPPED], default="affine",
                   help="the routed experts' quantization: affine (4-bit, group 64, as every other linear), mxfp4 "
                   "(group 32, as gpt-oss's and DeepSeek-V4's checkpoints ship them), nvfp4 (group 16, Inkling's), "
                   "or shipped: each model as its MLX checkpoints are quantized (gpt_oss mxfp4 experts, inkling "
                   "nvfp4, deepseek_v4 by its own predicate: mxfp4 experts, mxfp8 shared experts and attention, in "
                   "its dense equivalent too; the others affine)")
    p.add_argument("--seed", type=int, default=0, help="seeds weights and prompts")
    p.add_argument("--json", help="write all numbers here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny configs of all four families with dense equivalents, few tokens",
    )
    args = p.parse_args(argv)
    if args.models is None:
        args.models = ",".join(MOE_MODELS) if args.smoke else "qwen3_moe,mixtral"
    if args.smoke:
        args.prompts, args.decode_prompt, args.decode_tokens = [16, 40], 16, 8
        args.parity_tokens, args.batch_sizes = 8, [1, 2]
        # 12 > gpt_oss's tiny 8-token window: the batched caches have wrapped around.
        args.batch_prompt, args.batch_tokens = 12, 4
        args.repeats, args.prefill_step_size = 1, 16
    args.models = args.models.split(",")
    unknown = set(args.models) - set(MOE_MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {MOE_MODELS}")
    return args


def start_run(args, tag: str):
    """(rng, environment, model specs) of a model benchmark run: seeds MLX and the rng from
    --seed, logs the environment under `tag`."""
    mx.random.seed(args.seed)
    env = environment()
    log(f"[{tag}] " + environment_line(env))
    specs = model_specs(args.smoke, args.deepseek_layers)
    mode = getattr(args, "experts_mode", "affine")
    for spec in specs.values():
        spec.experts_mode = SHIPPED_MODES.get(spec.name, "affine") if mode == SHIPPED else mode
    return np.random.default_rng(args.seed), env, specs


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    rng, env, specs = start_run(args, "models")

    names = []
    for moe in args.models:
        names.append(moe)
        if not args.no_dense:
            names.append(specs[moe].dense)
    result = {
        "env": env,
        "mlx_moe_fix_status": mlx_moe_fix.status(),
        "config": vars(args),
        "models": {},
        "summary": [],
    }
    for name in names:
        result["models"][name] = run_model(specs[name], args, rng)
        gc.collect()  # the model went out of scope: give its memory back before the next
        mx.clear_cache()
        result["summary"] = summary_rows(result["models"], args)
        if args.json:  # after every model, so a run cut short still leaves its numbers
            write_json(args.json, result)
    if args.json:
        log(f"[models] wrote {args.json}")
    print(f"# End-to-end models: {environment_line(env)}\n")
    print(models_report(result))
    return result


if __name__ == "__main__":
    main()
