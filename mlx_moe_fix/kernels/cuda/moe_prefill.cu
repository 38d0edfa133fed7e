// Sorted grouped prefill for mx.fast.cuda_kernel: one grouped GEMM over (token, expert) pairs
// sorted by expert, each expert's run padded to the tile height BM, so that every BM-row tile
// belongs to one expert (`tile_expert`, -1 for tiles past the last run). Tensor cores through
// mma.sync (bf16 / fp16 in, fp32 accumulate), the weights dequantised in registers.
//
// Sections are split on "//// <name>" lines (`header`, `grouped`, `route`, `k_order`, `combine`). Template
// constants:
//   T (bf16 or fp16), S (scales, biases and additive bias type), SC (per-expert scale type),
//   WT (routing weight type; `combine` only),
//   BITS 4 or 8, GROUP 32/64/128, BM 16/32/64 (tile height),
//   FP4:       the weights are MLX's mxfp4 (GROUP 32: S = uint8_t e8m0 scales, powers of two) or
//              nvfp4 (GROUP 16: e4m3 scales): BITS 4 e2m1 codes, no quantization biases (b0 / b1
//              absent), additive biases of type T
//   PAIRS_IN:  A rows are x rows gathered per pair (pair / top_k); else the padded rows of `a`
//   ACTIVATE:  epilogue applies the activation and writes padded rows; else it writes the
//              projection per pair (rows of `out` in pair order)
//   GATED:     two weight matrices (gate = 0, up = 1) feed the activation
//   HAS_BIAS: the bias inputs' signature (S, or the float32 placeholder; see
//              moe_common::bias_signature_matches)
//   ACT, LIMITED: the activation (codes of moe_common::activate), with its clamp stage; constants
//              here, unlike the decode kernels' run-time ones, because the epilogue is unrolled
//              and every activation's code in it made NVRTC compile for seconds
//   RBN, K_ORDER_OUT (grouped_wgmma only): weight rows a block; the gate+up's output columns in
//              the order the down on grouped_wgmma reads them (moe_prefill.wgmma_k_order)
// Run-time values: dims = IN_DIM, OUT_DIM, TOP_K, -, -, HAS_BIAS, HAS_SCALE; params = limit, alpha.

//// header
#include <cuda/std/type_traits>

namespace grouped {

using namespace moe_common;

constexpr int BK = 64;       // k-step
constexpr int STAGES = 3;    // cp.async pipeline depth (4 measured no faster on the H200)
constexpr int WGMMA_STAGES = 5;  // grouped_wgmma's
// grouped_wgmma refills the stage read two k-steps back, whose wgmmas have completed, so that no
// k-step waits for the previous one's last wgmmas: WGMMA_STAGES - 2 stages in flight.
constexpr int WGMMA_AHEAD = WGMMA_STAGES - 2;
constexpr int LDS = BK;  // shared row stride of A (values of T): 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8)

// The sum of `value` over lanes 0..lane of the warp (every lane calls it).
__device__ __forceinline__ int warp_inclusive_sum(int value, int lane) {
  for (int offset = 1; offset < 32; offset *= 2) {
    const int below = __shfl_sync(0xffffffffu, value, lane >= offset ? lane - offset : lane);
    if (lane >= offset) value += below;
  }
  return value;
}

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two fp32 values rounded to T and packed low-first, as one 32-bit word.
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  }
}

// One thread's share of a pipeline stage's packed weight rows: COPIES 16-byte cp.async copies,
// copy c = tid + i x THREADS taking row n0 + c / (ROW_BYTES / 16) of `expert` (zero-filled past
// out_dim) at its 16-byte part c % (ROW_BYTES / 16), into shared byte 16c of the stage.
// TILE_ROWS: the block's tile height (BM), which decides whether each copy asks L2 for its whole
// 128-byte line (below).
template <int COPIES, int THREADS, int ROW_BYTES, int TILE_ROWS>
struct WeightCopies {
  static constexpr bool WHOLE_LINES = TILE_ROWS < 64;
  size_t offset[COPIES];  // from the expert matrix's first byte at k 0
  int bytes[COPIES];
  __device__ WeightCopies(int tid, int n0, int expert, int out_dim, size_t row_bytes) {
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
      const int c = tid + i * THREADS;
      const int n = n0 + c / (ROW_BYTES / 16);
      offset[i] = ((size_t)expert * out_dim + (n < out_dim ? n : 0)) * row_bytes + c % (ROW_BYTES / 16) * 16;
      bytes[i] = n < out_dim ? 16 : 0;
    }
  }
  // `source`: the matrix's bytes at the stage's first k; `stage`: the stage's shared bytes. A
  // k-step takes 32 or 64 bytes of each of many rows. Under tiles of fewer than 64 rows, where each
  // block streams its expert's rows once, fetching them from DRAM 128 bytes at a time (the
  // driver's default is 64) lets a row's next k-steps find theirs in L2: DeepSeek-V3's 32-row
  // gate+up 3-5% faster on an H200; taller tiles re-read their weights from L2 anyway, and there
  // Mixtral's 128-row down read 2-5% slower with it.
  __device__ void copy(const unsigned char* source, unsigned char* stage, int tid) const {
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
      const unsigned destination = smem_address(stage + (tid + i * THREADS) * 16);
      if constexpr (WHOLE_LINES)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(source + offset[i]), "r"(bytes[i]));
      else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(source + offset[i]), "r"(bytes[i]));
    }
  }
};

// An e8m0 scale byte as the bf16 power of two it stands for, 2^(e - 127), exactly (e = 0 as a
// bf16 subnormal).
__device__ __forceinline__ __nv_bfloat16 e8m0_scale(unsigned char e) {
  return __ushort_as_bfloat16(static_cast<unsigned short>(e ? e << 7 : 0x0040));
}

// Whether dequant_pair_at takes its 4-bit values in place: against bf16 with bf16 scales.
template <typename T, typename S, int BITS, bool FP4>
constexpr bool DEQUANT_IN_PLACE = BITS == 4 && !FP4 && cuda::std::is_same_v<T, __nv_bfloat16> && cuda::std::is_same_v<S, T>;

// The type of a group's scale: bf16, exactly the value of an FP4 group's byte (e8m0 at GROUP 32,
// e4m3 at GROUP 16: at most 4 significant bits).
template <typename T, typename S, bool FP4>
using GroupScale = cuda::std::conditional_t<FP4, T, S>;

// The type a thread keeps a group's scale in for dequant_pair_at: in place, a pair (the scale for
// values at bit 0 of a half, then for values at bit 4).
template <typename T, typename S, int BITS, bool FP4>
using KeptScale = cuda::std::conditional_t<DEQUANT_IN_PLACE<T, S, BITS, FP4>, __nv_bfloat162, GroupScale<T, S, FP4>>;

// In place, dequant_pair_at's values are the weights times 2^-64, and so are the GEMM's sums: its
// epilogue multiplies them by ACCUMULATOR_UNSCALE (exact). The masked value read as bf16 is
// q x 2^-133 (at bit 0) or q x 2^-129 (at bit 4): the group's scale times 2^69 or 2^65 and its bias
// times 2^-64 make one fused multiply-add the weight times 2^-64, rounded once, with no product by
// a power of two first. Exact while scales are under 2^59 and weights of 2^-62 or more stay normal
// bf16 (no quantization's scale comes near).
template <typename T, typename S, int BITS, bool FP4>
constexpr float ACCUMULATOR_UNSCALE = DEQUANT_IN_PLACE<T, S, BITS, FP4> ? 0x1p64f : 1.f;

