"""Upstream activation modules that the ops know, matched by exact type (and a few activation
functions, matched by identity).

A subclass could change the math, so only the listed classes themselves are recognised; anything
else leaves its layer on stock code. Classes are looked up in modules that are already imported
(an instance exists only if its module was), so recognising never imports a package.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

from ..kernels import Activation


def _gelu(module) -> Activation:
    approx = module._approx
    if approx == "none":
        return Activation("gelu")
    return Activation("gelu_approx" if approx in ("precise", "tanh") else "gelu_fast")


def _limited_swiglu(limit) -> Activation:
    # DeepSeek-V4 clamps only for a positive limit (`if limit and limit > 0`).
    return Activation("swiglu", limit=float(limit) if limit and limit > 0 else None)


def _situ(module) -> Activation:
    linear_beta = module.linear_beta
    return Activation("situ", limit=None if linear_beta is None else float(linear_beta), alpha=float(module.beta))


# (module, class name, how to read its parameters)
KNOWN_ACTIVATIONS: tuple = (
    ("mlx_lm.models.switch_layers", "SwiGLU", lambda m: Activation("swiglu")),
    ("mlx_vlm.models.switch_layers", "SwiGLU", lambda m: Activation("swiglu")),
    ("mlx_vlm.models.deepseek_v4.language", "LimitedSwiGLU", lambda m: _limited_swiglu(m.limit)),
    (
        "mlx_lm.models.activations",
        "SwigluOAI",
        lambda m: Activation("swiglu_oai", limit=float(m._limit), alpha=float(m._alpha)),
    ),
    # mlx-vlm's gpt-oss SwiGLU calls its module-level swiglu with the defaults 1.702 / 7.0.
    ("mlx_vlm.models.gpt_oss.language", "SwiGLU", lambda m: Activation("swiglu_oai", limit=7.0, alpha=1.702)),
    ("mlx.nn.layers.activations", "GELU", _gelu),
    ("mlx.nn.layers.activations", "ReLU2", lambda m: Activation("relu2")),
    # mlx-vlm's MiniMax-M3-VL: gpt-oss's SwiGLU with (up + beta), the same as SwigluOAI at beta 1
    ("mlx_vlm.models.minimax_m3_vl.language", "MiniMaxSwiGLUOAI",
     lambda m: Activation("swiglu_oai", limit=float(m.limit), alpha=float(m.alpha)) if m.beta == 1.0 else None),
    # DeepSeek-V4.1's clamped SwiGLU in float32 (mlx-lm's; mlx-vlm's also weights and fp8-rounds
    # its output, in its own SwitchGLU subclass)
    ("mlx_lm.models.deepseek_v41", "DeepseekV41SwiGLU",
     lambda m: Activation("swiglu_fp32", limit=float(m.limit) if m.limit > 0 else None)),
    ("mlx_lm.models.step3p5", "ClampedSwiGLU", lambda m: Activation("swiglu_clamped_silu", limit=float(m.limit))),
    ("mlx_vlm.models.step3p5.language", "ClampedSwiGLU", lambda m: Activation("swiglu_clamped_silu", limit=float(m.limit))),
    ("mlx_vlm.models.step3p7.language", "ClampedSwiGLU", lambda m: Activation("swiglu_clamped_silu", limit=float(m.limit))),
    # GLM-5-Next clamps whatever its limit (DeepSeek-V4 only for a positive one)
    ("mlx_vlm.models.glm5_next.language", "LimitedSwiGLU", lambda m: Activation("swiglu", limit=float(m.limit))),
    ("mlx_lm.models.gemma4_text", "GeGLU", lambda m: Activation("geglu_approx")),
    ("mlx_vlm.models.gemma4.language", "GeGLU", lambda m: Activation("geglu_approx")),
    ("mlx_vlm.models.gemma4_text.language", "GeGLU", lambda m: Activation("geglu_approx")),
    ("mlx_lm.models.kimi_k3", "SiTU", _situ),
    ("mlx_vlm.models.kimi_k3.language", "SiTU", _situ),
)


# Activations that are functions, not modules (every compiled function has one type): matched by
# identity. (module, function name, the activation it computes)
KNOWN_ACTIVATION_FUNCTIONS: tuple = (
    # silu(gate) clipped to +-100 against fp16 overflow, times up
    ("mlx_vlm.models.kimi_vl.language", "clipped_silu", Activation("swiglu_capped_silu", limit=100.0)),
)


def _reader(cls) -> Optional[Callable]:
    for module_name, class_name, read in KNOWN_ACTIVATIONS:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, class_name, None) is cls:
            return read
    return None


def recognise(activation) -> Optional[Activation]:
    for module_name, function_name, known in KNOWN_ACTIVATION_FUNCTIONS:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, function_name, None) is activation:
            return known
    read = _reader(type(activation))
    return None if read is None else read(activation)


# Dense shared-experts modules whose gate, up and down projections the ops read (SharedExperts):
# (module, class name, their activation)
KNOWN_SHARED_EXPERTS: tuple = (
    ("mlx_vlm.models.inkling.language", "InklingSharedExpertsDense", lambda m: Activation("swiglu")),
    ("mlx_vlm.models.deepseek_v4.language", "DeepseekV4MLP", lambda m: _limited_swiglu(m.swiglu_limit)),
)


def shared_experts_activation(module) -> Optional[Activation]:
    """The activation of a dense shared-experts module of a class listed in KNOWN_SHARED_EXPERTS
    (that class exactly), else None."""
    for module_name, class_name, read in KNOWN_SHARED_EXPERTS:
        upstream = sys.modules.get(module_name)
        if upstream is not None and getattr(upstream, class_name, None) is type(module):
            return read(module)
    return None


def known_activation_names() -> list:
    return [f"{module}.{name}" for module, name, _ in KNOWN_ACTIVATIONS + KNOWN_ACTIVATION_FUNCTIONS]
