"""The CUDA kernel sources compile for sm_90a (what MLX's NVRTC targets on Hopper), with the signatures mx.fast.cuda_kernel generates
from the launchers' input names: syntax and type errors show up here, before GPU time is spent.
Needs nvcc (skipped, with the reason, where there is none); nothing runs."""

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from mlx_moe_fix.kernels.sources import cuda_kernel_source

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine: CUDA sources not compiled")

import mlx_moe_fix.kernels  # noqa: E402,F401  loads the op modules (their names are the dispatchers')

DECODE = sys.modules["mlx_moe_fix.kernels.moe_decode"]
PREFILL = sys.modules["mlx_moe_fix.kernels.moe_prefill"]
ROUTER = sys.modules["mlx_moe_fix.kernels.moe_router"]
ROUTED = sys.modules["mlx_moe_fix.kernels.moe_routed_decode"]

# C types of the inputs, as cuda_kernel declares them from the arrays the launchers pass.
INT_INPUTS = {"indices": "uint32_t", "row_pair": "int32_t", "tile_expert": "int32_t", "dims": "int32_t", "sizes": "int32_t",
              "token_ids": "int32_t", "expert_table": "int32_t"}
WEIGHT_INPUTS = {"gate_w", "up_w", "w", "w0", "w1", "router_w", "shared_gate_w", "shared_up_w", "shared_w"}
FLOAT_INPUTS = {"params", "gate_scale", "out_scale", "scale", "correction", "global_scale"}


BIAS_INPUTS = {"bias0", "bias1", "gate_bias", "up_bias", "bias"}  # S, or the float32 placeholder


# mxfp4 / nvfp4 experts' kernels (S = uint8_t: the prefill's FP4, the decode's S "uint8_t"): e8m0 /
# e4m3 scale bytes, the absent quantization biases' float32 placeholder.
FP4_INPUTS = {**dict.fromkeys(("s0", "s1", "s", "gate_s", "up_s", "shared_gate_s", "shared_up_s", "shared_s"), "uint8_t"),
              **dict.fromkeys(("b0", "b1", "b", "gate_b", "up_b", "shared_gate_b", "shared_up_b", "shared_b"), "float")}


def signature(name, inputs, outputs, t, has_bias, fp4=False):
    def ctype(n):
        if fp4 and n in FP4_INPUTS:
            return FP4_INPUTS[n]
        if n in INT_INPUTS:
            return INT_INPUTS[n]
        if n in WEIGHT_INPUTS:
            return "uint32_t"
        if n in BIAS_INPUTS:
            return t if has_bias else "float"
        return "float" if n in FLOAT_INPUTS else t

    params = [f"const {ctype(n)}* {n}" for n in inputs] + [f"{ctype(n)}* {n}" for n in outputs]
    return f"__global__ void {name}({', '.join(params)})"


def translation_unit(module, filename, variants, source_constants=()):
    """One file of kernels of one stage, with the header and body cuda_kernel gets for it; the
    inputs among `source_constants` (launch.SourceConstants) declared in the body, not passed."""
    (stage,) = {variant[0] for variant in variants}
    header, body = cuda_kernel_source(filename, stage)
    declared = {constant.name for constant in source_constants}
    inputs = [name for name in module.INPUTS[stage] if name not in declared]
    body = "".join(constant.declaration() for constant in source_constants) + body
    text = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cstdint>\n" + header
    for i, (_, t, constants) in enumerate(variants):
        # S: the scales' type, a template type of the variant (not a constant); "uint8_t": FP4
        s_type = constants.get("S", "uint8_t" if constants.get("FP4") else t)
        fp4 = s_type == "uint8_t"
        lines = [f"  using T = {t}; using S = {s_type}; using SC = float; using WT = {t};"]
        lines += [f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};" for k, v in constants.items()
                  if k != "S"]
        text += f"\n{signature(f'k{i}', inputs, module.OUTPUTS[stage], t, constants.get('HAS_BIAS'), fp4)} {{\n"
        text += "\n".join(lines)
        text += f"\n{body}\n}}\n"
    return text


