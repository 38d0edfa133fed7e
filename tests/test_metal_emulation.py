"""The Metal decode kernel (kernels/metal/moe_decode.metal), run on a CPU through
tests/metal_emulation.py: against the float32 oracle of its pure-MLX reference (the launches
moe_decode plans for Metal: grids, template constants, inputs; the kernel's arithmetic, indexing,
activations and combine), and in every zoo model with the package behaving as on a Mac with the
kernel switched on (greedy-token parity as tests/parity/test_greedy_tokens.py checks a kernel).
Not a Metal compile and not Apple hardware (see the emulation's docstring): the GPU tests in
tests/parity stay the check to run on a Mac."""

import sys

import mlx.core as mx
import pytest

import mlx_moe_fix
from mlx_moe_fix import zoo
from mlx_moe_fix.kernels import moe_decode_reference
from mlx_moe_fix.kernels.sources import sections

from .metal_emulation import CXX, EmulatedMetalKernel
from .parity.cases import make_case
from .parity.test_greedy_tokens import MOE_LAYER, N_TOKENS, assert_tokens_match_stock, record_stock_run
from .parity.test_ops import assert_kernel_reads_every_fp4_code, check, float32_oracle
from .parity.tolerance import references_only

DECODE = sys.modules["mlx_moe_fix.kernels.moe_decode"]  # the package's name is the dispatcher's

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++) to emulate the Metal kernels with")

# make_case's arguments (dtype, quantization, glu, activation, limit, scaled, dims, hidden,
# experts, top_k, batch, tokens) and keywords: each activation, both bit widths and every group
# size, the clamp stage binding, additive biases, Inkling's per-expert scales, per-pair outputs
# and the weighted combine, a top-k that does not divide the down's 4 simdgroups, and top-k 8
# (two pairs a simdgroup); mxfp4 and nvfp4 experts against each activation dtype; DeepSeek-V4.1's,
# Step-3.5's, Kimi-VL's, Gemma 4's, Kimi-K3's and Nemotron-H's activations.
CASES = {
    "bf16 4-bit/64 swiglu combined": ((mx.bfloat16, (4, 64), True, "swiglu", 50.0, False, 128, 64, 8, 2, 1, 2),
                                      {"with_weights": True}),
    "fp16 8-bit/32 limited swiglu (binding) per pair": ((mx.float16, (8, 32), True, "swiglu_limited", 0.25, False, 96, 64,
                                                         4, 2, 1, 2), {}),
    "fp32 4-bit/128 gpt-oss swiglu with biases combined": ((mx.float32, (4, 128), True, "swiglu_oai", 7.0, False, 256, 128,
                                                            4, 3, 1, 2), {"with_weights": True, "bias": True}),
    "bf16 8-bit/128 gelu (SwitchMLP) combined": ((mx.bfloat16, (8, 128), False, "gelu", 50.0, False, 128, 128, 5, 2, 2, 1),
                                                  {"with_weights": True}),
    "bf16 4-bit/32 Inkling scales combined": ((mx.bfloat16, (4, 32), True, "swiglu", 50.0, True, 64, 64, 4, 2, 1, 2),
                                              {"with_weights": True}),
    "fp16 4-bit/64 gelu fast per pair": ((mx.float16, (4, 64), False, "gelu_fast", 50.0, False, 64, 128, 3, 1, 1, 3), {}),
    "fp32 8-bit/64 gelu approx top-3 combined": ((mx.float32, (8, 64), False, "gelu_approx", 50.0, False, 64, 64, 6, 3, 1, 2),
                                                  {"with_weights": True}),
    "bf16 4-bit/64 swiglu top-8 combined": ((mx.bfloat16, (4, 64), True, "swiglu", 50.0, False, 64, 64, 8, 8, 1, 1),
                                             {"with_weights": True, "seed": 5}),
    "bf16 mxfp4 gpt-oss swiglu with biases combined": ((mx.bfloat16, (4, 32, "mxfp4"), True, "swiglu_oai", 7.0, False, 128,
                                                        64, 8, 2, 1, 2), {"with_weights": True, "bias": True}),
    "fp16 nvfp4 swiglu Inkling scales per pair": ((mx.float16, (4, 16, "nvfp4"), True, "swiglu", 50.0, True, 64, 96, 4, 2,
                                                   1, 2), {}),
    "fp32 mxfp4 gelu (SwitchMLP) top-3 combined": ((mx.float32, (4, 32, "mxfp4"), False, "gelu", 50.0, False, 96, 64, 6, 3,
                                                    1, 2), {"with_weights": True}),
    "bf16 nvfp4 swiglu top-8 combined": ((mx.bfloat16, (4, 16, "nvfp4"), True, "swiglu", 50.0, False, 64, 64, 8, 8, 1, 1),
                                         {"with_weights": True, "seed": 3}),
    "bf16 4-bit/64 DeepSeek-V4.1 swiglu (binding) combined": ((mx.bfloat16, (4, 64), True, "swiglu_fp32_limited", 0.25,
                                                               False, 128, 64, 8, 2, 1, 2), {"with_weights": True}),
    "fp16 4-bit/64 Step-3.5 clamped silu (binding) per pair": ((mx.float16, (4, 64), True, "swiglu_clamped_silu", 0.25,
                                                                False, 128, 64, 8, 2, 1, 2), {}),
    "bf16 8-bit/64 Gemma 4 geglu combined": ((mx.bfloat16, (8, 64), True, "geglu_approx", 50.0, False, 128, 64, 8, 2, 1, 2),
                                             {"with_weights": True}),
    "bf16 4-bit/64 Nemotron-H relu2 (SwitchMLP) combined": ((mx.bfloat16, (4, 64), False, "relu2", 50.0, False, 128, 128, 8,
                                                              2, 1, 2), {"with_weights": True}),
    "fp16 4-bit/64 Kimi-VL capped silu per pair": ((mx.float16, (4, 64), True, "swiglu_capped_silu", 50.0, False, 128, 64, 8,
                                                    2, 1, 2), {}),
    "fp32 4-bit/32 Kimi-K3 situ (binding) combined": ((mx.float32, (4, 32), True, "situ", 0.25, False, 128, 64, 8, 2, 1, 2),
                                                      {"with_weights": True}),
}