// A group's stored scale as a thread keeps it for dequant_pair_at: FP4's byte as its value; in
// place, times 2^69 and 2^65 (exact: a bf16 value times a power of two); else as it is.
template <typename T, int BITS, bool FP4, int GROUP, typename S>
__device__ __forceinline__ KeptScale<T, S, BITS, FP4> group_scale_of(S scale) {
  if constexpr (FP4 && GROUP == 16) return __float2bfloat16_rn(e4m3_over_256(scale) * 256.f);
  else if constexpr (FP4) return e8m0_scale(scale);
  else if constexpr (DEQUANT_IN_PLACE<T, S, BITS, FP4>) {
    const unsigned at_0_and_4 = 0x60006200u;  // 2^69, 2^65
    return __hmul2(__nv_bfloat162(scale, scale), *reinterpret_cast<const __nv_bfloat162*>(&at_0_and_4));
  } else return scale;
}

// A group's stored bias as a thread keeps it for dequant_pair_at: in place, times 2^-64.
template <typename T, int BITS, bool FP4, typename S>
__device__ __forceinline__ S group_bias_of(S bias) {
  if constexpr (DEQUANT_IN_PLACE<T, S, BITS, FP4>) return __hmul(bias, __ushort_as_bfloat16(0x1F80));  // 2^-64
  else return bias;
}

// Word `first / (4 / sizeof(S))` of a row of scales (or biases) for grouped_wgmma's windows
// (rows of whole 4-byte words, `count` groups), zero past the row's end.
template <typename S>
__device__ __forceinline__ unsigned window_word(const S* row, int first, int count) {
  return first < count ? *reinterpret_cast<const unsigned*>(row + first) : 0u;
}

// The group at the bottom of a window word (shifted there), as its type S.
template <typename S>
__device__ __forceinline__ S word_value(unsigned word) {
  using Bits = cuda::std::conditional_t<sizeof(S) == 1, unsigned char, cuda::std::conditional_t<sizeof(S) == 2, unsigned short, unsigned>>;
  const Bits bits = static_cast<Bits>(word);
  return *reinterpret_cast<const S*>(&bits);
}

// Two packed values of one group at bits 0 and 16 of `q`, dequantised and packed as two T.
// Affine: small unsigned integers, q * scale + bias; in T's two-lane arithmetic where MAGIC + q is
// exact in T (4-bit in bf16, 4/8-bit in fp16, scales of type T): the integers under MAGIC's
// exponent, one subtraction, one fused multiply-add; else in fp32, rounded once.
// FP4 (bf16 only): e2m1 codes (sign, 2 exponent bits, 1 mantissa bit) times `scale`: the sign
// to bf16's, the other three bits to the bottom of its exponent field and the top of its
// mantissa make each code's value times 2^-126 (code 1, 0.5, a bf16 subnormal), then two exact
// products, by 2^126 and by the group's scale (2 and 4 significant bits: one product by the scale
// times 2^126 would overflow for mxfp4's e > 128).
template <typename T, typename S, int BITS, bool FP4 = false>
__device__ __forceinline__ unsigned dequant_pair(unsigned q, GroupScale<T, S, FP4> scale, S bias) {
  using T2 = cuda::std::conditional_t<cuda::std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
  if constexpr (FP4) {
    static_assert(cuda::std::is_same_v<T, __nv_bfloat16> && BITS == 4, "fp4: 4-bit codes against bf16");
    const unsigned x = (q & 0x00080008u) << 12 | (q & 0x00070007u) << 6, two_126 = 0x7E807E80u;
    T2 v = __hmul2(*reinterpret_cast<const T2*>(&x), *reinterpret_cast<const T2*>(&two_126));
    v = __hmul2(v, T2(scale, scale));
    return *reinterpret_cast<unsigned*>(&v);
  } else if constexpr ((BITS == 4 || !cuda::std::is_same_v<T, __nv_bfloat16>) && cuda::std::is_same_v<S, T>) {
    constexpr unsigned MAGIC = cuda::std::is_same_v<T, __nv_bfloat16> ? 0x43004300u : 0x64006400u;
    const unsigned x = q | MAGIC, magic = MAGIC;
    T2 v = __hsub2(*reinterpret_cast<const T2*>(&x), *reinterpret_cast<const T2*>(&magic));
    v = __hfma2(v, T2(scale, scale), T2(bias, bias));
    return *reinterpret_cast<unsigned*>(&v);
  } else {
    const float s = static_cast<float>(scale), b = static_cast<float>(bias);
    return pack2<T>(fmaf(s, small_uint_to_float(q & 0xFFFFu), b), fmaf(s, small_uint_to_float(q >> 16), b));
  }
}

// The pair of BITS-bit values at bit `at` of each 16-bit half of `q` (other bits anything; `at`
// 0, or BITS for a byte's high 4-bit value), dequantised as dequant_pair does with the group's
// scale and bias (group_scale_of's and group_bias_of's). 4-bit values against bf16 scales are
// masked in place, not shifted, and need no MAGIC: the masked half read as bf16 is v x 2^-133
// exactly (v = q or 16q < 256: its exponent field 0 or 1; `fma.bf16` flushes no subnormal), and
// one fused multiply-add by the scale for `at` gives (q x scale + bias) x 2^-64 rounded once, bit
// for bit dequant_pair's times 2^-64: two instructions a pair where the shift, mask, MAGIC and
// subtraction took five.
template <typename T, typename S, int BITS, bool FP4 = false>
__device__ __forceinline__ unsigned dequant_pair_at(unsigned q, int at, KeptScale<T, S, BITS, FP4> scale, S bias) {
  if constexpr (DEQUANT_IN_PLACE<T, S, BITS, FP4>) {
    using T2 = __nv_bfloat162;
    const unsigned x = q & 0x000F000Fu << at;
    const T2 v = __hfma2(*reinterpret_cast<const T2*>(&x), at ? __high2bfloat162(scale) : __low2bfloat162(scale), T2(bias, bias));
    return *reinterpret_cast<const unsigned*>(&v);
  } else {
    constexpr unsigned PAIR_MASK = BITS == 4 ? 0x000F000Fu : 0x00FF00FFu;
    return dequant_pair<T, S, BITS, FP4>(q >> at & PAIR_MASK, scale, bias);
  }
}

// One output of a grouped GEMM from its fp32 sums (`second`: the up projection's, GATED), rounded
// where stock rounds: the additive biases, the per-expert scale (of gate, or of the output), the
// activation (ACTIVATE).
// EXTRAS false: the caller knows the launch has neither bias nor scale (d.has_bias and
// d.has_scale false), and the per-output checks of both go.
template <typename T, bool ACTIVATE, bool GATED, int ACT, bool LIMITED, bool EXTRAS, typename B, typename SC>
__device__ __forceinline__ float finish(float first, float second, const Dims& d, const B* bias0, const B* bias1,
                                        const SC* scale, const float* params, int expert, int n) {
  const size_t bias_at = (size_t)expert * d.out_dim + n;
  const bool has_bias = EXTRAS && d.has_bias, has_scale = EXTRAS && d.has_scale;
  first = rnd<T>(first);
  if (has_bias) first = rnd<T>(first + static_cast<float>(bias0[bias_at]));
  if (!ACTIVATE) return has_scale ? rnd<T>(first * rnd<T>(static_cast<float>(scale[expert]))) : first;
  float up = first, gate = 0.f;
  if (GATED) {
    gate = first;
    up = rnd<T>(second);
    if (has_bias) up = rnd<T>(up + static_cast<float>(bias1[bias_at]));
    if (has_scale) gate = rnd<T>(gate * rnd<T>(static_cast<float>(scale[expert])));
  }
  return activate<T>(ACT, LIMITED, up, gate, params[0], params[1]);
}

