"""Our CUDA kernel sources run on a CPU: a stand-in for `mx.fast.cuda_kernel` objects that compiles
a kernel as MLX 0.32.4's cuda_kernel assembles it (mlx/backend/cuda/custom_kernel.cpp: the header,
then `namespace mlx::core::cu`, a signature of const input pointers and output pointers, the
template arguments as constants at the top of the body) as C++ (g++ or clang++, C++20), and runs
its grid with a fiber per CUDA thread (tests/metal_emulation.py's), so that the CUDA kernels'
arithmetic, indexing and combine (the decode GEMVs, the routers, the grouped prefill's GEMMs,
routing and combine) can be checked against the pure-MLX reference on machines without a GPU.

What the emulation is: bf16 and fp16 stored and rounded as on the GPU (tests/metal_emulation.py's
types; bf16x2 arithmetic rounded once a lane, as the hardware does); a warp is 32 threads,
`__shfl_xor_sync` exchanges their values after all have arrived; `__shared__` memory is one array
for the block running now (blocks run one after another, their threads in thread order from one
barrier or warp exchange to the next; a deadlock fails); the inline PTX the kernels use (`prmt`,
`dp4a`, a streamed 16-byte load, an empty `asm` that hides a pointer's origin, `cp.async` into
dynamic shared memory, `mma.sync` m16n8k16 and Hopper's `wgmma` m64nNk16 on their fragment layouts
and shared-memory descriptor) becomes the C++ of its definition; MLX's grid
in threads is rounded up to whole blocks, as MLX launches it; a cp.async copy lands when a
wait_group lets its group complete, its destination all-ones bytes until then, so that a stage read
too early reads garbage; a wgmma reads its B and writes its sums when a wait_group lets its commit
group complete, so that a stage refilled under a pending wgmma, or sums read before their wait,
come out wrong. What it is not: NVRTC or ptxas (CUDA's rules, registers and spills are
tests/test_cuda_sources.py's), a wgmma's A registers changed before it completes (taken at its
issue here), the proxy fence (unseen), a copy that another thread reads without a barrier after the
wait (seen or not by the threads' fixed order), nor the GPU's speed or its order of additions.
Outputs start as all-ones bytes (NaN in floating point), so an output a kernel fails to write
shows as not finite."""

from __future__ import annotations

import re

import mlx.core as mx

from .metal_emulation import HALF_TYPES, launcher, run_grid

CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.uint32: "uint32_t",
              mx.int32: "int32_t", mx.uint8: "uint8_t"}