# Variants a translation unit holds at most: a stage's many variants in a few units, which
# compile_all builds side by side (nvcc uses one core; ptxas takes most of its time).
UNIT_VARIANTS = 6


def translation_units(module, filename, variants):
    """Each stage's variants as translation_unit texts of at most UNIT_VARIANTS variants: a
    stage's header keeps only the declarations it reaches."""
    stages = dict.fromkeys(variant[0] for variant in variants)
    units = []
    for stage in stages:
        of_stage = [v for v in variants if v[0] == stage]
        units += [translation_unit(module, filename, of_stage[i:i + UNIT_VARIANTS]) for i in range(0, len(of_stage), UNIT_VARIANTS)]
    return units


def compile_all(tmp_path, texts, *options) -> list:
    """nvcc's output (stdout, then stderr) for each text compiled for sm_90a with `options`, as
    many at once as there are cores; fails on the first that does not compile. Device code only
    (a cubin), as NVRTC builds it for MLX: the host pass would add a third of the time and check
    nothing the kernels run."""

    def build(i):
        path = tmp_path / f"kernels{i}.cu"
        path.write_text(texts[i])
        return subprocess.run(
            [NVCC, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", *options, "-o", str(tmp_path / f"kernels{i}.cubin"),
             str(path)],
            capture_output=True, text=True, timeout=300,
        )

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = list(pool.map(build, range(len(texts))))
    for result in done:
        assert result.returncode == 0, result.stderr[-4000:]
    return [result.stdout + result.stderr for result in done]


@pytest.mark.parametrize("t", ["__nv_bfloat16", "__half", "float"])
def test_decode_kernels_compile(tmp_path, t):
    variants = []
    for bits, group in ((4, 64), (8, 32)):
        base = {"BITS": bits, "GROUP": group, "WARPS": 8, "HAS_BIAS": bits == 8, "RPW": 4 if bits == 4 else 1}
        variants += [("gate_up", t, {**base, "GATED": gated, "SHARED_SPLIT": split})
                     for gated in (True, False) for split in (False, t != "float")]
        variants += [("down", t, {**base, "INPUT_PER_PAIR": p, "COMBINE": c}) for p in (True, False) for c in (True, False)]
        variants += [("routed_down", t, {**base, "RESIDUAL": residual}) for residual in (False, True)]
        variants += [("shared_gate_up", t, {**base, "GATED": True, "SHARED_SPLIT": split, "SHARED": 2, "SHARED_WEIGHTS": weighted})
                     for split in (False, t != "float") for weighted in (False, True)]
        variants += [(stage, t, {**base, "SHARED": shared}) for stage in ("shared_down", "routed_shared_down") for shared in (1, 2)]
    for group in (32, 16) if t != "float" else ():
        # mxfp4 (group 32) and nvfp4 (16) experts against 16-bit activations (moe_decode.cuda_unsupported_reason), with
        # gpt-oss's biases
        fp4 = {"S": "uint8_t", "BITS": 4, "GROUP": group, "WARPS": 8, "RPW": 4, "HAS_BIAS": True}
        variants += [("gate_up", t, {**fp4, "GATED": gated, "SHARED_SPLIT": split}) for gated in (True, False) for split in (False, True)]
        variants += [("down", t, {**fp4, "INPUT_PER_PAIR": True, "COMBINE": c}) for c in (True, False)]
        variants += [("routed_down", t, {**fp4, "RESIDUAL": residual}) for residual in (False, True)]
        # with shared experts quantized as the routed ones (moe_shared_decode.cuda_unsupported_reason)
        variants += [("shared_gate_up", t, {**fp4, "HAS_BIAS": False, "GATED": True, "SHARED_SPLIT": split, "SHARED": 2,
                                            "SHARED_WEIGHTS": weighted}) for split in (False, True) for weighted in (False, True)]
        variants += [(stage, t, {**fp4, "HAS_BIAS": False, "SHARED": 2}) for stage in ("shared_down", "routed_shared_down")]
    compile_all(tmp_path, translation_units(DECODE, "moe_decode.cu", variants))


