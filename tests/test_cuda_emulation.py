"""The CUDA decode, router, routed decode and grouped prefill kernels (kernels/cuda/moe_decode.cu,
moe_router.cu, moe_routed_decode.cu, moe_prefill.cu), run on a CPU through tests/cuda_emulation.py.
The decode kernel: the launches moe_decode plans for CUDA (grids, template constants, source
constants, inputs, the dynamic shared memory of the split activation rows) and the kernel's
arithmetic, indexing, fixed-point GEMV, FP4 reads, activations and combine, against the float32
oracle of its pure-MLX reference, on the cases tests/test_metal_emulation.py gives the Metal kernel.
The router kernel: its routings (mlx-lm's softmax ones, Inkling's sigmoid, DeepSeek-V4's
sqrt-softplus) against the reference's experts and weights. The routed decode kernels: the routing
inside the gate+up launch, the router's logits computed there too (router_gate_up's bf16x2 matmul)
and Inkling's block with its shared experts, each against the router and decode kernels apart, bit
for bit, as on the GPU. The grouped prefill: its routing, GEMM (gate+up with the activation on
mma.sync and on wgmma, down) and combine against the float32 oracle, at every tile height. Then the
zoo's families greedy with the whole package as on an H200. Not NVRTC and not a GPU (see the
emulation's docstring): tests/parity's GPU tests stay the check on an NVIDIA GPU; these let a
machine without one check a change to the CUDA sources' logic and the patches' CUDA paths."""

import dataclasses
import os
import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_moe_fix
from mlx_moe_fix import zoo

from mlx_moe_fix.kernels import moe_decode_reference, moe_prefill_reference, moe_router_reference
from mlx_moe_fix.kernels.experts import FP4_GROUP_SIZES
from mlx_moe_fix.kernels.experts import MoEExperts, RouterLinear
from mlx_moe_fix.kernels.moe_router import Routing
from mlx_moe_fix.kernels.sources import sections

from .cuda_emulation import EmulatedCudaKernel
from . import metal_emulation
from .metal_emulation import CXX
from .parity.cases import GATED_KINDS, describe, make_case
from .parity.test_greedy_tokens import N_TOKENS, assert_tokens_match_stock, record_stock_run
from .parity.test_ops import assert_kernel_reads_every_fp4_code, check, float32_oracle
from .parity.test_routing import assert_routes, most_tiles_routing
from .parity.tolerance import assert_close, relative_error
from .test_metal_emulation import CASES

# the package's names are the dispatchers'
DECODE = sys.modules["mlx_moe_fix.kernels.moe_decode"]
ROUTER = sys.modules["mlx_moe_fix.kernels.moe_router"]
ROUTED = sys.modules["mlx_moe_fix.kernels.moe_routed_decode"]
PREFILL = sys.modules["mlx_moe_fix.kernels.moe_prefill"]
BACKEND = sys.modules["mlx_moe_fix.kernels.backend"]
CURRENT_BACKEND = BACKEND.current_backend  # the function every module imported, before any test patches it

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++) to emulate the CUDA kernels with")

# The CUDA GEMV reads FP4 experts against bf16 / fp16 activations only (float32 ones go to
# upstream's code, test_ops checks the reason).
CUDA_CASES = {name: case for name, case in CASES.items()
              if not (case[0][0] == mx.float32 and len(case[0][1]) == 3 and case[0][1][2] in FP4_GROUP_SIZES)}


def emulated_kernel(header_edit=lambda header: header, section_edit=lambda section: section):
    """A stand-in for launch.cuda_kernel_object: the emulated kernel of a CUDA section, its header
    passed through `header_edit` and its own source through `section_edit`."""

    def kernel_object(filename, section, input_names, output_names, shared_bytes, bounds=(), constants=()):
        source = sections("cuda", filename)
        declared = {constant.name for constant in constants}
        return EmulatedCudaKernel([name for name in input_names if name not in declared], output_names,
                                  "".join(constant.declaration() for constant in constants) + section_edit(source[section]),
                                  header_edit(source["header"]), shared_bytes)

    return kernel_object


