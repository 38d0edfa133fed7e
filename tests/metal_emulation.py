"""Our Metal kernel sources run on a CPU: a stand-in for `mx.fast.metal_kernel` that compiles a
kernel's source as C++ (g++ or clang++, C++20) and runs its grid with one CPU thread per Metal
thread, so that the Metal decode kernel's arithmetic, indexing and combine can be checked against
the pure-MLX reference on machines without Apple hardware.

What the emulation is: bf16 and fp16 are stored and rounded as on the GPU (round to nearest even
at every conversion to them); a simdgroup is 32 threads and `simd_sum` adds its lanes' values (in
lane order: Metal leaves the order open) after all have arrived; `threadgroup` memory is one
array a threadgroup, whose threads run at once; threadgroups run one after another; an input MLX
would pass in the `constant` address space is `volatile` (CONSTANT_BELOW), so that handing it on
as `device` memory fails to compile, as on Metal. What it is not: a Metal compile (attribute
rules, the other address spaces' conversions and Metal's own math library are not checked), nor
Apple hardware's speed or its order of additions. Outputs start as all-ones bytes
(NaN in floating point), so an output a kernel fails to write shows as not finite."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import mlx.core as mx
import numpy as np

CXX = shutil.which("g++") or shutil.which("clang++")

# What both emulations share: bfloat16_t / float16_t (GPU bits, rounded as the GPU rounds), and each
# thread's lane, its simdgroup's or warp's Lanes and its group's barrier (set by LAUNCHER).
HALF_TYPES = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = uint16_t((u >> 16) | 0x40u); return; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = uint16_t(u >> 16);
  }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
  operator float() const volatile { return static_cast<float>(*const_cast<const bfloat16_t*>(this)); }
};
struct float16_t {
  _Float16 v;
  float16_t() = default;
  float16_t(float f) : v(static_cast<_Float16>(f)) {}
  operator float() const { return static_cast<float>(v); }
  operator float() const volatile { return static_cast<float>(v); }
};
struct Lanes {  // one simdgroup / warp: what its threads exchange, each in its own slot
  std::barrier<> meet{32};
  alignas(16) unsigned char values[32][16];
};
thread_local Lanes* this_lanes;
thread_local unsigned this_lane;
thread_local std::barrier<>* this_group;
"""

# Metal's types and library calls on a CPU. simd_sum and threadgroup_barrier meet the other threads
# through the barriers the launcher gives each thread; `threadgroup` storage is static (shared by the
# threadgroup running now).
SHIM = HALF_TYPES + r"""
typedef unsigned int uint;
typedef unsigned long ulong;
struct uint3 { uint x, y, z; };
struct uint4 { uint x, y, z, w; uint operator[](int i) const { return (&x)[i]; } };
template <typename To, typename From> To as_type(From f) { To t; std::memcpy(&t, &f, sizeof t); return t; }
namespace metal {
using std::fabs; using std::fma; using std::fmax; using std::fmin; using std::max; using std::min; using std::is_same_v;
namespace precise { using std::exp; using std::tanh; }
inline float simd_sum(float v) {
  std::memcpy(this_lanes->values[this_lane], &v, 4);
  this_lanes->meet.arrive_and_wait();
  float sum = 0.f;
  for (int lane = 0; lane < 32; ++lane) sum += as_type<float>(*reinterpret_cast<const uint*>(this_lanes->values[lane]));
  this_lanes->meet.arrive_and_wait();
  return sum;
}
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
}
inline void threadgroup_barrier(metal::mem_flags) { this_group->arrive_and_wait(); }
#define device
#define constant
#define threadgroup static
#define thread
"""