# CUDA's builtins on a CPU. threadIdx is each thread's own (in its Own), blockIdx the block's; the
# block barrier and each warp's exchange meet through the barriers metal_emulation's launcher gives
# each thread.
SHIM = HALF_TYPES + r"""
#include <algorithm>
#include <atomic>
#include <functional>
#include <stdexcept>
#include <cstddef>
#include <type_traits>
#include <vector>
namespace cuda { namespace std { using namespace ::std; } }
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __grid_constant__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
using __nv_bfloat16 = bfloat16_t;
using __half = float16_t;
struct dim3 { unsigned x, y, z; };
inline dim3 blockIdx, blockDim, gridDim;
// PTX's asynchronous work in a thread's commit groups (cp.async's, wgmma's): work issued joins
// the open group, a commit closes it, and a wait_group runs the work of all but the newest PENDING
// committed groups, oldest first, in the waiting thread.
struct AsyncGroups {
  std::vector<std::function<void()>> open;
  std::vector<std::vector<std::function<void()>>> committed;  // oldest first
  void commit() { committed.push_back(std::move(open)); open.clear(); }
  void wait(size_t pending) {
    for (; committed.size() > pending; committed.erase(committed.begin()))
      for (const auto& work : committed.front()) work();
  }
};
// What a CUDA thread keeps of its own (fresh for each block): its lane, warp and block barrier, its
// index, its count of mma calls and its commit groups.
struct Own {
  unsigned lane; Lanes* lanes; Barrier* group;
  dim3 thread_index;
  unsigned mma_calls = 0;
  AsyncGroups copies, wgmmas;
};
#define threadIdx (own->thread_index)
inline void __syncthreads() { own->group->arrive_and_wait(); }
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(4) __half2 { __half x, y; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
// bf16x2 arithmetic (the fused router's matmul): each lane rounds once, as the hardware does. An
// fma's exact value comes to bf16 through a float rounded to odd (24 bits, then 8: one rounding).
inline __nv_bfloat16 bfloat16_of_exact(double exact) {
  float f = static_cast<float>(exact);
  if (static_cast<double>(f) != exact) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if (std::fabs(static_cast<double>(f)) > std::fabs(exact)) --u;  // truncated, then made odd
    u |= 1u;
    std::memcpy(&f, &u, 4);
  }
  return __nv_bfloat16(f);
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__nv_bfloat16(a), __nv_bfloat16(b)}; }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return {a, a}; }
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  const auto lane = [](__nv_bfloat16 p, __nv_bfloat16 q, __nv_bfloat16 r) {
    return bfloat16_of_exact(double(float(p)) * double(float(q)) + double(float(r)));  // exact below 2^-1000
  };
  return {lane(a.x, b.x, c.x), lane(a.y, b.y, c.y)};
}
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {bfloat16_of_exact(double(float(a.x)) - double(float(b.x))), bfloat16_of_exact(double(float(a.y)) - double(float(b.y)))};
}
inline float __low2float(__nv_bfloat162 a) { return float(a.x); }
inline __nv_bfloat162 __low2bfloat162(__nv_bfloat162 a) { return {a.x, a.x}; }
inline __nv_bfloat162 __high2bfloat162(__nv_bfloat162 a) { return {a.y, a.y}; }
inline float __high2float(__nv_bfloat162 a) { return float(a.y); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((bytes >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
// PTX prmt.b32's default mode: __byte_perm, but a selector nibble with its top bit set gives the
// selected byte's sign replicated (0xff or 0)
inline unsigned prmt(unsigned a, unsigned b, unsigned c) {
  const uint64_t bytes = (uint64_t(b) << 32) | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned selector = (c >> (4 * i)) & 15, byte = (bytes >> (8 * (selector & 7))) & 0xff;
    r |= (selector & 8 ? (byte & 0x80 ? 0xffu : 0u) : byte) << (8 * i);
  }
  return r;
}
inline unsigned __vmaxu2(unsigned a, unsigned b) {
  return std::max(a & 0xffffu, b & 0xffffu) | (std::max(a >> 16, b >> 16) << 16);
}
inline __half __ushort_as_half(unsigned short bits) { __half h; std::memcpy(&h, &bits, 2); return h; }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline float2 __half22float2(__half2 h) { return float2{static_cast<float>(h.x), static_cast<float>(h.y)}; }
// the IEEE-rounded intrinsics as plain float arithmetic (C++20 does not contract them); __expf,
// the GPU's fast approximation, as expf: the routers' weights are compared within tolerance
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.f / a; }
inline float __expf(float a) { return std::exp(a); }
using std::isinf; using std::isnan;
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { __nv_bfloat16 b; std::memcpy(&b, &bits, 2); return b; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { unsigned short u; std::memcpy(&u, &b, 2); return u; }
inline unsigned short __half_as_ushort(__half h) { unsigned short u; std::memcpy(&u, &h, 2); return u; }
template <typename A, typename B> inline std::common_type_t<A, B> min(A a, B b) { return a < b ? a : b; }
template <typename A, typename B> inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename A, typename B> inline int dp4a(unsigned a, unsigned b) {
  int sum = 0;
  for (int i = 0; i < 4; ++i) sum += int(A(a >> (8 * i))) * int(B(b >> (8 * i)));
  return sum;
}
inline unsigned char* dynamic_shared;
template <typename T> T __shfl_sync(unsigned, T v, int source) {  // every lane of the warp takes part
  static_assert(sizeof(T) <= 16);
  std::memcpy(own->lanes->values[own->lane], &v, sizeof(T));
  own->lanes->meet.arrive_and_wait();
  T other;
  std::memcpy(&other, own->lanes->values[source & 31], sizeof(T));
  own->lanes->meet.arrive_and_wait();
  return other;
}
template <typename T> T __shfl_xor_sync(unsigned mask, T v, int offset) { return __shfl_sync(mask, v, own->lane ^ offset); }
template <typename Reduce> unsigned reduce_lanes(unsigned v, Reduce reduce) {
  std::memcpy(own->lanes->values[own->lane], &v, 4);
  own->lanes->meet.arrive_and_wait();
  unsigned r;
  std::memcpy(&r, own->lanes->values[0], 4);
  for (int lane = 1; lane < 32; ++lane) {
    unsigned other;
    std::memcpy(&other, own->lanes->values[lane], 4);
    r = reduce(r, other);
  }
  own->lanes->meet.arrive_and_wait();
  return r;
}
// The grouped prefill's (moe_prefill.cu): fp16 pairs, shared memory addresses, cp.async, mma.sync,
// wgmma and the route kernel's shared-memory atomics.
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return bfloat16_of_exact(double(float(a)) * double(float(b))); }
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {bfloat16_of_exact(double(float(a.x)) * double(float(b.x))), bfloat16_of_exact(double(float(a.y)) * double(float(b.y)))};
}
// fp16 lanes: the exact result (a double holds a product of two halves and a sum exactly at
// these magnitudes) rounded once to fp16
inline __half2 __hsub2(__half2 a, __half2 b) {
  return {__half(float(double(float(a.x)) - double(float(b.x)))), __half(float(double(float(a.y)) - double(float(b.y))))};
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  const auto lane = [](__half p, __half q, __half r) { return __half(static_cast<float>(double(float(p)) * double(float(q)) + double(float(r)))); };
  return {lane(a.x, b.x, c.x), lane(a.y, b.y, c.y)};
}
inline int atomicAdd(int* address, int value) { return std::atomic_ref<int>(*address).fetch_add(value); }
// A shared-memory address is its offset in the block's dynamic shared memory (the GEMM's
// cp.async destinations all lie there).
inline unsigned __cvta_generic_to_shared(const void* p) {
  return unsigned(static_cast<const unsigned char*>(p) - dynamic_shared);
}
// cp.async.cg of 16 bytes (`bytes` of them copied, the rest zero-filled) in its thread's groups:
// the destination holds all-ones bytes (NaN in T, nibbles of 15 in packed weights) from the copy's
// issue until a cp.async.wait_group lets its group complete, so that a kernel that reads a stage
// before waiting for it reads garbage here (where the GPU might have let it pass). Each thread
// completes its own copies at its wait; the block's barrier after the wait shows them to the rest.
inline void cp_async_16(unsigned shared_address, const void* source, unsigned bytes) {
  std::memset(dynamic_shared + shared_address, 0xFF, 16);
  own->copies.open.push_back([shared_address, source, bytes] {
    std::memset(dynamic_shared + shared_address, 0, 16);
    std::memcpy(dynamic_shared + shared_address, source, bytes);
  });
}
// The tensor cores' A operand, A[16 x 16] of a warp in mma.sync's m16n8k16 layout: lane
// (g = lane / 4, t = lane % 4) holds rows g, g + 8 at k 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9 (a2,
// a3), each register two values, the lower k in the low half. The warp's registers meet in a buffer
// of its own, two of them taken in turn, so one meeting a call suffices: a lane writes a buffer
// again only after every lane has met past the other buffer's call, which they reach after
// reading this one. Each output sums its 16 exact products in float in k order, then adds the
// accumulator (the tensor core's order and rounding differ).
struct MmaOperands { unsigned a[32][4], b[32][2]; };
struct MmaLanes { MmaOperands operands[2]; };
inline MmaLanes mma_lanes[32];  // per warp of the block running now
inline MmaOperands& warp_operands(const unsigned (&a)[4], unsigned b0, unsigned b1) {
  MmaOperands& x = mma_lanes[threadIdx.x / 32].operands[own->mma_calls++ & 1];
  std::memcpy(x.a[own->lane], a, sizeof(a));
  x.b[own->lane][0] = b0, x.b[own->lane][1] = b1;
  own->lanes->meet.arrive_and_wait();
  return x;
}
template <typename T> float value_of(unsigned short bits) { T value; std::memcpy(&value, &bits, 2); return static_cast<float>(value); }
template <typename T> float a_element(const MmaOperands& x, unsigned row, unsigned k) {
  return value_of<T>(static_cast<unsigned short>(x.a[4 * (row % 8) + (k % 8) / 2][row / 8 + 2 * (k / 8)] >> (16 * (k & 1))));
}
// mma.sync.m16n8k16.row.col, fp32 accumulators: D[16 x 8] += A B, B column g at k 2t, 2t + 1 (b0)
// and 2t + 8, 2t + 9 (b1), D rows g, g + 8 at columns 2t, 2t + 1 (c0 c1, c2 c3).
template <typename T>
void mma_m16n8k16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const MmaOperands& x = warp_operands(a, b0, b1);
  const unsigned g = own->lane / 4, t = own->lane % 4;
  for (unsigned e = 0; e < 4; ++e) {
    const unsigned row = g + 8 * (e / 2), column = 2 * t + e % 2;
    float sum = 0.f;
    for (unsigned k = 0; k < 16; ++k)
      sum += a_element<T>(x, row, k) * value_of<T>(static_cast<unsigned short>(x.b[4 * column + (k % 8) / 2][k / 8] >> (16 * (k & 1))));
    c[e] += sum;
  }
}
// wgmma.mma_async m64nNk16 with A from registers (each warp of the warpgroup its 16 rows, as
// mma.sync's A) and B[16 x N] from shared memory through its descriptor, K-major with the 128-byte
// swizzle (the only layout the kernels use; any other mode throws): start address and stride byte
// offset (to the next 8 columns) in 16-byte units, element (k, n) at start + (n / 8) stride +
// (n % 8) 128 + 2k bytes, then that address's 16-byte chunk bits (4-6) XOR its 128-byte row bits
// (7-9), as the hardware swizzles the shared address. D: mma.sync's C layout repeated over the N /
// 8 column blocks. Asynchronous as on the GPU, at its latest: the warp's A registers are taken at
// the issue, but B is read and D written only when a wgmma.wait_group lets the wgmma's commit
// group complete (in each thread for its own accumulators), so that a kernel that refills a stage a
// pending wgmma still reads, or reads accumulators before waiting for them, gets wrong sums here.
template <typename T, int N>
void wgmma_m64k16(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long descriptor) {
  if (descriptor >> 62 != 1) throw std::runtime_error("wgmma: only the 128-byte swizzle is emulated");
  const MmaOperands operands = warp_operands(a, 0, 0);  // a copy: the buffer serves later calls
  const unsigned lane = own->lane;
  own->wgmmas.open.push_back([operands, lane, descriptor, &d] {
    const unsigned start = (descriptor & 0x3FFF) << 4, stride = ((descriptor >> 32) & 0x3FFF) << 4;
    const unsigned g = lane / 4, t = lane % 4;
    for (unsigned j = 0; j < N / 8; ++j)
      for (unsigned e = 0; e < 4; ++e) {
        const unsigned row = g + 8 * (e / 2), column = 8 * j + 2 * t + e % 2;
        float sum = 0.f;
        for (unsigned k = 0; k < 16; ++k) {
          const unsigned linear = start + (column / 8) * stride + (column % 8) * 128 + k * 2;
          unsigned short bits;
          std::memcpy(&bits, dynamic_shared + (linear ^ ((linear >> 7) & 7) << 4), 2);
          sum += a_element<T>(operands, row, k) * value_of<T>(bits);
        }
        d[4 * j + e] += sum;
      }
  });
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) { return reduce_lanes(v, [](unsigned a, unsigned b) { return std::max(a, b); }); }
inline unsigned __reduce_min_sync(unsigned, unsigned v) { return reduce_lanes(v, [](unsigned a, unsigned b) { return std::min(a, b); }); }
"""