// Runs a GEMM's epilogue `stage_outputs(extras)` with finish's EXTRAS as a type: checked once for
// the block whether the launch has a bias or a scale. Checked for each output, their branches and
// loads made 2127 instructions of code after the k-loop of the 4-bit down at 64-row tiles against
// 584 without them, where its k-loop is 424 a k-step (nvcc, sm_90a; docs/benchmarks.md,
// sixty-ninth stop, item 5); the down GEMM's median 1.01-1.06x faster for it on two H100s
// (seventieth stop, item 2).
template <typename StageOutputs>
__device__ __forceinline__ void with_extras(const Dims& d, StageOutputs&& stage_outputs) {
  if (d.has_bias || d.has_scale) stage_outputs(cuda::std::true_type{});
  else stage_outputs(cuda::std::false_type{});
}

// A block's BM x RBN outputs, staged in shared memory as rows out_stride<RBN> values apart, leave as
// 16-byte row pieces: to padded row tile x BM + r (ACTIVATE), or to row `pair` of the per-pair
// output; padding rows and columns past out_dim stay unwritten. Scattered 2-byte stores of the
// fragments wrote each 32-byte sector in several partial pieces.
template <int RBN>
constexpr int out_stride = RBN + 8;  // values of T: rows 16 bytes apart in the banks (RBN a multiple of 64)
template <typename T, int BM, int RBN, int THREADS, bool ACTIVATE>
struct StagedRowStores {
  static constexpr int CHUNKS = RBN / 8;  // 16-byte pieces of an output row
  static constexpr int PIECES = BM * CHUNKS / THREADS + (BM * CHUNKS % THREADS != 0);  // a thread's
  int pair[PIECES];  // each piece's row's pair (-1: padding, or no piece)

  // Called before the outputs are staged where registers allow (the one-matrix GEMM), so that the
  // row_pair loads land while they are: loaded where they were needed, their waits were ~2% of
  // the down's stall samples (docs/benchmarks.md, seventy-fourth stop, item 6). Held through the
  // staging, they made the gated GEMMs spill.
  __device__ __forceinline__ void load(const int* row_pair, int tile, int n0, int out_dim, int tid) {
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
      const int c = tid + i * THREADS, r = c / CHUNKS;
      pair[i] = r < BM && n0 + c % CHUNKS * 8 < out_dim ? row_pair[tile * BM + r] : -1;
    }
  }

  __device__ __forceinline__ void store(const T* staged, T* out, int tile, int n0, int out_dim, int tid) const {
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
      if (pair[i] < 0) continue;
      const int c = tid + i * THREADS, r = c / CHUNKS, column = n0 + c % CHUNKS * 8;
      const size_t row = ACTIVATE ? (size_t)tile * BM + r : (size_t)pair[i];
      *reinterpret_cast<uint4*>(&out[row * out_dim + column]) = *reinterpret_cast<const uint4*>(&staged[r * out_stride<RBN> + c % CHUNKS * 8]);
    }
  }
};

// Hopper's warpgroup MMA (grouped_wgmma): D[64 x N] += A[64 x 16] B[16 x N], A from registers
// (each warp 16 rows, mma.sync's m16n8k16 A layout), B from shared memory through a descriptor
// (K-major, 128-byte swizzle: column n's 64 k values a 128-byte row at n x 128 bytes, its 16-byte
// chunk c at chunk c ^ (n % 8), 1024 bytes to the next 8 columns; the pattern follows the shared
// address, so a stage starts on 1024 bytes; a k16 step's start address 32 bytes on), fp32
// accumulators in mma.sync's C layout repeated over N / 8.
constexpr unsigned WGMMA_SWIZZLE_BYTES = 1024;
__device__ __forceinline__ unsigned long long wgmma_descriptor(unsigned address) {
  return (unsigned long long)((address & 0x3FFFF) >> 4) | 1ull << 16 | (unsigned long long)(WGMMA_SWIZZLE_BYTES >> 4) << 32 |
         1ull << 62;
}

// One wgmma of shape SHAPE on TYPE operands: D_OPERANDS is the asm's "{d...}, {a0..a3}, desc",
// ACCUMULATE the operand number of `accumulate`, then the accumulators' constraints (MOE_N*).
#define MOE_WGMMA(SHAPE, TYPE, D_OPERANDS, ACCUMULATE, ...) asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACCUMULATE ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " D_OPERANDS ", p, 1, 1, 0;\n}\n" : __VA_ARGS__ : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(descriptor), "r"(accumulate))
#define MOE_WGMMA_OF(...) MOE_WGMMA(__VA_ARGS__)  // expands MOE_N* into MOE_WGMMA's arguments
#define MOE_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MOE_N16 "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12", "%13", MOE_D8(0)
#define MOE_N32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20", "%21", MOE_D8(0), MOE_D8(8)
#define MOE_N64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36", "%37", MOE_D8(0), MOE_D8(8), MOE_D8(16), MOE_D8(24)

template <typename T, int N>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long descriptor) {
  static_assert(N == 16 || N == 32 || N == 64, "wgmma widths: 16, 32, 64");
  constexpr bool BF16 = cuda::std::is_same_v<T, __nv_bfloat16>;
  const int accumulate = 1;
  if constexpr (N == 16 && BF16) MOE_WGMMA_OF("m64n16k16", "bf16", MOE_N16);
  if constexpr (N == 16 && !BF16) MOE_WGMMA_OF("m64n16k16", "f16", MOE_N16);
  if constexpr (N == 32 && BF16) MOE_WGMMA_OF("m64n32k16", "bf16", MOE_N32);
  if constexpr (N == 32 && !BF16) MOE_WGMMA_OF("m64n32k16", "f16", MOE_N32);
  if constexpr (N == 64 && BF16) MOE_WGMMA_OF("m64n64k16", "bf16", MOE_N64);
  if constexpr (N == 64 && !BF16) MOE_WGMMA_OF("m64n64k16", "f16", MOE_N64);
}

// Orders this thread's register writes before the warpgroup's next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most N committed groups of this warpgroup's wgmmas are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Tells the compiler that `v` may change here: no write of a wgmma operand moves below the fence
// before the wgmma, and no read of an accumulator above the wait for the wgmmas that write it.
template <int N>
__device__ __forceinline__ void pin(float (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(v[i]));
}

template <int N>
__device__ __forceinline__ void pin(unsigned (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(v[i]));
}

}  // namespace grouped

