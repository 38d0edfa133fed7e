"""The Metal kernel sources, checked on any machine: they have the CUDA sources' sections, and
they parse and type-check as C++ (g++ or clang++) under tests/metal_emulation.py's shim, which
maps Metal's address spaces, vector types and library calls onto C++, with the signatures
mx.fast.metal_kernel generates from the launchers' input names (the small ones `volatile`, as
the emulation marks MLX's `constant` inputs). This is not a Metal compile: nothing here runs
Metal (no Apple hardware), so most Metal-only errors (attribute rules, address-space errors other
than `constant` memory handed on as `device`) are not caught."""

import subprocess
import sys

import pytest

from mlx_moe_fix.kernels.sources import sections

from .metal_emulation import ATTRIBUTES, CXX, SHIM, template_line

import mlx_moe_fix.kernels  # noqa: E402,F401  loads the op modules (their names are the dispatchers')

DECODE = sys.modules["mlx_moe_fix.kernels.moe_decode"]
INT_INPUTS = {"indices": "uint32_t", "dims": "int32_t"}
WEIGHT_INPUTS = {"gate_w", "up_w", "w"}
FLOAT_INPUTS = {"params", "gate_scale", "out_scale"}
SMALL_INPUTS = {"dims", "params"}


def signature(name, inputs, outputs, t):
    def ctype(n):
        return INT_INPUTS.get(n) or ("uint32_t" if n in WEIGHT_INPUTS else "float" if n in FLOAT_INPUTS else t)

    # dims and params are always below CONSTANT_BELOW elements: `constant` memory (volatile here)
    params = [f"const {'volatile' if n in SMALL_INPUTS else 'device'} {ctype(n)}* {n}" for n in inputs]
    params += [f"device {ctype(n)}* {n}" for n in outputs]
    return f"void {name}({', '.join(params + list(ATTRIBUTES))})"


def translation_unit(module, filename, variants):
    source = sections("metal", filename)
    text = SHIM + source["header"]
    for i, (stage, t, constants) in enumerate(variants):
        lines = [f"  using T = {t}; using S = {t}; using SC = float; using WT = {t};"]
        lines += [template_line(k, v) for k, v in constants.items()]
        text += f"\n{signature(f'k{i}', module.INPUTS[stage], module.OUTPUTS[stage], t)} {{\n"
        text += "\n".join(lines) + f"\n{source[stage]}\n}}\n"
    return text


# Sections only CUDA needs: the launch after moe_routed_decode's gate+up, and moe_shared_decode's two (no Metal kernels).
CUDA_ONLY = {"moe_decode": {"routed_down", "shared_gate_up", "shared_down", "routed_shared_down"}}


def test_metal_sources_have_the_cuda_sources_sections():
    for filename in ("moe_decode",):
        cuda = sections("cuda", f"{filename}.cu").keys() - CUDA_ONLY[filename]
        assert sections("metal", f"{filename}.metal").keys() == cuda


@pytest.mark.skipif(CXX is None, reason="no g++ / clang++ on this machine: Metal sources not type-checked")
@pytest.mark.parametrize("t", ["bfloat16_t", "float16_t", "float"])
def test_metal_decode_kernels_type_check_as_cpp(tmp_path, t):
    variants = []
    for bits, group in ((4, 64), (8, 32)):
        base = {"BITS": bits, "GROUP": group, "WARPS": DECODE.GATE_UP_BLOCK.warps, "RPW": DECODE.GATE_UP_BLOCK.rows, "HAS_BIAS": bits == 8}
        variants += [("gate_up", t, {**base, "GATED": gated}) for gated in (True, False)]
        variants += [("down", t, {**base, "INPUT_PER_PAIR": p, "COMBINE": c}) for p in (True, False) for c in (True, False)]
    path = tmp_path / "kernels.cpp"
    path.write_text(translation_unit(DECODE, "moe_decode.metal", variants))
    done = subprocess.run([CXX, "-std=c++20", "-fsyntax-only", "-Wno-unknown-pragmas", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
