"""A zoo of small, random-weight, quantized MoE language models.

Every model is built from the libraries' own model classes (``mlx_lm`` for
mixtral / qwen3_moe / deepseek_v3 / gpt_oss / phimoe, ``mlx_vlm`` language
models for deepseek_v4 / inkling), re-initialised with seeded normals scaled so
that a greedy decode is not degenerate, and quantized (affine, group size 64)
the way the libraries' converters do it. Every MoE layer routes through the
library's ``SwitchGLU`` (or ``InklingSwitchGLU``) with ``QuantizedSwitchLinear``
experts.

API::

    FAMILIES                                  # the 7 family names
    BREADTH_FAMILIES                          # more, mlx-lm's and mlx-vlm's (zoo_breadth.py): build and prompt_for take them
    build(family, bits, *, seed=0, dtype=mx.float32) -> model
    randomized(module, bits, *, dtype=mx.float32) -> module   # any upstream module, as build makes models
    save_checkpoint(family, bits, folder)     # an mlx-lm family's model written as mlx-lm's converter writes one
    prompt_for(family) -> list[int]           # fixed prompt, >= 64 (token, expert) pairs
    greedy_tokens(model, prompt, n=32) -> list[int]
    greedy_decode(model, prompt, n=32) -> (tokens, logits [n, vocab] float32)
    moe_layers(model) -> [(path, SwitchGLU-, SwitchMLP- or packed-expert module)]
    EXPERTS[family] -> (num_experts, top_k)

``build`` draws from the global MLX PRNG (it calls ``mx.random.seed(seed)``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import sys

from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import trace
from .kernels.experts import FP4_GROUP_SIZES
from .patches import compiled
from .zoo_breadth import BREADTH_FAMILIES

FAMILIES: tuple[str, ...] = (
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "phimoe",
    "deepseek_v4",
    "inkling",
)

MLX_VLM_FAMILIES = ("deepseek_v4", "inkling")

GROUP_SIZE = 64
# K64_NOTE: no quantized projection takes 64-wide inputs (one quantization group), sharded over two
# ranks included (SHARDED_FAMILIES: the expert down projections and attention's o_proj take a
# rank's slice of their input): on the H200, MLX 0.32.4's CUDA quantized_matmul gives NaN or
# different values from run to run for such inputs at more than one row (docs/benchmarks.md,
# seventh session), which made stock deepseek_v3 / deepseek_v4 / inkling zoo models (64-wide
# expert and shared expert down projections) and the sharded zoo models (a 64-wide o_proj per
# rank, until the eighth session) not reproduce themselves there.
SHARDED_FAMILIES = ("qwen3_moe", "gpt_oss")
VOCAB = 256
HIDDEN = 128
PROMPT_LEN = 40  # x top_k (>= 2) >= 80 >= 64: prefill takes SwitchGLU's sorted path

# (num_experts, top_k) per family, for reference by tests / benchmarks.
EXPERTS: dict[str, tuple[int, int]] = {
    "mixtral": (4, 2),
    "qwen3_moe": (8, 2),
    "deepseek_v3": (8, 2),
    "gpt_oss": (4, 4),  # top_k == num_experts
    "phimoe": (4, 2),
    "deepseek_v4": (8, 2),
    "inkling": (8, 2),
}


# --------------------------------------------------------------------------
# Configs (smallest valid ones; read from each package's ModelArgs/ModelConfig)
# --------------------------------------------------------------------------


def _config(family: str):
    E, K = EXPERTS[family]
    if family == "mixtral":
        from mlx_lm.models.mixtral import ModelArgs

        return ModelArgs(
            model_type="mixtral",
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=E,
            num_experts_per_tok=K,
        )
    if family == "qwen3_moe":
        from mlx_lm.models.qwen3_moe import ModelArgs

        return ModelArgs(
            model_type="qwen3_moe",
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_experts=E,
            num_experts_per_tok=K,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=256,  # 4 groups: 128 per rank when sharded over two (K64_NOTE)
            rms_norm_eps=1e-6,
            vocab_size=VOCAB,
            num_key_value_heads=2,
            head_dim=64,  # o_proj 256 wide: 128 per rank when sharded over two (K64_NOTE)
            rope_theta=1e6,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            norm_topk_prob=True,
        )
    if family == "deepseek_v3":
        from mlx_lm.models.deepseek_v3 import ModelArgs

        return ModelArgs(
            model_type="deepseek_v3",
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=128,
            moe_intermediate_size=128,  # K64_NOTE
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_shared_experts=1,
            n_routed_experts=E,
            routed_scaling_factor=2.5,
            # 128, not 64: MLX's CUDA quantized_matmul has no kernel for 64-wide inputs with
            # per-head (3-D) weights, as the MLA projections have ("No implementation for problem
            # shape"; probed on the H200 at 1, 8 and 40 rows).
            kv_lora_rank=128,
            q_lora_rank=128,
            qk_rope_head_dim=32,
            v_head_dim=128,
            qk_nope_head_dim=128,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            n_group=2,  # exercises the group-limited selection
            topk_group=1,
            num_experts_per_tok=K,
            moe_layer_freq=1,
            first_k_dense_replace=0,
            max_position_embeddings=4096,
        )
    if family == "gpt_oss":
        from mlx_lm.models.gpt_oss import ModelArgs

        return ModelArgs(
            model_type="gpt_oss",
            num_hidden_layers=2,  # layer_types -> [sliding, full]
            num_local_experts=E,
            num_experts_per_tok=K,
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=256,  # 128 per rank when sharded over two (K64_NOTE)
            head_dim=64,  # o_proj 256 wide: 128 per rank when sharded over two (K64_NOTE)
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=32,  # < prompt + decode: the rotating cache wraps
        )
    if family == "phimoe":
        from mlx_lm.models.phimoe import ModelArgs

        return ModelArgs(
            model_type="phimoe",
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            rope_scaling=None,  # plain RoPE
            num_local_experts=E,
            num_experts_per_tok=K,
        )
    if family == "deepseek_v4":
        from mlx_vlm.models.deepseek_v4.config import ModelConfig

        return ModelConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=128,
            moe_intermediate_size=128,  # K64_NOTE
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            n_shared_experts=1,
            n_routed_experts=E,
            num_experts_per_tok=K,
            # 128, not 64: as for deepseek_v3, MLX's CUDA quantized_matmul has no kernel for the
            # grouped (3-D) output projection with 64-wide inputs.
            q_lora_rank=128,
            qk_rope_head_dim=32,
            head_dim=128,
            o_groups=2,  # wo_a input = heads * head_dim / o_groups = 128
            o_lora_rank=128,
            max_position_embeddings=4096,
            compress_ratios=[0, 0],  # plain sliding-window attention, no indexer
            num_hash_layers=1,  # layer 0: hash routing (tid2eid), layer 1: learned
            swiglu_limit=1.5,  # small so LimitedSwiGLU's clamp is actually hit
            sliding_window=32,
            index_n_heads=2,
            index_head_dim=32,
            index_topk=8,
        )
    if family == "inkling":
        from mlx_vlm.models.inkling.config import TextConfig

        return TextConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            vocab_size=VOCAB,
            max_position_embeddings=4096,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            swa_num_attention_heads=2,
            swa_num_key_value_heads=1,
            swa_head_dim=64,
            sliding_window_size=32,
            layer_types=["hybrid_sliding", "full_attention"],
            d_rel=16,
            rel_extent=64,
            log_scaling_n_floor=16,
            dense_mlp_idx=0,  # no dense layers: both layers are InklingSparseMoE
            intermediate_size=128,  # the MoE expert width (K64_NOTE)
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_shared_experts=1,
            route_scale=2.0,
        )
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _model_class(family: str):
    if family == "deepseek_v4":
        return importlib.import_module("mlx_vlm.models.deepseek_v4.language").LanguageModel
    if family == "inkling":
        return importlib.import_module("mlx_vlm.models.inkling.language").LanguageModel
    return importlib.import_module(f"mlx_lm.models.{family}").Model


# --------------------------------------------------------------------------
# Random re-initialisation
# --------------------------------------------------------------------------


def _module_kinds(model: nn.Module) -> dict[str, str]:
    """Map each leaf parameter path to a coarse kind of the module owning it."""
    kinds = {}
    for path, m in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(m, (nn.RMSNorm, nn.LayerNorm)):
            kind = "norm"
        elif isinstance(m, nn.Embedding):
            kind = "embed"
        elif isinstance(m, nn.Conv1d):
            kind = "conv"
        else:
            kind = "other"
        for name, v in m.items():
            if isinstance(v, mx.array):
                kinds[prefix + name] = kind
    return kinds


def _reinit(model: nn.Module, family: str) -> None:
    kinds = _module_kinds(model)
    embedding_std = BREADTH_FAMILIES[family].embedding_std if family in BREADTH_FAMILIES else 1.0
    new = []
    for path, v in tree_flatten(model.parameters()):
        name = path.rsplit(".", 1)[-1]
        kind = kinds.get(path, "other")
        shape = v.shape
        if name == "tid2eid":
            # deepseek_v4 hash routing: K distinct experts per token id.
            E, K = EXPERTS[family]
            r = mx.random.uniform(shape=(shape[0], E))
            w = mx.argsort(r, axis=-1)[:, :K].astype(v.dtype)
        elif not mx.issubdtype(v.dtype, mx.floating):
            w = v
        elif kind == "norm":
            w = 0.1 * mx.random.normal(shape) + (1.0 if name == "weight" else 0.0)
        elif kind == "embed":
            w = embedding_std * mx.random.normal(shape)
        elif kind == "conv":
            # inkling short convs: depthwise taps (C, K, 1); keep them tame.
            w = 0.3 * mx.random.normal(shape)
        elif name in ("gate_scale", "out_scale"):
            # inkling per-expert scales: non-trivial so the scaled path runs.
            w = mx.random.uniform(0.5, 1.5, shape)
        elif name == "e_score_correction_bias":
            w = 0.2 * mx.random.normal(shape)
        elif name in ("sinks", "attn_sink"):
            w = 0.5 * mx.random.normal(shape)
        elif name == "global_scale":
            w = v  # inkling routed/dense output scale: keep 1
        elif path.endswith("_hc.scale") or path.endswith("hc_head.scale"):
            w = 1.0 + 0.1 * mx.random.normal(shape)
        elif name == "rel_proj":
            w = 0.1 * mx.random.normal(shape)
        elif v.ndim >= 2:
            # Linear / SwitchLinear / MultiLinear / router weights: unit-gain.
            w = mx.random.normal(shape) * (shape[-1] ** -0.5)
        else:
            # biases (gpt_oss, phimoe attention), hc base, ...
            w = 0.1 * mx.random.normal(shape)
        new.append((path, w.astype(v.dtype)))
    model.update(tree_unflatten(new))


# --------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------


# build(experts_mode=...): how the routed experts' switch linears are quantized, where not as the
# rest of the model (gpt-oss's and DeepSeek-V4's checkpoints ship mxfp4 experts, Inkling's nvfp4).
EXPERT_MODES = {mode: {"group_size": group, "bits": 4, "mode": mode} for mode, group in FP4_GROUP_SIZES.items()}


def _quantize(model: nn.Module, family: str, group_size: int, bits: int, experts_mode: str = "affine") -> None:
    """Affine-quantize like mlx_lm.utils.quantize_model.

    Layers whose input dim is not a multiple of group_size are skipped; for
    mlx-lm families the model's own ``quant_predicate`` is honoured (routers
    at 8 bits for qwen3_moe / gpt_oss). deepseek_v4's own predicate asks for
    mxfp4/mxfp8, which we override: everything quantizable is affine here,
    but the routed experts' switch linears where ``experts_mode`` is one of
    EXPERT_MODES.
    """
    own = None if family in MLX_VLM_FAMILIES else getattr(model, "quant_predicate", None)

    def predicate(path, m):
        if not hasattr(m, "to_quantized"):
            return False
        if m.weight.shape[-1] % group_size != 0:
            return False
        if experts_mode in EXPERT_MODES and m.weight.ndim == 3:
            return EXPERT_MODES[experts_mode]
        if own is None:
            return True
        r = own(path, m)
        if isinstance(r, dict):
            r = {"group_size": group_size, "bits": bits, "mode": "affine", **r}
        return r

    nn.quantize(model, group_size, bits, mode="affine", class_predicate=predicate)


def _cast(model: nn.Module, dtype) -> None:
    if dtype == mx.float32:
        return
    keep = getattr(model, "cast_predicate", None) or (lambda _: True)
    if not inspect.signature(keep).parameters:
        keep = keep()  # a method that returns the predicate (mlx-vlm's kimi_vl language model), not a property
    model.update(
        tree_unflatten(
            [
                (k, v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
                for k, v in tree_flatten(model.parameters())
            ]
        )
    )


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def build(family: str, bits: int, *, seed: int = 0, dtype=mx.float32, experts_mode: str = "affine"):
    """A small random MoE model of ``family``, affine-quantized to ``bits``; its routed experts
    in ``experts_mode`` ("affine" as the rest, or one of EXPERT_MODES)."""
    if family not in FAMILIES and family not in BREADTH_FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES} or zoo_breadth's")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if experts_mode != "affine" and experts_mode not in EXPERT_MODES:
        raise ValueError(f"experts_mode must be 'affine' or one of {tuple(EXPERT_MODES)}, got {experts_mode!r}")
    mx.random.seed(seed)
    model = BREADTH_FAMILIES[family].build() if family in BREADTH_FAMILIES else _model_class(family)(_config(family))
    return randomized(model, bits, dtype=dtype, family=family, experts_mode=experts_mode)


def randomized(module: nn.Module, bits: int, *, dtype=mx.float32, family: str = "", experts_mode: str = "affine"):
    """`module` (a model of `family`, or any upstream module), re-initialised, cast to `dtype` and
    affine-quantized to `bits` as ``build`` makes its models; drawn from the global MLX PRNG."""
    _reinit(module, family)
    _cast(module, dtype)
    _quantize(module, family, GROUP_SIZE, bits, experts_mode)
    module.eval()
    mx.eval(module.parameters())
    return module


def prompt_for(family: str, length: Optional[int] = None) -> list[int]:
    """A fixed prompt (the same for every family): `length` tokens, by default PROMPT_LEN, or for a
    family routing each token to one expert (llama4) twice that, so that the prompt makes as many
    (token, expert) pairs as the others' do."""
    if family not in FAMILIES and family not in BREADTH_FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    if length is None:
        top_k = BREADTH_FAMILIES[family].experts[1] if family in BREADTH_FAMILIES else EXPERTS[family][1]
        length = PROMPT_LEN * (2 if top_k == 1 else 1)
    return spread_tokens(length, VOCAB)


