"""Fast Mixture-of-Experts layers for mlx-lm and mlx-vlm.

    import mlx_moe_fix
    mlx_moe_fix.apply()

Every supported MoE layer then runs on the package's ops (our CUDA kernels); a call that no kernel
of ours takes, and anything unsupported, runs the original code. Where no
kernel of ours is on (the CPU; Metal unless MLX_MOE_FIX_METAL_DECODE=1) apply() patches nothing
and status() says why; MLX_MOE_FIX_REFERENCES=1 patches there too, running the references.
"""

from __future__ import annotations

from importlib import metadata

from .env import flag
from .kernels import current_backend, kernel_cache
from .kernels.moe_decode import moe_decode_implementation
from .kernels.moe_prefill import gemm_state, moe_prefill_implementation
from .kernels.moe_routed_decode import fused_router_state, moe_routed_decode_implementation
from .kernels.moe_router import moe_router_implementation
from .kernels.moe_shared_decode import moe_shared_decode_implementation
from .patches import (TARGETS, apply, compiled, disabled_by_env, is_applied, options, patched, revert, target_state,
                      why_not_applied)
from .patches.activations import known_activation_names
from .trace import path_counts, reset_path_counts

__version__ = "0.1.0"

_DISTRIBUTIONS = ("mlx", "mlx-lm", "mlx-vlm", "wrapt")


def _version(distribution: str):
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def compiled_state(phase: str) -> dict:
    why_not = compiled.why_not_compiled(phase)
    if why_not is None:
        calls = (f"calls of at most {compiled.DECODE_TOKENS} tokens" if phase == "decode"
                 else f"calls of more than {compiled.DECODE_TOKENS} tokens")
        return {"on": True, "reason": f"a patched block's {calls} are traced once per shape and replayed: by layers "
                "of one structure together, at a shape's first call in a model called before (its first call ever: "
                "at the second)"}
    return {"on": False, "reason": why_not}


def status() -> dict:
    """What is patched, deferred, missing or unsupported and why, which implementation each op runs here,
    the backend and the versions."""
    implementations = {
        "moe_prefill": moe_prefill_implementation(),
        "moe_decode": moe_decode_implementation(),
        "moe_router": moe_router_implementation(),
        "moe_routed_decode": moe_routed_decode_implementation(),
        "moe_shared_decode": moe_shared_decode_implementation(),
    }
    return {
        "applied": is_applied(),
        "why_not_applied": why_not_applied(),
        "disabled_by_env": disabled_by_env(),
        "phases": options.current(),
        "backend": current_backend(),
        # this package's own is the running code's: run from a checkout, no installed distribution
        # names it (its metadata gave None) or one names another copy
        "versions": {**{name: _version(name) for name in _DISTRIBUTIONS}, "mlx-moe-fix": __version__},
        "ops": {name: {"path": impl.path, "reason": impl.reason} for name, impl in implementations.items()},
        "prefill_gemm": gemm_state(),
        "routed_decode_router_inside": fused_router_state(),
        "compiled_decode_steps": compiled_state("decode"),
        "compiled_prefill_shapes": compiled_state("prefill"),
        "cuda_kernel_cache": kernel_cache.state(flag(kernel_cache.SWITCH)),
        "targets": [
            dict(zip(("target", "state", "reason"), (t.name, *target_state(t)))) for t in TARGETS
        ],
        "activations": known_activation_names(),
    }


__all__ = ["apply", "revert", "patched", "status", "path_counts", "reset_path_counts", "__version__"]
