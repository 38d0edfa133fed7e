"""More MoE families for the zoo (``zoo.build(family, bits)``): mlx-lm's models, and mlx-vlm's
language models (named ``<family>_vlm``: text only, no vision tower), each built from its own
config class's ``from_dict`` with the smallest config that keeps its structure, so that the
breadth parity test (tests/parity/test_families.py) can check that every family whose MoE layers
are ``SwitchGLU``s or ``SwitchMLP``s keeps stock's greedy tokens with the package applied. The
seven families of ``zoo.FAMILIES`` go through every test; these through that one.

Sizes as the zoo's (``zoo.VOCAB`` 256, ``zoo.HIDDEN`` 128, two to four layers, at least one of
them MoE); no quantized projection takes a 64-wide input (zoo.K64_NOTE). Not here: the upstream
models of LEFT_OUT, each with the reason. Some families call their switch linears themselves:
mlx-vlm's hy_v4, laguna, zaya1_vl and MiniMax-M3-VL (in its default layout) pack gate and up into
one switch linear of their own expert block (zoo.PACKED_SWITCH_GLUS), and mlx-vlm's deepseek_v41
has a SwitchGLU subclass with a call of its own (it weights and fp8-rounds the activation before
the down projection): there the package patches the switch linears, which the test follows
instead."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import re
from typing import NamedTuple


_SWITCH_LAYER = re.compile(r"\bSwitch(GLU|MLP|Linear)\b|switch_layers")


def upstream_moe_models() -> set:
    """mlx-lm's model modules and mlx-vlm's model packages whose source names a switch layer, as
    "mlx_lm.models.<module>" / "mlx_vlm.models.<package>"."""
    found = set()
    for package, in_folders in (("mlx_lm.models", False), ("mlx_vlm.models", True)):
        if importlib.util.find_spec(package.split(".")[0]) is None:
            continue
        root = pathlib.Path(importlib.util.find_spec(package).submodule_search_locations[0])
        for path in root.glob("*/*.py" if in_folders else "*.py"):
            if path.stem != "switch_layers" and _SWITCH_LAYER.search(path.read_text()):
                found.add(f"{package}.{path.parent.name if in_folders else path.stem}")
    return found


class BreadthFamily(NamedTuple):
    module: str  # the module of its model class
    config: dict  # its config class's from_dict argument
    experts: tuple  # (num_experts, top_k)
    model: str = "Model"  # the model class, in `module`
    args: str = ""  # "module:Class" of its config class; empty: `module`'s ModelArgs
    # mlx-vlm language models that run on plain tokens only with their model's whole config
    # (their rope index reads the vision config): (that config's class, its fields), both in the
    # args class's module, a field given as (class, fields) built so; the model is then built as
    # model(args, that config), as mlx-vlm's own model builds it.
    outer: tuple = ()
    # the standard deviation of its embeddings (the zoo's unit normals elsewhere): where the head
    # is always the tied embedding, small ones let the layers, not the last token's own embedding,
    # choose the next token (at 1 the greedy stream repeats the prompt's last token)
    embedding_std: float = 1.0

    def build(self):
        module, _, name = (self.args or f"{self.module}:ModelArgs").partition(":")
        configs = importlib.import_module(module)
        args = getattr(configs, name).from_dict(self.config)
        model = getattr(importlib.import_module(self.module), self.model)
        if not self.outer:
            return model(args)
        outer, fields = self.outer
        built = {k: getattr(configs, v[0])(**v[1]) if isinstance(v, tuple) else v for k, v in fields.items()}
        return model(args, getattr(configs, outer)(text_config=args, **built))


# DeepSeek-V3's MLA and grouped sigmoid routing, as mlx-vlm's deepseek_v3 and kimi_vl read them.
_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 128,
    "qk_rope_head_dim": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2,
    "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 4096}

# DeepSeek-V2's MLA and grouped routing, as mlx-lm's deepseek_v2 and mlx-vlm's deepseek_vl_v2 read them.
_DEEPSEEK_V2 = {
    "model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
    "n_routed_experts": 8, "routed_scaling_factor": 1.0, "kv_lora_rank": 128, "q_lora_rank": 128, "qk_rope_head_dim": 32,
    "v_head_dim": 32, "qk_nope_head_dim": 64, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
    "moe_layer_freq": 1, "max_position_embeddings": 4096}

# Gemma 4's sliding and global attention with its MoE block, as mlx-lm's gemma4_text and mlx-vlm's gemma4 read them.
_GEMMA4 = {
    "model_type": "gemma4_text", "vocab_size": 256, "vocab_size_per_layer_input": 256, "hidden_size": 128,
    "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "global_head_dim": 64, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"], "enable_moe_block": True, "num_experts": 8,
    "top_k_experts": 2, "moe_intermediate_size": 128, "max_position_embeddings": 4096, "tie_word_embeddings": False}

# MiniMax-M3's text model (full and block-sparse attention), as mlx-lm's minimax_m3_vl and
# mlx-vlm's read it (each names the sparse layer type its own way).
_MINIMAX_M3 = {
    "model_type": "minimax_m3", "hidden_size": 128, "intermediate_size": 128, "dense_intermediate_size": 256,
    "shared_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 5e6, "head_dim": 32, "partial_rotary_factor": 0.5, "vocab_size": 256, "tie_word_embeddings": False,
    "routed_scaling_factor": 2.0, "use_qk_norm": True, "use_gemma_norm": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    "index_n_heads": 2, "index_head_dim": 32, "index_block_size": 16, "index_topk_blocks": 2, "index_local_blocks": 1}

# Step-3.5's layers (dense, then sliding and full attention; the last one's experts clamped), as
# mlx-lm's step3p5 and mlx-vlm's step3p7 read them.
_STEP3P5 = {
    "model_type": "step3p5", "hidden_size": 128, "num_hidden_layers": 3, "vocab_size": 256, "num_attention_heads": 4,
    "num_attention_groups": 2, "head_dim": 32, "intermediate_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 1e4,
    "max_position_embeddings": 4096, "sliding_window": 128,
    "layer_types": ["full_attention", "sliding_attention", "full_attention"], "partial_rotary_factors": [0.5, 1.0, 0.5],
    "attention_other_setting": {"num_attention_heads": 4, "num_attention_groups": 2}, "use_head_wise_attn_gate": True,
    "moe_num_experts": 8, "moe_top_k": 2, "moe_intermediate_size": 128, "share_expert_dim": 128,
    "moe_router_scaling_factor": 3.0, "norm_expert_weight": True, "swiglu_limits": [0.0, 0.0, 7.0],
    "swiglu_limits_shared": [0.0, 0.0, 16.0], "tie_word_embeddings": False}

# Upstream model modules (mlx-lm's) and packages (mlx-vlm's) that name a switch layer and have no
# family here or in zoo.FAMILIES, each with the reason (the breadth test checks that every one is
# in one or the other, so a family upstream adds is not missed), as of these versions.
LEFT_OUT_CHECKED_AGAINST = {"mlx-lm": "0.32.2", "mlx-vlm": "0.7.10"}
_EXPERT_MODULE_TEST = "tests/parity/test_expert_modules.py checks its expert module's outputs instead"
LEFT_OUT: dict[str, str] = {
    "mlx_lm.models.muse_spark": "its attention, router and norms are Metal-only kernels",
    "mlx_vlm.models.muse_spark": "its attention, router and norms are Metal-only kernels",
    "mlx_vlm.models.diffusion_gemma": f"a diffusion LM: no greedy token stream; {_EXPERT_MODULE_TEST}",
    "mlx_vlm.models.openai_privacy_filter": f"a token classifier: no greedy token stream; {_EXPERT_MODULE_TEST}",
    "mlx_vlm.models.ming_image": "an image model (its text encoder has the experts): no greedy token stream; "
    f"{_EXPERT_MODULE_TEST}",
    "mlx_vlm.models.moondream3": "its MoE block routes inside, where the breadth test records the routes it is called "
    f"with; {_EXPERT_MODULE_TEST}",
    "mlx_vlm.models.mistral4": "its language module holds only Mistral4Model (no head, no config): mistral3's "
    "LanguageModel builds it, as mistral3_vlm",
    "mlx_vlm.models.lfm2": "its MoE block is built only from lfm2_moe's config (its own ModelConfig drops "
    "num_experts), as lfm2_moe_vlm, whose model is this one's subclass",
}

BREADTH_FAMILIES: dict[str, BreadthFamily] = {
    "afmoe": BreadthFamily("mlx_lm.models.afmoe", {
        "model_type": "afmoe", "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2,
        "num_shared_experts": 1, "num_dense_layers": 1, "route_norm": True, "route_scale": 2.826,
        "score_func": "sigmoid", "n_group": 2, "topk_group": 1, "sliding_window": 32,
        "mup_enabled": True}, (8, 2)),
    "bailing_hybrid": BreadthFamily("mlx_lm.models.bailing_hybrid", {
        "model_type": "bailing_hybrid", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1,
        "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "layer_group_size": 2,
        "group_norm_size": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "routed_scaling_factor": 2.5, "head_dim": 32,
        "kv_lora_rank": 128, "q_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 128,
        "v_head_dim": 32, "partial_rotary_factor": 0.5, "tie_word_embeddings": False}, (8, 2)),
    "bailing_moe": BreadthFamily("mlx_lm.models.bailing_moe", {
        "model_type": "bailing_moe", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "max_position_embeddings": 4096, "moe_intermediate_size": 128, "num_experts": 8,
        "num_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
        "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "first_k_dense_replace": 1,
        "use_qk_norm": True, "tie_word_embeddings": False, "moe_router_enable_expert_bias": True,
        "score_function": "sigmoid", "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1},
        (8, 2)),
    "bailing_moe_linear": BreadthFamily("mlx_lm.models.bailing_moe_linear", {
        "model_type": "bailing_moe_linear", "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 256, "max_position_embeddings": 4096, "moe_intermediate_size": 128,
        "num_experts": 8, "num_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
        "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "first_k_dense_replace": 1,
        "layer_group_size": 2, "group_norm_size": 2, "use_qk_norm": True,
        "tie_word_embeddings": False, "partial_rotary_factor": 0.5,
        "moe_router_enable_expert_bias": True, "score_function": "sigmoid",
        "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1, "head_dim": 32}, (8, 2)),
    "bailing_moe_v3": BreadthFamily("mlx_lm.models.bailing_moe_v3", {
        "model_type": "bailing_hybrid", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "layer_group_size": 2, "head_dim": 32, "q_lora_rank": 128,
        "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 32, "v_head_dim": 32,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False}, (8, 2)),
    # a parallel block (x + attention + MoE), its head always the tied embedding
    "cohere2_moe_vlm": BreadthFamily("mlx_vlm.models.cohere2_moe.language", {
        "model_type": "cohere2_moe", "vocab_size": 256, "hidden_size": 128, "head_dim": 32, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 50000.0,
        "sliding_window": 32, "sliding_window_pattern": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "moe_num_shared_experts": 1, "moe_gate_act": "sigmoid",
        "shared_expert_combination_strategy": "average", "first_k_dense_replace": 0}, (8, 2), model="LanguageModel",
        args="mlx_vlm.models.cohere2_moe.config:ModelConfig", embedding_std=0.03),
    "deepseek": BreadthFamily("mlx_lm.models.deepseek", {
        "model_type": "deepseek", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
        "max_position_embeddings": 4096}, (8, 2)),
    "deepseek_v2": BreadthFamily("mlx_lm.models.deepseek_v2", {
        **_DEEPSEEK_V2, "num_hidden_layers": 3, "topk_method": "group_limited_greedy", "first_k_dense_replace": 1,
        "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0}}, (8, 2)),
    # index_topk 128 > the 40-token prompt and 32 tokens after it: attention over every key, its
    # indexer's picks left out. At 16 its picks had near-ties at a fifth to a third of the steps
    # (stock bf16, its MoE outputs nudged by 2^-9 relative noise, each step from stock's cache:
    # 5-11 of 32 steps moved), too many for greedy parity to say much (docs/benchmarks.md,
    # sixty-first stop); the other sparse attentions' picks stay in (TOP_K_PICKERS).
    "deepseek_v32": BreadthFamily("mlx_lm.models.deepseek_v32", {
        "model_type": "deepseek_v32", "vocab_size": 256, "hidden_size": 128, "index_head_dim": 64,
        "index_n_heads": 2, "index_topk": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 128, "q_lora_rank": 128, "qk_rope_head_dim": 32, "v_head_dim": 32,
        "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
        "moe_layer_freq": 1, "first_k_dense_replace": 1, "max_position_embeddings": 4096}, (8, 2)),
    # qk_nope / v_head 128 (as zoo's deepseek_v3): qk_nope 64 makes embed_q a 64-wide quantized
    # input (K64_NOTE), and with v_head 32 the stream was one repeated token.
    "deepseek_v3_vlm": BreadthFamily("mlx_vlm.models.deepseek_v3.language", {
        **_DEEPSEEK_V3, "q_lora_rank": 128, "v_head_dim": 128, "qk_nope_head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0}, (8, 2), model="LanguageModel", args="mlx_vlm.models.deepseek_v3.config:ModelConfig"),
    "deepseek_v41": BreadthFamily("mlx_lm.models.deepseek_v41", {
        "model_type": "deepseek_v41", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "head_dim": 128, "q_lora_rank": 128, "qk_rope_head_dim": 32,
        "o_groups": 2, "o_lora_rank": 128, "moe_intermediate_size": 128, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "swiglu_limit": 1.5, "rms_norm_eps": 1e-6, "sliding_window": 32,
        "max_position_embeddings": 4096}, (8, 2)),
    # no engram layers (its default tables are 384M rows each)
    "deepseek_v41_vlm": BreadthFamily("mlx_vlm.models.deepseek_v41.language", {
        "vocab_size": 256, "hidden_size": 128, "moe_intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "head_dim": 128, "qk_rope_head_dim": 32, "q_lora_rank": 128, "o_lora_rank": 128,
        "o_groups": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "swiglu_limit": 1.5, "sliding_window": 32,
        "engram_layer_ids": [], "engram_num_embeddings": []}, (8, 2), model="LanguageModel",
        args="mlx_vlm.models.deepseek_v41.config:ModelConfig"),
    # its rope scaling without mscale_all_dim leaves the attention without rope: none
    "deepseek_vl_v2_vlm": BreadthFamily("mlx_vlm.models.deepseek_vl_v2.language", {
        **_DEEPSEEK_V2, "num_hidden_layers": 2, "topk_method": "greedy", "first_k_dense_replace": 0, "rope_scaling": None,
        "scoring_func": "softmax"}, (8, 2), model="LanguageModel", args="mlx_vlm.models.deepseek_vl_v2.config:TextConfig"),
    "dots1": BreadthFamily("mlx_lm.models.dots1", {
        "model_type": "dots1", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 3,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "first_k_dense_replace": 1,
        "moe_intermediate_size": 128, "n_routed_experts": 8, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_experts_per_tok": 2, "rope_theta": 10000.0,
        "routed_scaling_factor": 2.5, "scoring_func": "noaux_tc", "n_group": 2, "topk_group": 1,
        "tie_word_embeddings": False}, (8, 2)),
    "ernie4_5_moe": BreadthFamily("mlx_lm.models.ernie4_5_moe", {
        "model_type": "ernie4_5_moe", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_bias": False,
        "tie_word_embeddings": False, "moe_num_experts": 8, "moe_layer_start_index": 1,
        "moe_intermediate_size": 128, "moe_k": 2, "moe_layer_interval": 1,
        "moe_num_shared_experts": 1}, (8, 2)),
    "ernie4_5_moe_vl_vlm": BreadthFamily("mlx_vlm.models.ernie4_5_moe_vl.language", {
        "model_type": "ernie4_5_moe_vl", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_bias": False,
        "tie_word_embeddings": False, "moe_num_experts": [8, 8], "moe_layer_start_index": 1,
        "moe_layer_end_index": 2, "moe_intermediate_size": [128, 128], "moe_k": 2,
        "moe_layer_interval": 1, "moe_num_shared_experts": 1, "mrope_section": [6, 6, 4],
        "freq_allocation": 4}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.ernie4_5_moe_vl.config:TextConfig",
        outer=("ModelConfig", {"vision_config": ("VisionConfig", {}), "model_type": "ernie4_5_moe_vl"})),
    "exaone_moe": BreadthFamily("mlx_lm.models.exaone_moe", {
        "model_type": "exaone_moe", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "num_shared_experts": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
        "is_moe_layer": [True, True], "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False}, (8, 2)),
    "gemma4_text": BreadthFamily("mlx_lm.models.gemma4_text", _GEMMA4, (8, 2)),
    # mlx-vlm's always ties its head: with one global kv head (key = value, as the 26B-A4B's) the stream is not one token
    "gemma4_vlm": BreadthFamily("mlx_vlm.models.gemma4.language", {
        **_GEMMA4, "attention_k_eq_v": True, "num_global_key_value_heads": 1}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.gemma4.config:TextConfig"),
    "glm4_moe": BreadthFamily("mlx_lm.models.glm4_moe", {
        "model_type": "glm4_moe", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 3,
        "intermediate_size": 256, "max_position_embeddings": 4096, "moe_intermediate_size": 128,
        "norm_topk_prob": True, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 8,
        "routed_scaling_factor": 2.5, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": None, "use_qk_norm": True,
        "tie_word_embeddings": False, "attention_bias": False, "partial_rotary_factor": 0.5}, (8, 2)),
    "glm4_moe_lite": BreadthFamily("mlx_lm.models.glm4_moe_lite", {
        "model_type": "glm4_moe_lite", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 3,
        "intermediate_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
        "routed_scaling_factor": 1.8, "kv_lora_rank": 128, "q_lora_rank": 128,
        "qk_rope_head_dim": 32, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_group": 2,
        "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0}, (8, 2)),
    "glm4v_moe_vlm": BreadthFamily("mlx_vlm.models.glm4v_moe.language", {
        "model_type": "glm4v_moe_text", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "max_position_embeddings": 4096, "moe_intermediate_size": 128, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "n_group": 2,
        "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3,
        "rms_norm_eps": 1e-5, "use_qk_norm": False, "attention_bias": True, "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.glm4v_moe.config:TextConfig",
        outer=("ModelConfig", {"vision_config": ("VisionConfig", {
            "model_type": "glm4v_moe", "depth": 1, "hidden_size": 128, "intermediate_size": 128, "num_heads": 2,
            "patch_size": 14}), "model_type": "glm4v_moe"})),
    "glm5_next_vlm": BreadthFamily("mlx_vlm.models.glm5_next.language", {
        "model_type": "glm5_next_text", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 128, "q_lora_rank": 128, "qk_rope_head_dim": 0,
        "v_head_dim": 32, "qk_nope_head_dim": 128, "n_group": 2, "topk_group": 1,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "first_k_dense_replace": 0,
        "layer_types": ["linear_attention", "full_attention"],
        "index_topk": 16, "index_head_dim": 64, "index_n_heads": 2, "index_kpool": 4,
        "swiglu_limit": 10.0, "linear_head_dim": 32, "linear_num_heads": 4,
        "linear_conv_kernel_dim": 4, "hc_mult": 4},
        (8, 2), model="LanguageModel", args="mlx_vlm.models.glm5_next.config:TextConfig"),
    "gpt_oss_vlm": BreadthFamily("mlx_vlm.models.gpt_oss.language", {
        "model_type": "gpt_oss", "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 256, "rms_norm_eps": 1e-5, "hidden_size": 128, "intermediate_size": 128,
        "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 32,
        "rope_theta": 150000, "layer_types": ["sliding_attention", "full_attention"]}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.gpt_oss.config:ModelConfig"),
    # attention_multiplier head_dim ** -0.5: at 1/32 the bf16 greedy stream repeats one token
    # from the third on (the CPU's and the H200's), and parity on it would prove little
    "granitemoe": BreadthFamily("mlx_lm.models.granitemoe", {
        "model_type": "granitemoe", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "logits_scaling": 1.0, "attention_multiplier": 32 ** -0.5,
        "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "max_position_embeddings": 4096,
        "attention_bias": False, "rope_theta": 10000.0, "num_local_experts": 8,
        "num_experts_per_tok": 2, "tie_word_embeddings": False}, (8, 2)),
    "granitemoehybrid": BreadthFamily("mlx_lm.models.granitemoehybrid", {
        "model_type": "granitemoehybrid", "vocab_size": 256, "hidden_size": 128,
        "num_hidden_layers": 2, "intermediate_size": 128, "max_position_embeddings": 4096,
        "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False,
        "embedding_multiplier": 1.0, "attention_multiplier": 0.03125, "logits_scaling": 1.0,
        "residual_multiplier": 1.0, "layer_types": ["mamba", "attention"], "rms_norm_eps": 1e-6,
        "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 128,
        "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_proj_bias": False, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
        "position_embedding_type": "rope", "tie_word_embeddings": False}, (8, 2)),
    # its head always the tied embedding (tie_word_embeddings is not read)
    "hunyuan": BreadthFamily("mlx_lm.models.hunyuan", {
        "model_type": "hunyuan", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 128, "moe_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_bias": False, "moe_topk": 2, "num_experts": 8, "num_shared_expert": 1, "use_mixed_mlp_moe": True,
        "use_qk_norm": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "use_cla": False, "cla_share_factor": 2,
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}}, (8, 2), embedding_std=0.03),
    "hy_v4_vlm": BreadthFamily("mlx_vlm.models.hy_v4.language", {
        "model_type": "hy_v4", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 1, "n_shared_experts": 1, "n_routed_experts": 8,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 128, "q_lora_rank": 128, "qk_rope_head_dim": 32,
        "v_head_dim": 32, "qk_nope_head_dim": 128, "index_head_dim": 64, "index_n_heads": 2,
        "index_topk": 16, "topk_method": "noaux_tc", "norm_topk_prob": True, "n_group": 2,
        "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "hc_mult": 4},
        (8, 2), model="LanguageModel", args="mlx_vlm.models.hy_v4.config:ModelConfig"),
    "jamba": BreadthFamily("mlx_lm.models.jamba", {
        "model_type": "jamba", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 0,
        "expert_layer_period": 1, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
        "num_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}, (8, 2)),
    "kimi_k3": BreadthFamily("mlx_lm.models.kimi_k3", {
        "model_type": "kimi_k3", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                               "head_dim": 128, "short_conv_kernel_size": 4},
        "hidden_act": "situ", "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 32, "v_head_dim": 128, "mla_use_nope": True, "num_experts": 8,
        "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 128,
        "first_k_dense_replace": 0, "moe_layer_freq": 1, "num_expert_group": 2, "topk_group": 1,
        "tie_word_embeddings": False}, (8, 2)),
    "kimi_linear": BreadthFamily("mlx_lm.models.kimi_linear", {
        "model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
        "head_dim": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                               "head_dim": 128, "short_conv_kernel_size": 4},
        "model_max_length": 4096, "num_experts": 8, "moe_intermediate_size": 128,
        "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 32, "v_head_dim": 128,
        "num_experts_per_token": 2, "num_shared_experts": 1, "num_expert_group": 2,
        "topk_group": 1, "tie_word_embeddings": False}, (8, 2)),
    "kimi_vl_vlm": BreadthFamily("mlx_vlm.models.kimi_vl.language", {
        **_DEEPSEEK_V3, "q_lora_rank": None, "v_head_dim": 32, "qk_nope_head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 800000.0}, (8, 2), model="LanguageModel", args="mlx_vlm.models.kimi_vl.config:TextConfig"),
    "Klear": BreadthFamily("mlx_lm.models.Klear", {
        "model_type": "Klear", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_bias": False, "mlp_only_layers": [], "num_experts": 8, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "n_shared_experts": 1, "moe_intermediate_size": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "norm_topk_prob": True}, (8, 2)),
    "laguna": BreadthFamily("mlx_lm.models.laguna", {
        "model_type": "laguna", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 3,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 4096, "sliding_window": 32,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "tie_word_embeddings": False}, (8, 2)),
    "lfm2_moe": BreadthFamily("mlx_lm.models.lfm2_moe", {
        "model_type": "lfm2_moe", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 3,
        "intermediate_size": 256, "moe_intermediate_size": 128, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "use_expert_bias": True,
        "num_dense_layers": 1, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
        # embeddings always tied (lm head = embed_tokens.as_linear): at routed_scaling_factor 1-2.5
        # the stream is one repeated token (32 x 174); 16 lets the MoE outweigh the embedding.
        "routed_scaling_factor": 16.0,
        "layer_types": ["conv", "full_attention", "conv"]}, (8, 2)),
    "llada2_moe_vlm": BreadthFamily("mlx_vlm.models.llada2_moe.language", {
        "model_type": "llada2_moe", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "use_qk_norm": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "rope_theta": 600000, "partial_rotary_factor": 0.5,
        "num_experts": 8, "num_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 2.5, "moe_intermediate_size": 128,
        "first_k_dense_replace": 1, "pad_token_id": 0, "mask_token_id": 255, "norm_topk_prob": True,
        "score_function": "sigmoid", "moe_router_enable_expert_bias": True},
        (8, 2), model="LanguageModel", args="mlx_vlm.models.llada2_moe.config:ModelConfig"),
    "llama4": BreadthFamily("mlx_lm.models.llama4", {
        "model_type": "llama4", "text_config": {
            "model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 8192,
            "head_dim": 32, "hidden_size": 128, "interleave_moe_layer_step": 1,
            "intermediate_size": 128, "intermediate_size_mlp": 256, "max_position_embeddings": 4096,
            "num_attention_heads": 4, "num_experts_per_tok": 1, "num_hidden_layers": 4,
            "num_key_value_heads": 2, "num_local_experts": 8, "rms_norm_eps": 1e-5,
            "rope_scaling": None, "rope_theta": 5e5, "use_qk_norm": True, "vocab_size": 256}}, (8, 1)),
    "llama4_vlm": BreadthFamily("mlx_vlm.models.llama4.language", {
        "model_type": "llama4_text", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 128,
        "intermediate_size_mlp": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 4096, "num_local_experts": 8, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1, "attention_chunk_size": 8192, "use_qk_norm": True,
        "no_rope_layers": [], "tie_word_embeddings": False}, (8, 1),
        model="LanguageModel", args="mlx_vlm.models.llama4.config:TextConfig"),
    "longcat_flash": BreadthFamily("mlx_lm.models.longcat_flash", {
        "model_type": "longcat_flash", "attention_method": "MLA", "zero_expert_type": "identity",
        "hidden_size": 128, "ffn_hidden_size": 256, "moe_topk": 2, "expert_ffn_hidden_size": 128,
        "n_routed_experts": 8, "zero_expert_num": 2, "num_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 4096, "num_attention_heads": 4, "kv_lora_rank": 128,
        "q_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "routed_scaling_factor": 6.0, "rms_norm_eps": 1e-5, "rope_theta": 1e4,
        "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "attention_bias": False,
        "norm_topk_prob": False, "router_bias": False}, (8, 2)),
    "mellum": BreadthFamily("mlx_lm.models.mellum", {
        "model_type": "mellum", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
        "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "rms_norm_eps": 1e-6, "vocab_size": 256, "num_key_value_heads": 2, "head_dim": 32,
        "tie_word_embeddings": False, "max_position_embeddings": 4096, "norm_topk_prob": True,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
                            "full_attention": {"rope_theta": 1e6, "rope_type": "default"}}}, (8, 2)),
    "mimo_v2_flash": BreadthFamily("mlx_lm.models.mimo_v2_flash", {
        "model_type": "mimo_v2_flash", "num_experts_per_tok": 2, "hybrid_layer_pattern": [0, 1],
        "moe_layer_freq": [1, 1], "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "sliding_window_size": 128, "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "n_shared_experts": None, "n_routed_experts": 8,
        "routed_scaling_factor": None, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "max_position_embeddings": 4096,
        "layernorm_epsilon": 1e-5, "rope_theta": 5e6, "swa_rope_theta": 1e4,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "head_dim": 64, "v_head_dim": 64,
        "swa_head_dim": 64, "swa_v_head_dim": 64, "partial_rotary_factor": 0.5}, (8, 2)),
    "minimax": BreadthFamily("mlx_lm.models.minimax", {
        "model_type": "minimax", "hidden_size": 128, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "num_experts_per_tok": 2,
        "num_local_experts": 8, "shared_intermediate_size": 0, "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 5e6, "rotary_dim": 16, "vocab_size": 256,
        "tie_word_embeddings": False, "scoring_func": "sigmoid", "head_dim": 32, "use_qk_norm": True}, (8, 2)),
    "minimax_m3_vl": BreadthFamily("mlx_lm.models.minimax_m3_vl", {
        "model_type": "minimax_m3_vl", "text_config": {**_MINIMAX_M3, "layer_types": ["full_attention", "sparse_attention"]}},
        (8, 2)),
    # pack_shared_expert False: the unpacked layout (a SwitchGLU with MiniMaxSwiGLUOAI, the shared
    # expert a separate MLP). By default (one shared expert as wide as the routed ones, as the
    # checkpoints) the experts are a MiniMaxPackedSwitchGLU, not a SwitchGLU: there only its
    # quantized switch linears are patched.
    # the default layout: the shared expert packed with the routed ones (a ninth expert, a third index
    # a token) in a MiniMaxPackedSwitchGLU
    "minimax_m3_vl_packed_vlm": BreadthFamily("mlx_vlm.models.minimax_m3_vl.language", {
        **_MINIMAX_M3, "moe_layer_freq": [0, 1], "layer_types": ["full_attention", "minimax_m3_sparse"]}, (9, 3),
        model="LanguageModel", args="mlx_vlm.models.minimax_m3_vl.config:TextConfig"),
    "minimax_m3_vl_vlm": BreadthFamily("mlx_vlm.models.minimax_m3_vl.language", {
        **_MINIMAX_M3, "moe_layer_freq": [0, 1], "pack_shared_expert": False,
        "layer_types": ["full_attention", "minimax_m3_sparse"]}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.minimax_m3_vl.config:TextConfig"),
    "mistral4": BreadthFamily("mlx_lm.models.mistral4", {
        "model_type": "mistral4", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
        "routed_scaling_factor": 1.0, "kv_lora_rank": 128, "q_lora_rank": 128, "norm_topk_prob": True,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "topk_group": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 0, "n_group": 1, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                            "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}}, (8, 2)),
    "mixtral_vlm": BreadthFamily("mlx_vlm.models.mixtral.language", {
        "model_type": "mixtral", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "tie_word_embeddings": False}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.mixtral.config:ModelConfig"),
    "nemotron_h": BreadthFamily("mlx_lm.models.nemotron_h", {
        "model_type": "nemotron_h", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 32, "mamba_proj_bias": False,
        "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
        "use_bias": False, "use_conv_bias": True, "hybrid_override_pattern": ["M", "E", "*", "E"],
        "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 128, "n_group": 1,
        "n_routed_experts": 8, "n_shared_experts": 1, "topk_group": 1, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "tie_word_embeddings": False}, (8, 2)),
    "olmoe": BreadthFamily("mlx_lm.models.olmoe", {
        "model_type": "olmoe", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}, (8, 2)),
    "phimoe_vlm": BreadthFamily("mlx_vlm.models.phimoe.language", {
        "model_type": "phimoe", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 10000.0,
        "router_jitter_noise": 0.01}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.phimoe.config:ModelConfig"),
    "phixtral": BreadthFamily("mlx_lm.models.phixtral", {
        "model_type": "phixtral", "num_vocab": 256, "model_dim": 128, "num_heads": 4, "num_layers": 3, "rotary_dim": 16,
        "num_experts_per_tok": 2, "num_local_experts": 8}, (8, 2)),
    "qwen2_moe": BreadthFamily("mlx_lm.models.qwen2_moe", {
        "model_type": "qwen2_moe", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
        "rms_norm_eps": 1e-6}, (8, 2)),
    "qwen3_5_moe_vlm": BreadthFamily("mlx_vlm.models.qwen3_5_moe.language", {
        "model_type": "qwen3_5_moe_text", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "shared_expert_intermediate_size": 128, "moe_intermediate_size": 128,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "full_attention_interval": 2,
        "rope_parameters": {"type": "default", "mrope_section": [3, 3, 2], "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True},
        "norm_topk_prob": True, "tie_word_embeddings": False}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.qwen3_5_moe.config:TextConfig",
        outer=("ModelConfig", {"vision_config": ("VisionConfig", {}), "model_type": "qwen3_5_moe"})),
    "qwen3_moe_vlm": BreadthFamily("mlx_vlm.models.qwen3_moe.language", {
        "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 4096, "norm_topk_prob": True, "tie_word_embeddings": False}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.qwen3_moe.config:ModelConfig"),
    "qwen3_next": BreadthFamily("mlx_lm.models.qwen3_next", {
        "model_type": "qwen3_next", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
        "num_attention_heads": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 128, "mlp_only_layers": [], "moe_intermediate_size": 128,
        "rms_norm_eps": 1e-6, "vocab_size": 256, "num_key_value_heads": 2, "rope_theta": 1e7,
        "partial_rotary_factor": 0.25, "max_position_embeddings": 4096, "head_dim": 64,
        "norm_topk_prob": True, "tie_word_embeddings": False, "full_attention_interval": 2}, (8, 2)),
    "qwen3_omni_moe_vlm": BreadthFamily("mlx_vlm.models.qwen3_omni_moe.language", {
        "model_type": "qwen3_omni_moe_text_encoder", "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "norm_topk_prob": True, "tie_word_embeddings": False,
        "rope_scaling": {"type": "default", "mrope_section": [6, 5, 5], "interleaved": True}},
        (8, 2), model="LanguageModel", args="mlx_vlm.models.qwen3_omni_moe.config:TextConfig",
        outer=("ThinkerConfig", {"vision_config": ("VisionConfig", {}), "audio_config": ("AudioConfig", {})})),
    "qwen3_vl_moe_vlm": BreadthFamily("mlx_vlm.models.qwen3_vl_moe.language", {
        "model_type": "qwen3_vl_moe", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
        "max_position_embeddings": 4096, "norm_topk_prob": True,
        "rope_scaling": {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True},
        "tie_word_embeddings": False}, (8, 2),
        model="LanguageModel", args="mlx_vlm.models.qwen3_vl_moe.config:TextConfig",
        outer=("ModelConfig", {"vision_config": ("VisionConfig", {}), "model_type": "qwen3_vl_moe"})),
    "step3p5": BreadthFamily("mlx_lm.models.step3p5", _STEP3P5, (8, 2)),
    "step3p7_vlm": BreadthFamily("mlx_vlm.models.step3p7.language", {**_STEP3P5, "moe_layers_enum": [1, 2]}, (8, 2),
                                 model="LanguageModel", args="mlx_vlm.models.step3p7.config:TextConfig"),
}

# mlx-vlm's language models of these families, built from mlx-lm's configs above (their config
# class ModelConfig, kimi_k3's TextConfig).
for _family in ("afmoe", "bailing_moe", "bailing_moe_linear", "deepseek", "deepseek_v2", "deepseek_v32", "dots1",
                "ernie4_5_moe", "exaone_moe", "gemma4_text", "glm4_moe", "glm4_moe_lite", "granitemoe", "jamba", "kimi_k3",
                "kimi_linear", "laguna", "longcat_flash", "mellum", "mimo_v2_flash", "minimax", "nemotron_h", "olmoe",
                "phixtral", "qwen2_moe", "qwen3_next", "step3p5"):
    BREADTH_FAMILIES[f"{_family}_vlm"] = BreadthFamily(
        f"mlx_vlm.models.{_family}.language", BREADTH_FAMILIES[_family].config, BREADTH_FAMILIES[_family].experts,
        model="LanguageModel", args=f"mlx_vlm.models.{_family}.config:{'TextConfig' if _family == 'kimi_k3' else 'ModelConfig'}")
# mlx-vlm's asks for its rope base
BREADTH_FAMILIES["granitemoehybrid_vlm"] = BreadthFamily(
    "mlx_vlm.models.granitemoehybrid.language", {**BREADTH_FAMILIES["granitemoehybrid"].config, "rope_theta": 10000.0},
    (8, 2), model="LanguageModel", args="mlx_vlm.models.granitemoehybrid.config:ModelConfig")
# mlx-vlm's reads tie_word_embeddings (mlx-lm's ties its head always)
BREADTH_FAMILIES["lfm2_moe_vlm"] = BreadthFamily(
    "mlx_vlm.models.lfm2_moe.language", {**BREADTH_FAMILIES["lfm2_moe"].config, "tie_word_embeddings": False},
    (8, 2), model="LanguageModel", args="mlx_vlm.models.lfm2_moe.config:ModelConfig")
# DeepSeek-OCR's text model: DeepSeek-V2's MoE with plain multi-head attention (qk_nope_head_dim 0,
# as the checkpoint), two shared experts, the first layer dense
BREADTH_FAMILIES["deepseekocr_vlm"] = BreadthFamily("mlx_vlm.models.deepseekocr.language", {
    "model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 2, "n_routed_experts": 8, "routed_scaling_factor": 1.0, "topk_method": "greedy",
    "scoring_func": "softmax", "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}, (8, 2),
    model="LanguageModel", args="mlx_vlm.models.deepseekocr.config:TextConfig")
# sliding and full attention with learned sinks, sigmoid routing with a selection bias, a shared expert
BREADTH_FAMILIES["flint_vlm"] = BreadthFamily("mlx_vlm.models.flint.language", {
    "model_type": "flint", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 4096, "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "mlp_only_layers": [0],
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "tie_word_embeddings": False}, (8, 2),
    model="LanguageModel", args="mlx_vlm.models.flint.config:ModelConfig")
# mlx-lm's hunyuan's code and Klear's
BREADTH_FAMILIES["hunyuan_vlm"] = BreadthFamily(
    "mlx_vlm.models.hunyuan.language", BREADTH_FAMILIES["hunyuan"].config, (8, 2), model="LanguageModel",
    args="mlx_vlm.models.hunyuan.config:ModelConfig", embedding_std=BREADTH_FAMILIES["hunyuan"].embedding_std)
BREADTH_FAMILIES["klear_vlm"] = BreadthFamily(
    "mlx_vlm.models.klear.language", BREADTH_FAMILIES["Klear"].config, (8, 2), model="LanguageModel",
    args="mlx_vlm.models.klear.config:ModelConfig")
BREADTH_FAMILIES["kolibri1_vlm"] = BreadthFamily("mlx_vlm.models.kolibri1.language", {
    "model_type": "kolibri1", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "sliding_window": 32, "norm_topk_prob": True,
    "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False}, (8, 2),
    model="LanguageModel", args="mlx_vlm.models.kolibri1.config:ModelConfig")
# LongCat-Flash's layers with its sparse attention's indexer (index_topk 16 < the 40-token prompt:
# sparse in both phases)
BREADTH_FAMILIES["longcat_flash_sparse_vlm"] = BreadthFamily("mlx_vlm.models.longcat_flash_sparse.language", {
    **BREADTH_FAMILIES["longcat_flash"].config, "model_type": "longcat_flash_sparse", "attention_method": "LSA",
    "index_n_heads": 2, "index_head_dim": 64, "index_topk": 16}, (8, 2),
    model="LanguageModel", args="mlx_vlm.models.longcat_flash_sparse.config:ModelConfig")
# mlx-vlm's Mistral-4 (mistral4/language.py's Mistral4Model: MLA, softmax routing, a shared expert)
# under mistral3's LanguageModel, the only head it has
BREADTH_FAMILIES["mistral3_vlm"] = BreadthFamily(
    "mlx_vlm.models.mistral3.language", BREADTH_FAMILIES["mistral4"].config, (8, 2),
    model="LanguageModel", args="mlx_vlm.models.mistral3.config:TextConfig")
# text-only Qwen3.5-MoE (its rope index reads no vision config: no outer)
BREADTH_FAMILIES["qwen3_5_moe_text_vlm"] = BreadthFamily(
    "mlx_vlm.models.qwen3_5_moe_text.language",
    {**BREADTH_FAMILIES["qwen3_5_moe_vlm"].config, "model_type": "qwen3_5_moe_text"}, (8, 2),
    model="LanguageModel", args="mlx_vlm.models.qwen3_5_moe_text.config:ModelConfig")
# Qwen4-Exp: Qwen3.5's linear attention and MoE block under 4-stream hyper-connections, QSA sparse
# attention (a budget of 16 in 4-token blocks, so the indexer selects from the prompt on), the
# n-gram PLE held in memory on the linear layer (a small hashed vocab). At a hidden size a multiple
# of 512 with a bf16 quantized head its decode calls the switch linears itself (the package's
# switch-linear patch takes those); not at this size.
BREADTH_FAMILIES["qwen4_exp_vlm"] = BreadthFamily("mlx_vlm.models.qwen4_exp.language", {
    **BREADTH_FAMILIES["qwen3_5_moe_vlm"].config, "model_type": "qwen4_exp", "hc_count": 4, "hc_lowrank": 128,
    "indexer_n_heads": 4, "indexer_head_dim": 128, "indexer_budget": 16, "indexer_compress_ratio": 4,
    "ple_layer_ids": [1], "ngram_vocab_size_base": 512, "split_ngram_parts": 4, "eos_token_id": 1}, (8, 2),
    model="LanguageModel", args="mlx_vlm.models.qwen4_exp.config:TextConfig",
    outer=("ModelConfig", {"vision_config": ("VisionConfig", {}), "model_type": "qwen4_exp"}))
# Youtu-VL's optional MoE: DeepSeek-V3's MLA and sigmoid routing (at 3 layers deepseek_v3_vlm's
# very stream, ending in one repeated token; 4 layers)
BREADTH_FAMILIES["youtu_vl_vlm"] = BreadthFamily("mlx_vlm.models.youtu_vl.language", {
    **BREADTH_FAMILIES["deepseek_v3_vlm"].config, "model_type": "youtu_vl", "num_hidden_layers": 4,
    "tie_word_embeddings": False}, (8, 2), model="LanguageModel", args="mlx_vlm.models.youtu_vl.config:TextConfig")
# ZAYA1's experts: one gated switch linear and a down one, its own block (zoo.PACKED_SWITCH_GLUS),
# top-1 with a skip expert; its residual scaling off (zoo's 0.1-scale draws of 1-D parameters make
# those scales ~0 with random signs, and the stream one or two tokens)
BREADTH_FAMILIES["zaya1_vl_vlm"] = BreadthFamily("mlx_vlm.models.zaya1_vl.language", {
    "model_type": "zaya1_vl", "vocab_size": 256, "hidden_size": 128, "ffn_hidden_size": 256,
    "num_hidden_layers": 2, "num_experts": 8, "num_attention_heads": 4, "head_dim": 32,
    "num_query_groups": 2, "num_key_value_heads": 2, "zaya_mlp_expansion": 128, "moe_router_topk": 1,
    "tie_word_embeddings": False, "scale_residual_merge": False, "max_position_embeddings": 4096},
    (8, 1), model="LanguageModel", args="mlx_vlm.models.zaya1_vl.config:TextConfig")
