"""The CUDA kernels' activation (`moe_common::activate` in kernels/cuda/common.cuh, which both the
decode GEMV's and the prefill GEMM's epilogues call), compiled as host C++ (g++ or clang++) with
tests/metal_emulation.py's bf16 / fp16 types, which round as the GPU does, and run on a CPU for
every activation code: against the references' activation (stock's own ops) on values of each
16-bit dtype and float32, clamps binding and not. It checks the source's arithmetic and rounding
points on any machine; the GPU tests check the kernels that call it."""

import ctypes
import hashlib
import re
import subprocess
from importlib import resources

import mlx.core as mx
import numpy as np
import pytest

from mlx_moe_fix.kernels.experts import Activation
from mlx_moe_fix.kernels.launch import ACTIVATION_CODES
from mlx_moe_fix.kernels.reference import activate

from .metal_emulation import CXX, SHIM
from .parity.tolerance import relative_error

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++) to build the CUDA activation with")

# Host stand-ins for what the extracted functions use of CUDA.
HOST = r"""
#define __device__
#define __forceinline__ inline
using __nv_bfloat16 = bfloat16_t;
using __half = float16_t;
"""

RUNNER = r"""
template <typename T>
void run_as(int act, bool has_limit, const float* up, const float* gate, float limit, float alpha, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<T>(moe_common::activate<T>(act, has_limit, up[i], gate[i], limit, alpha)));
}
extern "C" void run(int dtype, int act, int has_limit, const float* up, const float* gate, float limit, float alpha, float* out, int n) {
  if (dtype == 0) run_as<bfloat16_t>(act, has_limit, up, gate, limit, alpha, out, n);
  else if (dtype == 1) run_as<float16_t>(act, has_limit, up, gate, limit, alpha, out, n);
  else run_as<float>(act, has_limit, up, gate, limit, alpha, out, n);
}
"""
DTYPES = {mx.bfloat16: 0, mx.float16: 1, mx.float32: 2}
# ‖cuda - reference‖ / ‖reference‖ over a test's 4096 values: about half a unit in the last place
# of bf16 / a quarter of fp16's; a formula off by 1% exceeds them.
ELEMENTWISE_TOLERANCE = {mx.bfloat16: 4e-3, mx.float16: 1e-3, mx.float32: 2e-7}


def function_source(text: str, name: str) -> str:
    """The definition of `name` in `text`: from its template line (if any) to its closing brace."""
    start = re.search(rf"(template <typename T>\n)?__device__ __forceinline__ \w+ {name}\(", text).start()
    depth, i = 0, text.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
        if depth == 0:
            return text[start:i]


@pytest.fixture(scope="module")
def cuda_activate(tmp_path_factory):
    common = resources.files("mlx_moe_fix.kernels").joinpath("cuda/common.cuh").read_text()
    functions = "\n".join(function_source(common, f) for f in ("rnd", "sigmoid", "silu", "gelu_tanh", "activate"))
    source = SHIM + HOST + "namespace moe_common {\n" + functions + "\n}\n" + RUNNER
    path = str(tmp_path_factory.mktemp("cuda-activation") / hashlib.sha256(source.encode()).hexdigest()[:16])
    with open(f"{path}.cc", "w") as f:
        f.write(source)
    built = subprocess.run([CXX, "-std=c++20", "-O1", "-shared", "-fPIC", f"{path}.cc", "-o", f"{path}.so"],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
    library = ctypes.CDLL(f"{path}.so")
    library.run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                            ctypes.c_float, ctypes.c_void_p, ctypes.c_int]

    def run(activation: Activation, up: mx.array, gate: mx.array) -> mx.array:
        up32, gate32 = (np.ascontiguousarray(np.array(a.astype(mx.float32))) for a in (up, gate))
        out = np.empty_like(up32)
        library.run(DTYPES[up.dtype], ACTIVATION_CODES[activation.kind], int(activation.limit is not None), up32.ctypes.data,
                    gate32.ctypes.data, activation.limit or 0.0, activation.alpha or 0.0, out.ctypes.data, out.size)
        return mx.array(out)

    return run


ACTIVATIONS = [Activation("swiglu"), Activation("swiglu", limit=0.75), Activation("swiglu_oai", limit=0.75, alpha=1.702),
               Activation("swiglu_fp32"), Activation("swiglu_fp32", limit=0.75), Activation("swiglu_clamped_silu", limit=0.75), Activation("swiglu_capped_silu", limit=0.75),
               Activation("geglu_approx"), Activation("situ", alpha=2.0), Activation("situ", limit=0.75, alpha=2.0),
               Activation("gelu"), Activation("gelu_approx"), Activation("gelu_fast"), Activation("relu2")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: f"{a.kind}-{a.limit}")
def test_cuda_activation_matches_the_reference(cuda_activate, activation, dtype):
    # Values across the clamps (limit 0.75 binds for about half of them) and the activations'
    # curved ranges. The kernels' sigmoid, tanh and erf are not MLX's, and where stock rounds
    # between ops a 1-ulp difference carries on: measured 0 (the float32 kinds at 16 bits) to
    # 1.3e-3 (bf16), 2.8e-4 (fp16), 6e-8 (fp32) of the outputs' norm.
    mx.random.seed(0)
    up, gate = (3.0 * mx.random.normal((4096,))).astype(dtype), (3.0 * mx.random.normal((4096,))).astype(dtype)
    expected = activate(activation, up, gate if activation.gated else None).astype(mx.float32)
    got = cuda_activate(activation, up, gate)
    error = relative_error(got, expected)
    assert error <= ELEMENTWISE_TOLERANCE[dtype], f"{activation} {dtype}: relative error {error:.3g}"
