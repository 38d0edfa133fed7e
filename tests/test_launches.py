"""The CUDA launchers' arguments, on any machine: kernel objects replaced by recorders, so that
what a launch would be given is checked where no GPU runs it."""

import sys

import mlx.core as mx

from .parity.cases import make_case

import mlx_moe_fix.kernels  # noqa: F401  loads the op modules (their names are the dispatchers')

PREFILL = sys.modules["mlx_moe_fix.kernels.moe_prefill"]
DECODE = sys.modules["mlx_moe_fix.kernels.moe_decode"]
ROUTED = sys.modules["mlx_moe_fix.kernels.moe_routed_decode"]


def recorded_decode_kernels(monkeypatch) -> list:
    """The decode modules' CUDA kernel objects replaced by Recorders; returns the list of
    (section, shared bytes, launch bounds) they are asked for, in order."""
    created = []
    for module in (DECODE, ROUTED):
        monkeypatch.setattr(module, "cuda_kernel_object", lambda filename, section, inputs, outputs, shared, bounds, constants=():
                            created.append((section, shared, bounds)) or Recorder(section))
    return created


class Recorder:
    def __init__(self, section):
        self.section, self.calls = section, []

    def __call__(self, **launch):
        self.calls.append(launch)
        return [mx.zeros(shape, dtype) for shape, dtype in zip(launch["output_shapes"], launch["output_dtypes"])]


def test_grouped_launches_are_built_once_per_layer_stage_and_tile(monkeypatch):
    recorders = {}
    monkeypatch.setattr(PREFILL, "cuda_kernel_object",
                        lambda filename, section, *rest: recorders.setdefault(section, Recorder(section)))
    built = []
    build = PREFILL._grouped_launch
    monkeypatch.setattr(PREFILL, "_grouped_launch", lambda experts, stage, *rest: built.append(stage) or build(experts, stage, *rest))
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 7.0, False, 128, 256, 8, 2, 1, 48, with_weights=True)
    tiles = []
    for tokens in (48, 80):  # the same tile height (32 rows), other grids
        x = mx.zeros((1, tokens, 128), mx.bfloat16)
        indices = mx.broadcast_to(mx.array([0, 1], mx.uint32), (1, tokens, 2))
        weights = mx.full((1, tokens, 2), 0.5, mx.bfloat16)
        PREFILL.moe_prefill_kernel(x, indices, case.experts, weights)
        tiles.append(PREFILL.grid_tiles(indices.size, 8, PREFILL.tile_height(indices.size, 8)))
    assert built == ["first", "last"]  # once per stage of the layer at this tile height
    first_call, last_call, first_again, last_again = recorders["grouped"].calls
    for call, again in ((first_call, first_again), (last_call, last_again)):
        # the weights, placeholders, dims and params: the same objects at every call of the layer
        assert all(a is b for a, b in zip(call["inputs"][3:], again["inputs"][3:])) and len(call["inputs"]) == 14
        assert call["template"] == again["template"]
    assert [c["grid"][1] for c in (first_call, first_again)] == tiles and tiles[0] != tiles[1]
    assert dict(first_call["template"])["ACTIVATE"] and dict(first_call["template"])["PAIRS_IN"]
    assert not dict(last_call["template"])["ACTIVATE"] and not dict(last_call["template"])["PAIRS_IN"]
    tile = dict(first_call["template"])["BM"]
    assert first_call["output_shapes"] == [(tiles[0] * tile, 256)] and last_call["output_shapes"] == [(48 * 2, 128)]
    assert len(recorders["combine"].calls) == 2


