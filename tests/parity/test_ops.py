"""The ops against stock upstream layers: ref_* (pure-MLX references) and dispatch_* (what the
current backend runs: the kernel on a GPU that has one, else the reference)."""

import dataclasses
import itertools
import sys

import mlx.core as mx
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from mlx_moe_fix.kernels import Activation, ExpertLinear, MoEExperts, moe_decode, moe_decode_reference, moe_prefill, moe_prefill_reference
from mlx_moe_fix.kernels import backend
from mlx_moe_fix.kernels.backend import Implementation

from .cases import CASES, GATED_KINDS, layer_cases, make_case
from .tolerance import assert_close



def check(op, case, expected=None):
    """op's output against `expected` (default: the stock layer's) within the dtype's tolerance."""
    out = op(case.x, case.indices, case.experts, case.weights)
    expected = case.stock() if expected is None else expected
    assert out.dtype == expected.dtype, case.label
    try:
        assert_close(out, expected, case.dtype)
    except AssertionError as error:
        raise AssertionError(f"{case.label}: {error}") from None


@CASES
@given(case=layer_cases())
def test_ref_prefill_matches_stock(case):
    check(moe_prefill_reference, case)


@CASES
@given(case=layer_cases())
def test_ref_decode_matches_stock(case):
    check(moe_decode_reference, case)


@CASES
@given(case=layer_cases())
def test_dispatch_prefill_matches_stock(device, case):
    check(moe_prefill, case)


@CASES
@given(case=layer_cases())
def test_dispatch_decode_matches_stock(device, case):
    check(moe_decode, case)


# (quantization, glu, kind, num_experts, top_k, batch, tokens, routing): the corners that random
# draws may miss.
EDGE_CASES = {
    "all-pairs-on-one-expert-decode": ((4, 64), True, "swiglu", 8, 1, 1, 5, "one_expert"),
    "all-pairs-on-one-expert-prefill": ((4, 64), True, "swiglu", 8, 1, 2, 40, "one_expert"),
    "top_k-equals-experts": ((8, 32), True, "swiglu_oai", 5, 5, 2, 7, "random"),
    "empty-experts": ((4, 128), False, "gelu", 8, 2, 1, 50, "few_experts"),
    "63-pairs": ((4, 32), True, "swiglu_limited", 7, 1, 1, 63, "random"),
    "64-pairs": ((4, 32), True, "swiglu_limited", 7, 1, 1, 64, "random"),
}


@pytest.mark.parametrize("op", [moe_prefill_reference, moe_decode_reference, moe_prefill, moe_decode])
@pytest.mark.parametrize("name", EDGE_CASES)
def test_edge_cases_match_stock(device, name, op):
    quantization, glu, kind, experts, top_k, batch, tokens, routing = EDGE_CASES[name]
    group = quantization[1]
    for with_weights in (False, True):
        case = make_case(
            mx.bfloat16, quantization, glu, kind, 0.25, False, 2 * group, group, experts, top_k, batch, tokens,
            routing=routing, with_weights=with_weights,
        )
        check(op, case)


def test_decode_of_no_tokens_gives_an_empty_output_without_a_launch(device):
    # at zero pairs a launch has no blocks, which CUDA refuses (stock's gather_qmm fails so): the
    # kernel returns the empty output itself, also where it is called off the GPU. The dispatcher
    # too where it runs the kernel, or the CPU's reference; with the kernel switched off on a GPU
    # it runs the reference, which fails there as stock does.
    from mlx_moe_fix.kernels.moe_decode import moe_decode_implementation, moe_decode_kernel

    for with_weights in (False, True):
        case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 128, 64, 8, 2, 1, 0, with_weights=with_weights)
        shape = (1, 0, 128) if with_weights else (1, 0, 2, 128)
        dispatched = device == "cpu" or moe_decode_implementation(case.experts, mx.bfloat16).path == "kernel"
        for op in (moe_decode, moe_decode_kernel) if dispatched else (moe_decode_kernel,):
            out = op(case.x, case.indices, case.experts, case.weights)
            mx.eval(out)
            assert (out.shape, out.dtype) == (shape, mx.bfloat16), (op.__name__, with_weights, out.shape)


def test_limit_binds_and_changes_the_output():
    """The clamp stage is real: with a binding limit the output differs from plain SwiGLU."""
    from mlx_moe_fix.kernels.reference import activate

    gate = mx.array([-3.0, 0.1, 3.0])
    up = mx.array([-3.0, 0.1, 3.0])
    plain = activate(Activation("swiglu"), up, gate)
    clamped = activate(Activation("swiglu", limit=1.0), up, gate)
    assert mx.allclose(plain[1], clamped[1]).item()
    assert not mx.allclose(plain[2], clamped[2]).item()
    assert clamped[2].item() == pytest.approx(1.0 * (1 / (1 + 2.718281828**-1.0)), rel=1e-5)


