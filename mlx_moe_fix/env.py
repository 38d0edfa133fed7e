"""The package's environment switches: MLX_MOE_FIX_DISABLE, MLX_MOE_FIX_TRACE,
MLX_MOE_FIX_CUDA_DECODE, MLX_MOE_FIX_CUDA_PREFILL, MLX_MOE_FIX_CUDA_PREFILL_WGMMA, MLX_MOE_FIX_CUDA_ROUTER,
MLX_MOE_FIX_CUDA_ROUTED_DECODE, MLX_MOE_FIX_CUDA_FUSED_ROUTER, MLX_MOE_FIX_CUDA_SHARED_DECODE, MLX_MOE_FIX_COMPILED_DECODE, MLX_MOE_FIX_COMPILED_PREFILL,
MLX_MOE_FIX_SHARED_STEPS, MLX_MOE_FIX_RESIDUAL_IN_BLOCK, MLX_MOE_FIX_METAL_DECODE, MLX_MOE_FIX_KERNEL_CACHE, MLX_MOE_FIX_REFERENCES.

Read on first use and again at every `apply()`, not per call: reading `os.environ` costs
~0.7 us, and the patched layers consult the switches on every call of a decode step."""

import contextlib
import os

# name: its value where unset (or set empty)
SWITCHES = {"MLX_MOE_FIX_DISABLE": False, "MLX_MOE_FIX_TRACE": False, "MLX_MOE_FIX_CUDA_DECODE": True,
            "MLX_MOE_FIX_CUDA_PREFILL": True, "MLX_MOE_FIX_CUDA_PREFILL_WGMMA": True, "MLX_MOE_FIX_CUDA_ROUTER": True,
            "MLX_MOE_FIX_CUDA_ROUTED_DECODE": True, "MLX_MOE_FIX_CUDA_FUSED_ROUTER": True,
            "MLX_MOE_FIX_CUDA_SHARED_DECODE": True, "MLX_MOE_FIX_COMPILED_DECODE": True,
            "MLX_MOE_FIX_COMPILED_PREFILL": True, "MLX_MOE_FIX_SHARED_STEPS": True, "MLX_MOE_FIX_RESIDUAL_IN_BLOCK": True,
            # off until the Metal decode kernel has run on Apple hardware (kernels/metal/)
            "MLX_MOE_FIX_METAL_DECODE": False,
            "MLX_MOE_FIX_KERNEL_CACHE": True,
            # on: apply() patches where no kernel of ours is on, and every call that no kernel
            # takes runs the pure-MLX reference (tests, parity tools); off: upstream's code runs
            # there (kernels.backend.REFERENCES_SWITCH)
            "MLX_MOE_FIX_REFERENCES": False}
_values: dict = {}
_snapshot: list = [()]


def refresh() -> None:
    """Read the switches from the environment now."""
    _values.update({name: default if os.environ.get(name, "") == "" else os.environ[name] != "0"
                    for name, default in SWITCHES.items()})
    _snapshot[0] = tuple(_values[name] for name in SWITCHES)


def snapshot() -> tuple:
    """Every switch's value as of the last refresh, in SWITCHES order (one tuple per refresh, for
    per-call cache keys)."""
    if not _values:
        refresh()
    return _snapshot[0]


def flag(name: str) -> bool:
    """As of the last refresh: False where the variable is 0, True where it is anything else,
    its SWITCHES default where it is unset or empty."""
    if not _values:
        refresh()
    return _values[name]


@contextlib.contextmanager
def switched(name: str, value: str):
    """The environment switch `name` at `value` for the block, read afresh at its start and end."""
    previous = os.environ.get(name)
    os.environ[name] = value
    refresh()
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous
        refresh()