def test_wgmma_gate_up_takes_256_row_blocks_where_its_k_loop_is_long(monkeypatch):
    # moe_prefill.wgmma_block_rows: four warpgroups (512 threads, one block an SM) at in_dim >=
    # WGMMA_WIDE_MIN_K, two (256, two blocks) below; RBN, the grid and the shared memory follow (with
    # room to start the activation stages on the swizzle pattern's 1024 bytes).
    created = []
    monkeypatch.setattr(PREFILL, "cuda_kernel_object", lambda filename, section, inputs, outputs, shared, bounds, constants=():
                        created.append((section, shared, bounds)) or Recorder(section))
    monkeypatch.setattr(PREFILL, "wgmma_device", lambda: True)
    plans = []
    for hidden in (PREFILL.WGMMA_WIDE_MIN_K - 64, PREFILL.WGMMA_WIDE_MIN_K):
        case = make_case(mx.bfloat16, (4, 64), True, "swiglu", None, False, hidden, 640, 2, 1, 1, 128, with_weights=True)
        tile = PREFILL.tile_height(case.indices.size, 2)
        assert tile >= PREFILL.wgmma_min_tile(case.experts, "first") and PREFILL.gemm_kernel(case.experts, "first", tile) == "grouped_wgmma"
        launch = PREFILL._grouped_launch(case.experts, "first", tile, 1, mx.bfloat16, "grouped_wgmma")
        section, shared, bounds = created[-1]
        weight_bytes = 2 * dict(launch.template)["RBN"] * PREFILL.BLOCK_K // 2
        assert section == "grouped_wgmma" and shared == PREFILL.WGMMA_STAGES * (tile * PREFILL.BLOCK_K * 2 + weight_bytes) + PREFILL.WGMMA_SWIZZLE_BYTES
        plans.append((dict(launch.template)["RBN"], launch.threadgroup[0], launch.grid[0], bounds))
    # 640 output rows: 5 blocks of 128, 3 of 256 (the last half past the rows)
    assert plans == [(128, 256, 5 * 256, (256, 2)), (256, 512, 3 * 512, (512, 1))]


