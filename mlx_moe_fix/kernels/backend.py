"""Which implementation of an op runs on the current device, and why."""

from __future__ import annotations

import ctypes
import functools
import re
from typing import Callable, NamedTuple, Optional

import mlx.core as mx

from ..env import flag


# On: a call that no kernel of ours takes runs the op's pure-MLX reference (the tests' and parity
# tools' way to check the references, env.SWITCHES); off: it runs upstream's code.
REFERENCES_SWITCH = "MLX_MOE_FIX_REFERENCES"


def current_backend() -> str:
    """'cuda', 'metal' or 'cpu': where MLX runs ops on the default device."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "cpu"


@functools.lru_cache(maxsize=None)
def compute_capability() -> Optional[tuple]:
    """The CUDA GPU's (major, minor) from mx.device_info, once per process; None where MLX does
    not say."""
    info = mx.device_info(mx.gpu)
    major, minor = info.get("compute_capability_major"), info.get("compute_capability_minor")
    if major is None or minor is None:
        match = re.fullmatch(r"sm_(\d+)(\d)a?", str(info.get("architecture", "")))
        return (int(match.group(1)), int(match.group(2))) if match else None
    return major, minor


# CUdevice_attribute CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT (cuda.h)
_MULTIPROCESSOR_COUNT = 16


@functools.lru_cache(maxsize=None)
def multiprocessor_count() -> Optional[int]:
    """The CUDA GPU's streaming multiprocessors (MLX's default GPU), asked of the driver once per
    process (mx.device_info does not say); None where the driver cannot be asked (no libcuda, no
    CUDA GPU)."""
    # MLX's Device shows its index only in its repr: "Device(gpu, 0)"
    match = re.fullmatch(r"Device\(gpu, (\d+)\)", str(mx.default_device()))
    index = int(match.group(1)) if match else 0
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, count = ctypes.c_int(), ctypes.c_int()
    if (driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), index) != 0
            or driver.cuDeviceGetAttribute(ctypes.byref(count), _MULTIPROCESSOR_COUNT, device) != 0):
        return None
    return count.value if count.value > 0 else None


class Implementation(NamedTuple):
    function: Callable
    path: str  # "kernel" or "reference"
    reason: str


def choose(
    op_name: str,
    reference: Callable,
    cuda_kernel: Callable,
    switch: str,
    unsupported_reason: Optional[Callable[[], Optional[str]]],
    metal: Optional[tuple] = None,
) -> Implementation:
    """The backend's kernel where its switch is on and `unsupported_reason()` (None: no experts to
    check) finds nothing; the reference otherwise, with the reason. CUDA: `cuda_kernel` under
    `switch`; Metal: `metal` = (kernel, switch), if the op has a Metal kernel."""
    backend = current_backend()
    if backend == "cpu":
        return Implementation(reference, "reference", "CPU: the pure-MLX reference is the implementation")
    if backend == "metal" and metal is not None:
        kernel, switch = metal
        if not flag(switch):
            return Implementation(reference, "reference", f"the Metal {op_name} kernel is not verified on Apple hardware "
                                  f"yet and is off unless {switch}=1")
    elif backend != "cuda":
        return Implementation(reference, "reference", f"no {backend} kernel for {op_name}")
    else:
        kernel = cuda_kernel
        if not flag(switch):
            return Implementation(reference, "reference", f"the CUDA {op_name} kernel is switched off ({switch}=0)")
    reason = None if unsupported_reason is None else unsupported_reason()
    if reason is not None:
        return Implementation(reference, "reference", reason)
    return Implementation(kernel, "kernel", f"{'CUDA' if backend == 'cuda' else 'Metal'} {op_name} kernel")
