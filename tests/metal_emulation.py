"""Our Metal kernel sources run on a CPU: a stand-in for `mx.fast.metal_kernel` that compiles a
kernel's source as C++ (g++ or clang++, C++20) and runs its grid with a fiber per Metal thread (on
one CPU thread, switching at barriers), so that the Metal decode kernel's arithmetic, indexing and
combine can be checked against the pure-MLX reference on machines without Apple hardware.

What the emulation is: bf16 and fp16 are stored and rounded as on the GPU (round to nearest even
at every conversion to them); a simdgroup is 32 threads and `simd_sum` adds its lanes' values (in
lane order: Metal leaves the order open) after all have arrived; `threadgroup` memory is one
array a threadgroup, whose threads run in thread order from one barrier to the next (a kernel
whose threads all wait at barriers that none of them can complete fails as a deadlock, where a GPU
would hang); threadgroups run one after another; an input MLX would pass in the `constant` address
space is `volatile` (CONSTANT_BELOW), so that handing it on as `device` memory fails to compile, as
on Metal. What it is not: a Metal compile (attribute rules, the other address spaces' conversions
and Metal's own math library are not checked), nor Apple hardware's speed or its order of
additions. Outputs start as all-ones bytes (NaN in floating point), so an output a kernel fails to
write shows as not finite."""

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

# What both emulations share: bfloat16_t / float16_t (GPU bits, rounded as the GPU rounds), the
# fibers the GPU threads run as, their barriers, and each thread's Own state (each emulation defines
# Own: its lane, its simdgroup's or warp's Lanes, its group's barrier, and what else it keeps).
HALF_TYPES = r"""
#if defined(__APPLE__)  // macOS declares the ucontext calls only under _XOPEN_SOURCE (untested here: no Mac)
#define _XOPEN_SOURCE 700
#define _DARWIN_C_SOURCE
#endif
#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
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
// A group's GPU threads are fibers on one CPU thread, each on a stack of its own: a thread runs until
// it waits at a barrier, then the next one in thread order, so that a barrier costs a few switches in
// user space (an OS thread a GPU thread, as before, spent as much time in the kernel's futex calls as
// in the kernels). The fibers' code is FIBERS, compiled once a process and linked into each kernel.
struct Own;  // a GPU thread's own state, which each emulation defines
inline Own* own;  // the running thread's
struct Fiber {
  jmp_buf context;
  ucontext_t start;
  Own* own;
  bool started, finished, progressed;
};
// Back to the scheduler, saying whether the fiber did anything since it was resumed; returns when
// the scheduler resumes it.
void pause_fiber(bool progressed);
struct Barrier {  // std::barrier's arrive_and_wait and arrive_and_drop, for fibers
  unsigned expected, arrived = 0, phase = 0;
  explicit Barrier(unsigned count) : expected(count) {}
  void arrive_and_wait() {
    const unsigned mine = phase;
    if (++arrived == expected) { arrived = 0, ++phase; return; }
    pause_fiber(true);
    while (phase == mine) pause_fiber(false);
  }
  void arrive_and_drop() {  // a thread that has returned: the others no longer wait for it
    if (--expected == arrived && arrived) arrived = 0, ++phase;
  }
};
struct Lanes {  // one simdgroup / warp: what its threads exchange, each in its own slot
  Barrier meet{32};
  alignas(16) unsigned char values[32][16];
};
// The fibers of a launch: `body(context, t)` is GPU thread t's part of a group, run for each group in
// turn; `fibers[t].own` its Own state.
struct Fibers {
  Fibers(unsigned threads, void (*body)(void* context, unsigned t), void* context);
  ~Fibers();
  // One group: each unfinished fiber in turn, until all have returned (true) or all wait at
  // barriers that none of them can complete (false: a deadlock, which would hang a GPU).
  bool run_group();
  Fiber* fibers;
  unsigned threads;
  void (*body)(void*, unsigned);
  void* context;
};
"""