# The inline PTX of the kernels, as C++: (pattern, replacement).
PTX = (
    (r'asm\("prmt\.b32 %0, %1, %2, %3;" : "=r"\((\w+)\) : "r"\(([^)]*)\), "r"\(([^)]*)\), "r"\(([^;]*)\)\);',
     r"\1 = prmt(\2, \3, \4);"),
    (r'asm\("dp4a\.([su])32\.([su])32 %0, %1, %2, %0;" : "\+r"\((\w+)\) : "r"\(([^)]*)\), "r"\(([^;]*)\)\);',
     lambda m: f"{m[3]} += dp4a<{'int8_t' if m[1] == 's' else 'uint8_t'}, "
               f"{'int8_t' if m[2] == 's' else 'uint8_t'}>({m[4]}, {m[5]});"),
    (r'asm\("ld\.global\.L1::no_allocate\.v4\.u32 \{%0, %1, %2, %3\}, \[%4\];" : "=r"\((\w+)\.x\), "=r"\(\w+\.y\), '
     r'"=r"\(\w+\.z\), "=r"\(\w+\.w\) : "l"\((\w+)\)\);',
     r"\1 = *reinterpret_cast<const uint4*>(\2);"),
    (r'asm\("" : "\+l"\(\w+\)\);', ""),
    (r'asm volatile\("cp\.async\.cg\.shared\.global(?:\.L2::128B)? \[%0\], \[%1\], 16, %2;\\n" ::"r"\((.*?)\),\s*"l"\((.*?)\),\s*"r"\((.*?)\)\);',
     r"cp_async_16(\1, \2, \3);"),
    (r'asm volatile\("cp\.async\.commit_group;\\n" ::\);', "own->copies.commit();"),
    (r'asm volatile\("cp\.async\.wait_group %0;\\n" ::"n"\(([^;]*)\)\);', r"own->copies.wait(\1);"),
    (r'(?s)asm volatile\(\s*"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(?:bf16\.bf16|f16\.f16)\.f32 [^"]*"\s*:.*?\);',
     "mma_m16n8k16<T>(c, a, b0, b1);"),
    (r'MOE_WGMMA_OF\("m64n\d+k16", "b?f16", MOE_N\d+\);', "wgmma_m64k16<T, N>(d, a, descriptor);"),
    (r'asm volatile\("wgmma\.commit_group\.sync\.aligned;\\n" ::: "memory"\);', "own->wgmmas.commit();"),
    (r'asm volatile\("wgmma\.wait_group\.sync\.aligned %0;\\n" ::"n"\(N\) : "memory"\);', "own->wgmmas.wait(N);"),
    # the register and proxy fences order what the emulation does in program order anyway
    (r'asm volatile\("(?:wgmma\.fence\.sync\.aligned|fence\.proxy\.async\.shared::cta);\\n" ::: "memory"\);', ""),
    (r'asm volatile\("" : "\+[fr]"\(v\[i\]\)\);', ";"),  # a loop's body
    (r"extern __shared__ (?:__align__\(\d+\) )?([\w ]+?) (\w+)\[\];", r"\1* \2 = reinterpret_cast<\1*>(dynamic_shared);"),
    (r"#include <cuda/[^>]*>", ""),
)