//// grouped
// inputs: a [rows, IN_DIM] (x, or the padded hidden rows), row_pair [tiles * BM] (pair, -1: padding),
//         tile_expert [tiles], w0 / w1 [E, OUT_DIM, IN_DIM * BITS / 32], s0, b0, s1, b1
//         [E, OUT_DIM, IN_DIM / GROUP], bias0 / bias1 [E, OUT_DIM], scale [E], dims, params
// output: out [tiles * BM, OUT_DIM] (ACTIVATE) or [pairs, OUT_DIM]
// Each block computes BM rows x 128 columns (per matrix) with WARPS_M x 4 warps of WM x 32, over
// k-steps of 64 through a STAGES-deep cp.async pipeline of activation rows and packed weight rows.
//
// The reduction order inside a 64-wide k-step is free, so the mma operands use a permuted k: in
// each k16 mma, logical k (2t, 2t+1, 2t+8, 2t+9) of the thread with lane % 4 = t is the same four
// physical k for A and for B. They are chosen so that a B register pair is two values 16 bits
// apart in one packed word: (q >> shift) & 0x000F000F (4-bit) or & 0x00FF00FF (8-bit) puts both
// under one exponent, and one fused multiply-add in T's two-lane arithmetic dequantises the pair
// (MAGIC + q is exact in T: 4-bit in bf16, 4/8-bit in fp16; else in fp32, rounded once); 4-bit
// values against bf16 are masked where they lie, with no shift or MAGIC (dequant_pair_at). The
// A pairs come out of 16-byte shared loads by byte permutes. Thread t holds physical k
// 16t .. 16t + 15 of every k-step: 2 packed words a row (4-bit) or 4 (8-bit), one group.
// Needs IN_DIM % 64 == 0, OUT_DIM % 32 == 0. Dynamic shared memory: STAGES x (BM x LDS values of T
// + MATRICES x 128 rows x BK x BITS / 8 bytes) (moe_prefill.shared_bytes).
{
  using namespace grouped;
  constexpr int MATRICES = GATED ? 2 : 1;
  constexpr int RBN = 128, WN = 32, WARPS_N = RBN / WN;
  constexpr int WM = BM < 64 ? BM : 64, WARPS_M = BM / WM, MI = WM / 16;
  constexpr int THREADS = WARPS_M * WARPS_N * 32;
  constexpr int W_ROW_BYTES = BK * BITS / 8;              // one row's packed weights per k-step
  constexpr int W_STAGE_BYTES = RBN * W_ROW_BYTES;        // per matrix
  constexpr int A_STAGE = BM * LDS;                       // values of T
  constexpr int A_CHUNKS = BM * BK / 8 / THREADS;         // 16-byte copies per thread and stage
  constexpr int W_CHUNKS = W_STAGE_BYTES / 16 / THREADS;  // per matrix
  constexpr int WORDS = 16 * BITS / 32;                   // packed words of a row per thread and k-step
  static_assert(BM * BK / 8 % THREADS == 0 && W_STAGE_BYTES / 16 % THREADS == 0, "copies split evenly");
  static_assert(GROUP % 16 == 0, "a thread's 16 values of a k-step share one group");
  using Bias = cuda::std::conditional_t<FP4, T, S>;
  static_assert(bias_signature_matches<HAS_BIAS, Bias, decltype(bias0)> &&
                bias_signature_matches<HAS_BIAS, Bias, decltype(bias1)>, "HAS_BIAS disagrees with the bias inputs");
  static_assert(!FP4 || (BITS == 4 && (GROUP == 32 || GROUP == 16)), "fp4: 4-bit codes in groups of 32 (mxfp4) or 16 (nvfp4)");

  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* sa = reinterpret_cast<T*>(shared_bytes);                                      // [STAGES][BM * LDS]
  unsigned char* sw = shared_bytes + STAGES * A_STAGE * sizeof(T);                 // [STAGES][MATRICES][RBN * W_ROW_BYTES]

  const Dims d(dims);
  const int tile = blockIdx.y;
  const int expert = tile_expert[tile];
  if (expert < 0) return;
  const int n0 = blockIdx.x * RBN;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  const int g = lane / 4, t = lane % 4;
  const int k_steps = d.in_dim / BK, groups_per_row = d.in_dim / GROUP;
  const size_t row_bytes = (size_t)d.in_dim * BITS / 8;

  // This thread's A copies: offsets into `a` (32 bits: every `a` has fewer than 2^32 values) and
  // whether each row exists (padding rows of gathered x are zero-filled). Pointers would cost
  // registers. Padded rows of `a` are copied whole, whatever the padding holds: a row of A only
  // reaches its own row of outputs, which is never stored, and the copies need not wait for
  // row_pair.
  unsigned a_offset[A_CHUNKS];
  unsigned a_present = PAIRS_IN ? 0u : ~0u;
  const int a_chunk = tid % (BK / 8);
  static_assert(THREADS % 64 == 0, "a thread's copies share their rows' r % 8");
  const int a_slot = a_chunk ^ (tid / (BK / 8) % 8);
#pragma unroll
  for (int i = 0; i < A_CHUNKS; ++i) {
    const int r = (tid + i * THREADS) / (BK / 8);
    if constexpr (PAIRS_IN) {
      const int pair = row_pair[tile * BM + r];
      a_offset[i] = (pair >= 0 ? pair / d.top_k : 0) * d.in_dim + a_chunk * 8;
      a_present |= (pair >= 0 ? 1u : 0u) << i;
    } else {
      a_offset[i] = (unsigned)(tile * BM + r) * d.in_dim + a_chunk * 8;
    }
  }
  const WeightCopies<W_CHUNKS, THREADS, W_ROW_BYTES, BM> w_copies(tid, n0, expert, d.out_dim, row_bytes);
  auto load_stage = [&](int stage, int k0) {
    T* a_dst = sa + stage * A_STAGE;
#pragma unroll
    for (int i = 0; i < A_CHUNKS; ++i) {
      const int r = (tid + i * THREADS) / (BK / 8);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(&a_dst[r * LDS + a_slot * 8])),
                   "l"(a + a_offset[i] + k0), "r"((a_present >> i & 1u) * 16));
    }
#pragma unroll
    for (int m = 0; m < MATRICES; ++m)
      w_copies.copy(reinterpret_cast<const unsigned char*>(m == 0 ? w0 : w1) + (size_t)k0 * BITS / 8,
                    sw + (stage * MATRICES + m) * W_STAGE_BYTES, tid);
  };

  // Scales and biases of this thread's rows (n8 block j: column n0 + wn * 32 + 8 j + g) for one
  // k-step. Loaded before the step's barrier, which hides their latency; loading them a step
  // ahead instead held 16 more registers through the mmas and made the gated variants spill.
  KeptScale<T, S, BITS, FP4> group_scale[MATRICES][WN / 8];
  S group_bias[MATRICES][WN / 8];
  auto load_scales = [&](int k0) {
#pragma unroll
    for (int m = 0; m < MATRICES; ++m) {
#pragma unroll
      for (int j = 0; j < WN / 8; ++j) {
        const int n = n0 + wn * WN + 8 * j + g;
        const size_t at = ((size_t)expert * d.out_dim + (n < d.out_dim ? n : 0)) * groups_per_row + (k0 + 16 * t) / GROUP;
        group_scale[m][j] = group_scale_of<T, BITS, FP4, GROUP>((m == 0 ? s0 : s1)[at]);
        if constexpr (!FP4) group_bias[m][j] = group_bias_of<T, BITS, FP4>((m == 0 ? b0 : b1)[at]);
      }
    }
  };

  float acc[MATRICES][MI][WN / 8][4];