# The grid's groups (threadgroups, blocks) one after another, on one CPU thread per GPU thread that
# lives for the whole launch; each group gets fresh barriers, which a thread leaves
# (arrive_and_drop) when it returns, so that it no longer holds back the others. Each emulation
# fills in POSITION (the type of a group's position), GRID_SETUP, THREAD_SETUP, GROUP_SETUP and
# CALL (the kernel's call, `position` and `t` in scope).
LAUNCHER = r"""
#include <memory>
extern "C" void launch(void** buffers, unsigned groups_x, unsigned groups_y, unsigned groups_z, unsigned threads,
                       unsigned shared_bytes) {
  std::barrier<> start(threads + 1), finish(threads + 1);
  std::unique_ptr<std::barrier<>> group;
  std::unique_ptr<Lanes[]> lanes;
  std::vector<unsigned char> shared(shared_bytes + 16);
  POSITION position{0, 0, 0};
  bool done = false;
  GRID_SETUP
  std::vector<std::thread> running;
  for (unsigned t = 0; t < threads; ++t)
    running.emplace_back([&, t] {
      this_lane = t % 32;
      THREAD_SETUP
      while (true) {
        start.arrive_and_wait();
        if (done) return;
        this_lanes = &lanes[t / 32];
        this_group = group.get();
        GROUP_SETUP
        CALL;
        group->arrive_and_drop();
        lanes[t / 32].meet.arrive_and_drop();
        finish.arrive_and_wait();
      }
    });
  for (unsigned z = 0; z < groups_z; ++z)
    for (unsigned y = 0; y < groups_y; ++y)
      for (unsigned x = 0; x < groups_x; ++x) {
        group = std::make_unique<std::barrier<>>(threads);
        lanes.reset(new Lanes[threads / 32]);
        position = POSITION{x, y, z};
        start.arrive_and_wait();
        finish.arrive_and_wait();
      }
  done = true;
  start.arrive_and_wait();
  for (auto& thread : running) thread.join();
}
"""


def launcher(position: str, call: str, grid_setup: str = "", thread_setup: str = "", group_setup: str = "") -> str:
    """LAUNCHER filled in (see above)."""
    text = LAUNCHER
    for name, value in (("POSITION", position), ("GRID_SETUP", grid_setup), ("THREAD_SETUP", thread_setup),
                        ("GROUP_SETUP", group_setup), ("CALL", call)):
        text = text.replace(name, value)
    return text


ATTRIBUTES = ("uint3 threadgroup_position_in_grid", "uint thread_index_in_simdgroup", "uint simdgroup_index_in_threadgroup")
C_TYPES = {mx.bfloat16: "bfloat16_t", mx.float16: "float16_t", mx.float32: "float", mx.uint32: "uint32_t",
           mx.int32: "int32_t", mx.uint8: "uint8_t"}
# How each dtype's bits travel to and from numpy (which has no bfloat16).
STORAGE = {mx.bfloat16: (mx.uint16, np.uint16), mx.float16: (mx.float16, np.float16), mx.float32: (mx.float32, np.float32),
           mx.uint32: (mx.uint32, np.uint32), mx.int32: (mx.int32, np.int32), mx.uint8: (mx.uint8, np.uint8)}

_libraries = {}
_lock = threading.Lock()
_folder = tempfile.TemporaryDirectory(prefix="metal-emulation-")  # removed at exit: the builds of this process


# MLX passes an input of fewer than 8 elements in Metal's `constant` address space, the others in
# `device` (mlx/backend/common/metal_kernel.cpp). C++ has no address spaces, so the emulated
# signature gives the small ones `volatile` instead: a kernel handing such a pointer to a helper
# that takes `const device T*` (erased to `const T*`) then fails to compile here as on Metal.
CONSTANT_BELOW = 8
# Every output byte before a kernel runs: all ones (NaN in floating point, -1 in integers), so an
# output it fails to write shows; a test of a kernel whose outputs are meant to hold -1 sets another.
OUTPUT_FILL_BYTE = 0xFF


def address_space(array) -> str:
    """The qualifier standing in for `array`'s Metal address space in an emulated signature."""
    return "volatile " if array.size < CONSTANT_BELOW else ""


def template_line(name: str, value) -> str:
    """A template constant as a declaration at the top of the kernel's body (MLX makes it a
    template parameter)."""
    if isinstance(value, mx.Dtype):
        return f"  using {name} = {C_TYPES[value]};"
    if isinstance(value, bool):
        return f"  constexpr bool {name} = {str(value).lower()};"
    return f"  constexpr int {name} = {int(value)};"


# g++'s flags for an emulated kernel's library, and for its prelude's precompiled header (g++ takes
# a precompiled header only under the options it was built with).
CXX_FLAGS = ("-std=c++20", "-O1", "-w", "-fPIC", "-pthread")
PRECOMPILES = CXX is not None and os.path.basename(CXX) == "g++"


