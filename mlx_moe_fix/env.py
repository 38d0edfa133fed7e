"""The package's environment switches: MLX_MOE_FIX_DISABLE, MLX_MOE_FIX_TRACE,
MLX_MOE_FIX_CUDA_DECODE, MLX_MOE_FIX_CUDA_PREFILL."""

import os


def flag(name: str) -> bool:
    """True when the variable is set to anything but empty or 0."""
    return os.environ.get(name, "") not in ("", "0")