def test_a_16_bit_gate_up_splits_its_activation_row_once_a_block_where_it_fits(monkeypatch):
    # moe_decode.shared_split_bytes: CUDA gate+up launches in fixed point (16-bit activations)
    # get SPLIT_BYTES_PER_VECTOR of shared memory a 128-bit weight vector of the row and
    # SHARED_SPLIT; fp32 activations, a row past MAX_SPLIT_BYTES and Metal get neither.
    decode, routed = DECODE, ROUTED
    created = recorded_decode_kernels(monkeypatch)

    def plan(dtype, bits, backend="cuda"):
        case = make_case(dtype, (bits, 64), True, "swiglu", None, False, 256, 128, 8, 2, 1, 1)
        template = dict(decode.gate_up_launch(case.experts, 2, 2, dtype, backend).template)
        return template.get("SHARED_SPLIT"), created[-1][:2] if backend == "cuda" else None

    assert plan(mx.bfloat16, 4) == (True, ("gate_up", 256 * 4 // 128 * decode.SPLIT_BYTES_PER_VECTOR))
    assert plan(mx.float16, 8) == (True, ("gate_up", 256 * 8 // 128 * decode.SPLIT_BYTES_PER_VECTOR))
    assert plan(mx.float32, 4) == (False, ("gate_up", 0))
    monkeypatch.setattr(decode, "metal_kernel_object", lambda *a: Recorder("metal"))
    assert plan(mx.bfloat16, 4, "metal") == (None, None)
    monkeypatch.setattr(decode, "MAX_SPLIT_BYTES", 256 * 4 // 128 * decode.SPLIT_BYTES_PER_VECTOR - 1)
    assert plan(mx.bfloat16, 4) == (False, ("gate_up", 0))
    # the routed gate+up launch takes the plain one's shared memory
    monkeypatch.setattr(decode, "MAX_SPLIT_BYTES", 48 * 1024)
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", None, False, 256, 128, 8, 2, 1, 1)
    from mlx_moe_fix.kernels.moe_router import Routing
    routed._launches(case.experts, Routing("softmax_topk", 2, True), (1, 1), mx.bfloat16)
    assert ("routed_gate_up", 256 * 4 // 128 * decode.SPLIT_BYTES_PER_VECTOR) in [c[:2] for c in created]


def test_the_combining_down_of_4_bit_experts_at_top_k_8_takes_one_pair_a_warp_in_8_warp_blocks(monkeypatch):
    # moe_decode.down_block_shape: in fixed point (CUDA, 16-bit activations) the combining down of
    # 4-bit experts at top-k >= 8 runs blocks of 8 warps, each one pair's 8 rows, bounded for 8-warp blocks; the
    # other downs keep 4-warp blocks of 4 rows a warp. Either way one block's warps cover the
    # token's pairs, and the grid covers every output row.
    decode, routed = DECODE, ROUTED
    created = recorded_decode_kernels(monkeypatch)
    monkeypatch.setattr(decode, "metal_kernel_object", lambda *a: Recorder("metal"))

    def down(dtype, top_k, backend="cuda", out=256, bits=4):
        case = make_case(dtype, (bits, 64), True, "swiglu", None, False, out, 128, 8, top_k, 1, 1)
        launch = decode.decode_launches(case.experts, top_k, 2 * top_k, dtype, dtype, backend)[1]
        template = dict(launch.template)
        return (template["WARPS"], template["RPW"]), launch.grid, launch.threadgroup

    assert down(mx.bfloat16, 8) == ((8, 8), (256 // 8 * 256, 2, 1), (256, 1, 1))
    assert created[-1] == ("down", 0, (256, 2)) and decode.ONE_PAIR_A_WARP_DOWN.launch_bounds() == (256, 2)
    assert down(mx.float16, 8, out=320) == ((8, 8), (320 // 8 * 256, 2, 1), (256, 1, 1))
    for dtype, top_k, backend, bits in ((mx.bfloat16, 2, "cuda", 4), (mx.float32, 8, "cuda", 4), (mx.bfloat16, 8, "metal", 4),
                                        (mx.bfloat16, 8, "cuda", 8)):
        # 4 warps of 4 rows: the pairs over min(top_k, 4) warps, the rest over rows
        assert down(dtype, top_k, backend, bits=bits) == ((4, 4), (256 // (4 // min(top_k, 4) * 4) * 128, 2, 1), (128, 1, 1))
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", None, False, 256, 128, 8, 8, 1, 1)
    from mlx_moe_fix.kernels.moe_router import Routing
    routed._launches(case.experts, Routing("softmax_topk", 8, True), (1, 1), mx.bfloat16)
    bounds = {section: bound for section, _, bound in created}
    assert bounds["routed_down"] == (256, 2) and bounds["routed_gate_up"] == (128, 4)


def test_a_gate_up_block_shape_reaches_the_plain_and_the_routed_gate_up_launch(monkeypatch):
    # moe_decode.GATE_UP_BLOCK, read at each launch plan (benchmarks/block_shapes.py sets it): its
    # warps and rows a warp in the template and the grid, its resident warps in the launch bounds,
    # for both gate+up launches; the downs keep theirs.
    from mlx_moe_fix.kernels.moe_router import Routing

    decode, routed = DECODE, ROUTED
    created = recorded_decode_kernels(monkeypatch)
    monkeypatch.setattr(decode, "GATE_UP_BLOCK", decode.BlockShape(4, 2, 24))
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", None, False, 256, 128, 8, 8, 1, 1)
    gate_up, down = routed._launches(case.experts, Routing("softmax_topk", 8, True), (1, 1), mx.bfloat16)
    plain = decode.gate_up_launch(case.experts, 8, 8, mx.bfloat16, "cuda")
    for launch in (gate_up, plain):
        template = dict(launch.template)
        assert (template["WARPS"], template["RPW"]) == (4, 2)
        assert launch.grid == (128 // (4 * 2) * 128, 8, 1) and launch.threadgroup == (128, 1, 1)  # 128 hidden rows a pair
    bounds = {section: bound for section, _, bound in created}
    assert bounds["routed_gate_up"] == bounds["gate_up"] == (128, 6)
    assert (dict(down.template)["WARPS"], dict(down.template)["RPW"]) == (8, 8) and bounds["routed_down"] == (256, 2)


def test_global_qualifiers_give_launch_bounds_to_the_kernel_mlx_declares():
    from mlx_moe_fix.kernels.launch import global_qualifiers

    bounded = global_qualifiers((128, 4))
    assert "#define __global__ __location__(global) __launch_bounds__(128, 4)\n" in bounded
    assert bounded.startswith("#if defined(__global__) && defined(__location__)\n#undef __global__\n") and bounded.endswith("#endif\n")
    assert global_qualifiers() == ""


def test_the_router_goes_inside_the_gate_up_launch_only_where_its_blocks_fit_one_wave(monkeypatch):
    """Every block of router_gate_up computes the token's logits, so a launch of more
    blocks than the GPU runs at once would compute them again each wave: at the H200's 132 SMs (4
    blocks of 4 warps an SM), Qwen3-30B-A3B's gate+up (768 rows, top-8: 384 blocks) takes the
    router inside, Mixtral-8x7B's (14336 rows, top-2: 1792 blocks) keeps the router's node."""
    from types import SimpleNamespace

    def experts(rows):
        return SimpleNamespace(projections=[SimpleNamespace(output_dims=rows)] * 3)

    qwen3, mixtral = experts(768), experts(14336)
    assert (ROUTED.fused_router_blocks(qwen3, 8), ROUTED.fused_router_blocks(mixtral, 2)) == (384, 1792)
    assert ROUTED.fused_router_blocks(experts(40), 2) == 6  # 3 row groups for each of 2 pairs
    monkeypatch.setattr(ROUTED, "multiprocessor_count", lambda: 132)
    assert ROUTED.one_wave_blocks() == 528
    assert ROUTED._waves_reason(qwen3, 8) is None
    assert "1792 gate+up blocks, more than the 528 of one wave" in ROUTED._waves_reason(mixtral, 2)
    monkeypatch.setattr(ROUTED, "multiprocessor_count", lambda: None)
    assert "SM count is unknown" in ROUTED._waves_reason(qwen3, 8)


def test_cuda_decode_launches_declare_their_params_and_absent_inputs_in_their_source(monkeypatch):
    # launch.source_constants: a CUDA decode launch passes its weights and dims (the routed
    # gate+up's with the expert count after them); params and the absent optional inputs are
    # declared at the start of the kernel's body, the floats by their bits. Metal passes them all.
    from mlx_moe_fix.kernels.launch import SourceConstant, absent
    from mlx_moe_fix.kernels.moe_router import Routing

    decode, routed = DECODE, ROUTED
    kernels = []
    for module in (DECODE, ROUTED):
        monkeypatch.setattr(module, "cuda_kernel_object", lambda filename, section, inputs, outputs, shared, bounds,
                            constants=(): kernels.append((section, inputs, constants)) or Recorder(section))
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu_oai", 7.0, False, 256, 128, 8, 2, 1, 1, bias=True)
    gate_up, down = routed._launches(case.experts, Routing("softmax_topk", 2, True), (1, 1), mx.bfloat16)
    sections = {section: (inputs, {c.name: c for c in constants}) for section, inputs, constants in kernels}
    inputs, constants = sections["routed_gate_up"]
    gate, up = case.experts.projections[:2]
    *arrays, dims = gate_up.fixed_inputs
    assert arrays == [gate.weight, gate.scales, gate.biases, up.weight, up.scales, up.biases, gate.bias, up.bias]
    assert dims.tolist() == [256, 128, 2, 1, 1, 1, 0, 8] and inputs[-2:] == ("dims", "params")
    assert set(constants) == {"gate_scale", "params"} and constants["gate_scale"] == SourceConstant("gate_scale", None, None)
    limit, alpha = constants["params"].values
    assert (limit, alpha) == (7.0, mx.array(case.experts.activation.alpha).item()) and "__int_as_float(1088421888)" in constants["params"].declaration()
    assert constants["gate_scale"].declaration() == "const float* gate_scale = reinterpret_cast<const float*>(dims);\n"
    inputs, constants = sections["routed_down"]
    last = case.experts.projections[-1]
    assert down.fixed_inputs[:4] == [last.weight, last.scales, last.biases, last.bias] and len(down.fixed_inputs) == 5
    assert set(constants) == {"out_scale", "residual"} and dict(down.template)["RESIDUAL"] is False
    # with a decoder layer's residual: passed after the hidden input, added in the launch
    kernels.clear()
    _, down = routed._launches(case.experts, Routing("softmax_topk", 2, True), (1, 1), mx.bfloat16, residual=True)
    inputs, constants = {section: (inputs, {c.name: c for c in constants}) for section, inputs, constants in kernels}["routed_down"]
    assert inputs[:2] == ("hidden", "residual") and set(constants) == {"out_scale"} and dict(down.template)["RESIDUAL"] is True
    assert len(down.fixed_inputs) == 5
    monkeypatch.setattr(decode, "metal_kernel_object", lambda *a: Recorder("metal"))
    metal = decode.gate_up_launch(case.experts, 2, 2, mx.bfloat16, "metal")
    assert len(metal.fixed_inputs) == 11 and metal.fixed_inputs[8] is absent()


def test_the_combining_down_with_shared_experts_keeps_4_warp_blocks_for_fp4_experts(monkeypatch):
    # moe_decode.down_block_shape: with shared experts, mxfp4 / nvfp4 experts' down spilled at one
    # pair a warp's bounds (tests/test_cuda_sources.py checks the bounds each shape gets), so it
    # keeps 4-warp blocks of 4 rows a warp at any top-k; affine ones take one pair a warp from 8
    # routed and shared pairs on.
    from .parity.test_shared_decode import make_shared_case

    recorded_decode_kernels(monkeypatch)
    for quantization, shape in (((4, 64), (8, 8)), ((4, 32, "mxfp4"), (4, 4)), ((4, 16, "nvfp4"), (4, 4))):
        case = make_shared_case("inkling", mx.bfloat16, quantization, 128, 64, 16, 6, 2, 1)
        down = DECODE.shared_decode_launches(case.experts, case.shared, 6, 1, mx.bfloat16, True)[1]
        template = dict(down.template)
        assert (template["WARPS"], template["RPW"]) == shape, quantization