def prelude_include(prelude: str) -> list:
    """The arguments that make g++ read `prelude` (an emulation's SHIM, over half of a kernel's
    compile time read as text) from a header precompiled once a process; where it is none, or the
    compiler not g++, none (`prelude` is then compiled with each kernel's text). Call under _lock."""
    if not prelude or not PRECOMPILES:
        return []
    header = os.path.join(_folder.name, hashlib.sha256(prelude.encode()).hexdigest()[:20] + ".h")
    if not os.path.exists(header):
        with open(header, "w") as f:
            f.write(prelude)
        # A header that fails to precompile is read as text (g++ falls back to it), so the
        # kernel's own compile reports any error.
        subprocess.run([CXX, *CXX_FLAGS, "-x", "c++-header", header, "-o", header + ".gch"], capture_output=True)
    return ["-include", header]


def build_library(source: str, language: str, prelude: str = ""):
    """The compiled shared library of `prelude` followed by `source` (cached by their text), with
    LAUNCHER's `launch`."""
    digest = hashlib.sha256((prelude + "\0" + source).encode()).hexdigest()[:20]
    with _lock:
        if digest not in _libraries:
            path = os.path.join(_folder.name, digest)
            include = prelude_include(prelude)
            with open(f"{path}.cc", "w") as f:
                f.write(source if include else prelude + source)
            built = subprocess.run([CXX, *CXX_FLAGS, "-shared", *include, f"{path}.cc", "-o", f"{path}.so"],
                                   capture_output=True, text=True)
            if built.returncode != 0:
                raise RuntimeError(f"the {language} source does not compile as C++:\n{built.stderr[-4000:]}")
            library = ctypes.CDLL(f"{path}.so")
            library.launch.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_uint] * 5
            _libraries[digest] = library
        return _libraries[digest]


def run_grid(compose, language: str, inputs, input_parameters: list, output_shapes, output_dtypes,
             output_parameters: list, grid, threadgroup, shared_bytes: int = 0, prelude: str = "") -> list:
    """The outputs (MLX arrays) of the kernel whose C++ source is `prelude` followed by
    `compose(parameters, arguments)` (its signature's parameters; the launcher's casts of its
    buffers to them), run over `grid` (in threads) in groups of `threadgroup` threads on `inputs`."""
    threads = threadgroup[0]
    assert threadgroup[1:] == (1, 1) and threads % 32 == 0, "one-dimensional groups of whole simdgroups / warps only"
    assert all(g % t == 0 for g, t in zip(grid, threadgroup)), "a grid of whole groups only"
    arrays = [np.ascontiguousarray(np.array(a.view(STORAGE[a.dtype][0]))) for a in inputs]
    outputs = [np.full(tuple(shape) + (dtype.size,), OUTPUT_FILL_BYTE, dtype=np.uint8).view(STORAGE[dtype][1]).reshape(shape)
               for shape, dtype in zip(output_shapes, output_dtypes)]
    parameters = input_parameters + output_parameters
    arguments = ", ".join(f"({p.rsplit(' ', 1)[0]})buffers[{i}]" for i, p in enumerate(parameters))
    buffers = (ctypes.c_void_p * (len(arrays) + len(outputs)))(*[b.ctypes.data for b in arrays + outputs])
    build_library(compose(parameters, arguments), language, prelude).launch(buffers, grid[0] // threads, grid[1], grid[2],
                                                                  threads, shared_bytes)
    return [mx.array(o).view(dtype) if dtype == mx.bfloat16 else mx.array(o) for o, dtype in zip(outputs, output_dtypes)]


class EmulatedMetalKernel:
    """Called as an `mx.fast.metal_kernel` object is (inputs, template, grid in threads,
    threadgroup, output shapes and dtypes); returns the outputs as MLX arrays."""

    def __init__(self, input_names, output_names, source: str, header: str):
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.source, self.header = source, header

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **unused):
        assert not unused, f"the emulation does not take {sorted(unused)}"
        constants = "\n".join(template_line(name, value) for name, value in template)

        def compose(parameters, arguments):
            return (self.header + f"\nvoid kernel({', '.join(parameters + list(ATTRIBUTES))}) {{\n{constants}\n"
                    + self.source + "\n}\n#undef device\n#undef constant\n#undef threadgroup\n#undef thread\n"
                    + launcher("uint3", f"kernel({arguments}, position, t % 32, t / 32)"))

        return run_grid(compose, "Metal", inputs,
                        [f"const {address_space(a)}{C_TYPES[a.dtype]}* {n}" for a, n in zip(inputs, self.input_names)],
                        output_shapes, output_dtypes, [f"{C_TYPES[d]}* {n}" for d, n in zip(output_dtypes, self.output_names)],
                        grid, threadgroup, prelude=SHIM)
