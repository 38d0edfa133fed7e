"""The CUDA decode kernel (kernels/cuda/moe_decode.cu), run on a CPU through tests/cuda_emulation.py:
the launches moe_decode plans for CUDA (grids, template constants, source constants, inputs, the
dynamic shared memory of the split activation rows) and the kernel's arithmetic, indexing, fixed-
point GEMV, FP4 reads, activations and combine, against the float32 oracle of its pure-MLX
reference, on the cases tests/test_metal_emulation.py gives the Metal kernel. Not NVRTC and not a
GPU (see the emulation's docstring): tests/parity's GPU tests stay the check on an NVIDIA GPU;
this one lets a machine without one check a change to the CUDA source's logic."""

import sys

import mlx.core as mx
import pytest

from mlx_moe_fix.kernels import moe_decode_reference
from mlx_moe_fix.kernels.experts import FP4_GROUP_SIZES
from mlx_moe_fix.kernels.sources import sections

from .cuda_emulation import EmulatedCudaKernel
from .metal_emulation import CXX
from .parity.cases import make_case
from .parity.test_ops import check, every_fp4_code, float32_oracle
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
    moe, expected, in_dim = every_fp4_code(mode)
    for dtype in (mx.bfloat16, mx.float16):
        assert DECODE.cuda_unsupported_reason(moe, dtype) is None
        out = DECODE.moe_decode_kernel(mx.eye(in_dim, dtype=dtype), mx.ones((in_dim, 1), dtype=mx.uint32), moe)[:, 0, :]
        assert mx.array_equal(out, expected.astype(dtype)).item(), (dtype, mx.abs(out.astype(mx.float32) - expected).max())


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