def save_checkpoint(family: str, bits: int, folder, dtype=mx.bfloat16) -> None:
    """Write the zoo's ``build(family, bits, dtype=dtype)`` model of an mlx-lm family into
    ``folder`` as mlx-lm's converter writes a checkpoint (safetensors weights; config.json with the
    model's arguments and its quantization), so that what loads checkpoints can be tried on it.
    bf16 by default, as the checkpoints of MoE models ship (a loaded model runs in its weights'
    dtype, and on CUDA the grouped prefill kernel takes bf16 / fp16 activations only)."""
    import dataclasses
    from pathlib import Path

    from mlx_lm.utils import save_config, save_model

    if family not in FAMILIES or family in MLX_VLM_FAMILIES:
        raise ValueError(f"save_checkpoint takes the zoo's mlx-lm families, not {family!r}")
    save_model(Path(folder), build(family, bits, dtype=dtype))
    config = {**dataclasses.asdict(_config(family)), "quantization": {"group_size": GROUP_SIZE, "bits": bits}}
    save_config(config, Path(folder) / "config.json")


def upstream_families() -> dict[str, list[str]]:
    """{upstream model ("mlx_lm.models.<module>" / "mlx_vlm.models.<package>"): the zoo's families
    built from it}, FAMILIES' and BREADTH_FAMILIES'."""
    built: dict[str, list[str]] = {}
    for family in FAMILIES:
        library = "mlx_vlm" if family in MLX_VLM_FAMILIES else "mlx_lm"
        built.setdefault(f"{library}.models.{family}", []).append(family)
    for family, breadth in BREADTH_FAMILIES.items():
        built.setdefault(".".join(breadth.module.split(".")[:3]), []).append(family)
    return built