def test_a_kernel_compiles_with_its_header_included_from_its_file(tmp_path, monkeypatch):
    """What MLX compiles (launch.cuda_kernel_object): the header as cuda_header_directive's
    `#include` of the file it wrote."""
    from mlx_moe_fix.kernels.sources import cuda_header_directive

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cuda_header_directive.cache_clear()
    try:
        header, _ = cuda_kernel_source("moe_routed_decode.cu", "routed_gate_up")
        constants = {"BITS": 4, "GROUP": 64, "WARPS": 4, "HAS_BIAS": False, "RPW": 4, "GATED": True, "SHARED_SPLIT": True,
                     "SOFTMAX_FIRST": True, "NORMALIZE": True, "LAST_K": True}
        text = translation_unit(ROUTED, "moe_routed_decode.cu", [("routed_gate_up", "__nv_bfloat16", constants)])
        directive = cuda_header_directive(header)
        assert directive.startswith("#include") and text.count(header) == 1
        compile_all(tmp_path, [text.replace(header, directive)])
    finally:
        cuda_header_directive.cache_clear()


@pytest.mark.parametrize("t", ["__nv_bfloat16", "__half"])
def test_prefill_kernel_compiles(tmp_path, t):
    quantizations = ((4, 64, 64, False), (8, 32, 32, False), (4, 128, 16, False), (8, 64, 64, False))
    if t == "__nv_bfloat16":  # mxfp4 (group 32) and nvfp4 (16) against bf16 only (moe_prefill.cuda_unsupported_reason)
        quantizations += ((4, 32, 64, True), (4, 32, 16, True), (4, 16, 64, True))
    variants = [
        (gemm, t, {"BITS": bits, "GROUP": group, "FP4": fp4, "BM": bm, "PAIRS_IN": pairs_in, "ACTIVATE": activate,
                   "GATED": gated, "ACT": act, "LIMITED": act < 2, "HAS_BIAS": bits == 8 or (fp4 and act == 1),
                   **({"RBN": 128 << act, "K_ORDER_OUT": activate and act == 0} if gemm == "grouped_wgmma" else {})})  # wgmma's two block widths
        for bits, group, bm, fp4 in quantizations
        for pairs_in, activate, gated, act in ((True, True, True, 0), (True, True, True, 1), (True, True, False, 3),
                                               (False, False, False, 0), (True, False, False, 0))
        for gemm in PREFILL.GEMMS if gemm == "grouped" or (activate == gated == pairs_in and bits == 4)  # wgmma: 4-bit gate+up, down
    ]
    variants.append(("route", t, {"TILE": 128, "MAX_EXPERTS": PREFILL.ROUTE_MAX_EXPERTS}))
    variants.append(("k_order", t, {"THREADS": PREFILL.K_ORDER_THREADS}))
    variants.append(("combine", t, {}))
    compile_all(tmp_path, translation_units(PREFILL, "moe_prefill.cu", variants))


@pytest.mark.parametrize("t", ["__nv_bfloat16", "__half", "float"])
def test_router_kernel_compiles(tmp_path, t):
    variants = [("topk", t, {"SOFTMAX_FIRST": first, "NORMALIZE": first and normalize, "LAST_K": last_k})
                for first in (True, False) for normalize in (True, False) for last_k in (True, False)]
    variants.append(("sigmoid_topk", t, {}))
    variants += [(kind, t, {"NORMALIZE": normalize}) for kind in ("sqrtsoftplus_topk", "sqrtsoftplus_hash")
                 for normalize in (True, False)]
    compile_all(tmp_path, translation_units(ROUTER, "moe_router.cu", variants))