@pytest.fixture
def emulated_cuda_kernels(monkeypatch):
    """Every CUDA kernel emulated (decode, router, routed decode, the grouped prefill's GEMM,
    routing and combine), as on an sm_90 GPU of 132 SMs (the fused router sizes its waves by them);
    the prefill's gate+up on mma.sync unless a test takes wgmma."""
    for module in (DECODE, ROUTER, ROUTED, PREFILL):
        monkeypatch.setattr(module, "cuda_kernel_object", emulated_kernel())
    for module in (DECODE, ROUTER, ROUTED, BACKEND):
        monkeypatch.setattr(module, "current_backend", lambda: "cuda")
    monkeypatch.setattr(ROUTED, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(ROUTED, "multiprocessor_count", lambda: 132)
    monkeypatch.setattr(PREFILL, "wgmma_device", lambda: False)


@pytest.mark.parametrize("name", CUDA_CASES)
def test_emulated_cuda_decode_kernel_matches_ref(emulated_cuda_kernels, name):
    arguments, keywords = CUDA_CASES[name]
    case = make_case(*arguments, **keywords)
    assert DECODE.cuda_unsupported_reason(case.experts, case.dtype) is None
    check(DECODE.moe_decode_kernel, case, float32_oracle(moe_decode_reference, case))


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_emulated_cuda_decode_kernel_reads_every_fp4_code_and_scale_exactly(emulated_cuda_kernels, mode):
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


# The grouped prefill (route, the GEMM's gate+up and down launches, combine) at every tile height,
# both activation types, 4- and 8-bit weights (the fp32 dequantisation of 8-bit against bf16 as
# well as the two-lane one), groups 16-128, ragged, empty and one-expert runs, the clamp binding,
# biases, Inkling's per-expert scales, FP4 experts and widths that leave blocks part-filled:
# (dtype, quantization, glu, kind, limit, scaled, tokens, routing, bias, tile height the kernel
# must pick), by default 8 experts top-2 of 256 x 256 (four k-steps: the three-stage pipeline
# wraps). Small: each emulated mma.sync / wgmma is a meeting of its warp's 32 threads.
PREFILL_CASES = {
    "bf16 4-bit/64 swiglu, 64-row tiles": (mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 130, "random", False, 64),
    "fp16 8-bit/32 gpt-oss swiglu biased, one expert": (mx.float16, (8, 32), True, "swiglu_oai", 7.0, False, 40, "one_expert",
                                                        True, 32),
    "fp16 4-bit/128 gelu_approx mlp, empty experts": (mx.float16, (4, 128), False, "gelu_approx", 0.25, False, 100, "few_experts",
                                                      False, 32),
    "fp16 4-bit/64 geglu_approx, 32-row tiles": (mx.float16, (4, 64), True, "geglu_approx", 0.25, False, 40, "random", False, 32),
    "bf16 8-bit/64 clamped swiglu binding, biased": (mx.bfloat16, (8, 64), True, "swiglu_limited", 0.25, False, 20, "random", True,
                                                     16),
    "bf16 4-bit/32 Inkling scales": (mx.bfloat16, (4, 32), True, "swiglu", 0.25, True, 20, "random", False, 16),
    "bf16 mxfp4 gpt-oss swiglu biased": (mx.bfloat16, (4, 32, "mxfp4"), True, "swiglu_oai", 7.0, False, 20, "random", True, 16),
    "bf16 nvfp4 Inkling scales, 64-row tiles": (mx.bfloat16, (4, 16, "nvfp4"), True, "swiglu", 7.0, True, 130, "random", False, 64),
    "bf16 4-bit/64 swiglu, ragged widths": (mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 23, "random", False, 32),
    "bf16 4-bit/32 swiglu, scale windows reloaded": (mx.bfloat16, (4, 32), True, "swiglu", 0.25, False, 20, "random", False, 32),
    "fp16 4-bit/64 swiglu, scale windows reloaded": (mx.float16, (4, 64), True, "swiglu", 0.25, False, 20, "random", False, 32),
    "bf16 mxfp4 swiglu biased, scale windows reloaded": (mx.bfloat16, (4, 32, "mxfp4"), True, "swiglu_oai", 7.0, False, 20, "random",
                                                          True, 32),
}
# (hidden, intermediate, experts, top-k, batch) where not (256, 256, 8, 2, 1): 448 = seven k-steps of
# gate+up (wgmma's five-stage pipeline wraps) and 3.5 column blocks of down, 192 = 1.5 of gate+up,
# 5 experts top-3 over two batch rows. Its rows of seven groups (14 bytes of bf16 scales) are not
# whole 4-byte words: wgmma loads their scales a group a k-step. 640 = ten k-steps: wgmma's scale
# windows (16 bytes of a row's scales: 4 to 8 k-steps) reloaded, the last one past the row's end.
WINDOWS_RELOADED = (640, 192, 5, 3, 1)
PREFILL_SHAPES = {"bf16 4-bit/64 swiglu, ragged widths": (448, 192, 5, 3, 2),
                  **{name: WINDOWS_RELOADED for name in PREFILL_CASES if name.endswith("scale windows reloaded")}}


def prefill_case(name):
    dtype, quantization, glu, kind, limit, scaled, tokens, routing, bias, tile = PREFILL_CASES[name]
    hidden, intermediate, experts, top_k, batch = PREFILL_SHAPES.get(name, (256, 256, 8, 2, 1))
    case = make_case(dtype, quantization, glu, kind, limit, scaled, hidden, intermediate, experts, top_k, batch, tokens,
                     routing=routing, with_weights=True, bias=bias)
    if quantization[2:] == ("mxfp4",) and name.endswith("scale windows reloaded"):
        # mx.quantize gives these normal weights one e8m0 scale (120) in every group: varied ones
        # make a scale read from the wrong group show
        for module in (case.layer[projection] for projection in ("gate_proj", "up_proj", "down_proj")):
            module.scales = mx.random.randint(118, 123, module.scales.shape).astype(mx.uint8)
        case = dataclasses.replace(case, experts=describe(case.layer, glu, scaled))
    assert PREFILL.cuda_unsupported_reason(case.experts, dtype) is None
    assert PREFILL.tile_height(case.indices.size, experts) == tile
    return case


def take_wgmma(patch, wgmma: bool, rows: int = 128) -> None:
    """Gate+up of 4-bit gated experts on wgmma (`wgmma`) or mma.sync, at any tile height, wgmma's
    blocks of `rows` weight rows (moe_prefill.wgmma_block_rows: these cases' widths take 128;
    256 where set) (as tests/parity/test_ops.py's prefill_gemm, for the GPU)."""
    patch.setattr(PREFILL, "wgmma_device", lambda: wgmma)
    patch.setattr(PREFILL, "wgmma_min_tile", lambda experts, stage: 0)
    if rows == 256:
        patch.setattr(PREFILL, "WGMMA_WIDE_MIN_K", 0)


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_emulated_cuda_prefill_kernel_matches_ref(emulated_cuda_kernels, name):
    case = prefill_case(name)
    check(PREFILL.moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


@pytest.mark.parametrize("chunk_offset", ["taken", "left out"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_experts=st.integers(1, 40), pairs=st.integers(65, 300), seed=st.integers(0, 2**16),
       tile=st.sampled_from(PREFILL.TILES))
def test_emulated_cuda_route_kernel_routes_in_many_blocks(monkeypatch, chunk_offset, num_experts, pairs, seed, tile):
    # test_routing's GPU check on the emulation, every block scattering its 64 pairs, the outputs
    # zero-filled first: the kernel writes the -1 of padding rows and unused tiles itself. A block
    # that leaves out the pairs before its chunk puts its pairs over another block's, and must fail.
    edit = ((lambda section: section) if chunk_offset == "taken"
            else lambda section: section.replace("start[e] + before[e] + atomicAdd", "start[e] + atomicAdd"))
    monkeypatch.setattr(PREFILL, "cuda_kernel_object", emulated_kernel(section_edit=edit))
    monkeypatch.setattr(PREFILL, "ROUTE_PAIRS_PER_BLOCK", 64)
    monkeypatch.setattr(metal_emulation, "OUTPUT_FILL_BYTE", 0)
    experts = np.random.default_rng(seed).integers(0, num_experts, pairs).astype(np.uint32)
    experts[64] = experts[0]  # an expert in two blocks' chunks
    routing = PREFILL.route_kernel(mx.array(experts), num_experts, tile)
    if chunk_offset == "taken":
        assert_routes(experts, num_experts, tile, *routing)
    else:
        with pytest.raises(AssertionError, match="every pair exactly once"):
            assert_routes(experts, num_experts, tile, *routing)


@pytest.mark.parametrize("num_experts, pairs, tile", [(256, 128, 16), (40, 100, 64), (8, 300, 32)])
def test_emulated_cuda_route_kernel_fills_the_grid_in_its_worst_case(monkeypatch, num_experts, pairs, tile):
    # test_routing's worst case on the emulation, in blocks of 64 pairs: every tile of the grid used
    monkeypatch.setattr(PREFILL, "cuda_kernel_object", emulated_kernel())
    monkeypatch.setattr(PREFILL, "ROUTE_PAIRS_PER_BLOCK", 64)
    experts = most_tiles_routing(num_experts, pairs, tile)
    row_pair, tile_expert, tiles = PREFILL.route_kernel(mx.array(experts), num_experts, tile)
    assert_routes(experts, num_experts, tile, row_pair, tile_expert, tiles)
    assert (np.array(tile_expert) >= 0).all()


@pytest.mark.parametrize("name", ["bf16 8-bit/64 clamped swiglu binding, biased", "bf16 4-bit/64 swiglu, 64-row tiles"])
def test_emulated_cuda_prefill_kernel_matches_ref_on_one_projection(emulated_cuda_kernels, name):
    # A lone expert matmul (QuantizedSwitchLinear's: the GEMM's "only" launch, one output per
    # pair): the case's gate projection (with its bias where the case has one), no weights.
    case = prefill_case(name)
    case = dataclasses.replace(case, experts=MoEExperts(case.experts.projections[:1]), weights=None,
                               label=f"{case.label}, gate projection alone")
    assert PREFILL.cuda_unsupported_reason(case.experts, case.dtype) is None
    check(PREFILL.moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


@st.composite
def random_prefill_cases(draw):
    """A layer of random widths (multiples of 64 and of the group), experts, top-k, batch and
    tokens, in a quantization, activation and routing the kernel takes."""
    quantization = draw(st.sampled_from(((4, 64), (8, 32), (4, 128), (8, 64), (4, 32, "mxfp4"), (4, 16, "nvfp4"))))
    dtype = mx.bfloat16 if len(quantization) == 3 else draw(st.sampled_from((mx.bfloat16, mx.float16)))
    glu = draw(st.booleans())
    kind = draw(st.sampled_from(GATED_KINDS if glu else ("gelu", "gelu_approx", "gelu_fast", "relu2")))
    scaled = glu and kind == "swiglu" and draw(st.booleans())
    unit = max(64, quantization[1])
    num_experts = draw(st.sampled_from((1, 3, 8)))
    top_k = draw(st.integers(1, min(num_experts, 4)))
    return make_case(dtype, quantization, glu, kind, draw(st.sampled_from((0.25, 50.0))), scaled, unit * draw(st.integers(1, 4)),
                     unit * draw(st.integers(1, 3)), num_experts, top_k, draw(st.integers(1, 2)), draw(st.integers(1, 60)),
                     routing=draw(st.sampled_from(("random", "one_expert", "few_experts"))), with_weights=draw(st.booleans()),
                     seed=draw(st.integers(0, 2**16)), bias=not scaled and draw(st.booleans()))


# Each example compiles the kernel variants it reaches (a few seconds each): few examples.
@settings(max_examples=int(os.environ.get("MLX_MOE_FIX_EMULATED_EXAMPLES", "10")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=random_prefill_cases(), wgmma=st.booleans(), rows=st.sampled_from((128, 256)))
def test_emulated_cuda_prefill_kernel_matches_ref_on_random_layers(emulated_cuda_kernels, case, wgmma, rows):
    assert PREFILL.cuda_unsupported_reason(case.experts, case.dtype) is None, case.label
    with pytest.MonkeyPatch.context() as patch:
        take_wgmma(patch, wgmma, rows)
        check(PREFILL.moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


# The cases whose gate+up Hopper's wgmma takes (4-bit, gated), here at every tile height.
WGMMA_CASES = [name for name, case in PREFILL_CASES.items() if case[1][0] == 4 and case[2]]


@pytest.mark.parametrize("rows", [128, 256])
@pytest.mark.parametrize("name", WGMMA_CASES)
def test_emulated_cuda_prefill_kernel_matches_ref_with_wgmma(emulated_cuda_kernels, monkeypatch, name, rows):
    take_wgmma(monkeypatch, True, rows)
    case = prefill_case(name)
    tile = PREFILL_CASES[name][-1]
    assert PREFILL.gemm_kernel(case.experts, "first", tile) == PREFILL.gemm_kernel(case.experts, "last", tile) == "grouped_wgmma"
    assert PREFILL.block_n("grouped_wgmma", case.experts.projections[0].input_dims) == rows
    check(PREFILL.moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


@pytest.mark.parametrize("gate_up_bits, down_bits", [(4, 8), (8, 4)])
def test_emulated_cuda_prefill_kernel_matches_ref_with_mixed_widths(emulated_cuda_kernels, monkeypatch, gate_up_bits, down_bits):
    # gate+up and down of different bit widths (mixed-precision checkpoints): one GEMM on wgmma, the
    # other on mma.sync, the gate+up's rows reordered for the down only where the down reads them in
    # wgmma's k order (the 4-bit down after an 8-bit gate+up), plain rows for a down on mma.sync
    take_wgmma(monkeypatch, True)
    case = make_case(mx.bfloat16, (gate_up_bits, 64), True, "swiglu", 0.25, False, 256, 256, 8, 2, 1, 130, with_weights=True,
                     down_bits=down_bits)
    assert [p.bits for p in case.experts.projections] == [gate_up_bits, gate_up_bits, down_bits]
    assert PREFILL.cuda_unsupported_reason(case.experts, case.dtype) is None
    tile = PREFILL.tile_height(case.indices.size, 8)
    assert [PREFILL.gemm_kernel(case.experts, stage, tile) for stage in ("first", "last")] == (
        ["grouped_wgmma", "grouped"] if gate_up_bits == 4 else ["grouped", "grouped_wgmma"])
    check(PREFILL.moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


def test_emulated_cuda_prefill_kernel_matches_ref_on_wide_experts_at_16_row_tiles(emulated_cuda_kernels, monkeypatch):
    # experts as wide as WGMMA_WIDE_MIN_K (lowered to this case's 256) at 16-row tiles, by the
    # production rule (wgmma_min_tile): the gate+up on wgmma, the down on mma.sync reading its plain rows
    monkeypatch.setattr(PREFILL, "wgmma_device", lambda: True)
    monkeypatch.setattr(PREFILL, "WGMMA_WIDE_MIN_K", 256)
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 256, 256, 8, 2, 1, 20, with_weights=True)
    tile = PREFILL.tile_height(case.indices.size, 8)
    assert tile == 16
    assert [PREFILL.gemm_kernel(case.experts, stage, tile) for stage in ("first", "last")] == ["grouped_wgmma", "grouped"]
    check(PREFILL.moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_emulated_cuda_k_order_kernel_is_the_mlx_transpose(emulated_cuda_kernels, dtype):
    # gemm_rows takes the k_order launch from K_ORDER_KERNEL_MIN_VALUES values on, above every
    # emulated layer: its permutation checked here on its own, bit for bit, on 5 x 384 rows (240
    # 16-byte chunks: one block, part-filled), and a wrong mapping must fail
    rows = mx.random.normal((5, 384), key=mx.random.key(2)).astype(dtype)
    assert mx.array_equal(PREFILL.wgmma_k_order_kernel(rows), PREFILL.wgmma_k_order(rows)).item()
    right, wrong = "source[16 * t + 4 * e]", "source[4 * t + 16 * e]"
    swapped = emulated_kernel(section_edit=lambda section: section.replace(right, wrong) if right in section else section)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PREFILL, "cuda_kernel_object", swapped)
        assert not mx.array_equal(PREFILL.wgmma_k_order_kernel(rows), PREFILL.wgmma_k_order(rows)).item()


# GEMMs that must fail: one that feeds mma.sync its two B registers the wrong way round (k 2t,
# 2t + 1 against 2t + 8, 2t + 9), a wgmma GEMM whose activation copies miss the descriptor's
# swizzle, whose k16 steps start 16 bytes apart (not 32) or whose descriptor strides 512 bytes to
# the next 8 columns (the emulated tensor-core instructions read their operands' layouts), each
# GEMM waiting for one cp.async group too few before it reads a stage (the emulated copies land at
# the wait), and the wgmma GEMM without its waits for its wgmmas
# (the emulated ones read B and write their sums at the wait: in the loop, a stage refilled while
# its wgmmas are pending; at the end, sums read before the last ones), and the wgmma GEMM that
# keeps its first scale window: mma.sync's on the ragged-widths case (seven k-steps, its three
# stages wrap), wgmma's on a case of ten (its five stages wrap, and its windows are reloaded); and
# each GEMM whose epilogue never takes its bias, on a biased case; and the wgmma gate+up that writes
# its columns for the down on wgmma (K_ORDER_OUT) in another order than the down reads.
# {name: (GEMM, right source text, wrong[, case: else WRONG_GEMM_CASES'])}
WRONG_GEMMS = {
    "mma.sync's B registers swapped": ("grouped", "const unsigned (&a)[4], unsigned b0, unsigned b1)",
                                       "const unsigned (&a)[4], unsigned b1, unsigned b0)"),
    "wgmma's activation copies unswizzled": ("grouped_wgmma", "b_slot[i] = r * 128 + (kb ^ r % 8) * 16;",
                                             "b_slot[i] = r * 128 + kb * 16;"),
    "wgmma's k16 steps 16 bytes apart": ("grouped_wgmma", "(2 * half + s) * 32)", "(2 * half + s) * 16)"),
    "wgmma's 8-column stride half the swizzle pattern": ("grouped_wgmma", "(WGMMA_SWIZZLE_BYTES >> 4) << 32",
                                                         "(WGMMA_SWIZZLE_BYTES >> 5) << 32"),
    "mma.sync GEMM reads a stage before its copies": ("grouped", '::"n"(STAGES - 2));', '::"n"(STAGES - 1));'),
    "wgmma GEMM reads a stage before its copies": ("grouped_wgmma", '::"n"(WGMMA_AHEAD - 1));', '::"n"(WGMMA_AHEAD));'),
    "wgmma GEMM refills stages its wgmmas read": ("grouped_wgmma", "wgmma_wait<1>();", ""),
    "wgmma GEMM reads its sums before its last wgmmas": ("grouped_wgmma", "wgmma_wait<0>();", ""),
    "wgmma GEMM keeps its first scale window": ("grouped_wgmma", "load_window((step + 2) / STEPS_PER_WINDOW);", "load_window(0);"),
    "mma.sync GEMM drops its bias": ("grouped", "finish<T, ACTIVATE, GATED, ACT, LIMITED, decltype(extras)::value>(",
                                     "finish<T, ACTIVATE, GATED, ACT, LIMITED, false>(", "bf16 mxfp4 swiglu biased, scale windows reloaded"),
    "wgmma GEMM drops its bias": ("grouped_wgmma", "finish<T, ACTIVATE, GATED, ACT, LIMITED, decltype(extras)::value>(",
                                  "finish<T, ACTIVATE, GATED, ACT, LIMITED, false>(", "bf16 mxfp4 swiglu biased, scale windows reloaded"),
    "wgmma gate+up writes the down's k order wrongly": ("grouped_wgmma", "16 * (q / 2 % 2) + 8 * (q % 2)",
                                                        "8 * (q / 2 % 2) + 16 * (q % 2)"),
}
# each GEMM's case: more k-steps than its pipeline's stages
WRONG_GEMM_CASES = {"grouped": "bf16 4-bit/64 swiglu, ragged widths", "grouped_wgmma": "bf16 4-bit/32 swiglu, scale windows reloaded"}


@pytest.mark.parametrize("name", WRONG_GEMMS)
def test_the_emulation_finds_a_wrong_cuda_prefill_gemm(monkeypatch, name):
    gemm, right, wrong, *case_name = WRONG_GEMMS[name]
    source = sections("cuda", "moe_prefill.cu")
    assert (source["header"] + source[gemm]).count(right) == 1

    def broken(text):
        return text.replace(right, wrong)

    monkeypatch.setattr(PREFILL, "cuda_kernel_object", emulated_kernel(broken, broken))
    take_wgmma(monkeypatch, gemm == "grouped_wgmma", rows=256)  # wgmma's wider block: four warpgroups
    case = prefill_case(case_name[0] if case_name else WRONG_GEMM_CASES[gemm])
    assert PREFILL.gemm_kernel(case.experts, "first", 32) == gemm
    with pytest.raises(AssertionError, match="relative error|non-finite output"):  # a stage read early: NaN
        check(PREFILL.moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


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
def test_emulated_cuda_router_kernel_matches_ref(emulated_cuda_kernels, name, dtype):
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


ROUTED_CASES = {
    "bf16 4-bit/64, softmax then top-2": (mx.bfloat16, (4, 64), Routing("softmax_topk", 2), 3),
    "fp16 8-bit/32, softmax then top-4, normalised": (mx.float16, (8, 32), Routing("softmax_topk", 4, True), 1),
    "bf16 4-bit/128, top-3 then softmax": (mx.bfloat16, (4, 128), Routing("topk_softmax", 3), 2),
    "fp32 4-bit/64, top-2 then softmax, last k": (mx.float32, (4, 64), Routing("topk_softmax_last", 2), 1),
}


@pytest.mark.parametrize("name", ROUTED_CASES)
def test_emulated_cuda_routed_decode_kernel_is_the_router_and_decode_kernels(emulated_cuda_kernels, name):
    # test_router's GPU check on the emulation: the routing inside the gate+up launch (its experts
    # and weights carried in the hidden output's tail to the combining down) gives the router and
    # decode kernels' output bit for bit, and the float32 oracle's within tolerance
    dtype, quantization, routing, tokens = ROUTED_CASES[name]
    case = make_case(dtype, quantization, True, "swiglu", None, False, 128, 128, 16, routing.top_k, 1, tokens, seed=3)
    logits = mx.round(mx.random.normal((1, tokens, 16), key=mx.random.key(5)) * 4).astype(dtype) / 4  # ties too
    assert ROUTED.cuda_unsupported_reason(case.experts, routing, dtype, dtype) is None
    fused = ROUTED.moe_routed_decode_kernel(case.x, logits, routing, case.experts)
    indices, weights = ROUTER.moe_router_kernel(logits, routing)
    assert mx.array_equal(fused, DECODE.moe_decode_kernel(case.x, indices, case.experts, weights)).item()
    routed_case = dataclasses.replace(case, indices=indices, weights=weights)
    assert_close(fused, float32_oracle(moe_decode_reference, routed_case), dtype, f"{name}: ")
    residual = mx.random.normal(fused.shape, key=mx.random.key(6)).astype(dtype)
    assert mx.array_equal(ROUTED.moe_routed_decode_kernel(case.x, logits, routing, case.experts, residual),
                          residual + fused).item()  # added inside the down launch, as MLX adds


@pytest.mark.parametrize("bits", [4, 8])
def test_emulated_cuda_fused_router_kernel_is_the_routed_kernel_on_its_logits(emulated_cuda_kernels, bits):
    # router_gate_up computes each block's token's logits itself, as MLX's CUDA qmv does (each
    # weight dequantised to bf16, then multiplied: MLX's CPU matmul keeps it in float32 and its
    # logits differ), then routes and computes as routed_gate_up does on logits given
    from .parity.test_router import quantized_router

    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", None, False, 256, 128, 16, 2, 1, 1, seed=4)
    router = RouterLinear.from_module(quantized_router(256, 16, bits, 64, 1))
    routing = Routing("softmax_topk", 2, True)
    assert ROUTED.fused_router_reason(case.x, router, case.experts, 2) is None
    fused = ROUTED.moe_routed_decode_kernel(case.x, router, routing, case.experts)
    weights = mx.dequantize(router.weight, router.scales, router.biases, router.group_size, bits).astype(mx.bfloat16)
    logits = (case.x.astype(mx.float32) @ weights.astype(mx.float32).T).astype(mx.bfloat16)
    on_logits = ROUTED.moe_routed_decode_kernel(case.x, logits, routing, case.experts)
    assert mx.array_equal(fused, on_logits).item(), relative_error(fused, on_logits)


@pytest.mark.parametrize("dtype, quantization", [(mx.bfloat16, (4, 64)), (mx.float16, (4, 16, "nvfp4"))])
def test_emulated_cuda_routed_shared_decode_kernel_is_the_router_and_shared_decode_kernels(emulated_cuda_kernels, dtype,
                                                                                           quantization):
    # Inkling's block in two launches (sigmoid_shared_gate_up, routed_shared_down): test_shared_decode's
    # GPU check on the emulation, its per-expert scales and ties in the routing included
    from mlx_moe_fix.kernels.moe_shared_decode import moe_shared_decode_kernel

    from .parity.test_shared_decode import RoutedSharedCase, make_shared_case, shared_float32_oracle

    case = make_shared_case("inkling", dtype, quantization, 128, 64, 8, 3, 2, 2, scaled=True, seed=9)
    logits = mx.round(mx.random.normal((2, 8 + 2), key=mx.random.key(10)) * 3).astype(dtype)
    correction = mx.round(mx.random.uniform(-0.5, 0.5, (8,), key=mx.random.key(11)) * 4) / 4
    routed = RoutedSharedCase(case, logits, Routing("sigmoid_topk", 3, shared=2, shared_width=1, scale=2.5), correction,
                              mx.array([0.75]))
    assert ROUTED.cuda_unsupported_reason(case.experts, routed.routing, dtype, dtype, case.shared) is None
    out = routed.call(ROUTED.moe_routed_decode_kernel)
    indices, weights, shared_weights = ROUTER.moe_router_kernel(logits, routed.routing, correction, routed.global_scale)
    apart = moe_shared_decode_kernel(case.x, indices, case.experts, weights, case.shared, shared_weights)
    assert mx.array_equal(out, apart).item(), relative_error(out, apart)
    routed_case = dataclasses.replace(case, indices=indices, weights=weights, shared_weights=shared_weights)
    assert_close(out, shared_float32_oracle(routed_case), dtype, "inkling: ")


def test_emulated_cuda_shared_decode_kernel_matches_ref_on_deepseek_v4s_block(emulated_cuda_kernels):
    # DeepSeek-V4's shared experts: unweighted, SwiGLU clamped at its limit in both the routed and
    # the shared rows (shared_gate_up, shared_down), float32 routing weights
    from mlx_moe_fix.kernels.moe_shared_decode import cuda_unsupported_reason, moe_shared_decode_kernel

    from .parity.test_shared_decode import call, make_shared_case, shared_float32_oracle

    case = make_shared_case("deepseek_v4", mx.bfloat16, (4, 64), 128, 64, 8, 3, 2, 2, limit=0.25, seed=12)
    assert cuda_unsupported_reason(case.experts, case.shared, case.dtype) is None
    out = call(moe_shared_decode_kernel, case)
    assert out.dtype == case.dtype and out.shape == (*case.x.shape[:-1], case.experts.output_dims)
    assert_close(out, shared_float32_oracle(case), case.dtype, "deepseek_v4: ")


@pytest.fixture
def emulated_cuda_backend(emulated_cuda_kernels, monkeypatch, switch):
    """The whole package as on an H200: the decode path's kernels emulated and every module's
    current_backend() saying "cuda". The prefill kernel is off (its tensor-core PTX is not
    emulated: the prefill runs upstream's code, as any call no kernel of ours takes on CUDA), and
    so are the compiled decode steps (the emulation evaluates its inputs, which a compiled
    function's trace cannot) and the PTX cache (NVRTC's, not ours)."""
    for module in [m for name, m in sys.modules.items() if name.startswith("mlx_moe_fix")]:
        if getattr(module, "current_backend", None) is CURRENT_BACKEND:
            monkeypatch.setattr(module, "current_backend", lambda: "cuda")
    for name, value in (("MLX_MOE_FIX_CUDA_PREFILL", "0"), ("MLX_MOE_FIX_COMPILED_DECODE", "0"),
                        ("MLX_MOE_FIX_KERNEL_CACHE", "0"), ("MLX_MOE_FIX_REFERENCES", "")):
        switch(name, value)


# The zoo's families whose blocks the routed decode kernel takes (moe_router knows their routing);
# deepseek_v3's grouped routing, phimoe's sparsemixer and DeepSeek-V4's sqrt-softplus route apart.
ROUTED_FAMILIES = {"qwen3_moe", "mixtral", "gpt_oss", "inkling"}


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_emulated_cuda_greedy_tokens_match_stock(emulated_cuda_backend, family):
    # tests/parity/test_greedy_tokens.py's check (teacher-forced, as for any kernel that sums in
    # another order than stock) with the package applied as on a GPU, the patched blocks' CUDA
    # decode wiring on the emulated kernels: the run not recorded takes the routed decode where
    # moe_router knows the routing (the routing inside the gate+up launch, the decoder layer's
    # residual in the down launch, Inkling's shared experts in the decode launches). In float32,
    # as the CPU runs stock: in bf16 the CPU's own expert layers come out 2.6-3.2% (relative) off
    # their float32 values in the zoo's qwen3_moe, where the emulated kernel's are 0.4% off, so
    # bf16 stock on the CPU is no yardstick for a bf16 kernel (the fused router, bf16 only, has
    # its own test above).
    model = zoo.build(family, 4)
    prompt = zoo.prompt_for(family)
    stock = record_stock_run(model, prompt, N_TOKENS // 4, teacher_forced=True)  # each step ~1 s of emulation
    mlx_moe_fix.reset_path_counts()
    rerouted = assert_tokens_match_stock(model, prompt, stock, False, mx.float32)
    decode_paths = {r.reason for r in mlx_moe_fix.path_counts() if r.phase == "decode" and r.path == "kernel"}
    assert decode_paths and any("moe_routed_decode" in p for p in decode_paths) == (family in ROUTED_FAMILIES), decode_paths
    # the routed kernels' routing was read back from their launches at every decode step, and matched stock's
    assert (rerouted == [False] * (len(stock.tokens) - 1)) if family in ROUTED_FAMILIES else rerouted is None, rerouted


def in_place_and_magic_dequantisation(header: str):
    """grouped::dequant_pair_at's bf16 pairs times 2^64 (its values are the weights times 2^-64) and
    dequant_pair's (the MAGIC path's), emulated with the prefill's `header`: every value of every
    byte of a word, at both nibbles, against scales and biases of both signs and zero, from 2^-49
    to 2^50 (dequant_pair_at is exact for scales under 2^59 and weights of 2^-62 or more)."""
    words = mx.array([a | (a * 37 % 256) << 8 | (a * 101 % 256) << 16 | (a * 211 % 256) << 24 for a in range(256)], mx.uint32)
    scales = mx.array([1e-3, 0.0123, 0.5, 3.0, -0.02, 0.0, 2.0 ** -40, 1.2e-15, 65504.0, 2.0 ** 50], mx.bfloat16)
    biases = mx.array([-0.1, 0.0, 7.5, -1e-3, 0.37, -3.0, 2.0 ** -41, 1e-12, -65504.0, 2.0 ** 49], mx.bfloat16)
    body = """
      const int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i >= sizes[0]) return;
      const int group = i / sizes[1];
      const unsigned word = words[i % sizes[1]];
      for (int shift = 0; shift < 2; ++shift)
        for (int at = 0; at < 2; ++at) {
          const int o = (i * 2 + shift) * 2 + at;
          const unsigned weights_times_2_to_minus_64 = grouped::dequant_pair_at<T, T, 4>(
              word >> 8 * shift, 4 * at, grouped::group_scale_of<T, 4, false, 64>(scales[group]),
              grouped::group_bias_of<T, 4, false>(biases[group]));
          const unsigned two_to_64 = 0x5F805F80u;
          const __nv_bfloat162 weights = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&weights_times_2_to_minus_64),
                                                 *reinterpret_cast<const __nv_bfloat162*>(&two_to_64));
          in_place[o] = *reinterpret_cast<const unsigned*>(&weights);
          magic[o] = grouped::dequant_pair<T, T, 4>(word >> (8 * shift + 4 * at) & 0x000F000Fu, scales[group], biases[group]);
        }
    """
    kernel = EmulatedCudaKernel(["words", "scales", "biases", "sizes"], ["in_place", "magic"], body, header, 0)
    count = words.size * scales.size
    return kernel(inputs=[words, scales, biases, mx.array([count, words.size], mx.int32)], template=[("T", mx.bfloat16)],
                  grid=(count, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(count * 4,)] * 2, output_dtypes=[mx.uint32] * 2)


def test_emulated_in_place_dequantisation_is_the_magic_paths_bit_for_bit():
    header = sections("cuda", "moe_prefill.cu")["header"]
    in_place, magic = in_place_and_magic_dequantisation(header)
    assert mx.array_equal(in_place, magic).item()
    # the comparison sees a wrong constant: the high nibbles' scale times 2^69 as the low ones'
    assert "0x60006200u" in header
    in_place, magic = in_place_and_magic_dequantisation(header.replace("0x60006200u", "0x62006200u"))
    assert not mx.array_equal(in_place, magic).item()


def run_emulated_threads(body: str, threads: int = 64):
    """`body` as a one-block CUDA kernel of `threads` threads writing `out` (one float a thread)."""
    kernel = EmulatedCudaKernel(["unused"], ["out"], body, "", 0)
    return kernel(inputs=[mx.zeros((1,))], template=[], grid=(threads, 1, 1), threadgroup=(threads, 1, 1),
                  output_shapes=[(threads,)], output_dtypes=[mx.float32])[0]


def test_the_emulation_reports_a_deadlock_and_a_kernels_exception():
    # each thread's exchange through its warp and the block barrier, in order: every thread's value
    ring = run_emulated_threads("""
      const float mine = float(threadIdx.x);
      const float next = __shfl_sync(0xffffffffu, mine, (threadIdx.x + 1) % 32);
      __syncthreads();
      out[threadIdx.x] = next;""")
    assert ring.tolist() == [float(32 * (t // 32) + (t + 1) % 32) for t in range(64)]
    # one lane at the warp's exchange, the rest at the block barrier: a GPU would hang, the emulation
    # says so (its threads are fibers that all wait)
    with pytest.raises(RuntimeError, match="deadlock"):
        run_emulated_threads("""
          if (threadIdx.x == 0) out[0] = __shfl_sync(0xffffffffu, 1.f, 1);
          __syncthreads();
          out[threadIdx.x] = 0.f;""")
    # threads that return early leave the barrier: the others pass it
    early = run_emulated_threads("""
      if (threadIdx.x % 2) return;
      __syncthreads();
      out[threadIdx.x] = 1.f;""")
    assert np.array_equal(np.isnan(np.array(early)), np.arange(64) % 2 == 1)
    with pytest.raises(RuntimeError, match="only the 128-byte swizzle"):
        run_emulated_threads("""
          float d[4] = {};
          const unsigned a[4] = {};
          wgmma_m64k16<__nv_bfloat16, 8>(d, a, 0ull);
          out[threadIdx.x] = d[0];""")