@pytest.mark.parametrize("mode, reason_part", [("mxfp8", "mxfp8"), ("nvfp4 with a global scale", "global scale")])
def test_unsupported_quantization_is_reported(mode, reason_part):
    w = mx.random.normal((2, 64, 64))
    q, scales = mx.quantize(w, mode=mode.split()[0])
    linear = ExpertLinear(q, scales, None, group_size=32 if mode == "mxfp8" else 16, bits=8 if mode == "mxfp8" else 4,
                          mode=mode.split()[0], global_scale=mx.ones((2,)) if "global" in mode else None)
    reason = MoEExperts((linear,)).unsupported_reason(mx.zeros((1, 64)), mx.zeros((1, 1), mx.uint32))
    assert reason_part in reason


def test_fp4_experts_are_supported_by_the_references_and_the_cuda_kernels_that_read_them():
    # The ops' references run MLX's own mxfp4 matmuls. On CUDA the grouped prefill GEMM
    # dequantises mxfp4 to bf16 and the decode GEMV reads it in fixed point (bf16 / fp16); the
    # Metal decode kernel's fp32 loop reads it against any activations.
    from mlx_moe_fix.kernels.moe_decode import cuda_unsupported_reason as decode_reason
    from mlx_moe_fix.kernels.moe_prefill import cuda_unsupported_reason as prefill_reason

    case = make_case(mx.bfloat16, (4, 32, "mxfp4"), True, "swiglu_oai", 7.0, False, 128, 64, 8, 2, 1, 40, bias=True)
    assert all(p.mode == "mxfp4" and p.biases is None for p in case.experts.projections)
    assert case.experts.unsupported_reason(case.x, case.indices) is None
    assert prefill_reason(case.experts, mx.bfloat16) is None
    assert "bfloat16 only" in prefill_reason(case.experts, mx.float16)
    assert decode_reason(case.experts, mx.bfloat16, "cuda") is None
    assert "mxfp4 experts against mlx.core.float32 activations" in decode_reason(case.experts, mx.float32, "cuda")
    assert decode_reason(case.experts, mx.bfloat16, "metal") is None
    assert "additive bias is not of the activations' dtype" in decode_reason(case.experts, mx.float32, "metal")
    linear = case.experts.projections[0]
    grouped_64 = dataclasses.replace(linear, group_size=64)
    assert "groups of 32 only" in grouped_64.unsupported_reason()
    # nvfp4 (Inkling's): the decode GEMV's 32-value vectors span two of its groups
    case = make_case(mx.bfloat16, (4, 16, "nvfp4"), True, "swiglu", 7.0, True, 128, 64, 8, 2, 1, 40)
    assert case.experts.unsupported_reason(case.x, case.indices) is None and case.experts.gate_scale is not None
    assert prefill_reason(case.experts, mx.bfloat16) is None
    assert decode_reason(case.experts, mx.bfloat16, "cuda") is None
    assert decode_reason(case.experts, mx.float16, "metal") is None and decode_reason(case.experts, mx.float32, "metal") is None
    # rows of 48 values: three groups of 16, one and a half of the GEMV's 32-value vectors
    case = make_case(mx.bfloat16, (4, 16, "nvfp4"), True, "swiglu", 7.0, True, 48, 64, 8, 2, 1, 1)
    assert case.experts.projections[0].input_dims == 48
    assert "whole 16-byte vectors" in decode_reason(case.experts, mx.bfloat16, "cuda")
    assert "whole 16-byte vectors" in decode_reason(case.experts, mx.bfloat16, "metal")


def test_gate_and_up_quantized_differently_are_left_to_stock():
    # Both CUDA gate+up kernels (decode GEMV, prefill GEMM) read gate and up with one BITS and
    # GROUP: a layer whose two differ must not reach them.
    from mlx_moe_fix.kernels.launch import quantized_experts_reason

    def linear(bits, group, shape=(2, 64, 128)):
        q, scales, biases = mx.quantize(mx.random.normal(shape), group_size=group, bits=bits)
        return ExpertLinear(q, scales, biases, group_size=group, bits=bits)

    down = linear(8, 32, (2, 128, 64))  # the down launch has its own BITS and GROUP
    assert quantized_experts_reason(MoEExperts((linear(4, 64), linear(4, 64), down), Activation("swiglu"))) is None
    for gate in (linear(8, 64), linear(4, 32)):
        reason = quantized_experts_reason(MoEExperts((gate, linear(4, 64), down), Activation("swiglu")))
        assert "quantized differently" in reason