def families_markdown() -> str:
    """docs/families.md: every upstream MoE model (zoo_breadth.upstream_moe_models) with the zoo
    families built from it and the test that checks them, or the reason it has none."""
    from .zoo_breadth import LEFT_OUT, LEFT_OUT_CHECKED_AGAINST, upstream_moe_models

    built = upstream_families()
    rows = []
    for model in sorted(upstream_moe_models() | set(built), key=str.lower):
        if model in LEFT_OUT:
            rows.append(f"| `{model}` | | not in the zoo: {LEFT_OUT[model]} |")
            continue
        names = built.get(model, [])
        every = [f for f in names if f in FAMILIES]
        checked = ("every parity test (greedy tokens, hypothesis, callers), the benchmarks" if every else
                   "tests/parity/test_families.py (greedy tokens, both phases through the ops)")
        rows.append(f"| `{model}` | {', '.join(f'`{f}`' for f in names)} | {checked} |")
    versions = ", ".join(f"{k} {v}" for k, v in LEFT_OUT_CHECKED_AGAINST.items())
    return "\n".join([
        "# MoE models of mlx-lm and mlx-vlm, and what checks them",
        "",
        f"Every model module of {versions} whose source names a switch layer (SwitchGLU, SwitchMLP,",
        "SwitchLinear), with the small random models the zoo builds from it (`mlx_moe_fix.zoo`, `zoo_breadth`)",
        "and the test that checks the package on them; generated by `mlx_moe_fix.zoo.families_markdown()`",
        "(tests/parity/test_families.py keeps this file equal to it). Where the tests have run (CPU, GPU)",
        "is in the README.",
        "",
        "| upstream model | zoo families | checked by |",
        "|---|---|---|",
        *rows,
        "",
    ])