@pytest.mark.parametrize("t", ["__nv_bfloat16", "__half", "float"])
def test_routed_decode_kernel_compiles(tmp_path, t):
    variants = [("routed_gate_up", t, {"BITS": bits, "GROUP": group, "WARPS": 8, "RPW": 4, "HAS_BIAS": bits == 8,
                                       "GATED": gated, "SHARED_SPLIT": t != "float" and first,
                                       "SOFTMAX_FIRST": first, "NORMALIZE": first, "LAST_K": first})
                for bits, group in ((4, 64), (8, 32)) for gated in (True, False) for first in (True, False)]
    variants += [("sigmoid_shared_gate_up", t, {"BITS": bits, "GROUP": group, "WARPS": 4, "RPW": 4, "HAS_BIAS": bits == 8,
                                                "GATED": True, "SHARED_SPLIT": t != "float" and split, "SHARED": shared})
                 for bits, group in ((4, 64), (8, 32)) for split in (True, False) for shared in (1, 2)]
    if t != "float":  # mxfp4 experts, as gpt-oss's block routes them; FP4 ones with their shared experts, as Inkling's
        variants += [("routed_gate_up", t, {"S": "uint8_t", "BITS": 4, "GROUP": 32, "WARPS": 8, "RPW": 4, "HAS_BIAS": True, "GATED": True,
                                            "SHARED_SPLIT": True, "SOFTMAX_FIRST": False, "NORMALIZE": False, "LAST_K": False})]
        variants += [("sigmoid_shared_gate_up", t, {"S": "uint8_t", "BITS": 4, "GROUP": group, "WARPS": 4, "RPW": 4, "HAS_BIAS": False,
                                                    "GATED": True, "SHARED_SPLIT": True, "SHARED": 2}) for group in (32, 16)]
    texts = translation_units(ROUTED, "moe_routed_decode.cu", variants)
    if t == "__nv_bfloat16":  # router_gate_up reproduces MLX's bf16 quantized_matmul: bf16 only
        router_variants = [("router_gate_up", t, {"BITS": bits, "GROUP": 64, "WARPS": 4, "RPW": 4, "HAS_BIAS": False, "GATED": True,
                                                  "SHARED_SPLIT": True, "SOFTMAX_FIRST": first, "NORMALIZE": first, "LAST_K": first,
                                                  "ROUTER_BITS": router_bits, "ROUTER_GROUP": router_group})
                           for bits in (4, 8) for first in (True, False) for router_bits, router_group in ((8, 64), (4, 32))]
        texts += translation_units(ROUTED, "moe_routed_decode.cu", router_variants)
    compile_all(tmp_path, texts)


def resource_usage(tmp_path, text) -> str:
    return compile_all(tmp_path, [text], "--resource-usage")[0]


def with_launch_bounds(text, filename, stage, bounds):
    from mlx_moe_fix.kernels.launch import global_qualifiers

    header = cuda_kernel_source(filename, stage)[0]
    return text.replace(header, header + global_qualifiers(bounds))


def registers(usage: str) -> int:
    return int(re.search(r"Used (\d+) registers", usage).group(1))