#pragma unroll
  for (int m = 0; m < MATRICES; ++m)
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < WN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_steps) load_stage(s, s * BK);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (int step = 0; step < k_steps; ++step) {
    const int stage = step % STAGES;
    load_scales(step * BK);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();
    // The stage computed in the previous step is free: every thread has passed the barrier.
    const int ahead = step + STAGES - 1;
    if (ahead < k_steps) load_stage(ahead % STAGES, ahead * BK);
    asm volatile("cp.async.commit_group;\n" ::);

    const T* a_stage = sa + stage * A_STAGE;
    const int a_read_slot = 2 * t ^ g;  // rows wm WM + mi 16 + g and + 8: r % 8 = g
    // This thread's packed words of its rows: WORDS / 2 per half, read per half (holding all of a
    // step's made the gated variants spill)
    const unsigned char* w_stage = sw + stage * MATRICES * W_STAGE_BYTES + (wn * WN + g) * W_ROW_BYTES + t * WORDS * 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // physical k 16t + 8 half .. + 7: k16 mmas 2 half, 2 half + 1
      unsigned af[MI][2][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int row = wm * WM + mi * 16 + g;
        const uint4 top = *reinterpret_cast<const uint4*>(&a_stage[row * LDS + (a_read_slot ^ half) * 8]);
        const uint4 low = *reinterpret_cast<const uint4*>(&a_stage[(row + 8) * LDS + (a_read_slot ^ half) * 8]);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          // registers (e0 e1) (e2 e3) (e4 e5) (e6 e7): 4-bit pairs (e_2s, e_2s+4), (e_2s+1, e_2s+5);
          // 8-bit pairs (e_4s, e_4s+2), (e_4s+1, e_4s+3)
          const unsigned t0 = BITS == 4 ? (s ? top.y : top.x) : (s ? top.z : top.x);
          const unsigned t1 = BITS == 4 ? (s ? top.w : top.z) : (s ? top.w : top.y);
          const unsigned l0 = BITS == 4 ? (s ? low.y : low.x) : (s ? low.z : low.x);
          const unsigned l1 = BITS == 4 ? (s ? low.w : low.z) : (s ? low.w : low.y);
          af[mi][s][0] = __byte_perm(t0, t1, 0x5410);
          af[mi][s][1] = __byte_perm(l0, l1, 0x5410);
          af[mi][s][2] = __byte_perm(t0, t1, 0x7632);
          af[mi][s][3] = __byte_perm(l0, l1, 0x7632);
        }
      }
#pragma unroll
      for (int m = 0; m < MATRICES; ++m) {
#pragma unroll
        for (int j = 0; j < WN / 8; ++j) {
          const unsigned char* row = w_stage + m * W_STAGE_BYTES + 8 * j * W_ROW_BYTES + half * WORDS * 2;
          unsigned words[WORDS / 2];
          if constexpr (WORDS == 2) {
            words[0] = *reinterpret_cast<const unsigned*>(row);
          } else {
            const uint2 v = *reinterpret_cast<const uint2*>(row);
            words[0] = v.x, words[1] = v.y;
          }
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            // 4-bit: word `half`, nibble pairs (2s, 2s + 4) and (2s + 1, 2s + 5); 8-bit: word
            // 2 half + s, byte pairs (0, 2) and (1, 3)
            const unsigned word = BITS == 4 ? words[0] : words[s % (WORDS / 2)];
            const int shift = BITS == 4 ? 8 * s : 0;
            const unsigned b_lo = dequant_pair_at<T, S, BITS, FP4>(word >> shift, 0, group_scale[m][j], group_bias[m][j]);
            const unsigned b_hi = dequant_pair_at<T, S, BITS, FP4>(word >> shift, BITS, group_scale[m][j], group_bias[m][j]);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) mma<T>(acc[m][mi][j], af[mi][s], b_lo, b_hi);
          }
        }
      }
    }
  }

  // The outputs through shared memory (the pipeline's, free once every warp is here).
  static_assert(BM * out_stride<RBN> * sizeof(T) <= STAGES * (A_STAGE * sizeof(T) + MATRICES * W_STAGE_BYTES), "outputs fit the pipeline's memory");
  T* staged = reinterpret_cast<T*>(shared_bytes);
  StagedRowStores<T, BM, RBN, THREADS, ACTIVATE> stores;
  if constexpr (MATRICES == 1) stores.load(row_pair, tile, n0, d.out_dim, tid);
  __syncthreads();
  with_extras(d, [&](auto extras) {
    // A bare projection's output is its sums rounded once (finish's rounding, then pack2's of an
    // already rounded value, is that); its padding rows are staged too, as StagedRowStores
    // leaves them: checking each row's pair cost the down's epilogue more than staging them.
    constexpr bool BARE = !ACTIVATE && !decltype(extras)::value;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wm * WM + mi * 16 + g + half * 8;
        if (!BARE && row_pair[tile * BM + r] < 0) continue;
#pragma unroll
        for (int ni = 0; ni < WN / 8; ++ni) {
          const int column = wn * WN + ni * 8 + 2 * t, n = n0 + column;
          if (n >= d.out_dim) continue;
          constexpr float UNSCALE = ACCUMULATOR_UNSCALE<T, S, BITS, FP4>;
          float value[2];
#pragma unroll
          for (int j = 0; j < 2; ++j)
            value[j] = BARE ? acc[0][mi][ni][half * 2 + j] * UNSCALE
                            : finish<T, ACTIVATE, GATED, ACT, LIMITED, decltype(extras)::value>(
                                  acc[0][mi][ni][half * 2 + j] * UNSCALE, acc[MATRICES - 1][mi][ni][half * 2 + j] * UNSCALE, d, bias0,
                                  bias1, scale, params, expert, n + j);
          *reinterpret_cast<unsigned*>(&staged[r * out_stride<RBN> + column]) = pack2<T>(value[0], value[1]);
        }
      }
    }
  });
  __syncthreads();
  if constexpr (MATRICES == 2) stores.load(row_pair, tile, n0, d.out_dim, tid);
  stores.store(staged, out, tile, n0, d.out_dim, tid);
}