def spread_tokens(length: int, vocab_size: int) -> list[int]:
    """`length` token ids, deterministic, spread over a vocab of `vocab_size` (no repeats in the
    first `vocab_size` where 37 does not divide it)."""
    return [(37 * i + 11) % vocab_size for i in range(length)]


def has_expert_layers(model) -> bool:
    """Whether ``model`` has a switch layer of mlx-lm's or mlx-vlm's (quantized or not): what the
    package patches, whichever block calls it."""
    return any(type(m).__module__.endswith("models.switch_layers") for _, m in model.named_modules())


def make_cache(model):
    """The model's own cache (``model.make_cache()``) or mlx_lm's default."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def logits_of(out) -> mx.array:
    """mlx_vlm language models return LanguageModelOutput; mlx_lm a bare array."""
    return out if isinstance(out, mx.array) else out.logits


def prompt_logits(model, family: str) -> mx.array:
    """The float32 logits after the family's prompt, prefilled in one call into a fresh cache."""
    prompt = mx.array([prompt_for(family)])
    return logits_of(model(prompt, cache=make_cache(model)))[0, -1].astype(mx.float32)


def _decode(model, prompt: list[int], n: int, forced: Optional[list[int]] = None, caches: Optional[list] = None,
            snapshots: Optional[list] = None):
    """Prefill ``prompt`` in one call, then one token per call; also times the two phases.
    With ``forced``, step i + 1 is fed forced[i] instead of the model's own choice; with
    ``caches`` (another run's ``snapshots``), it starts from a copy of caches[i] instead of this
    run's own cache; ``snapshots`` gets a copy of the cache each decode step starts from."""
    import time

    cache = make_cache(model)
    started = time.perf_counter()
    logits = logits_of(model(mx.array([prompt]), cache=cache))[0, -1]
    rows = [logits.astype(mx.float32)]
    tokens = [mx.argmax(logits, axis=-1).item()]
    prefilled = time.perf_counter()
    for i in range(n - 1):
        fed = tokens[-1] if forced is None else forced[i]
        if caches is not None:
            cache = copy.deepcopy(caches[i])
        if snapshots is not None:
            snapshots.append(copy.deepcopy(cache))
        logits = logits_of(model(mx.array([[fed]]), cache=cache))[0, -1]
        rows.append(logits.astype(mx.float32))
        tokens.append(mx.argmax(logits, axis=-1).item())
    return tokens, mx.stack(rows), prefilled - started, time.perf_counter() - prefilled


