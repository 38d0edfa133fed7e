"""The package's environment switches: MLX_MOE_FIX_DISABLE, MLX_MOE_FIX_TRACE,
MLX_MOE_FIX_CUDA_DECODE, MLX_MOE_FIX_CUDA_PREFILL.

Read on first use and again at every `apply()`, not per call: reading `os.environ` costs
~0.7 us, and the patched layers consult the switches on every call of a decode step."""

import os

SWITCHES = ("MLX_MOE_FIX_DISABLE", "MLX_MOE_FIX_TRACE", "MLX_MOE_FIX_CUDA_DECODE", "MLX_MOE_FIX_CUDA_PREFILL")
_values: dict = {}


def refresh() -> None:
    """Read the switches from the environment now."""
    _values.update({name: os.environ.get(name, "") not in ("", "0") for name in SWITCHES})


def flag(name: str) -> bool:
    """True when the variable was set to anything but empty or 0 (as of the last refresh)."""
    if not _values:
        refresh()
    return _values[name]