# HALF_TYPES' fibers: a fiber's first entry is a ucontext (makecontext); its switches, _setjmp /
# _longjmp (no signal-mask system call; CXX_FLAGS turn off _FORTIFY_SOURCE, whose longjmp check
# refuses a jump to another stack).
FIBERS = r"""
#include <new>
namespace {
constexpr size_t STACK_BYTES = 512 << 10, GUARD_BYTES = 4096;
jmp_buf scheduler;
Fiber* running;
Fibers* entering;
unsigned entering_thread;
void enter() {  // a fiber's whole life: its part of each group, then back to the scheduler
  Fibers& all = *entering;
  const unsigned t = entering_thread;
  while (true) {
    all.body(all.context, t);
    running->finished = true;
    pause_fiber(true);
  }
}
}  // namespace
void pause_fiber(bool progressed) {
  running->progressed = progressed;
  if (!_setjmp(running->context)) _longjmp(scheduler, 1);
}
Fibers::Fibers(unsigned threads, void (*body)(void*, unsigned), void* context)
    : fibers(new Fiber[threads]()), threads(threads), body(body), context(context) {
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& fiber = fibers[t];
    char* stack = static_cast<char*>(mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE,
                                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (stack == MAP_FAILED) throw std::bad_alloc();
    mprotect(stack, GUARD_BYTES, PROT_NONE);  // an overflow faults rather than writing another stack
    getcontext(&fiber.start);
    fiber.start.uc_stack.ss_sp = stack;
    fiber.start.uc_stack.ss_size = STACK_BYTES;
    fiber.start.uc_link = nullptr;
    makecontext(&fiber.start, enter, 0);
  }
}
Fibers::~Fibers() {
  for (unsigned t = 0; t < threads; ++t) munmap(fibers[t].start.uc_stack.ss_sp, STACK_BYTES);
  delete[] fibers;
}
bool Fibers::run_group() {
  for (unsigned t = 0; t < threads; ++t) fibers[t].finished = false;
  unsigned live = threads, idle = 0;
  while (live > 0)
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& fiber = fibers[t];
      if (fiber.finished) continue;
      running = &fiber, own = fiber.own;
      if (!_setjmp(scheduler)) {
        if (fiber.started) _longjmp(fiber.context, 1);
        fiber.started = true, entering = this, entering_thread = t;
        setcontext(&fiber.start);
      }
      if (fiber.finished) --live, idle = 0;
      else if (fiber.progressed) idle = 0;
      else if (++idle >= live) return false;
    }
  return true;
}
"""


# Metal's types and library calls on a CPU. simd_sum and threadgroup_barrier meet the other threads
# through the barriers the launcher gives each thread; `threadgroup` storage is static (shared by the
# threadgroup running now).
SHIM = HALF_TYPES + r"""
struct Own { unsigned lane; Lanes* lanes; Barrier* group; };
typedef unsigned int uint;
typedef unsigned long ulong;
struct uint3 { uint x, y, z; };
struct uint4 { uint x, y, z, w; uint operator[](int i) const { return (&x)[i]; } };
template <typename To, typename From> To as_type(From f) { To t; std::memcpy(&t, &f, sizeof t); return t; }
namespace metal {
using std::fabs; using std::fma; using std::fmax; using std::fmin; using std::max; using std::min; using std::is_same_v;
namespace precise { using std::exp; using std::tanh; }
inline float simd_sum(float v) {
  std::memcpy(own->lanes->values[own->lane], &v, 4);
  own->lanes->meet.arrive_and_wait();
  float sum = 0.f;
  for (int lane = 0; lane < 32; ++lane) sum += as_type<float>(*reinterpret_cast<const uint*>(own->lanes->values[lane]));
  own->lanes->meet.arrive_and_wait();
  return sum;
}
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
}
inline void threadgroup_barrier(metal::mem_flags) { own->group->arrive_and_wait(); }
#define device
#define constant
#define threadgroup static
#define thread
"""

# The grid's groups (threadgroups, blocks) one after another, each thread a fiber (HALF_TYPES) that
# lives for the whole launch; each group gets fresh barriers and Own states, and a thread leaves its
# barriers (arrive_and_drop) when it returns, so that it no longer holds back the others. Returns
# null, or what went wrong: an exception's message (the first), or a deadlock. Each emulation fills
# in POSITION (the type of a group's position), GRID_SETUP, GROUP_SETUP, THREAD_SETUP (`mine`, the
# thread's Own, and `t` in scope) and CALL (the kernel's call, `position` and `t` in scope).
LAUNCHER = r"""
#include <cstdio>
extern "C" const char* launch(void** buffers, unsigned groups_x, unsigned groups_y, unsigned groups_z, unsigned threads,
                              unsigned shared_bytes) {
  static char failure[1024];
  failure[0] = 0;
  std::vector<unsigned char> shared(shared_bytes + 16);
  std::vector<Own> owns(threads);
  std::vector<Lanes> lanes(threads / 32);
  POSITION position{0, 0, 0};
  GRID_SETUP
  auto body = [&](unsigned t) {
    try {
      CALL;
    } catch (const std::exception& error) {
      if (!failure[0]) std::snprintf(failure, sizeof failure, "%s", error.what());
    }
    own->group->arrive_and_drop();
    own->lanes->meet.arrive_and_drop();
  };
  Fibers fibers(threads, [](void* context, unsigned t) { (*static_cast<decltype(body)*>(context))(t); }, &body);
  for (unsigned t = 0; t < threads; ++t) fibers.fibers[t].own = &owns[t];
  for (unsigned z = 0; z < groups_z; ++z)
    for (unsigned y = 0; y < groups_y; ++y)
      for (unsigned x = 0; x < groups_x; ++x) {
        Barrier group(threads);
        for (Lanes& warp : lanes) warp.meet = Barrier(32);
        position = POSITION{x, y, z};
        GROUP_SETUP
        for (unsigned t = 0; t < threads; ++t) {
          Own& mine = owns[t] = Own{};
          mine.lane = t % 32, mine.lanes = &lanes[t / 32], mine.group = &group;
          THREAD_SETUP
        }
        if (!fibers.run_group()) return "deadlock: the group's threads all wait at barriers that none of them can complete";
        if (failure[0]) return failure;
      }
  return nullptr;
}
"""