def greedy_decode(model, prompt: list[int], n: int = 32, snapshots: Optional[list] = None) -> tuple[list[int], mx.array]:
    """The ``n`` greedy tokens and the ``[n, vocab]`` float32 logits each was the argmax of
    (for tolerance-based comparisons; near-ties do occur); ``snapshots``, a list, gets a copy of
    the cache each decode step starts from (forced_decode's ``caches``)."""
    tokens, logits, _, _ = _decode(model, prompt, n, snapshots=snapshots)
    return tokens, logits


def forced_decode(model, prompt: list[int], tokens: list[int], caches: Optional[list] = None) -> tuple[list[int], mx.array]:
    """Teacher forcing: the model's own choice and logits at each step of ``tokens`` (another
    run's greedy stream), fed those tokens rather than its choices, so two models can be
    compared at every step, past a first difference. With ``caches`` (that run's snapshots) each
    decode step also starts from that run's cache, so that a step's difference (a router's
    near-tie that sent a token to other experts) stays in that step: in this run's own cache it
    would move the steps after it too (on the H200, one in zoo inkling's 8-bit bf16 run moved the
    next three steps' logits by 0.09-0.12, relative)."""
    choices, logits, _, _ = _decode(model, prompt, len(tokens), forced=tokens, caches=caches)
    return choices, logits


# A step's greedy choice is clear where its top-2 logit margin exceeds this fraction of the top
# logit (8 bf16 ulps). bf16 MoE outputs that differ by their roundings move logits by more than a
# few ulps after the layers above them: on the H200 the kernels moved one of zoo deepseek_v41_vlm's
# by 0.092 at a top logit of 2.95 (relative error 0.035, in tolerance) and flipped a 1.7% margin,
# where 4 ulps (2^-6) called it clear; on the CPU's bf16 streams of every zoo family, 2^-5 leaves at
# least 17 of 32 steps clear (docs/benchmarks.md, sixty-first stop).
NEAR_TIE = 2**-5


def clear_steps(logits: mx.array) -> list[bool]:
    """Per step of `logits` [steps, vocab]: whether its greedy choice is clear (NEAR_TIE)."""
    top_two = mx.sort(logits, axis=-1)[:, -2:]
    return ((top_two[:, 1] - top_two[:, 0]) > NEAR_TIE * mx.abs(top_two[:, 1])).tolist()


