"""What an MoE expert layer is, independent of which library built it.

The ops in this package take these plain descriptions rather than mlx-lm / mlx-vlm modules, so that
a kernel, its reference and the patch layer agree on one contract and the ops can be tested without
any model class.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# MLX's 4-bit float modes: e2m1 codes (sign, two exponent bits, one mantissa bit) packed as
# 4-bit values, no biases, one 8-bit scale a group: mxfp4 an e8m0 power of two a 32 values
# (gpt-oss's and DeepSeek-V4's experts as their checkpoints ship), nvfp4 an e4m3 float a 16
# (Inkling's, its per-expert second scale in gate_scale / out_scale). Their group sizes:
MXFP4, NVFP4 = "mxfp4", "nvfp4"
FP4_GROUP_SIZES = {MXFP4: 32, NVFP4: 16}
# (group size, bits) of a quantization mode where a layer leaves them None: mlx.nn.quantize's
# defaults, which mlx-lm's QuantizedSwitchLinear keeps as None and MLX's matmuls resolve so.
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
SUPPORTED_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


@dataclass(frozen=True, eq=False)
class ExpertLinear:
    """One projection of every expert: `weight` is [E, out, in], or mx.quantize's packed
    [E, out, in * bits / 32] with `scales` / `biases` of [E, out, in / group_size]."""

    weight: mx.array
    scales: Optional[mx.array] = None
    biases: Optional[mx.array] = None
    bias: Optional[mx.array] = None
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"
    global_scale: Optional[mx.array] = None

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def output_dims(self) -> int:
        return self.weight.shape[1]

    @property
    def input_dims(self) -> int:
        if self.quantized:
            return self.scales.shape[-1] * self.group_size
        return self.weight.shape[2]

    @classmethod
    def from_module(cls, module) -> Optional["ExpertLinear"]:
        """Reads an mlx-lm / mlx-vlm `SwitchLinear` or `QuantizedSwitchLinear`; None for
        anything else (an offloaded or custom projection), which then stays on stock code."""
        if "weight" not in module or getattr(module["weight"], "ndim", 0) != 3:
            return None
        bias = module["bias"] if "bias" in module else None
        if "scales" not in module:
            return cls(module["weight"], bias=bias)
        mode = getattr(module, "mode", "affine")
        default_group_size, default_bits = MODE_DEFAULTS.get(mode, (None, None))
        return cls(
            module["weight"],
            module["scales"],
            module.get("biases"),
            bias,
            group_size=module.group_size or default_group_size,
            bits=module.bits or default_bits,
            mode=mode,
            global_scale=getattr(module, "global_scale", None),
        )

    def unsupported_reason(self) -> Optional[str]:
        if not self.quantized:
            return None
        if self.mode in FP4_GROUP_SIZES:
            group = FP4_GROUP_SIZES[self.mode]
            if (self.bits, self.group_size) != (4, group) or self.biases is not None:
                return f"an {self.mode} projection of {self.bits} bits in groups of {self.group_size} (4 in groups of {group} only)"
            if self.global_scale is not None:
                return f"an {self.mode} projection with a global scale"
            return None
        if self.mode != "affine" or self.biases is None or self.global_scale is not None:
            return f"quantization mode {self.mode!r} is not supported yet (affine, mxfp4 and nvfp4 only)"
        if self.bits not in SUPPORTED_BITS:
            return f"{self.bits}-bit experts are not supported (supported: {SUPPORTED_BITS})"
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            return f"group size {self.group_size} is not supported (supported: {SUPPORTED_GROUP_SIZES})"
        return None


@dataclass(frozen=True, eq=False)
class RouterLinear:
    """A MoE block's router as an affine-quantized linear (mlx's `nn.QuantizedLinear`): `weight`
    [E, in * bits / 32], `scales` / `biases` [E, in / group_size], an optional additive `bias`
    [E]. Called on x, it gives the router logits as that module's call does."""

    weight: mx.array
    scales: mx.array
    biases: Optional[mx.array]
    group_size: int
    bits: int
    mode: str = "affine"
    bias: Optional[mx.array] = None

    @property
    def output_dims(self) -> int:
        return self.weight.shape[0]

    @property
    def input_dims(self) -> int:
        return self.scales.shape[-1] * self.group_size

    @classmethod
    def from_module(cls, module) -> Optional["RouterLinear"]:
        """Reads an `nn.QuantizedLinear` (that class exactly: a subclass may compute its output
        otherwise); None for anything else."""
        if type(module) is not nn.QuantizedLinear:
            return None
        return cls(module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits,
                   getattr(module, "mode", "affine"), module.get("bias"))

    def logits_dtype(self, dtype):
        """The logits' dtype for activations of `dtype`: MLX promotes it with the scales' (and the
        additive bias's) dtype, which for the floating types it quantizes with is that dtype where
        they agree and float32 where they do not."""
        for other in (self.scales.dtype, None if self.bias is None else self.bias.dtype):
            if other is not None and other != dtype:
                dtype = mx.float32
        return dtype

    def __call__(self, x: mx.array) -> mx.array:
        logits = mx.quantized_matmul(x, self.weight, scales=self.scales, biases=self.biases, transpose=True,
                                     group_size=self.group_size, bits=self.bits, mode=self.mode)
        return logits if self.bias is None else logits + self.bias