@pytest.mark.parametrize("t", ["__nv_bfloat16", "__half", "float"])
@pytest.mark.parametrize("bits", [4, 8])
def test_decode_kernels_fit_their_launch_bounds_without_spilling(tmp_path, t, bits):
    # Every decode launch as production builds it (its moe_decode.BlockShape's launch bounds, the
    # routed module's too): the bound must hold the shape's resident warps an SM without spilling,
    # whichever GEMV path (the fixed-point one for 16-bit activations, else the fp32 loop) a
    # variant takes.
    base = {"BITS": bits, "GROUP": 64, "HAS_BIAS": False}
    split = {"SHARED_SPLIT": t != "float"}  # what shared_split_bytes gives at these shapes' rows

    def shaped(shape, variants):
        return shape, [{**v, "WARPS": shape.warps, "RPW": shape.rows} for v in variants]

    units = [
        (DECODE, "moe_decode.cu", "gate_up", *shaped(DECODE.GATE_UP_BLOCK, [{**base, **split, "GATED": gated} for gated in (True, False)])),
        (DECODE, "moe_decode.cu", "down",
         *shaped(DECODE.DOWN_BLOCK, [{**base, "INPUT_PER_PAIR": True, "COMBINE": combine} for combine in (True, False)])),
        *[(DECODE, "moe_decode.cu", "routed_down", *shaped(DECODE.DOWN_BLOCK, [{**base, "RESIDUAL": residual}]))
          for residual in (False, True)],
        (DECODE, "moe_decode.cu", "shared_gate_up", *shaped(DECODE.GATE_UP_BLOCK, [{**base, **split, "GATED": True, "SHARED": 2,
                                                                                   "SHARED_WEIGHTS": True}])),
        (DECODE, "moe_decode.cu", "shared_down", *shaped(DECODE.DOWN_BLOCK, [{**base, "SHARED": 2}])),
        (DECODE, "moe_decode.cu", "routed_shared_down", *shaped(DECODE.DOWN_BLOCK, [{**base, "SHARED": 2}])),
        (ROUTED, "moe_routed_decode.cu", "sigmoid_shared_gate_up",
         *shaped(DECODE.GATE_UP_BLOCK, [{**base, **split, "GATED": True, "SHARED": 2}])),
        (ROUTED, "moe_routed_decode.cu", "routed_gate_up",
         *shaped(DECODE.GATE_UP_BLOCK, [{**base, **split, "GATED": True, "SOFTMAX_FIRST": True, "NORMALIZE": True, "LAST_K": True}])),
    ]
    if t == "__nv_bfloat16":
        units.append((ROUTED, "moe_routed_decode.cu", "router_gate_up",
                      *shaped(DECODE.GATE_UP_BLOCK, [{**base, **split, "GATED": True, "SOFTMAX_FIRST": True, "NORMALIZE": True,
                                                      "LAST_K": True, "ROUTER_BITS": router_bits, "ROUTER_GROUP": 64}
                                                     for router_bits in (4, 8)])))
    for group in (32, 16) if t != "float" and bits == 4 else ():  # mxfp4 and nvfp4 experts (S = uint8_t)
        fp4 = {**base, "S": "uint8_t", "GROUP": group}
        units += [
            (DECODE, "moe_decode.cu", "gate_up", *shaped(DECODE.GATE_UP_BLOCK, [{**fp4, **split, "GATED": True}])),
            (DECODE, "moe_decode.cu", "routed_down", *shaped(DECODE.DOWN_BLOCK, [{**fp4, "RESIDUAL": True}])),
            (DECODE, "moe_decode.cu", "routed_down", *shaped(DECODE.ONE_PAIR_A_WARP_DOWN, [{**fp4, "RESIDUAL": True}])),
            (DECODE, "moe_decode.cu", "down", *shaped(DECODE.ONE_PAIR_A_WARP_DOWN, [{**fp4, "INPUT_PER_PAIR": True, "COMBINE": True}])),
            (ROUTED, "moe_routed_decode.cu", "routed_gate_up",
             *shaped(DECODE.GATE_UP_BLOCK, [{**fp4, **split, "GATED": True, "SOFTMAX_FIRST": False, "NORMALIZE": False,
                                             "LAST_K": False}])),
            (DECODE, "moe_decode.cu", "shared_gate_up", *shaped(DECODE.GATE_UP_BLOCK, [{**fp4, **split, "GATED": True, "SHARED": 2,
                                                                                      "SHARED_WEIGHTS": True}])),
            # with shared experts at DOWN_BLOCK's bounds whatever the top-k (moe_decode.down_block_shape)
            *[(DECODE, "moe_decode.cu", stage, *shaped(DECODE.DOWN_BLOCK, [{**fp4, "SHARED": 2}]))
              for stage in ("shared_down", "routed_shared_down")],
            (ROUTED, "moe_routed_decode.cu", "sigmoid_shared_gate_up",
             *shaped(DECODE.GATE_UP_BLOCK, [{**fp4, **split, "GATED": True, "SHARED": 2}])),
        ]
    if t != "float" and bits == 4:  # the combining down of one pair a warp (moe_decode.down_block_shape), its own bounds
        units += [(DECODE, "moe_decode.cu", "routed_down", *shaped(DECODE.ONE_PAIR_A_WARP_DOWN, [{**base, "RESIDUAL": residual}]))
                  for residual in (False, True)]
        units += [(DECODE, "moe_decode.cu", stage, *shaped(DECODE.ONE_PAIR_A_WARP_DOWN, [{**base, "SHARED": 2}]))
                  for stage in ("shared_down", "routed_shared_down")]
    # each unit as MLX compiles it at a model's shape without bias or scales (its params and absent
    # inputs declared in its source: launch.source_constants), and with every input passed
    units = [(*unit, constants) for unit in units
             for constants in [(), source_constants_of(unit[2], *MODEL_SHAPES[0], residual=unit[4][0].get("RESIDUAL", False))]]
    texts = [with_launch_bounds(translation_unit(module, filename, [(stage, t, constants) for constants in variants], declared),
                                filename, stage, shape.launch_bounds())
             for module, filename, stage, shape, variants, declared in units]
    for (module, filename, stage, shape, variants, _), usage in zip(units, compile_all(tmp_path, texts, "--resource-usage")):
        threads, blocks = shape.launch_bounds()
        used = [int(n) for n in re.findall(r"Used (\d+) registers", usage)]
        assert len(used) == len(variants) and max(used) <= 65536 // (threads * blocks), usage
        assert re.findall(r"(\d+) bytes spill stores", usage) == ["0"] * len(variants), usage