# Routers whose weights jump without any expert changing: phimoe's sparsemixer masks, for each
# pick, the gates more than 2 * jitter_eps below the top one, so a gate crossing that band moves
# the softmax (mlx-lm's and mlx-vlm's copies). Recorded beside the indices: {module: function name}.
WEIGHT_ROUTERS = {"mlx_lm.models.phimoe": "sparsemixer", "mlx_vlm.models.phimoe.language": "sparsemixer"}
REWEIGHTED = 5e-2  # a routing weight that moved by more than this (relative) moved by a jump

# Top-k picks that the recorded routes would not show, each a discrete choice whose near-tie, which
# a rounding difference in the layers before tips, moves a step's logits as far as a router's
# does: sparse attentions' picks of a query's keys (or key blocks) by an indexer's scores (stock
# bf16 on the CPU, its MoE outputs nudged by ~1e-3 relative noise: 0.05-0.36 at the steps whose
# picks moved, at most 0.032 elsewhere; the H200's first breadth run failed five such families at
# one step each, 0.05-0.13; docs/benchmarks.md, sixtieth stop), and LongCat-Flash's router, whose
# zero (identity) experts reach its SwitchGLU as expert 0 at weight 0, so that a pick moving
# between expert 0 and a zero expert leaves the recorded indices as they were.
# {module: qualified names of the functions whose mx.argpartition picks}.
TOP_K_PICKERS = {
    "mlx_lm.models.deepseek_v32": {"Indexer.__call__"},
    "mlx_lm.models.deepseek_v41": {"Indexer.__call__"},
    "mlx_lm.models.longcat_flash": {"LongcatFlashTopkRouter.__call__"},
    "mlx_lm.models.minimax_m3_vl": {"Attention._block_mask"},
    "mlx_vlm.models.deepseek_v32.language": {"Indexer.__call__"},
    "mlx_vlm.models.glm5_next.language": {"_exact_pool_select"},
    "mlx_vlm.models.longcat_flash.language": {"LongcatFlashTopkRouter.__call__"},
    "mlx_vlm.models.longcat_flash_sparse.language": {"Indexer.__call__", "LongcatFlashTopkRouter.__call__"},
    "mlx_vlm.models.minimax_m3_vl.language": {"_build_sparse_causal_mask_compiled",
                                              "_select_sparse_block_indices_compiled"},
    "mlx_vlm.models.qwen4_exp.language": {"Qwen4ExpQSAIndexer.select_from_projected"},
}


class Route(NamedTuple):
    """One MoE layer call, as recording_routes records it."""

    experts: mx.array  # each token's top-k experts, sorted
    weights: Optional[mx.array] = None  # their routing weights in that order (WEIGHT_ROUTERS only)
    # the TOP_K_PICKERS' picks since the previous MoE layer call: (the indices below the
    # partition's kth, sorted; the index at kth), which fix the set on either side
    picks: tuple = ()


def _qualified_name(frame) -> str:
    code = frame.f_code
    if hasattr(code, "co_qualname"):  # Python 3.11
        return code.co_qualname
    owner = frame.f_locals.get("self")
    return code.co_name if owner is None else f"{type(owner).__name__}.{code.co_name}"


@contextlib.contextmanager
def recording_routes(model):
    """Within the block, every MoE layer of ``model`` appends what it is called with to the yielded
    list a Route, one per layer and forward, in call order: each token's top-k experts, their
    routing weights where the router is one of WEIGHT_ROUTERS, and the TOP_K_PICKERS' picks since
    the previous layer call (those after a forward's last MoE layer call, as an attention after its
    MoE block would make, go with that call: ``model``'s own calls mark the forwards). Two runs of a
    model on the same tokens can then be told apart where a router's near-tie sent a token to
    another expert or jumped a weight, or a sparse attention's near-tie picked other keys (each
    moves the output far more than any rounding)."""
    routes: list[Route] = []
    weights: list[Optional[mx.array]] = [None]  # the last recorded router's, for the next layer call
    picks: list[tuple] = []  # the TOP_K_PICKERS' picks since the last layer call

    def record(layer, x, indices, *args, **kwargs):
        routes.append(Route(mx.sort(indices, axis=-1), weights[0], tuple(picks)))
        weights[0] = None
        picks.clear()

    argpartition = mx.argpartition

    def recording_picks(a, kth, axis=-1, **kwargs):
        picked = argpartition(a, kth, axis=axis, **kwargs)
        caller = sys._getframe(1)
        if _qualified_name(caller) in TOP_K_PICKERS.get(caller.f_globals.get("__name__"), ()):
            last = mx.moveaxis(picked, axis, -1)
            kth %= last.shape[-1]
            picks.append((mx.sort(last[..., :kth], axis=-1), last[..., kth]))
        return picked

    def close_forward():
        if picks and routes:
            routes[-1] = routes[-1]._replace(picks=routes[-1].picks + tuple(picks))
        picks.clear()

    def forward(_, call, *args, **kwargs):
        close_forward()  # the picks left belong to the forward before
        return call(*args, **kwargs)

    routers = []
    for name, function in WEIGHT_ROUTERS.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        router = getattr(module, function)

        def recorded(*args, _router=router, **kwargs):
            indices, scores = _router(*args, **kwargs)
            weights[0] = mx.take_along_axis(scores, mx.argsort(indices, axis=-1), axis=-1)
            return indices, scores

        routers.append((module, function, router))
        setattr(module, function, recorded)
    mx.argpartition = recording_picks
    try:
        with intercepting([model], forward), intercepting_moe_layers(model, record):
            yield routes
        close_forward()
    finally:
        mx.argpartition = argpartition
        for module, function, router in routers:
            setattr(module, function, router)