//// grouped_wgmma
// `grouped`'s gate+up launch (GATED, ACTIVATE, PAIRS_IN; same inputs, output and template
// constants, and RBN, K_ORDER_OUT) and its down launch (below) on Hopper's warpgroup MMA, with
// the operands swapped: out^T = W x^T. `a`'s columns come permuted within each 64-wide k-step
// (moe_prefill.wgmma_k_order): the thread with
// lane % 4 = t dequantises its weight rows at physical k p = 16t + 8 half + 4e + 2s + h (e: the
// lane of a register pair, h: the pair's second register, k16 step 2 half + s), which wgmma reads
// as column L = 32 half + 16 s + 8 h + 2t + e of the step; `a` column L holds x column p.
// Each block computes RBN output rows of each matrix x BM tile rows with RBN / 64 warpgroups of
// 64: the weights are the register operand A, each thread dequantising its own two rows (g, g + 8
// of its warp's 16), so that no dequantised weight passes through shared memory; the tile's BM
// rows of `a` are the shared operand B (N = BM), copied by cp.async into core matrices, so that
// each wgmma reads them in place. A 64-row tile holds 64 fp32 accumulators a thread where
// mma.sync's took 128 (254 registers, spilling). RBN (moe_prefill.wgmma_block_rows): 256 rows
// copy a tile's activations once for twice the weights (the GEMM is bound by its copies), 128 run
// two blocks an SM, one's prologue and stores beside the other's k-loop (docs/benchmarks.md,
// sixty-seventh stop). The down launch too (one matrix, !GATED, !ACTIVATE, !PAIRS_IN: the
// gate+up's padded rows in, rows per pair out), since the swizzled stages made it faster than
// `grouped`'s (docs/benchmarks.md, eighty-seventh stop); its rows come from the gate+up in its k
// order (K_ORDER_OUT) or reordered between them.
// Dynamic shared memory: WGMMA_STAGES x (BM x BK values of T + 2 x RBN rows x BK x BITS / 8
// bytes), and WGMMA_SWIZZLE_BYTES to align the stages (moe_prefill.shared_bytes).
{
  using namespace grouped;
  constexpr int MATRICES = GATED ? 2 : 1, THREADS = 2 * RBN;  // RBN / 64 warpgroups of 64 output rows
  static_assert(RBN == 128 || RBN == 256, "two or four warpgroups");
  constexpr int W_ROW_BYTES = BK * BITS / 8;
  constexpr int W_STAGE_BYTES = RBN * W_ROW_BYTES;          // per matrix
  constexpr int B_STAGE_BYTES = BM * BK * 2;
  static_assert(BK * 2 == 128 && B_STAGE_BYTES % WGMMA_SWIZZLE_BYTES == 0, "a k-step's tile row is one swizzle row; stages of whole 8-row patterns");
  constexpr int B_COPIES = BM * BK / 8;                     // 16-byte copies per stage
  constexpr int B_PER_THREAD = (B_COPIES + THREADS - 1) / THREADS;
  constexpr int W_PER_THREAD = W_STAGE_BYTES / 16 / THREADS;
  static_assert(GATED == ACTIVATE && ACTIVATE == PAIRS_IN && BITS == 4, "the gate+up or the down launch of 4-bit experts");
  static_assert(ACTIVATE || !K_ORDER_OUT, "the down's output rows are the layer's");
  static_assert(W_STAGE_BYTES / 16 % THREADS == 0, "weight copies split evenly");
  static_assert(GROUP % 16 == 0, "a thread's 16 values of a k-step share one group");
  using Bias = cuda::std::conditional_t<FP4, T, S>;
  static_assert(bias_signature_matches<HAS_BIAS, Bias, decltype(bias0)> &&
                bias_signature_matches<HAS_BIAS, Bias, decltype(bias1)>, "HAS_BIAS disagrees with the bias inputs");
  static_assert(!FP4 || (BITS == 4 && (GROUP == 32 || GROUP == 16)), "fp4: 4-bit codes in groups of 32 (mxfp4) or 16 (nvfp4)");

  extern __shared__ __align__(128) unsigned char shared_bytes[];
  // [WGMMA_STAGES][B_STAGE_BYTES] from the first multiple of WGMMA_SWIZZLE_BYTES (moe_prefill.shared_bytes leaves room)
  unsigned char* sb = shared_bytes + (-smem_address(shared_bytes) & (WGMMA_SWIZZLE_BYTES - 1));
  unsigned char* sw = sb + WGMMA_STAGES * B_STAGE_BYTES;   // [WGMMA_STAGES][MATRICES][W_STAGE_BYTES]

  const Dims d(dims);
  const int tile = blockIdx.y;
  const int expert = tile_expert[tile];
  if (expert < 0) return;
  const int n0 = blockIdx.x * RBN;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
  const int row = warp / 4 * 64 + warp % 4 * 16 + g;  // this thread's first weight row in the block; the second is row + 8
  const int k_steps = d.in_dim / BK, groups_per_row = d.in_dim / GROUP;
  const size_t row_bytes = (size_t)d.in_dim * BITS / 8;

  // B copies: copy c takes tile row c / 8, 8-value chunk kb = c % 8, to shared byte row x 128 +
  // (kb ^ row % 8) x 16 (wgmma_descriptor's swizzle): a warp's copy is 4 rows' whole 128-byte
  // lines, each landing in one 128-byte row of shared memory. In core matrices (kb BM + row) x 16
  // the two halves of a row's 32-byte sector landed 16 BM bytes apart, and each asked L2 for the
  // sector (ncu: 25.8 sectors a warp's copy for 12.9 of bytes; docs/benchmarks.md, eighty-seventh stop).
  unsigned b_offset[B_PER_THREAD], b_slot[B_PER_THREAD];
  unsigned b_present = 0;
#pragma unroll
  for (int i = 0; i < B_PER_THREAD; ++i) {
    const int c = (tid + i * THREADS) % B_COPIES;
    const int r = c / 8, kb = c % 8;
    const int pair = row_pair[tile * BM + r];
    b_offset[i] = (PAIRS_IN ? (pair >= 0 ? pair / d.top_k : 0) : tile * BM + r) * d.in_dim + kb * 8;
    b_slot[i] = r * 128 + (kb ^ r % 8) * 16;
    b_present |= (pair >= 0 && tid + i * THREADS < B_COPIES ? 1u : 0u) << i;
  }
  const WeightCopies<W_PER_THREAD, THREADS, W_ROW_BYTES, BM> w_copies(tid, n0, expert, d.out_dim, row_bytes);
  auto load_stage = [&](int stage, int k0) {
    const unsigned b_dst = smem_address(sb + stage * B_STAGE_BYTES);
#pragma unroll
    for (int i = 0; i < B_PER_THREAD; ++i) {
      if (B_COPIES % THREADS == 0 || tid + i * THREADS < B_COPIES)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(b_dst + b_slot[i]), "l"(a + b_offset[i] + k0),
                     "r"((b_present >> i & 1u) * 16));
    }
#pragma unroll
    for (int m = 0; m < MATRICES; ++m)
      w_copies.copy(reinterpret_cast<const unsigned char*>(m == 0 ? w0 : w1) + (size_t)k0 * BITS / 8,
                    sw + (stage * MATRICES + m) * W_STAGE_BYTES, tid);
  };

  // Scales and biases of this thread's two rows, read in windows of 16 bytes of a row (WINDOW
  // groups): lane t of a quad holds word t of its rows' windows, loaded once every
  // STEPS_PER_WINDOW k-steps, and each k-step takes its group's value from the word's lane by a
  // shuffle. A 2-byte load a thread a k-step touched eight 128-byte lines a warp's load (one a row
  // of the warp's eight), eight loads a step: on Mixtral's 128-byte rows, 16% of the GEMM's time.
  constexpr int WINDOW = 16 / sizeof(S), PER_WORD = 4 / sizeof(S);
  constexpr int STEPS_PER_WINDOW = WINDOW * GROUP / BK;
  static_assert(STEPS_PER_WINDOW >= 2 && (GROUP >= BK || WINDOW % (BK / GROUP) == 0),
                "a k-step's groups lie in one window, and a window lasts two k-steps or more");
  KeptScale<T, S, BITS, FP4> group_scale[MATRICES][2];
  S group_bias[MATRICES][2];
  unsigned held_scale[MATRICES][2], held_bias[MATRICES][2];
  // Rows of whole 4-byte words (gpt-oss's 90 one-byte groups are not) load a group a k-step.
  const bool windows = groups_per_row * sizeof(S) % 4 == 0 &&
                       (reinterpret_cast<size_t>(s0) | reinterpret_cast<size_t>(s1) |
                        (FP4 ? 0 : reinterpret_cast<size_t>(b0) | reinterpret_cast<size_t>(b1))) % 4 == 0;
  auto row_start = [&](int h8) {  // the first group of this thread's row g + 8 h8 (rows past out_dim read row 0)
    const int n = n0 + row + 8 * h8;
    return ((size_t)expert * d.out_dim + (n < d.out_dim ? n : 0)) * groups_per_row;
  };
  auto load_window = [&](int window) {
    const int first = window * WINDOW + t * PER_WORD;  // this lane's word's first group
#pragma unroll
    for (int m = 0; m < MATRICES; ++m) {
#pragma unroll
      for (int h8 = 0; h8 < 2; ++h8) {
        held_scale[m][h8] = window_word((m == 0 ? s0 : s1) + row_start(h8), first, groups_per_row);
        if constexpr (!FP4) held_bias[m][h8] = window_word((m == 0 ? b0 : b1) + row_start(h8), first, groups_per_row);
      }
    }
  };
  auto take_scales = [&](int step) {
    const int group = (step * BK + 16 * t) / GROUP, in_window = group % WINDOW;
    const int from = (lane & ~3) | in_window / PER_WORD, shift = 8 * sizeof(S) * (in_window % PER_WORD);
#pragma unroll
    for (int m = 0; m < MATRICES; ++m) {
#pragma unroll
      for (int h8 = 0; h8 < 2; ++h8) {
        if (windows) {
          group_scale[m][h8] = group_scale_of<T, BITS, FP4, GROUP>(word_value<S>(__shfl_sync(0xffffffffu, held_scale[m][h8], from) >> shift));
          if constexpr (!FP4) group_bias[m][h8] = group_bias_of<T, BITS, FP4>(word_value<S>(__shfl_sync(0xffffffffu, held_bias[m][h8], from) >> shift));
        } else {
          const size_t at = row_start(h8) + group;
          group_scale[m][h8] = group_scale_of<T, BITS, FP4, GROUP>((m == 0 ? s0 : s1)[at]);
          if constexpr (!FP4) group_bias[m][h8] = group_bias_of<T, BITS, FP4>((m == 0 ? b0 : b1)[at]);
        }
      }
    }
  };

  float acc[MATRICES][BM / 2];