def test_experts_past_32_bit_offsets_are_left_to_stock():
    # The CUDA decode GEMV addresses one expert's packed rows with 32-bit offsets. The arrays
    # stay lazy, so the 16 GiB expert is never allocated.
    from mlx_moe_fix.kernels.moe_decode import MAX_EXPERT_WORDS, cuda_unsupported_reason

    def linear(rows, words):
        group, bits = 64, 4
        scales = mx.zeros((1, rows, words * 32 // bits // group), mx.bfloat16)
        return ExpertLinear(mx.zeros((1, rows, words), mx.uint32), scales, scales, group_size=group, bits=bits)

    largest = MoEExperts((linear(MAX_EXPERT_WORDS // 4096 - 1, 4096),))
    assert cuda_unsupported_reason(largest, mx.bfloat16) is None
    reason = cuda_unsupported_reason(MoEExperts((linear(MAX_EXPERT_WORDS // 4096, 4096),)), mx.bfloat16)
    assert "32-bit offsets" in reason


def test_experts_in_arrays_too_small_for_device_memory_are_left_to_stock_on_metal():
    # MLX passes a Metal kernel's inputs of fewer than 8 elements in constant memory, which the
    # Metal GEMV does not read its experts from: one expert of 4 rows (4 scales and 4 biases a
    # matrix) stays upstream's there; on CUDA the kernel takes it.
    from mlx_moe_fix.kernels.moe_decode import cuda_unsupported_reason

    q, scales, biases = mx.quantize(mx.random.normal((1, 4, 64)), group_size=64, bits=4)
    experts = MoEExperts((ExpertLinear(q, scales, biases, group_size=64, bits=4),))
    assert "fewer than 8 elements" in cuda_unsupported_reason(experts, mx.bfloat16, "metal")
    assert cuda_unsupported_reason(experts, mx.bfloat16, "cuda") is None
    q, scales, biases = mx.quantize(mx.random.normal((1, 8, 64)), group_size=64, bits=4)
    assert cuda_unsupported_reason(MoEExperts((ExpertLinear(q, scales, biases, group_size=64, bits=4),)), mx.bfloat16,
                                   "metal") is None


@pytest.mark.parametrize(
    "projections, activation",
    [(2, Activation("swiglu")), (3, Activation("gelu")), (1, Activation("gelu")), (3, None)],
)
def test_experts_reject_mismatched_activation(projections, activation):
    linear = ExpertLinear(mx.zeros((2, 8, 8)))
    with pytest.raises(ValueError):
        MoEExperts((linear,) * projections, activation)


def float32_oracle(reference, case):
    """The reference computed on the CPU in float32 from the same quantized weights, then cast to
    the case's dtype. On the CPU, not the GPU: there MLX JIT-compiles stock's quantized matmuls per
    shape (seconds to tens of seconds each), which left the kernel tests no time for cases. In
    float32: MLX's CPU bf16 / fp16 quantized matmuls land ~9 ulps from it, where the kernels and
    stock's CUDA path land ~1, so half-precision CPU references would hide or fake an error."""

    def widen(a):  # mxfp4's e8m0 scale bytes stay as they are
        return a if a is None or not mx.issubdtype(a.dtype, mx.floating) else a.astype(mx.float32)

    def widen_linear(p):
        return dataclasses.replace(p, weight=widen(p.weight) if not p.quantized else p.weight,
                                   scales=widen(p.scales), biases=widen(p.biases), bias=widen(p.bias))

    e = case.experts
    experts = dataclasses.replace(e, projections=tuple(widen_linear(p) for p in e.projections),
                                  gate_scale=widen(e.gate_scale), out_scale=widen(e.out_scale))
    with mx.stream(mx.cpu):
        out = reference(case.x.astype(mx.float32), case.indices, experts, widen(case.weights)).astype(case.dtype)
        mx.eval(out)
    return out


def check_kernel(kernel, unsupported_reason, reference, case):
    """A kernel itself (not the dispatcher) against its reference, on every case it supports;
    hypothesis discards the others (and fails the test if it finds too few supported ones)."""
    assume(unsupported_reason is None)
    check(kernel, case, float32_oracle(reference, case))


@CASES
@given(case=layer_cases())
def test_cuda_decode_kernel_matches_ref(cuda_device, case):
    from mlx_moe_fix.kernels.moe_decode import cuda_unsupported_reason, moe_decode_kernel

    check_kernel(moe_decode_kernel, cuda_unsupported_reason(case.experts, case.dtype), moe_decode_reference, case)


@pytest.mark.parametrize("op, tokens", [("moe_decode", 2), ("moe_prefill", 40)])
@pytest.mark.parametrize("kind", [*GATED_KINDS, "gelu", "gelu_approx", "gelu_fast", "relu2"])
def test_cuda_kernels_take_every_activation(cuda_device, op, tokens, kind):
    # Each activation through both kernels' epilogues, its clamp binding (limit 0.25) where it has
    # one, against the float32 oracle: the hypothesis draws may leave a kind out.
    module = sys.modules[f"mlx_moe_fix.kernels.{op}"]  # the package's names are the dispatchers'
    glu = kind in GATED_KINDS
    case = make_case(mx.bfloat16, (4, 64), glu, kind, 0.25, False, 128, 64 if glu else 128, 8, 2, 1, tokens, with_weights=True)
    assert module.cuda_unsupported_reason(case.experts, case.dtype) is None
    check(getattr(module, f"{op}_kernel"), case, float32_oracle(getattr(module, f"{op}_reference"), case))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_cuda_decode_kernel_sums_activations_of_every_magnitude(cuda_device, dtype, bits):
    # The fixed-point GEMV (16-bit activations) scales each activation vector (32 values for
    # 4-bit weights, 16 for 8-bit) by its largest magnitude: vectors 2^-12 to 2^4 in size, a zero
    # vector, a vector of values too small to matter, and an outlier within a vector must all sum
    # as the fp32 oracle; an activation that is not finite makes its token's outputs not finite,
    # as stock's are.
    from mlx_moe_fix.kernels.moe_decode import cuda_unsupported_reason, moe_decode_kernel

    case = make_case(dtype, (bits, 64), True, "swiglu", 50.0, False, 512, 128, 8, 2, 1, 4, with_weights=True)
    assert cuda_unsupported_reason(case.experts, dtype) is None
    vectors = 512 // 32
    mx.random.seed(1)
    magnitude = mx.power(2.0, mx.random.randint(-12, 5, (1, 4, vectors, 1)).astype(mx.float32))
    x = mx.random.normal((1, 4, vectors, 32)) * magnitude
    x[:, :, 0] = 0.0
    x[:, :, 1] = x[:, :, 1] * (2.0**-110 if dtype == mx.bfloat16 else 2.0**-20)  # below 2^-105; fp16: subnormal
    x[:, :, 2, 5] = 200.0
    x = x.reshape(1, 4, 512).astype(dtype)
    wide = dataclasses.replace(case, x=x)
    check(moe_decode_kernel, wide, float32_oracle(moe_decode_reference, wide))
    for bad in (float("nan"), float("inf")):
        x_bad = mx.array(x)
        x_bad[0, 1, 77] = bad
        out = moe_decode_kernel(x_bad, case.indices, case.experts, case.weights)
        assert not mx.isfinite(out[0, 1]).any().item(), bad
        assert mx.array_equal(out[0, [0, 2, 3]], moe_decode_kernel(x, case.indices, case.experts, case.weights)[0, [0, 2, 3]]).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_cuda_decode_gate_up_splits_its_row_once_a_block_as_each_warp_would(cuda_device, monkeypatch, dtype, bits):
    # A 16-bit activation row is split into fixed point once a block, in shared memory, where
    # moe_decode.shared_split_bytes finds room; else each warp splits the vectors it reads. Both
    # must give the same outputs bit for bit (the plain and the routed gate+up take the same path).
    decode = sys.modules["mlx_moe_fix.kernels.moe_decode"]  # the package exports the dispatcher under this name
    case = make_case(dtype, (bits, 64), True, "swiglu", 7.0, False, 512, 128, 8, 2, 1, 4, with_weights=True, seed=3)

    def run(experts):
        gate_up, _ = decode.decode_launches(experts, 2, case.indices.size, dtype, case.weights.dtype, "cuda")
        out = decode.moe_decode_kernel(case.x, case.indices, experts, case.weights)
        mx.eval(out)
        return dict(gate_up.template)["SHARED_SPLIT"], out

    split_once, shared = run(case.experts)
    check(decode.moe_decode_kernel, case, float32_oracle(moe_decode_reference, case))
    monkeypatch.setattr(decode, "MAX_SPLIT_BYTES", 0)
    split_per_warp, per_warp = run(dataclasses.replace(case.experts))
    assert split_once and not split_per_warp
    assert mx.array_equal(shared, per_warp).item()


@CASES
@given(case=layer_cases())
def test_metal_decode_kernel_matches_ref(metal_device, case):
    # the CUDA test's property, on Apple hardware (not run by this project: no Metal machine here)
    from mlx_moe_fix.kernels.moe_decode import cuda_unsupported_reason, moe_decode_kernel

    check_kernel(moe_decode_kernel, cuda_unsupported_reason(case.experts, case.dtype), moe_decode_reference, case)


# The prefill kernel's gate+up GEMMs (moe_prefill.GEMMS): mma.sync, and Hopper's wgmma, which
# production takes at 64-row tiles only: here at every tile height, so that every case reaches it,
# in blocks of 128 weight rows (these cases' widths) and of 256 (moe_prefill.wgmma_block_rows);
# the activation rows permuted by MLX's transpose at 128 rows, by the k_order launch at 256 (which
# production takes from K_ORDER_KERNEL_MIN_VALUES values on, above these cases).
PREFILL_GEMMS = pytest.mark.parametrize("wgmma", ["0", "1", "256"], ids=["grouped", "grouped_wgmma", "grouped_wgmma_256_rows"])


def prefill_gemm(switch, monkeypatch, wgmma: str) -> None:
    module = sys.modules["mlx_moe_fix.kernels.moe_prefill"]  # the package's name is the dispatcher's
    if wgmma != "0" and not module.wgmma_device():
        pytest.skip("no Hopper GPU: wgmma needs compute capability 9.0")
    switch(module.WGMMA_SWITCH, "0" if wgmma == "0" else "1")
    monkeypatch.setattr(module, "wgmma_min_tile", lambda experts, stage: 0)
    if wgmma == "256":
        monkeypatch.setattr(module, "WGMMA_WIDE_MIN_K", 0)
        monkeypatch.setattr(module, "K_ORDER_KERNEL_MIN_VALUES", 0)


@pytest.mark.parametrize("info, expected", [
    ({"compute_capability_major": 9, "compute_capability_minor": 0, "architecture": "sm_90"}, True),
    ({"compute_capability_major": 8, "compute_capability_minor": 0, "architecture": "sm_80"}, False),
    ({"compute_capability_major": 10, "compute_capability_minor": 0, "architecture": "sm_100"}, False),
    ({"compute_capability_major": 12, "compute_capability_minor": 0}, False),
    ({"architecture": "sm_90a"}, True),
    ({"architecture": "sm_89"}, False),
    ({"architecture": "x86_64", "device_name": "a CPU"}, False),
])
def test_wgmma_is_taken_on_hopper_only(monkeypatch, switch, info, expected):
    # wgmma is sm_90a's: an Ampere, Ada or Blackwell GPU keeps gate+up and down on mma.sync.
    module = sys.modules["mlx_moe_fix.kernels.moe_prefill"]
    monkeypatch.setattr(module.mx, "device_info", lambda device=None: info)
    backend.compute_capability.cache_clear()
    try:
        switch(module.WGMMA_SWITCH, "")
        experts = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 256, 256, 8, 2, 1, 4).experts
        assert module.wgmma_device() is expected
        # 64-row tiles and up; where the experts' input is WGMMA_WIDE_MIN_K wide (here 256), the down's
        # from 32 rows and the gate+up's at every height
        wgmma = "grouped_wgmma" if expected else "grouped"
        for wide_min_k, smallest in ((4096, {"first": 64, "last": 64}), (256, {"first": 16, "last": 32})):
            monkeypatch.setattr(module, "WGMMA_WIDE_MIN_K", wide_min_k)
            for stage, tile in smallest.items():
                assert module.wgmma_min_tile(experts, stage) == tile
                assert [module.gemm_kernel(experts, stage, rows) for rows in (tile // 2, tile)] == ["grouped", wgmma]
        # status() says which GEMM gate+up takes, as where the kernel runs
        monkeypatch.setattr(module, "moe_prefill_implementation", lambda *args: Implementation(None, "kernel", "CUDA"))
        monkeypatch.setattr(module.mx.cuda, "is_available", lambda: True)
        assert module.gemm_state()["gemm"] == ("grouped_wgmma" if expected else "grouped")
        switch(module.WGMMA_SWITCH, "0")
        assert module.gemm_kernel(experts, "first", 64) == "grouped"
        assert module.gemm_state() == {"gemm": "grouped", "reason": f"mma.sync: {module.WGMMA_SWITCH}=0"}
    finally:
        backend.compute_capability.cache_clear()


@PREFILL_GEMMS
@CASES
@given(case=layer_cases())
def test_cuda_prefill_kernel_matches_ref(cuda_device, switch, monkeypatch, wgmma, case):
    from mlx_moe_fix.kernels.moe_prefill import cuda_unsupported_reason, moe_prefill_kernel

    prefill_gemm(switch, monkeypatch, wgmma)
    check_kernel(moe_prefill_kernel, cuda_unsupported_reason(case.experts, case.dtype), moe_prefill_reference, case)


@CASES
@given(tokens=st.integers(1, 300), top_k=st.integers(1, 8), width=st.sampled_from([32, 96, 512, 2048]),
       dtype=st.sampled_from([mx.bfloat16, mx.float16]), float32_weights=st.booleans(), seed=st.integers(0, 2**16))
def test_cuda_prefill_combine_kernel_matches_ref(cuda_device, tokens, top_k, width, dtype, float32_weights, seed):
    # The grouped prefill's last launch on its own: the down GEMM's rows in pair order weighed and
    # summed per token as reference.combine does, within the dtype's tolerance (the kernel sums
    # in fp32; MLX's bf16 / fp16 sum rounds after each addition).
    from mlx_moe_fix.kernels.moe_prefill import combine_kernel
    from mlx_moe_fix.kernels.reference import combine

    key = mx.random.key(seed)
    rows = mx.random.normal((tokens * top_k, width), key=key).astype(dtype)
    weights = mx.softmax(mx.random.normal((1, tokens, top_k), key=mx.random.split(key)[0]), axis=-1)
    weights = weights if float32_weights else weights.astype(dtype)
    out = combine_kernel(rows, weights)
    expected = combine(rows.reshape(1, tokens, top_k, width), weights)
    assert out.shape == expected.shape == (1, tokens, width) and out.dtype == dtype
    assert_close(out, expected, dtype)


@CASES
@given(rows=st.integers(1, 300), steps=st.integers(1, 48), dtype=st.sampled_from([mx.bfloat16, mx.float16]),
       seed=st.integers(0, 2**16))
def test_cuda_wgmma_k_order_kernel_matches_ref(cuda_device, rows, steps, dtype, seed):
    # grouped_wgmma's activation rows permuted in one launch, bit for bit as the MLX transpose
    # (wgmma_k_order, checked against the GEMM's reading order on the CPU) permutes them.
    from mlx_moe_fix.kernels.moe_prefill import wgmma_k_order, wgmma_k_order_kernel

    x = mx.random.normal((rows, 64 * steps), key=mx.random.key(seed)).astype(dtype)
    out = wgmma_k_order_kernel(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert mx.array_equal(out, wgmma_k_order(x)).item()


def test_gemm_rows_permute_large_rows_in_the_k_order_launch_and_small_ones_in_mlx(monkeypatch):
    moe_prefill = sys.modules["mlx_moe_fix.kernels.moe_prefill"]  # the package's name is the dispatcher

    monkeypatch.setattr(moe_prefill, "wgmma_k_order_kernel", lambda rows: "k_order launch")
    width = 2048
    small = mx.arange((moe_prefill.K_ORDER_KERNEL_MIN_VALUES // width - 1) * width).reshape(-1, width)
    large = mx.zeros((moe_prefill.K_ORDER_KERNEL_MIN_VALUES // width, width), dtype=mx.bfloat16)
    assert moe_prefill.gemm_rows(large, "grouped_wgmma") == "k_order launch"
    assert mx.array_equal(moe_prefill.gemm_rows(small, "grouped_wgmma"), moe_prefill.wgmma_k_order(small)).item()
    assert moe_prefill.gemm_rows(large, "grouped") is large


def test_weights_per_pair_broadcast_as_the_references_broadcast_them():
    from mlx_moe_fix.kernels.launch import per_pair

    indices = mx.zeros((2, 3, 4), dtype=mx.uint32)
    weights = mx.arange(4, dtype=mx.float32).reshape(1, 1, 4)
    assert mx.array_equal(per_pair(weights, indices), mx.broadcast_to(weights, (2, 3, 4))).item()
    same = mx.ones((2, 3, 4))
    assert per_pair(same, indices) is same
    with pytest.raises(ValueError):
        per_pair(mx.ones((2, 5, 4)), indices)


@pytest.mark.parametrize("kernel, tokens", [("moe_prefill", 40), ("moe_decode", 3)])
def test_cuda_kernels_take_weights_of_fewer_leading_dimensions(cuda_device, kernel, tokens):
    # One set of routing weights per batch row, broadcast over its tokens as the references
    # broadcast it: the kernels read one weight per pair, never past the array.
    import importlib

    module = importlib.import_module(f"mlx_moe_fix.kernels.{kernel}")
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 256, 256, 8, 2, 2, tokens, with_weights=True)
    case = dataclasses.replace(case, weights=case.weights[:, :1])
    reference = getattr(module, f"{kernel}_reference")
    check(getattr(module, f"{kernel}_kernel"), case, float32_oracle(reference, case))


# Kernel corners the GPU's hypothesis shapes do not reach: every tile height (16 / 32 / 64 rows
# from 0 / 8 / 32 mean rows per expert), several K steps per projection, ragged and empty experts.
# (quantization, glu, kind, tokens, routing, bias, tile height the kernel must pick)
LARGE_PREFILL_CASES = {
    "64-row-tiles": ((4, 64), True, "swiglu", 1100, "random", False, 64),
    "64-row-tiles-one-expert-biased": ((8, 32), True, "swiglu_oai", 1100, "one_expert", True, 64),
    "32-row-tiles-empty-experts": ((4, 128), False, "gelu_approx", 100, "few_experts", False, 32),
    "16-row-tiles": ((8, 64), True, "swiglu", 20, "random", True, 16),
}


@PREFILL_GEMMS
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("name", LARGE_PREFILL_CASES)
def test_cuda_prefill_kernel_matches_ref_on_large_cases(cuda_device, switch, monkeypatch, wgmma, name, dtype):
    from mlx_moe_fix.kernels.moe_prefill import cuda_unsupported_reason, moe_prefill_kernel, tile_height

    prefill_gemm(switch, monkeypatch, wgmma)
    quantization, glu, kind, tokens, routing, bias, tile = LARGE_PREFILL_CASES[name]
    case = make_case(dtype, quantization, glu, kind, 0.25, False, 256, 256, 8, 2, 1, tokens,
                     routing=routing, with_weights=True, bias=bias)
    assert all((p.bias is not None) == bias for p in case.experts.projections)
    assert cuda_unsupported_reason(case.experts, dtype) is None
    assert tile_height(case.indices.size, 8) == tile
    check(moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


@pytest.mark.parametrize("tokens, tile, gemms", [(20, 16, ["grouped_wgmma", "grouped"]), (100, 32, ["grouped_wgmma"] * 2),
                                                  (600, 64, ["grouped_wgmma"] * 2)])
def test_cuda_prefill_kernel_matches_ref_on_experts_4096_wide(cuda_device, switch, tokens, tile, gemms):
    # the production rule (wgmma_min_tile) at WGMMA_WIDE_MIN_K: on Hopper the gate+up on wgmma at
    # every tile height, the down from 32 rows
    module = sys.modules["mlx_moe_fix.kernels.moe_prefill"]  # the package's name is the dispatcher's
    switch(module.WGMMA_SWITCH, "")
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, module.WGMMA_WIDE_MIN_K, 256, 8, 2, 1, tokens,
                     with_weights=True)
    assert module.tile_height(case.indices.size, 8) == tile
    expected = gemms if module.wgmma_device() else ["grouped", "grouped"]
    assert [module.gemm_kernel(case.experts, stage, tile) for stage in ("first", "last")] == expected
    check(module.moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


# FP4 experts against bf16: mxfp4 (gpt-oss's, DeepSeek-V4's), nvfp4 (Inkling's, its per-expert
# scales too): (mode, glu, kind, tokens, routing, bias, scaled, tile height).
FP4_PREFILL_CASES = {
    "mxfp4-64-row-tiles-gpt-oss-biased": ("mxfp4", True, "swiglu_oai", 1100, "random", True, False, 64),
    "mxfp4-32-row-tiles-empty-experts": ("mxfp4", False, "gelu_approx", 100, "few_experts", False, False, 32),
    "mxfp4-16-row-tiles": ("mxfp4", True, "swiglu", 20, "random", False, False, 16),
    "nvfp4-64-row-tiles-inkling-scaled": ("nvfp4", True, "swiglu", 1100, "random", False, True, 64),
    "nvfp4-16-row-tiles-biased": ("nvfp4", True, "swiglu_oai", 20, "random", True, False, 16),
}


@PREFILL_GEMMS
@pytest.mark.parametrize("name", FP4_PREFILL_CASES)
def test_cuda_prefill_kernel_matches_ref_on_fp4_experts(cuda_device, switch, monkeypatch, wgmma, name):
    from mlx_moe_fix.kernels.moe_prefill import cuda_unsupported_reason, moe_prefill_kernel, tile_height

    prefill_gemm(switch, monkeypatch, wgmma)
    mode, glu, kind, tokens, routing, bias, scaled, tile = FP4_PREFILL_CASES[name]
    group = 32 if mode == "mxfp4" else 16
    case = make_case(mx.bfloat16, (4, group, mode), glu, kind, 7.0, scaled, 256, 256, 8, 2, 1, tokens,
                     routing=routing, with_weights=True, bias=bias)
    assert all(p.mode == mode and (p.bias is not None) == bias for p in case.experts.projections)
    assert cuda_unsupported_reason(case.experts, mx.bfloat16) is None
    assert tile_height(case.indices.size, 8) == tile
    check(moe_prefill_kernel, case, float32_oracle(moe_prefill_reference, case))


def every_fp4_code(mode):
    """(experts, expected, in_dim): one-projection `mode` experts (2 of 64 x 128) whose expert 1
    holds every e2m1 code in each row's first 16 values, and expert 1's weights as MLX dequantises
    them, transposed: what one-hot activation rows routed to it read out of a kernel. Scale bytes:
    mxfp4's e8m0 100-140 (127, 128, 129 and 140 among them: 2^-27 .. 2^13); nvfp4's every e4m3
    byte but its two NaNs, subnormals and negative scales among them."""
    experts, out_dim, in_dim = 2, 64, 128
    group = 32 if mode == "mxfp4" else 16
    codes = mx.random.randint(0, 16, (experts, out_dim, in_dim))
    codes[1, :, :16] = mx.arange(16)
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    words = (codes.reshape(experts, out_dim, in_dim // 8, 8).astype(mx.uint32) << shifts).sum(axis=-1).astype(mx.uint32)
    if mode == "mxfp4":
        scales = mx.random.randint(100, 141, (experts, out_dim, in_dim // group)).astype(mx.uint8)
        scales[1, :4, 0] = mx.array([127, 128, 129, 140], dtype=mx.uint8)
    else:
        finite = mx.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=mx.uint8)
        scales = finite[mx.random.randint(0, finite.size, (experts, out_dim, in_dim // group))]
        scales[1, :, :2] = finite.reshape(-1, 2)[:out_dim]
    moe = MoEExperts((ExpertLinear(words, scales, None, group_size=group, bits=4, mode=mode),))
    return moe, mx.dequantize(words[1], scales[1], group_size=group, bits=4, mode=mode).T, in_dim


@pytest.mark.parametrize("op, mode, dtypes", [("moe_prefill", "mxfp4", (mx.bfloat16,)), ("moe_prefill", "nvfp4", (mx.bfloat16,)),
                                              ("moe_decode", "mxfp4", (mx.bfloat16, mx.float16)),
                                              ("moe_decode", "nvfp4", (mx.bfloat16, mx.float16))])
def test_cuda_kernels_read_every_fp4_code_and_scale_exactly(cuda_device, op, mode, dtypes):
    # One-hot activation rows read each weight out of a kernel unrounded. The prefill GEMM
    # dequantises to bf16 (code 1, 0.5, passes through a bf16 subnormal; mxfp4 scales past the
    # 2^(e - 1) that one product would need, which overflows bf16 from e = 129; nvfp4's e4m3 scales
    # through fp16's bits); the decode GEMV sums codes as signed bytes of twice their values (PRMT
    # lookups) in fixed point, nvfp4's two groups a vector apart.
    assert_kernel_reads_every_fp4_code(sys.modules[f"mlx_moe_fix.kernels.{op}"], op, mode, dtypes)


def assert_kernel_reads_every_fp4_code(module, op: str, mode: str, dtypes) -> None:
    """`module`'s `<op>_kernel` reads every_fp4_code's weights out exactly: one-hot activation rows
    of each of `dtypes` routed to its expert 1."""
    moe, expected, in_dim = every_fp4_code(mode)
    for dtype in dtypes:
        assert module.cuda_unsupported_reason(moe, dtype) is None
        out = getattr(module, f"{op}_kernel")(mx.eye(in_dim, dtype=dtype), mx.ones((in_dim, 1), dtype=mx.uint32), moe)[:, 0, :]
        assert mx.array_equal(out, expected.astype(dtype)).item(), (dtype, mx.abs(out.astype(mx.float32) - expected).max())


def test_wgmma_k_order_puts_each_physical_column_where_grouped_wgmma_reads_it():
    # cuda/moe_prefill.cu, wgmma_column: thread t's register pair (e) of k16 step 2 half + s,
    # second register h, holds physical k 16t + 8 half + 4e + 2s + h, which wgmma reads as
    # column 32 half + 16 s + 8 h + 2t + e of the k-step; the mapping repeats every 64 columns.
    from mlx_moe_fix.kernels.moe_prefill import wgmma_k_order

    rows = mx.arange(3 * 192, dtype=mx.int32).reshape(3, 192)
    permuted = wgmma_k_order(rows)
    for step in range(3):
        for t, half, e, s, h in itertools.product(range(4), range(2), range(2), range(2), range(2)):
            column = step * 64 + 32 * half + 16 * s + 8 * h + 2 * t + e
            assert permuted[1, column].item() == rows[1, step * 64 + 16 * t + 8 * half + 4 * e + 2 * s + h].item()