def as_cpu_source(text: str) -> str:
    """`text` with the kernels' inline PTX replaced by C++; any `asm` left is an error (but in a
    macro's definition: grouped_wgmma's wgmma asm, whose uses are replaced)."""
    for pattern, replacement in PTX:
        text = re.sub(pattern, replacement, text)
    unknown = [line for line in text.splitlines() if re.search(r"\basm\b", line) and not line.lstrip().startswith("#define")]
    assert not unknown, f"inline PTX the emulation does not know: {unknown[0][:200]}"
    return text


def constant_line(name: str, value) -> str:
    """A template argument as MLX's cuda_kernel writes it at the top of the body."""
    if isinstance(value, mx.Dtype):
        return f"  using {name} = {CUDA_TYPES[value]};"
    if isinstance(value, bool):
        return f"  constexpr bool {name} = {str(value).lower()};"
    return f"  constexpr int {name} = {int(value)};"


class EmulatedCudaKernel:
    """Called as an `mx.fast.cuda_kernel` object is (inputs, template, grid in threads,
    threadgroup, output shapes and dtypes); returns the outputs as MLX arrays."""

    def __init__(self, input_names, output_names, source: str, header: str, shared_bytes: int):
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.source, self.header, self.shared_bytes = source, header, shared_bytes

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **unused):
        assert set(unused) <= {"init_value"} and unused.get("init_value") is None, f"not emulated: {sorted(unused)}"
        constants = "\n".join(constant_line(name, value) for name, value in template)

        def compose(parameters, arguments):
            return (as_cpu_source(self.header) + "\nnamespace mlx::core::cu {\nvoid kernel("
                    + ", ".join(parameters) + f") {{\n{constants}\n" + as_cpu_source(self.source) + "\n}\n}\n"
                    + launcher("dim3", f"mlx::core::cu::kernel({arguments})",
                               grid_setup="blockDim = dim3{threads, 1, 1}; gridDim = dim3{groups_x, groups_y, groups_z};",
                               thread_setup="mine.thread_index = dim3{t, 0, 0};",
                               group_setup="blockIdx = position; dynamic_shared = shared.data();"))

        # MLX launches ceil(grid / threadgroup) blocks (mlx/backend/cuda/custom_kernel.cpp): a
        # kernel bounds-checks the threads past the grid itself
        grid = tuple(-(-g // t) * t for g, t in zip(grid, threadgroup))
        return run_grid(compose, "CUDA", inputs,
                        [f"const {CUDA_TYPES[a.dtype]}* {n}" for a, n in zip(inputs, self.input_names)],
                        output_shapes, output_dtypes, [f"{CUDA_TYPES[d]}* {n}" for d, n in zip(output_dtypes, self.output_names)],
                        grid, threadgroup, self.shared_bytes, SHIM)