@pytest.fixture
def emulated_metal(monkeypatch):
    """moe_decode's kernels as on a Metal device, each the emulated kernel of its Metal section."""

    def emulated_kernel_object(filename, section, input_names, output_names):
        source = sections("metal", filename)
        return EmulatedMetalKernel(input_names, output_names, source[section], source["header"])

    monkeypatch.setattr(DECODE, "metal_kernel_object", emulated_kernel_object)
    monkeypatch.setattr(DECODE, "current_backend", lambda: "metal")


@pytest.mark.parametrize("name", CASES)
def test_emulated_metal_decode_kernel_matches_ref(emulated_metal, name):
    arguments, keywords = CASES[name]
    case = make_case(*arguments, **keywords)
    assert DECODE.cuda_unsupported_reason(case.experts, case.dtype) is None
    check(DECODE.moe_decode_kernel, case, float32_oracle(moe_decode_reference, case))


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_emulated_metal_decode_kernel_reads_every_fp4_code_and_scale_exactly(emulated_metal, mode):
    # tests/parity/test_ops.py's check of the CUDA kernels: one-hot activation rows read each
    # weight out of the kernel unrounded (Metal's loop: twice the code's value times half the
    # scale, in fp32), against every activation dtype it takes.
    assert_kernel_reads_every_fp4_code(DECODE, "moe_decode", mode, (mx.bfloat16, mx.float16, mx.float32))


def test_the_emulation_finds_a_wrong_metal_kernel(emulated_metal, monkeypatch):
    # The same check on a kernel whose activation takes gate and up the wrong way round must fail:
    # the emulated runs above test the Metal source, not only the launches around it.
    right = "activate<T>(d.act, d.has_limit, up, gate, params[0], params[1])"

    def swapped_kernel_object(filename, section, input_names, output_names):
        source = sections("metal", filename)
        assert right in source["header"]
        header = source["header"].replace(right, "activate<T>(d.act, d.has_limit, gate, up, params[0], params[1])")
        return EmulatedMetalKernel(input_names, output_names, source[section], header)

    monkeypatch.setattr(DECODE, "metal_kernel_object", swapped_kernel_object)
    arguments, keywords = CASES["bf16 4-bit/64 swiglu combined"]
    case = make_case(*arguments, **keywords)
    with pytest.raises(AssertionError, match="relative error"):
        check(DECODE.moe_decode_kernel, case, float32_oracle(moe_decode_reference, case))


@pytest.fixture
def emulated_metal_backend(emulated_metal, monkeypatch, switch):
    """The whole package as on a Mac with the Metal decode kernel switched on: every module's
    current_backend() says "metal", the decode kernel is the emulated one, the other ops run
    their references (they have no Metal kernel) and Inkling's routing is upstream's."""
    backend = sys.modules["mlx_moe_fix.kernels.backend"]
    original = backend.current_backend
    for module in [m for name, m in sys.modules.items() if name.startswith("mlx_moe_fix")]:
        if getattr(module, "current_backend", None) is original:
            monkeypatch.setattr(module, "current_backend", lambda: "metal")
    switch(DECODE.METAL_KERNEL_SWITCH, "1")


@pytest.mark.parametrize("family, experts_mode", [(family, "affine") for family in zoo.FAMILIES]
                         + [("gpt_oss", "mxfp4"), ("inkling", "nvfp4")])
def test_emulated_metal_greedy_tokens_match_stock(emulated_metal_backend, family, experts_mode):
    # tests/parity/test_greedy_tokens.py's check (teacher-forced, as for any kernel that sums in
    # another order than stock), in float32 as the CPU runs stock; its decode calls must have
    # reached the emulated kernel. gpt-oss's and Inkling's experts also as their checkpoints ship.
    model = zoo.build(family, 4, experts_mode=experts_mode)
    prompt = zoo.prompt_for(family)
    stock = record_stock_run(model, prompt, N_TOKENS // 4, teacher_forced=True)  # each step ~0.3 s of emulation
    assert mlx_moe_fix.status()["ops"]["moe_decode"]["path"] == "kernel" and not references_only()
    mlx_moe_fix.reset_path_counts()
    assert_tokens_match_stock(model, prompt, stock, False, mx.float32)
    layer = MOE_LAYER.get(family, "SwitchGLU")
    assert ("decode", "kernel") in {(r.phase, r.path) for r in mlx_moe_fix.path_counts() if r.layer == layer}