#pragma unroll
  for (int m = 0; m < MATRICES; ++m)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc[m][i] = 0.f;

#pragma unroll
  for (int s = 0; s < WGMMA_AHEAD; ++s) {
    if (s < k_steps) load_stage(s, s * BK);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  if (windows) load_window(0);
  take_scales(0);
  for (int step = 0; step < k_steps; ++step) {
    const int stage = step % WGMMA_STAGES;
    asm volatile("cp.async.wait_group %0;\n" ::"n"(WGMMA_AHEAD - 1));
    // this thread's cp.async writes, visible to the wgmmas' (async proxy) reads after the barrier
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    // The stage refilled here was read two k-steps back: every warpgroup has since waited until
    // at most its last k16 step's wgmmas were pending, and every thread has passed the barrier.
    const int ahead = step + WGMMA_AHEAD;
    if (ahead < k_steps) load_stage(ahead % WGMMA_STAGES, ahead * BK);
    asm volatile("cp.async.commit_group;\n" ::);

    const unsigned char* w_stage = sw + stage * MATRICES * W_STAGE_BYTES + row * W_ROW_BYTES + t * 8;
    const unsigned b_stage = smem_address(sb + stage * B_STAGE_BYTES);
    // This thread's packed words of each row at physical k 16t .. 16t + 15, both halves' in one
    // 8-byte shared load: the dequantisation waited on each half's own 4-byte loads (ncu: its
    // shifts and masks stalled on them; docs/benchmarks.md, sixty-seventh stop).
    uint2 step_words[MATRICES][2];
#pragma unroll
    for (int m = 0; m < MATRICES; ++m)
#pragma unroll
      for (int h8 = 0; h8 < 2; ++h8)
        step_words[m][h8] = *reinterpret_cast<const uint2*>(w_stage + m * W_STAGE_BYTES + 8 * h8 * W_ROW_BYTES);
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // physical k 16t + 8 half .. + 7: word .x, then .y
#pragma unroll
      for (int s = 0; s < 2; ++s) {  // k16 step 2 half + s
        unsigned af[MATRICES][4];  // (row g, h 0), (row g + 8, h 0), (row g, h 1), (row g + 8, h 1)
#pragma unroll
        for (int m = 0; m < MATRICES; ++m) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int h8 = 0; h8 < 2; ++h8) {
              // the pair (e = 0, 1) at physical k 16t + 8 half + 4e + 2s + h: nibbles 2s + h and
              // 2s + h + 4 of the half's word
              const unsigned word = half == 0 ? step_words[m][h8].x : step_words[m][h8].y;
              af[m][2 * h + h8] = dequant_pair_at<T, S, BITS, FP4>(word >> 8 * s, 4 * h, group_scale[m][h8], group_bias[m][h8]);
            }
          }
        }
        // the next step's scales, once the last k16 step has dequantised with the current ones;
        // then, if that was its window's last step, the next window
        if (half == 1 && s == 1 && step + 1 < k_steps) {
          take_scales(step + 1);
          if (windows && (step + 2) % STEPS_PER_WINDOW == 0 && step + 2 < k_steps) load_window((step + 2) / STEPS_PER_WINDOW);
        }
#pragma unroll
        for (int m = 0; m < MATRICES; ++m) pin(af[m]), pin(acc[m]);
        wgmma_fence();
#pragma unroll
        for (int m = 0; m < MATRICES; ++m)
          wgmma<T, BM>(acc[m], af[m], wgmma_descriptor(b_stage + (2 * half + s) * 32));
        // one k16 step in flight while the next is dequantised: its registers are free after this
        wgmma_commit();
        wgmma_wait<1>();
      }
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int m = 0; m < MATRICES; ++m) pin(acc[m]);

  // The block's outputs through shared memory (the pipeline's, free once every warp is here): a
  // thread's accumulators are 2-byte pieces of BM rows, each output row leaves as 16-byte stores.
  // acc[m][4j + 2 h8 + e] is block column row + 8 h8 of tile row 8j + 2t + e.
  static_assert(BM * out_stride<RBN> * 2 <= WGMMA_STAGES * (B_STAGE_BYTES + MATRICES * W_STAGE_BYTES), "outputs fit the pipeline's memory");
  T* staged = reinterpret_cast<T*>(shared_bytes);
  // K_ORDER_OUT: block column p of each 64 (RBN and n0 are multiples of 64) staged at the column
  // of wgmma_k_order that holds it, 32 half + 16 s + 8 h + 2 t' + e for p = 16 t' + 8 half + 4 e +
  // 2 s + h, so that the down reads the rows as written (no reordering launch between them)
  int staged_column[2];
#pragma unroll
  for (int h8 = 0; h8 < 2; ++h8) {
    const int p = row + 8 * h8, q = p % 64;
    staged_column[h8] = !K_ORDER_OUT ? p : p - q + 32 * (q / 8 % 2) + 16 * (q / 2 % 2) + 8 * (q % 2) + 2 * (q / 16) + q / 4 % 2;
  }
  __syncthreads();
  with_extras(d, [&](auto extras) {
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int h8 = 0; h8 < 2; ++h8) {
          const int n = n0 + row + 8 * h8;
          constexpr float UNSCALE = ACCUMULATOR_UNSCALE<T, S, BITS, FP4>;
          const float value = finish<T, ACTIVATE, GATED, ACT, LIMITED, decltype(extras)::value>(
              acc[0][4 * j + 2 * h8 + e] * UNSCALE, acc[MATRICES - 1][4 * j + 2 * h8 + e] * UNSCALE, d, bias0, bias1, scale, params, expert,
              n < d.out_dim ? n : 0);
          staged[(8 * j + 2 * t + e) * out_stride<RBN> + staged_column[h8]] = static_cast<T>(value);
        }
      }
    }
  });
  __syncthreads();
  StagedRowStores<T, BM, RBN, THREADS, ACTIVATE> stores;
  stores.load(row_pair, tile, n0, d.out_dim, tid);
  stores.store(staged, out, tile, n0, d.out_dim, tid);
}