# (hidden, intermediate, top-k, experts) of Qwen3-30B-A3B and Mixtral-8x7B
MODEL_SHAPES = ((2048, 768, 8, 128), (4096, 14336, 2, 8))  # the source constants hold no shape: one is enough


def source_constants_of(stage, hidden, intermediate, top_k, experts, residual=False) -> tuple:
    """The SourceConstants of a decode launch of `stage` without bias or scales, at a model's shape
    (SwiGLU); routed_down's residual absent unless `residual`."""
    from mlx_moe_fix.kernels.launch import kernel_dims, kernel_params, source_constants

    if stage in ("down", "routed_down", "shared_down", "routed_shared_down"):
        fixed = {"bias": None, "out_scale": None, "dims": kernel_dims(intermediate, hidden, top_k)}
        if stage == "routed_down" and not residual:
            fixed = {"residual": None, **fixed}
    else:
        dims = kernel_dims(hidden, intermediate, top_k, None).tolist() + ([experts] if "routed" in stage or "router" in stage else [])
        fixed = {"gate_bias": None, "up_bias": None, "gate_scale": None, "dims": mx.array(dims, dtype=mx.int32),
                 "params": kernel_params(None) if stage != "sigmoid_shared_gate_up" else mx.array([0.0, 0.0, 1.0])}
    return source_constants(fixed)[0]


def test_a_bias_signature_that_disagrees_with_has_bias_does_not_compile(tmp_path):
    # MLX reuses a compiled kernel by name and template arguments: HAS_BIAS must tell the bias
    # inputs' type apart, and a kernel built with the wrong one must not compile at all.
    constants = {"BITS": 4, "GROUP": 64, "WARPS": 8, "GATED": True, "HAS_BIAS": True, "RPW": 1, "SHARED_SPLIT": False}
    text = translation_unit(DECODE, "moe_decode.cu", [("gate_up", "__nv_bfloat16", constants)])
    mismatched = text.replace("const __nv_bfloat16* up_bias", "const float* up_bias")
    assert mismatched != text
    path = tmp_path / "kernels.cu"
    path.write_text(mismatched)
    done = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "HAS_BIAS disagrees" in done.stderr