@dataclass(frozen=True)
class Activation:
    """The activation between the first and last expert projections.

    kind:
      "swiglu"      silu(gate) * up; with `limit`, DeepSeek-V4's clamp stage first:
                    gate = min(gate, limit), up = clip(up, -limit, limit)
      "swiglu_oai"  gpt-oss: gate = min(gate, limit), up = clip(up, -limit, limit),
                    (up + 1) * gate * sigmoid(alpha * gate)
      "swiglu_fp32" DeepSeek-V4.1: "swiglu" (its clamp stage with `limit`) computed in float32
                    from the projections' outputs, rounded once
      "swiglu_clamped_silu"  Step-3.5: min(silu(gate), limit) * clip(up, -limit, limit)
      "swiglu_capped_silu"   Kimi-VL: clip(silu(gate), -limit, limit) * up
      "geglu_approx"  Gemma 4: gelu_approx(gate) * up
      "situ"        Kimi-K3, in float32, rounded once: alpha * tanh(gate / alpha) * sigmoid(gate)
                    * up, `up` first limit * tanh(up / limit) where `limit` (its beta and
                    linear_beta)
      "gelu", "gelu_approx", "gelu_fast", "relu2" (Nemotron-H's max(up, 0)^2)   for two-projection
                    (SwitchMLP) experts
    """

    kind: str
    limit: Optional[float] = None
    alpha: Optional[float] = None

    GATED = ("swiglu", "swiglu_oai", "swiglu_fp32", "swiglu_clamped_silu", "swiglu_capped_silu", "geglu_approx", "situ")
    UNGATED = ("gelu", "gelu_approx", "gelu_fast", "relu2")

    @property
    def gated(self) -> bool:
        return self.kind in self.GATED

    def __post_init__(self):
        if self.kind not in self.GATED + self.UNGATED:
            raise ValueError(f"unknown activation kind {self.kind!r}")
        if self.kind == "swiglu_oai" and (self.limit is None or self.alpha is None):
            raise ValueError("swiglu_oai needs both limit and alpha")
        if self.kind in ("swiglu_clamped_silu", "swiglu_capped_silu") and self.limit is None:
            raise ValueError(f"{self.kind} needs a limit")
        if self.kind == "situ" and self.alpha is None:
            raise ValueError("situ needs alpha (its beta)")


@dataclass(frozen=True, eq=False)
class SharedExperts:
    """A block's always-on shared experts as one dense GLU (mlx-vlm's Inkling:
    InklingSharedExpertsDense; DeepSeek-V4: DeepseekV4MLP): `count` experts of `width`
    intermediate columns each, their gate and up projections concatenated along the output
    ([count * width, in]) and their down along the input ([out, count * width]), each an
    nn.QuantizedLinear (as RouterLinear reads one), with a gated `activation`. Per-token weights,
    where the block has them (Inkling's), are one a shared expert, applied to its columns before
    the down projection (moe_shared_decode)."""

    gate: RouterLinear
    up: RouterLinear
    down: RouterLinear
    count: int
    activation: Activation

    @property
    def width(self) -> int:
        return self.gate.output_dims // self.count

    @classmethod
    def from_module(cls, module, count: int, activation: Activation) -> Optional["SharedExperts"]:
        """Reads a module with quantized `gate_proj`, `up_proj` and `down_proj` linears; None for
        anything else."""
        linears = [RouterLinear.from_module(module[name]) if name in module else None
                   for name in ("gate_proj", "up_proj", "down_proj")]
        if any(linear is None for linear in linears) or count < 1 or linears[0].output_dims % count:
            return None
        return cls(*linears, count, activation)


@dataclass(frozen=True, eq=False)
class MoEExperts:
    """A routed expert block.

    projections: (linear,) one expert matmul; (fc1, fc2) an MLP with an ungated activation;
    (gate, up, down) a GLU with a gated activation. gate_scale / out_scale: optional [E]
    per-expert factors applied to the gate projection's output and to the block's output
    (Inkling)."""

    projections: tuple
    activation: Optional[Activation] = None
    gate_scale: Optional[mx.array] = None
    out_scale: Optional[mx.array] = None

    def __post_init__(self):
        n = len(self.projections)
        if n not in (1, 2, 3):
            raise ValueError(f"expected 1, 2 or 3 projections, got {n}")
        if (n == 1) != (self.activation is None):
            raise ValueError("an activation goes with 2 or 3 projections, and only with them")
        if n > 1 and self.activation.gated != (n == 3):
            raise ValueError(f"{self.activation.kind!r} does not fit {n} projections")
        if self.gate_scale is not None and n != 3:
            raise ValueError("gate_scale needs a gate projection")

    @cached_property
    def output_dims(self) -> int:
        return self.projections[-1].output_dims

    @cached_property
    def input_dims(self) -> int:
        return self.projections[0].input_dims

    @cached_property
    def num_experts(self) -> int:
        return self.projections[0].num_experts

    def memo(self, key, compute):
        """compute() once per key for this description (which the patches cache per layer):
        kernel launch plans and support checks, kept off the per-call host path."""
        memos = self.__dict__.setdefault("_memos", {})
        if key not in memos:
            memos[key] = compute()
        return memos[key]

    @cached_property
    def projections_unsupported_reason(self) -> Optional[str]:
        for projection in self.projections:
            reason = projection.unsupported_reason()
            if reason:
                return reason
        return None

    def unsupported_reason(self, x: mx.array, indices: Optional[mx.array] = None) -> Optional[str]:
        """Why the ops cannot take this call, or None when they can; without `indices`, x alone
        (a caller whose routing comes from x itself)."""
        reason = self.projections_unsupported_reason
        if reason:
            return reason
        if x.dtype not in SUPPORTED_DTYPES:
            return f"activations of dtype {x.dtype} are not supported"
        if indices is not None and x.shape[:-1] != indices.shape[:-1]:
            return f"x {tuple(x.shape)} and indices {tuple(indices.shape)} do not pair up token by token"
        if x.shape[-1] != self.input_dims:
            return f"x has {x.shape[-1]} features, the experts take {self.input_dims}"
        return None