//// route
// The routing of `grouped`: per-expert counts, each expert's run padded to whole TILE-row tiles
// and laid out in expert order, the tile -> expert map, then every pair scattered into its
// expert's run. Each block counts every pair in shared memory (those before its own chunk of
// `chunk` pairs apart), so it knows every run and where its chunk's pairs go in them without
// waiting on another block; the blocks then share the writes. Rows within a run come in atomic
// order: each row's result is independent of the others, so the outputs do not depend on it.
// inputs: indices [pairs] (the expert of each pair), sizes = pairs, experts, tiles (the grid's
//         worst case, moe_prefill.grid_tiles), chunk
// outputs: row_pair [tiles * TILE] (pair, -1: padding), tile_expert [tiles] (-1: unused)
// Template constants: TILE, MAX_EXPERTS (the shared arrays' size; the launcher checks experts and
// launches 32-warp blocks, a thread an expert in the scan).
{
  __shared__ int total[MAX_EXPERTS], before[MAX_EXPERTS], cursor[MAX_EXPERTS], start[MAX_EXPERTS + 1];
  __shared__ int warp_runs[32];
  const int pairs = sizes[0], experts = sizes[1], tiles = sizes[2], chunk = sizes[3];
  const int tid = threadIdx.x, threads = blockDim.x, lane = tid % 32, warp = tid / 32;
  const int first = blockIdx.x * chunk, end = min(first + chunk, pairs);
  for (int e = tid; e < experts; e += threads) total[e] = before[e] = cursor[e] = 0;
  __syncthreads();
  for (int p = tid; p < pairs; p += threads) {
    const int e = indices[p];
    atomicAdd(&total[e], 1);
    if (p < first) atomicAdd(&before[e], 1);
  }
  __syncthreads();
  // start[e + 1]: the padded runs of experts 0..e, an inclusive scan over the block's threads
  const int run = grouped::warp_inclusive_sum(tid < experts ? (total[tid] + TILE - 1) / TILE * TILE : 0, lane);
  if (lane == 31) warp_runs[warp] = run;
  __syncthreads();
  if (warp == 0) warp_runs[lane] = grouped::warp_inclusive_sum(warp_runs[lane], lane);
  __syncthreads();
  if (tid < experts) start[tid + 1] = run + (warp > 0 ? warp_runs[warp - 1] : 0);
  if (tid == 0) start[0] = 0;
  __syncthreads();
  const int used_rows = start[experts];
  const int grid_tid = blockIdx.x * threads + tid, grid_threads = gridDim.x * threads;
  for (int t = grid_tid; t < tiles; t += grid_threads) {
    const int row = t * TILE;
    int expert = -1;
    if (row < used_rows) {  // the last expert whose run starts at or before `row`
      int low = 0, high = experts - 1;
      while (low < high) {
        const int mid = (low + high + 1) / 2;
        if (start[mid] <= row) low = mid; else high = mid - 1;
      }
      expert = low;
    }
    tile_expert[t] = expert;
  }
  for (int i = grid_tid; i < experts * TILE; i += grid_threads) {  // each run's padding rows
    const int e = i / TILE, row = start[e] + total[e] + i % TILE;
    if (row < start[e + 1]) row_pair[row] = -1;
  }
  for (int row = used_rows + grid_tid; row < tiles * TILE; row += grid_threads) row_pair[row] = -1;
  for (int p = first + tid; p < end; p += threads) {
    const int e = indices[p];
    row_pair[start[e] + before[e] + atomicAdd(&cursor[e], 1)] = p;
  }
}


//// k_order
// grouped_wgmma's activation rows: each 64-wide k-step's columns in the order its wgmmas read them
// (moe_prefill.wgmma_k_order, the reference: column 32 half + 16 s + 8 h + 2 t + e holds column
// 16 t + 8 half + 4 e + 2 s + h), a permutation within each 64 values of the contiguous rows.
// MLX's transpose of the same permutation is a general 7-axis copy: 44 us for Qwen3-30B-A3B's
// 2048 x 2048 bf16 rows on the H200 (docs/benchmarks.md, seventy-second stop).
// inputs: rows [n, K] (K a multiple of 64), sizes = n, K; outputs: out [n, K]
// Template constants: T, THREADS (the block's threads). A block's threads each load 16 bytes into
// shared memory (whole k-steps: THREADS is a multiple of 8), then gather their 8 outputs from there
// and store them as 16 bytes.
{
  __shared__ uint4 staged[THREADS];
  const long long chunks = static_cast<long long>(sizes[0]) * sizes[1] / 8;
  const long long chunk = static_cast<long long>(blockIdx.x) * THREADS + threadIdx.x;
  if (chunk < chunks) staged[threadIdx.x] = reinterpret_cast<const uint4*>(rows)[chunk];
  __syncthreads();
  if (chunk >= chunks) return;
  const int quarter = threadIdx.x % 8;  // 4 half + 2 s + h
  const T* source = reinterpret_cast<const T*>(staged) + (threadIdx.x / 8) * 64 + 8 * (quarter >> 2) +
                    2 * ((quarter >> 1) & 1) + (quarter & 1);
  uint4 packed;
  T* values = reinterpret_cast<T*>(&packed);
#pragma unroll
  for (int t = 0; t < 4; ++t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) values[2 * t + e] = source[16 * t + 4 * e];
  }
  reinterpret_cast<uint4*>(out)[chunk] = packed;
}


//// combine
// The routing-weighted sum over each token's TOP_K rows of the down GEMM (rows in pair order),
// as the decode kernel's combining down launch computes it: each weight and each product
// rounded to T as the reference's combine rounds them, the products summed in fp32 (MLX's sum
// in T rounds after each addition: within T's tolerance, not bit for bit). One launch reading
// each row once, where the reference's multiply and sum over k took 7-13x the time of its bytes
// at HBM bandwidth (docs/benchmarks.md, tenth session).
// inputs: rows [tokens * TOP_K, OUT_DIM], weights [tokens * TOP_K] (WT), sizes = tokens, TOP_K, OUT_DIM
// outputs: out [tokens, OUT_DIM]
// One thread per 8 consecutive outputs (16-byte loads and stores; OUT_DIM is a multiple of 32),
// its rows loaded IN_FLIGHT at a time before any is summed (one load in flight per thread was
// latency bound).
{
  constexpr int IN_FLIGHT = 4;
  const int tokens = sizes[0], top_k = sizes[1], width = sizes[2];
  const int chunks = width / 8;
  const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<long long>(tokens) * chunks) return;
  const long long token = index / chunks;
  const int column = static_cast<int>(index % chunks) * 8;
  float total[8] = {};
  for (int first = 0; first < top_k; first += IN_FLIGHT) {
    uint4 packed[IN_FLIGHT];
    float weight[IN_FLIGHT];
#pragma unroll
    for (int k = 0; k < IN_FLIGHT; ++k) {
      const long long pair = token * top_k + min(first + k, top_k - 1);
      weight[k] = moe_common::rnd<T>(static_cast<float>(weights[pair]));
      packed[k] = *reinterpret_cast<const uint4*>(rows + pair * width + column);
    }
#pragma unroll
    for (int k = 0; k < IN_FLIGHT; ++k) {
      const T* values = reinterpret_cast<const T*>(&packed[k]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (first + k < top_k) total[i] += moe_common::rnd<T>(static_cast<float>(values[i]) * weight[k]);
      }
    }
  }
  uint4 packed;
  T* values = reinterpret_cast<T*>(&packed);
#pragma unroll
  for (int i = 0; i < 8; ++i) values[i] = static_cast<T>(total[i]);
  *reinterpret_cast<uint4*>(out + token * width + column) = packed;
}
