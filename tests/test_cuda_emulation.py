"""The CUDA decode and router kernels (kernels/cuda/moe_decode.cu, moe_router.cu), run on a CPU
through tests/cuda_emulation.py. The decode kernel: the launches moe_decode plans for CUDA (grids,
template constants, source constants, inputs, the dynamic shared memory of the split activation
rows) and the kernel's arithmetic, indexing, fixed-point GEMV, FP4 reads, activations and combine,
against the float32 oracle of its pure-MLX reference, on the cases tests/test_metal_emulation.py
gives the Metal kernel. The router kernel: its routings (mlx-lm's softmax ones, Inkling's sigmoid,
DeepSeek-V4's sqrt-softplus) against the reference's experts and weights. Not NVRTC and not a GPU
(see the emulation's docstring): tests/parity's GPU tests stay the check on an NVIDIA GPU; these
let a machine without one check a change to the CUDA sources' logic."""

import sys

import mlx.core as mx
import pytest

from mlx_moe_fix.kernels import moe_decode_reference, moe_router_reference
from mlx_moe_fix.kernels.experts import FP4_GROUP_SIZES
from mlx_moe_fix.kernels.moe_router import Routing
from mlx_moe_fix.kernels.sources import sections

from .cuda_emulation import EmulatedCudaKernel
from .metal_emulation import CXX
from .parity.cases import make_case
from .parity.test_ops import assert_kernel_reads_every_fp4_code, check, float32_oracle
from .parity.tolerance import assert_close
from .test_metal_emulation import CASES

DECODE = sys.modules["mlx_moe_fix.kernels.moe_decode"]  # the package's name is the dispatcher's

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++) to emulate the CUDA kernels with")

# The CUDA GEMV reads FP4 experts against bf16 / fp16 activations only (float32 ones go to
# upstream's code, test_ops checks the reason).
CUDA_CASES = {name: case for name, case in CASES.items()
              if not (case[0][0] == mx.float32 and len(case[0][1]) == 3 and case[0][1][2] in FP4_GROUP_SIZES)}


def emulated_kernel(header_edit=lambda header: header):
    """A stand-in for launch.cuda_kernel_object: the emulated kernel of a CUDA section, its header
    passed through `header_edit`."""

    def kernel_object(filename, section, input_names, output_names, shared_bytes, bounds=(), constants=()):
        source = sections("cuda", filename)
        declared = {constant.name for constant in constants}
        return EmulatedCudaKernel([name for name in input_names if name not in declared], output_names,
                                  "".join(constant.declaration() for constant in constants) + source[section],
                                  header_edit(source["header"]), shared_bytes)

    return kernel_object


@pytest.fixture
def emulated_cuda(monkeypatch):
    """moe_decode's kernels as on a CUDA device, each the emulated kernel of its CUDA section."""
    monkeypatch.setattr(DECODE, "cuda_kernel_object", emulated_kernel())
    monkeypatch.setattr(DECODE, "current_backend", lambda: "cuda")


@pytest.mark.parametrize("name", CUDA_CASES)
def test_emulated_cuda_decode_kernel_matches_ref(emulated_cuda, name):
    arguments, keywords = CUDA_CASES[name]
    case = make_case(*arguments, **keywords)
    assert DECODE.cuda_unsupported_reason(case.experts, case.dtype) is None
    check(DECODE.moe_decode_kernel, case, float32_oracle(moe_decode_reference, case))


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_emulated_cuda_decode_kernel_reads_every_fp4_code_and_scale_exactly(emulated_cuda, mode):
    # test_ops' GPU check on the emulation: one-hot activation rows read each weight out of the
    # GEMV unrounded (codes summed as signed bytes of twice their values, PRMT lookups)
    assert_kernel_reads_every_fp4_code(DECODE, "moe_decode", mode, (mx.bfloat16, mx.float16))


def test_the_emulation_finds_a_wrong_cuda_kernel(monkeypatch):
    # The same check on a kernel whose activation takes gate and up the wrong way round must fail:
    # the emulated runs above test the CUDA source, not only the launches around it.
    right = "activate<T>(d.act, d.has_limit, up, gate, params[0], params[1])"
    wrong = "activate<T>(d.act, d.has_limit, gate, up, params[0], params[1])"

    def swapped(header):
        assert right in header
        return header.replace(right, wrong)

    monkeypatch.setattr(DECODE, "cuda_kernel_object", emulated_kernel(swapped))
    monkeypatch.setattr(DECODE, "current_backend", lambda: "cuda")
    arguments, keywords = CASES["bf16 4-bit/64 swiglu combined"]
    case = make_case(*arguments, **keywords)
    with pytest.raises(AssertionError, match="relative error"):
        check(DECODE.moe_decode_kernel, case, float32_oracle(moe_decode_reference, case))


ROUTER = sys.modules["mlx_moe_fix.kernels.moe_router"]  # the package's name is the dispatcher's
ROUTINGS = {
    "softmax then top-2": (Routing("softmax_topk", 2), ()),
    "softmax then top-8, normalised": (Routing("softmax_topk", 8, True), ()),
    "top-4 then softmax": (Routing("topk_softmax", 4), ()),
    "top-2 then softmax, last k": (Routing("topk_softmax_last", 2), ()),
    "Inkling's sigmoid top-4, a shared expert": (Routing("sigmoid_topk", 4, shared=1, shared_width=3, scale=2.5),
                                                 ("correction", "global_scale")),
    "DeepSeek-V4's sqrt-softplus top-6": (Routing("sqrtsoftplus_topk", 6, normalize=True, scale=1.5), ("correction",)),
}


def by_expert(indices, weights):
    """A token's experts in index order with their weights: MLX's CPU argpartition orders a top-k
    otherwise than its CUDA one, which the kernel reproduces (the GPU test compares the order)."""
    order = mx.argsort(indices.astype(mx.int32), axis=-1)
    return mx.take_along_axis(indices.astype(mx.uint32), order, -1), mx.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("name", ROUTINGS)
def test_emulated_cuda_router_kernel_matches_ref(monkeypatch, name, dtype):
    monkeypatch.setattr(ROUTER, "cuda_kernel_object", emulated_kernel())
    monkeypatch.setattr(ROUTER, "current_backend", lambda: "cuda")
    routing, extras = ROUTINGS[name]
    experts = 64
    logits = mx.random.normal((5, experts + routing.shared), key=mx.random.key(7)).astype(dtype)
    arrays = {"correction": 0.2 * mx.random.normal((experts,), key=mx.random.key(8)),
              "global_scale": mx.array([0.75], mx.float32)}
    assert ROUTER.cuda_unsupported_reason(logits.dtype, logits.shape[-1], routing) is None
    out = ROUTER.moe_router_kernel(logits, routing, *(arrays[e] for e in extras))
    expected = moe_router_reference(logits, routing, *(arrays[e] for e in extras))
    (indices, weights), (expected_indices, expected_weights) = by_expert(*out[:2]), by_expert(*expected[:2])
    assert indices.tolist() == expected_indices.tolist()
    for got, ref in zip((weights, *out[2:]), (expected_weights, *expected[2:])):
        assert got.dtype == ref.dtype
        assert_close(got, ref, dtype)
