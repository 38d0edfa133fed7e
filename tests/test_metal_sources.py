"""The Metal kernel sources, checked on any machine: they have the CUDA sources' sections, and
they parse and type-check as C++ (g++ or clang++) under a small shim that maps Metal's address
spaces, vector types and library calls onto C++, with the signatures mx.fast.metal_kernel
generates from the launchers' input names. This is not a Metal compile: nothing here runs Metal
(no Apple hardware), so Metal-only errors (address spaces, attribute rules) are not caught."""

import shutil
import subprocess
import sys

import pytest

from mlx_moe_fix.kernels.sources import sections

import mlx_moe_fix.kernels  # noqa: E402,F401  loads the op modules (their names are the dispatchers')

DECODE = sys.modules["mlx_moe_fix.kernels.moe_decode"]
CXX = shutil.which("g++") or shutil.which("clang++")

# Metal as C++: address spaces vanish, uint4 is indexable, the metal:: calls are the std ones,
# a simdgroup is one lane (only types and syntax are checked).
SHIM = """
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
typedef unsigned int uint;
typedef unsigned long ulong;
struct uint3 { uint x, y, z; };
struct uint4 { uint x, y, z, w; uint operator[](int i) const { return (&x)[i]; } };
template <typename To, typename From> To as_type(From f) { To t; std::memcpy(&t, &f, sizeof t); return t; }
struct bfloat16_t { float v; bfloat16_t() = default; bfloat16_t(float f) : v(f) {} operator float() const { return v; } };
struct float16_t { float v; float16_t() = default; float16_t(float f) : v(f) {} operator float() const { return v; } };
namespace metal {
using std::fabs; using std::fma; using std::fmax; using std::fmin; using std::max; using std::min;
namespace precise { using std::exp; using std::tanh; }
inline float simd_sum(float v) { return v; }
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
}
inline void threadgroup_barrier(metal::mem_flags) {}
#define device
#define constant
#define threadgroup
#define thread
"""
ATTRIBUTES = ("uint3 threadgroup_position_in_grid", "uint thread_index_in_simdgroup", "uint simdgroup_index_in_threadgroup")
INT_INPUTS = {"indices": "uint32_t", "dims": "int32_t"}
WEIGHT_INPUTS = {"gate_w", "up_w", "w"}
FLOAT_INPUTS = {"params", "gate_scale", "out_scale"}


def signature(name, inputs, outputs, t):
    def ctype(n):
        return INT_INPUTS.get(n) or ("uint32_t" if n in WEIGHT_INPUTS else "float" if n in FLOAT_INPUTS else t)

    params = [f"const device {ctype(n)}* {n}" for n in inputs] + [f"device {ctype(n)}* {n}" for n in outputs]
    return f"void {name}({', '.join(params + list(ATTRIBUTES))})"


def translation_unit(module, filename, variants):
    source = sections("metal", filename)
    text = SHIM + source["header"]
    for i, (stage, t, constants) in enumerate(variants):
        lines = [f"  using T = {t}; using S = {t}; using SC = float; using WT = {t};"]
        lines += [f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};" for k, v in constants.items()]
        text += f"\n{signature(f'k{i}', module.INPUTS[stage], module.OUTPUTS[stage], t)} {{\n"
        text += "\n".join(lines) + f"\n{source[stage]}\n}}\n"
    return text


# Sections only CUDA needs: the launch after moe_routed_decode's gate+up, which has no Metal kernel.
CUDA_ONLY = {"moe_decode": {"routed_down"}}


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
    done = subprocess.run([CXX, "-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