@contextlib.contextmanager
def intercepting(modules, around):
    """Within the block, a call of any of ``modules`` runs ``around(module, call, *args,
    **kwargs)``, where ``call(*args, **kwargs)`` is the module's own call. A module listed twice
    (reachable by two paths) is intercepted once; every class is put back on exit. The patched
    blocks' compiled decode steps are suspended meanwhile: a replayed step calls no module."""
    swapped = []
    seen = set()
    for module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        base = type(module)

        class Intercepting(base):
            def __call__(self, *args, **kwargs):
                return around(self, super().__call__, *args, **kwargs)

        swapped.append((module, base))
        module.__class__ = Intercepting
    try:
        with compiled.suspended():
            yield
    finally:
        for module, base in reversed(swapped):
            module.__class__ = base


def intercepting_moe_layers(model, on_call):
    """Within the block, every MoE layer of ``model`` calls ``on_call(layer, *args, **kwargs)``
    with its arguments before it runs."""

    def around(layer, call, *args, **kwargs):
        on_call(layer, *args, **kwargs)
        return call(*args, **kwargs)

    return intercepting([layer for _, layer in moe_layers(model)], around)


@contextlib.contextmanager
def recording_layer_calls(model):
    """Within the block, every MoE layer call of ``model`` appends (layer, args, kwargs) to the
    yielded list, so that it can be replayed on exactly its inputs (``layer(*args, **kwargs)``)."""
    calls: list[tuple] = []
    with intercepting_moe_layers(model, lambda layer, *args, **kwargs: calls.append((layer, args, kwargs))):
        yield calls


def finite_stand_in(a, seed: int):
    """`a` itself where finite; else random values of its shape and dtype at the scale of its
    finite entries (an unreproducible stock run fed a layer NaNs or values that overflow)."""
    if not isinstance(a, mx.array) or not mx.issubdtype(a.dtype, mx.floating) or mx.isfinite(a).all().item():
        return a
    finite = mx.where(mx.isfinite(a), a, 0).astype(mx.float32)
    scale = mx.sqrt(mx.mean(finite * finite)).item() or 1.0
    return (mx.random.normal(a.shape, key=mx.random.key(seed)) * scale).astype(a.dtype)


def replayed_layer_calls(model, prompt: list[int], n: int) -> tuple[int, list[tuple]]:
    """Every MoE layer call of a stock greedy run of ``n`` tokens, replayed on its recorded inputs
    stock and under ``mlx_moe_fix.patched(references=True)`` (the references where no kernel of ours
    is on): (calls recorded, [(call number, args, stock output,
    patched output)] for each call whose replayed stock output is finite). Non-finite inputs get
    finite_stand_in, the recorded routing kept."""
    import mlx_moe_fix

    with recording_layer_calls(model) as calls:
        greedy_decode(model, prompt, n)
    replayed = []
    for number, (layer, args, kwargs) in enumerate(calls):
        args = tuple(finite_stand_in(a, number) for a in args)
        kwargs = {k: finite_stand_in(v, number) for k, v in kwargs.items()}
        stock = layer(*args, **kwargs)
        if not mx.isfinite(stock).all().item():
            continue
        with mlx_moe_fix.patched(references=True):
            patched = layer(*args, **kwargs)
        replayed.append((number, args, stock, patched))
    return len(calls), replayed