def test_one_matrix_prefill_gemm_fits_its_launch_bounds_without_spilling(tmp_path):
    # moe_prefill.launch_bounds_for: 64-row one-matrix GEMMs are capped to 3 blocks of 128
    # threads per SM (<= 170 registers); the cap must not make the 4-bit variant spill.
    assert PREFILL.launch_bounds_for(64, gated=False) == (128, PREFILL.ONE_MATRIX_MIN_BLOCKS)
    assert PREFILL.launch_bounds_for(64, gated=True) == () and PREFILL.launch_bounds_for(32, gated=False) == ()
    constants = {"BITS": 4, "GROUP": 64, "FP4": False, "BM": 64, "PAIRS_IN": False, "ACTIVATE": False, "GATED": False, "ACT": 0,
                 "LIMITED": False, "HAS_BIAS": False, "OUT_BITS": 0}
    text = translation_unit(PREFILL, "moe_prefill.cu", [("grouped", "__nv_bfloat16", constants)])
    usage = resource_usage(tmp_path, with_launch_bounds(text, "moe_prefill.cu", "grouped", PREFILL.launch_bounds_for(64, gated=False)))
    assert registers(usage) <= 65536 // (128 * PREFILL.ONE_MATRIX_MIN_BLOCKS) and "0 bytes spill stores" in usage, usage


def test_wgmma_gemm_is_neither_serialized_by_ptxas_nor_spilled(tmp_path):
    # ptxas serializes every wgmma of a kernel in which one is issued on a path it cannot prove
    # uniform across the warpgroup ("C7518 Potential Performance Loss: wgmma.mma_async instructions
    # are serialized"): each then waits for the one before. docs/benchmarks.md, sixty-third stop:
    # the staged GEMM (docs/experiments) with its wgmmas under a per-warpgroup branch earned it.
    # Both block widths (moe_prefill.wgmma_block_rows), gate+up and down, each under its launch
    # bounds (the register file over the threads they ask an SM for), unspilled.
    texts, limits, widths = [], [], []
    for in_dim in (PREFILL.WGMMA_WIDE_MIN_K // 2, PREFILL.WGMMA_WIDE_MIN_K):
        rows = PREFILL.wgmma_block_rows(in_dim)
        widths.append(rows)
        for gated in (True, False):
            variants = [("grouped_wgmma", t, {"BITS": 4, "GROUP": group, "FP4": fp4, "BM": 64, "PAIRS_IN": gated, "ACTIVATE": gated,
                                              "GATED": gated, "ACT": act, "LIMITED": gated and act < 2,
                                              "HAS_BIAS": fp4 and act == 1, "RBN": rows, "K_ORDER_OUT": gated})
                        for t, group, fp4 in (("__nv_bfloat16", 64, False), ("__half", 128, False), ("__nv_bfloat16", 32, True))
                        for act in ((0, 1) if gated else (0,))]
            bounds = PREFILL.launch_bounds_for(64, gated, "grouped_wgmma", in_dim)
            assert bounds[0] == 2 * rows
            texts += [with_launch_bounds(text, "moe_prefill.cu", "grouped_wgmma", bounds)
                      for text in translation_units(PREFILL, "moe_prefill.cu", variants)]
            limits += [65536 // (bounds[0] * bounds[1])] * len(variants)
    assert widths == [128, 256]
    assert limits[:6 + 3] == [128] * 6 + [85] * 3  # the down's 128-row blocks: three an SM
    for usage, limit in zip(compile_all(tmp_path, texts, "--resource-usage"), limits):
        assert "wgmma.mma_async instructions are serialized" not in usage, usage
        assert registers(usage) <= limit and "0 bytes spill stores" in usage, usage