def launcher(position: str, call: str, grid_setup: str = "", group_setup: str = "", thread_setup: str = "") -> str:
    """LAUNCHER filled in (see above)."""
    text = LAUNCHER
    for name, value in (("POSITION", position), ("GRID_SETUP", grid_setup), ("GROUP_SETUP", group_setup),
                        ("THREAD_SETUP", thread_setup), ("CALL", call)):
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
CXX_FLAGS = ("-std=c++20", "-O1", "-w", "-fPIC", "-U_FORTIFY_SOURCE")
PRECOMPILES = CXX is not None and os.path.basename(CXX) == "g++"


def prelude_include(prelude: str) -> list:
    """The arguments that make g++ read `prelude` (an emulation's SHIM, over half of a kernel's
    compile time read as text) from a header precompiled once a process; where the compiler is not
    g++, none (`prelude` is then compiled with each text). Call under _lock."""
    if not PRECOMPILES:
        return []
    header = os.path.join(_folder.name, hashlib.sha256(prelude.encode()).hexdigest()[:20] + ".h")
    if not os.path.exists(header):
        with open(header, "w") as f:
            f.write(prelude)
        # A header that fails to precompile is read as text (g++ falls back to it), so the
        # kernel's own compile reports any error.
        subprocess.run([CXX, *CXX_FLAGS, "-x", "c++-header", header, "-o", header + ".gch"], capture_output=True)
    return ["-include", header]


def compile_text(text: str, prelude: str, language: str, output: str, *options: str) -> str:
    """`output`, compiled from `prelude` followed by `text` with `options`, once a process (by
    their digest). Call under _lock."""
    path = os.path.join(_folder.name, hashlib.sha256((prelude + "\0" + text + "\0" + output).encode()).hexdigest()[:20])
    if not os.path.exists(path + output):
        include = prelude_include(prelude)
        with open(f"{path}.cc", "w") as f:
            f.write(text if include else prelude + text)
        built = subprocess.run([CXX, *CXX_FLAGS, *options, *include, f"{path}.cc", "-o", path + output],
                               capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"the {language} source does not compile as C++:\n{built.stderr[-4000:]}")
    return path + output


def build_library(source: str, language: str, prelude: str):
    """The shared library of `prelude` followed by `source` (LAUNCHER's `launch` among them), with
    FIBERS (compiled once a process), loaded once a process: a launch of a kernel already loaded
    finds it by its text, without digests or file checks."""
    key = (prelude, source)
    with _lock:
        if key not in _libraries:
            fibers = compile_text(FIBERS, prelude, language, ".o", "-c")
            library = ctypes.CDLL(compile_text(source, prelude, language, ".so", "-shared", fibers))
            library.launch.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_uint] * 5
            library.launch.restype = ctypes.c_char_p
            _libraries[key] = library
        return _libraries[key]


def run_grid(compose, language: str, inputs, input_parameters: list, output_shapes, output_dtypes,
             output_parameters: list, grid, threadgroup, shared_bytes: int, prelude: str) -> list:
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
    failure = build_library(compose(parameters, arguments), language, prelude).launch(
        buffers, grid[0] // threads, grid[1], grid[2], threads, shared_bytes)
    if failure is not None:
        raise RuntimeError(f"the emulated {language} kernel failed: {failure.decode()}")
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
                        grid, threadgroup, 0, SHIM)