def rerouted_steps(routes: list[Route], other: list[Route], forwards: int, by_row: bool = False) -> list:
    """Per forward of the ``forwards`` recorded (prefill, then each decode step): whether any MoE
    layer call of that forward routed some token to other experts in ``routes`` than in
    ``other``, moved a recorded routing weight by more than REWEIGHTED, or one of the
    TOP_K_PICKERS picked otherwise (recording_routes).
    Counted in forwards, not layers: a model may hold MoE layers that a forward does not call
    (ernie4_5_moe_vl's vision experts on a text prompt). With ``by_row``, per forward a list over
    the batch's rows (the first axis of the recorded indices): whether that row's tokens were."""
    if len(routes) != len(other) or not routes or len(routes) % forwards:
        raise ValueError(f"routes of {len(routes)} and {len(other)} layer calls for {forwards} forwards")
    layers = len(routes) // forwards

    def differ(a, b, row):
        (experts, weights, picks), (other_experts, other_weights, other_picks) = a, b
        if row is not None:
            experts, other_experts = experts[row], other_experts[row]
            weights = None if weights is None else weights[row]
            other_weights = None if other_weights is None else other_weights[row]
            picks = [[part[row] for part in pick] for pick in picks]
            other_picks = [[part[row] for part in pick] for pick in other_picks]
        if not mx.array_equal(experts, other_experts).item():
            return True
        if len(picks) != len(other_picks) or any(not mx.array_equal(part, other_part).item()
                                                 for pick, other_pick in zip(picks, other_picks)
                                                 for part, other_part in zip(pick, other_pick)):
            return True
        if weights is None or other_weights is None:
            return False
        moved = mx.abs(weights.astype(mx.float32) - other_weights.astype(mx.float32))
        return (moved > REWEIGHTED * mx.abs(other_weights.astype(mx.float32))).any().item()

    def forward(step, row=None):
        return any(differ(routes[c], other[c], row) for c in range(step, step + layers))

    steps = range(0, len(routes), layers)
    if by_row:
        return [[forward(step, row) for row in range(routes[step][0].shape[0])] for step in steps]
    return [forward(step) for step in steps]


@contextlib.contextmanager
def observing_routing():
    """Within the block, the experts of each routing that a kernel launch makes (the routed
    decode kernels route inside their gate+up launch, where recording_routes cannot look without
    sending the block apart from them) are appended to the yielded list, in call order
    (trace.observing_routing); compiled steps are suspended meanwhile (a replay is not seen)."""
    with compiled.suspended(), trace.observing_routing() as observed:
        yield observed


def observed_rerouted_steps(observed: list, routes: list[Route], forwards: int) -> Optional[list]:
    """For a run of ``forwards`` forwards whose decode steps routed every MoE layer call inside a
    kernel launch (observing_routing's ``observed``): per decode step (forwards 1 to forwards - 1),
    whether one of its calls chose other experts than ``routes`` (recording_routes' of another run
    on the same tokens) did (rerouted_steps). None where the run cannot be told so: a decode call
    routed otherwise (not observed), a prefill call observed, or ``routes`` holding weights or
    picks (WEIGHT_ROUTERS, TOP_K_PICKERS) that the launches do not show."""
    decode = routes[len(routes) // forwards:]
    if (len(observed) != len(decode) or any(route.weights is not None or route.picks for route in routes)
            or any(experts.size != route.experts.size for experts, route in zip(observed, decode))):
        return None
    seen = [Route(mx.sort(experts.reshape(route.experts.shape), axis=-1)) for experts, route in zip(observed, decode)]
    return rerouted_steps(seen, decode, forwards - 1)


def greedy_decode_timed(model, prompt: list[int], n: int = 32) -> tuple[list[int], float, float]:
    """The ``n`` greedy tokens, the prefill seconds and the seconds of the n - 1 decode steps."""
    tokens, _, prefill_s, decode_s = _decode(model, prompt, n)
    return tokens, prefill_s, decode_s


def greedy_tokens(model, prompt: list[int], n: int = 32) -> list[int]:
    """Greedy decode: prefill ``prompt`` in one call, then one token per call."""
    return greedy_decode(model, prompt, n)[0]


# mlx-vlm's expert blocks that fuse gate and up into one switch linear of their own (called as a
# SwitchGLU is: x, indices): the package patches their switch linears, not the block.
PACKED_SWITCH_GLUS = (("mlx_vlm.models.minimax_m3_vl.language", "MiniMaxPackedSwitchGLU"),
                      ("mlx_vlm.models.laguna.language", "LagunaPackedSwitchGLU"),
                      ("mlx_vlm.models.hy_v4.fused_switch_glu", "FusedSwitchGLU"),
                      ("mlx_vlm.models.zaya1_vl.language", "ZayaSwitchMLP"))


def moe_layers(model) -> list[tuple[str, nn.Module]]:
    """(path, module) of every SwitchGLU or SwitchMLP (mlx_lm or mlx_vlm, incl. InklingSwitchGLU),
    and every PACKED_SWITCH_GLUS block."""
    return [
        (path, m)
        for path, m in model.named_modules()
        if any(
            (c.__name__ in ("SwitchGLU", "SwitchMLP") and c.__module__.endswith("models.switch_layers"))
            or (c.__module__, c.__name__) in PACKED_SWITCH_GLUS
            for c in type(m).__mro__
        )
    ]
