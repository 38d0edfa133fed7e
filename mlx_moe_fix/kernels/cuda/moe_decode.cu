// Fused decode MoE for mx.fast.cuda_kernel: one warp per (pair or token, output row), 16-byte
// loads of packed affine-quantized (or mxfp4 / nvfp4) weights, dot products in registers (against 16-bit
// activations in fixed point with dp4a, against fp32 ones dequantised to fp32), fp32 sums.
//
// Sections are split on "//// <name>" lines: `header` goes into cuda_kernel's header, the others
// are kernel bodies. Template constants and types (set from Python; few, since each distinct
// set is one NVRTC compile):
//   T   activation / output type        S   scales, affine biases and additive bias type; uint8_t:
//       FP4 experts (FP4_EXPERTS: e2m1 codes, no affine biases, additive biases of T): mxfp4 at
//       GROUP 32 (e8m0 scales), nvfp4 at GROUP 16 (e4m3 scales)
//   SC  per-expert scale type           WT  routing weight type
//   BITS 4 or 8, GROUP 16 (nvfp4)/32/64/128, WARPS (warps per block), RPW (output rows per warp: the
//   warp reads each activation vector once for all of them), HAS_BIAS (the bias inputs' signature:
//   S, or the float32 placeholder; see moe_common::bias_signature_matches)
//   gate_up: GATED;  down: INPUT_PER_PAIR, COMBINE;  routed_down: RESIDUAL
// Run-time values (an int32 array `dims` and a float array `params`, uniform across the grid):
//   dims: IN_DIM, OUT_DIM, TOP_K, ACT (0 swiglu, 1 swiglu_oai, 2 gelu, 3 gelu_approx,
//         4 gelu_fast), HAS_LIMIT, HAS_BIAS, HAS_SCALE (gate_scale / out_scale)
//   params: limit, alpha

//// header
namespace moe_decode {

using namespace moe_common;

constexpr int WORDS_PER_VECTOR = 4;  // one 16-byte load of packed weights

// Activations per weight vector: a lane reads them straight from global memory (16-byte loads;
// every warp of an SM reads the same few rows, so they come from L1), with no staging in shared
// memory: a block then needs none, and the combining down launch no longer stages TOP_K rows to
// produce a few output rows.
template <int BITS>
constexpr int VALUES = WORDS_PER_VECTOR * 32 / BITS;

// Activation vector v of `row` (VALUES<BITS> values of T from v * VALUES) as loaded: its 32-bit
// words, each holding 4 / sizeof(T) values in order.
template <int BITS, typename T>
constexpr int ACTIVATION_WORDS = VALUES<BITS> * sizeof(T) / 4;
template <int BITS, typename T>
__device__ __forceinline__ void load_activation_words(unsigned (&words)[ACTIVATION_WORDS<BITS, T>], const T* row, int v) {
  const uint4* src = reinterpret_cast<const uint4*>(row + v * VALUES<BITS>);
#pragma unroll
  for (int i = 0; i < ACTIVATION_WORDS<BITS, T> / 4; ++i) {
    const uint4 q = src[i];
    words[4 * i] = q.x, words[4 * i + 1] = q.y, words[4 * i + 2] = q.z, words[4 * i + 3] = q.w;
  }
}

// One loaded word's 4 / sizeof(T) activations as fp32.
template <typename T>
__device__ __forceinline__ void widen_word(float* x, unsigned word) {
  if constexpr (sizeof(T) == 4) {
    x[0] = __uint_as_float(word);
  } else if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    x[0] = __uint_as_float(word << 16);
    x[1] = __uint_as_float(word & 0xffff0000u);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&word));
    x[0] = f.x;
    x[1] = f.y;
  }
}

// Activation vector v of `row` as fp32.
template <int BITS, typename T>
__device__ __forceinline__ void load_vector(float* x, const T* row, int v) {
  unsigned words[ACTIVATION_WORDS<BITS, T>];
  load_activation_words<BITS>(words, row, v);
#pragma unroll
  for (int w = 0; w < ACTIVATION_WORDS<BITS, T>; ++w) widen_word<T>(x + w * 4 / sizeof(T), words[w]);
}

// Dequantisation without a shift per value: value i of a packed word is read where it lies,
// (word & (MASK << BITS * place)) | the bits of 2^23, minus 2^23, which is q * 2^(BITS * place)
// exactly, against an activation prescaled by 2^-(BITS * place) (exact too), so that each fmaf
// sees the same product as q * x. Values whose bits reach fp32's exponent (from bit 23) are
// read from the word shifted right once by HIGH_SHIFT.
template <int BITS>
constexpr int IN_PLACE = BITS == 4 ? 5 : 2;
template <int BITS>
constexpr int HIGH_SHIFT = BITS == 4 ? 12 : 16;
template <int BITS>
__host__ __device__ constexpr int place(int i) {
  return i < IN_PLACE<BITS> ? i : i - HIGH_SHIFT<BITS> / BITS;
}

// x (one vector's activations) times each value's 2^-(BITS * place), in place.
template <int BITS>
__device__ __forceinline__ void prescale(float* x) {
  constexpr int PER_WORD = 32 / BITS;
#pragma unroll
  for (int i = 0; i < VALUES<BITS>; ++i) x[i] *= 1.f / static_cast<float>(1u << (BITS * place<BITS>(i % PER_WORD)));
}

template <int BITS>
__device__ __forceinline__ float dot_vector(const uint4& packed, const float* prescaled_x) {
  const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
  constexpr int PER_WORD = 32 / BITS;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  float acc = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const unsigned high = words[w] >> HIGH_SHIFT<BITS>;
#pragma unroll
    for (int i = 0; i < PER_WORD; ++i) {
      const unsigned bits = (i < IN_PLACE<BITS> ? words[w] : high) & (MASK << (BITS * place<BITS>(i)));
      acc = fmaf(__uint_as_float(0x4B000000u | bits) - 8388608.f, prescaled_x[w * PER_WORD + i], acc);
    }
  }
  return acc;
}

// The fixed-point path (16-bit activations), where the fp32 loop above is bound by the
// instructions it issues (three a 4-bit value a row: docs/benchmarks.md, eighteenth session): each
// activation vector becomes integers X = x 2^k (rounded; k from the vector's largest magnitude, so
// that |X| < 2^X_BITS: for 4-bit weights bf16 activations within 2^14 of it are exact, fp16 ones
// within 2^11; for 8-bit weights 2^10 and 2^7), split into bytes, and a row's dot product is dp4a
// sums of its weight bytes against them, exact in 32 bits, converted to fp32 once a vector: ~0.75
// dp4a and 0.4 mask a 4-bit value a row, 0.75 dp4a an 8-bit one. The split is made once a vector
// and shared by every row the warp reads (by every warp of a gate+up block: split_row). (On the
// H200 it cut the routed decode's kernel time by a quarter at Mixtral's 4-bit shape and by 15-17%
// at 8 bits: docs/benchmarks.md, twenty-second and twenty-third sessions.)
template <typename T>
constexpr bool FIXED_POINT = sizeof(T) == 2;

// MLX's mxfp4 and nvfp4 experts, told by their scales: bytes, e8m0 (2^(e - 127)) a group of 32
// or e4m3 a group of 16, the supported quantizations with 8-bit scales. Their 4-bit values are
// e2m1 codes (sign, two exponent bits, one mantissa bit), with no affine biases; their additive
// biases are of the activations' type. Only the fixed-point path reads them: each code as a
// signed byte of twice its value (the magnitudes 0, 1, 2, 3, 4, 6, 8, 12 looked up by PRMT), the
// group's scale halved.
template <typename S>
constexpr bool FP4_EXPERTS = cuda::std::is_same_v<S, uint8_t>;
template <typename S, typename T>
using AdditiveBias = cuda::std::conditional_t<FP4_EXPERTS<S>, T, S>;

// 2^(e - 128): an e8m0 scale byte's power of two, halved (e = 0 and 1 as fp32 subnormals).
__device__ __forceinline__ float e8m0_half(uint8_t e) {
  return e > 1 ? __uint_as_float(static_cast<unsigned>(e - 1) << 23) : __uint_as_float(0x00200000u << e);
}

// One activation vector split for dot_fixed. Entry e's byte b multiplies byte b of the weight
// word dot_fixed takes for e: for 4-bit weights the nibbles (word e / 2 >> 4 (e % 2)) & 0x0F0F0F0F,
// values 8 (e / 2) + e % 2 + 2b; for mxfp4 CODES the codes of word e / 2's half e % 2 looked up,
// values 8 (e / 2) + 4 (e % 2) + b; for 8-bit ones word e itself, values 4e + b. lo[e], mid[e],
// hi[e]: bytes 0, 1 (unsigned) and 2 (signed) of those values' X.
template <int BITS>
constexpr int FIXED_ENTRIES = VALUES<BITS> / 4;
template <int BITS, bool CODES>
__host__ __device__ constexpr int fixed_value(int e, int b) {
  return CODES ? 8 * (e / 2) + 4 * (e % 2) + b : BITS == 4 ? 8 * (e / 2) + e % 2 + 2 * b : 4 * e + b;
}
// |X| < 2^X_BITS keeps a vector's sum of q X within 32 bits (32 values of 15, 16 of 255).
template <int BITS>
constexpr int X_BITS = BITS == 4 ? 22 : 18;

template <int BITS>
struct FixedVector {
  unsigned lo[FIXED_ENTRIES<BITS>], mid[FIXED_ENTRIES<BITS>], hi[FIXED_ENTRIES<BITS>];
  float unscale;  // 2^-k; NaN where an activation is not finite, so that the row's sum is too
  float sum;      // the activations' fp32 sum, in dot_vector's order, for the affine biases
};

template <int BITS, bool CODES, typename T>
__device__ __forceinline__ void load_fixed_vector(FixedVector<BITS>& f, const T* row, int v) {
  static_assert(sizeof(T) == 2, "16-bit activations");
  constexpr int N = VALUES<BITS>;
  unsigned words[ACTIVATION_WORDS<BITS, T>];
  load_activation_words<BITS>(words, row, v);
  // the largest magnitude's fp32 exponent field (bf16 and fp16 magnitudes order as integers)
  unsigned largest = 0;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) largest = __vmaxu2(largest, words[i] & 0x7FFF7FFFu);
  largest = max(largest & 0xFFFFu, largest >> 16);
  int exponent;
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    exponent = largest >> 7;
  } else {
    exponent = (largest >> 10) == 0x1F ? 255 : (largest >> 10) + 112;  // fp16's bias 15 against fp32's 127
  }
  const bool finite = exponent < 255;
  exponent = max(exponent, 22);  // below 2^-105 every X is tiny anyway; keeps 2^k and 2^-k normal
  // 2^k with k = X_BITS + 126 - exponent: the largest magnitude (< 2^(exponent - 126)) times it is below 2^X_BITS
  const float scale_up = __uint_as_float((unsigned)(253 + X_BITS<BITS> - exponent) << 23);
  f.unscale = finite ? __uint_as_float((unsigned)(exponent + 1 - X_BITS<BITS>) << 23) : __uint_as_float(0x7FC00000u);
  // a packed word's values at a time (fewer registers live than the whole vector's)
  constexpr int PER_WORD = 32 / BITS;
  f.sum = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    float x[PER_WORD];
#pragma unroll
    for (int i = 0; i < PER_WORD / 2; ++i) widen_word<T>(x + 2 * i, words[PER_WORD / 2 * w + i]);
#pragma unroll
    for (int i = 0; i < PER_WORD; ++i) f.sum += x[i];
    // x 2^k + 1.5 2^23: the integer X in the low 23 bits, offset by 2^22 (byte 2 holds X's top
    // byte plus 64; the bytewise (+ 64) ^ 0x80 below makes it X's signed top byte)
    unsigned fixed[PER_WORD];
#pragma unroll
    for (int i = 0; i < PER_WORD; ++i) fixed[i] = __float_as_uint(fmaf(x[i], scale_up, 12582912.f));
#pragma unroll
    for (int e = PER_WORD / 4 * w; e < PER_WORD / 4 * (w + 1); ++e) {
      const int first = PER_WORD * w;
      const unsigned a = fixed[fixed_value<BITS, CODES>(e, 0) - first], b = fixed[fixed_value<BITS, CODES>(e, 1) - first];
      const unsigned c = fixed[fixed_value<BITS, CODES>(e, 2) - first], d = fixed[fixed_value<BITS, CODES>(e, 3) - first];
      const unsigned low01 = __byte_perm(a, b, 0x5140), low23 = __byte_perm(c, d, 0x5140);
      const unsigned top01 = __byte_perm(a, b, 0x0062), top23 = __byte_perm(c, d, 0x0062);
      f.lo[e] = __byte_perm(low01, low23, 0x5410);
      f.mid[e] = __byte_perm(low01, low23, 0x7632);
      f.hi[e] = (__byte_perm(top01, top23, 0x5410) + 0x40404040u) ^ 0x80808080u;
    }
  }
}

// Four mxfp4 codes (the nibbles of `codes`' low 16 bits) as signed bytes of twice their values.
// PRMT looks each code's magnitude up among 8 bytes; a selector nibble's top bit (the code's
// sign) makes it replicate the looked-up byte's sign bit instead, 0: so `positive` holds the
// magnitudes of the positive codes, `magnitude ^ positive` those of the negative ones, and the
// bytewise difference (no byte borrows: each stays within 116 .. 140 before the last XOR) is the
// signed value.
__device__ __forceinline__ unsigned e2m1_bytes(unsigned codes) {
  constexpr unsigned LOW = 0x03020100u, HIGH = 0x0C080604u;  // 0, 1, 2, 3 | 4, 6, 8, 12
  unsigned magnitude, positive;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(magnitude) : "r"(LOW), "r"(HIGH), "r"(codes & 0x7777u));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(positive) : "r"(LOW), "r"(HIGH), "r"(codes));
  return ((positive | 0x80808080u) - (magnitude ^ positive)) ^ 0x80808080u;
}

// Sum over a vector's values of q X, exact in 32 bits (X_BITS); CODES: q twice the FP4 codes'
// values, signed (|q| <= 12 where 4-bit values are below 16). Entries FIRST to LAST only: for
// CODES, entries 0-3 hold values 0-15 and entries 4-7 values 16-31, nvfp4's two groups.
template <int BITS, bool CODES, int FIRST = 0, int LAST = FIXED_ENTRIES<BITS>>
__device__ __forceinline__ int dot_fixed(const uint4& packed, const FixedVector<BITS>& f) {
  static_assert(!CODES || BITS == 4, "FP4 codes are 4-bit");
  const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
  unsigned hi = 0, mid = 0, lo = 0;
#pragma unroll
  for (int e = FIRST; e < LAST; ++e) {
    if constexpr (CODES) {
      const unsigned q = e2m1_bytes(e % 2 ? words[e / 2] >> 16 : words[e / 2]);
      asm("dp4a.s32.s32 %0, %1, %2, %0;" : "+r"(hi) : "r"(q), "r"(f.hi[e]));
      asm("dp4a.s32.u32 %0, %1, %2, %0;" : "+r"(mid) : "r"(q), "r"(f.mid[e]));
      asm("dp4a.s32.u32 %0, %1, %2, %0;" : "+r"(lo) : "r"(q), "r"(f.lo[e]));
    } else {
      const unsigned q = BITS == 4 ? (words[e / 2] >> (4 * (e % 2))) & 0x0F0F0F0Fu : words[e];
      asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(hi) : "r"(q), "r"(f.hi[e]));
      asm("dp4a.u32.u32 %0, %1, %2, %0;" : "+r"(mid) : "r"(q), "r"(f.mid[e]));
      asm("dp4a.u32.u32 %0, %1, %2, %0;" : "+r"(lo) : "r"(q), "r"(f.lo[e]));
    }
  }
  return static_cast<int>((hi << 16) + (mid << 8) + lo);
}

// A vector's split as a block keeps it in shared memory: padded to a stride of 4 words past a
// multiple of 8, so that the 8 lanes of a 16-byte shared load's phase read 32 distinct banks.
template <int BITS>
constexpr int SPLIT_WORDS = (sizeof(FixedVector<BITS>) / 4 + 4 + 7) / 8 * 8 - 4;
template <int BITS>
struct alignas(16) SharedFixed {
  FixedVector<BITS> f;
  unsigned padding[SPLIT_WORDS<BITS> - sizeof(FixedVector<BITS>) / 4];
};
// moe_decode.SPLIT_BYTES_PER_VECTOR reserves this much a vector.
static_assert(sizeof(SharedFixed<4>) <= 128 && sizeof(SharedFixed<8>) <= 128, "a vector's split within its reserved bytes");

// The gate+up block's activation `row` split once for all its warps into the launch's shared
// memory (SHARED_SPLIT; nullptr otherwise), where each warp split every vector itself (by the
// source's count a third of the GEMV's instructions; on the H200 Qwen3's routed gate+up went from
// 9.3 to 8.7 µs: docs/benchmarks.md, twenty-third session). A vector a thread, the last threads
// first: the routed gate+up's first warp routes meanwhile. The caller's barrier makes the split
// visible to every warp.
template <int BITS, bool SHARED_SPLIT, bool CODES, typename T>
__device__ __forceinline__ SharedFixed<BITS>* split_row(const T* row, int in_dim) {
  if constexpr (!SHARED_SPLIT) {
    return nullptr;
  } else {
    extern __shared__ __align__(16) unsigned char decode_shared[];
    SharedFixed<BITS>* split = reinterpret_cast<SharedFixed<BITS>*>(decode_shared);
    for (int v = blockDim.x - 1 - threadIdx.x; v < in_dim / VALUES<BITS>; v += blockDim.x) load_fixed_vector<BITS, CODES>(split[v].f, row, v);
    return split;
  }
}

// One expert's quantized matrix: packed rows and per-group scales and affine biases (mxfp4
// experts: the absent input's placeholder, never read).
template <typename S>
struct QuantizedRows {
  const uint32_t* w;
  const S* s;
  const S* b;

  QuantizedRows() = default;
  template <typename B>
  __device__ QuantizedRows(const uint32_t* w, const S* s, const B* b) : w(w), s(s), b(reinterpret_cast<const S*>(b)) {}

  // Expert `expert`'s matrix, where these are every expert's [E, out_dim, in_dim] ones.
  template <int BITS, int GROUP>
  __device__ QuantizedRows of_expert(size_t expert, const Dims& d) const {
    const size_t rows_before = expert * d.out_dim;
    const size_t groups = rows_before * (d.in_dim / GROUP);
    return {w + rows_before * (d.in_dim * BITS / 32), s + groups, b + groups};
  }
};

// The sums over the warp of each lane's N values, in groups of K (N / K a power of two up to 32),
// lane l left with group l / (32 K / N)'s K sums in `sums`: each butterfly step of warp_sum, while a
// lane holds more than one group, sends half of its groups to its partner and keeps the other half
// (the halves the partner sends), so that N sums take far fewer shuffles than N warp_sums (8 sums,
// K = 1: 9 against 40). Every sum is warp_sum's bit for bit: the same additions in the same order,
// a lane's own value first.
template <int N, int K, int OFFSET = 16>
__device__ __forceinline__ void warp_sum_spread(float (&sums)[K], const float (&v)[N]) {
  static_assert(N % K == 0 && N / K <= 2 * OFFSET && ((N / K) & (N / K - 1)) == 0, "a power of two of groups, at most the lanes left");
  if constexpr (N == K) {
#pragma unroll
    for (int k = 0; k < K; ++k) sums[k] = warp_sum<OFFSET>(v[k]);
  } else {
    const bool upper = threadIdx.x & OFFSET;
    float kept[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float send = upper ? v[i] : v[i + N / 2];
      kept[i] = (upper ? v[i + N / 2] : v[i]) + __shfl_xor_sync(0xffffffffu, send, OFFSET);
    }
    warp_sum_spread<N / 2, K, OFFSET / 2>(sums, kept);
  }
}

// p, as a value the compiler cannot see into: an offset is then added to it, where nvcc folded
// the expert's and the row's offsets into the kernel argument's address in 64-bit arithmetic,
// six instructions a load.
template <typename P>
__device__ __forceinline__ const P* opaque(const P* p) {
  asm("" : "+l"(p));
  return p;
}

// A 16-byte vector of packed weights, not allocated in L1 (L1::no_allocate): each is read once a
// token, while the scales, biases and activations sharing L1 are read again. Measured on the H200
// (docs/benchmarks.md, thirty-seventh session): Qwen3's routed decode 1564-1577 GB/s against
// 1519-1526 through L1, Mixtral's 2917-2920 against 2863-2869.
__device__ __forceinline__ uint4 load_streamed(const uint32_t* p) {
  uint4 v;
  asm("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Dot products of RPW consecutive rows (first_row on, each past last_row reading last_row) of
// each of M matrices with an activation row, summed over the warp (warp_sum_spread): lane l is
// left with KEPT rows' (KEPT dividing RPW), rows first_row + l / (32 KEPT / RPW) * KEPT + k for
// k < KEPT: out[k * M + m] for matrix m. A = 1: one
// row for every matrix; A = M: matrix m's is activations[m] (the fixed-point path only);
// SHARED_SPLIT: the one row's vectors already split, in `split` (fixed point, A = 1). Each lane
// takes whole 16-byte vectors; a vector never straddles a quantization group (GROUP >= 32
// values >= one vector's values), but for nvfp4's (GROUP 16): it spans two, whose adjacent scale
// bytes come in one 16-bit load. Rows are addressed from the matrices' bases, so that the
// warp keeps M bases and RPW row offsets live rather than 3 M RPW pointers; `row_dim` (default
// in_dim) is the values from one row's start to the next's: a matrix of in_dim columns within a
// wider one (a shared expert's columns of Inkling's concatenated down projection). A lane issues the
// loads of LOADS_AHEAD packed vectors (UNROLL per row and matrix), whatever M x RPW, with their
// groups' scales and biases, before using any. Each vector's dot products are FIXED_POINT's
// where it applies, else the fp32 loop's. (Measured on the H200, none of these was faster:
// scales loaded apart from the weights, a tensor-core loop with a third of the instructions,
// the vectors staged through shared memory with the next stage in flight, more warps an SM;
// docs/decode-attribution.md, sections 14-15.)
template <int BITS, int GROUP, int M, int RPW, int A, int KEPT, bool SHARED_SPLIT = false, typename S, typename T>
__device__ __forceinline__ void rows_dot(
    float (&out)[KEPT * M], const QuantizedRows<S> (&m)[M], int first_row, int last_row, const T* const (&activations)[A], int in_dim, int lane,
    const SharedFixed<BITS>* split = nullptr, int row_dim = 0) {
  static_assert(A == 1 || (A == M && FIXED_POINT<T>), "one activation row, or one a matrix in fixed point");
  static_assert(!SHARED_SPLIT || (A == 1 && FIXED_POINT<T>), "a shared split of one row, in fixed point");
  constexpr bool CODES = FP4_EXPERTS<S>;
  static_assert(!CODES || (FIXED_POINT<T> && BITS == 4), "FP4 experts in fixed point");
  constexpr bool TWO_GROUPS = CODES && GROUP == 16;
  static_assert(TWO_GROUPS || GROUP >= VALUES<BITS>, "a vector within one group, or nvfp4's two");
  using VectorScale = cuda::std::conditional_t<TWO_GROUPS, uint16_t, S>;
  constexpr int N = VALUES<BITS>;
  constexpr int LOADS_AHEAD = 8;
  constexpr int UNROLL = M * RPW >= LOADS_AHEAD ? 1 : LOADS_AHEAD / (M * RPW);
  const int stride = row_dim ? row_dim : in_dim;
  const int vectors = in_dim / N, groups = stride / GROUP, words = stride * BITS / 32;
  int rows[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) rows[r] = min(first_row + r, last_row);
  float acc[M * RPW];
#pragma unroll
  for (int i = 0; i < M * RPW; ++i) acc[i] = 0.f;
  for (int first = lane; first < vectors; first += 32 * UNROLL) {
    uint4 packed[UNROLL][M * RPW];
    VectorScale scale[UNROLL][M * RPW];
    S bias[UNROLL][M * RPW];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = min(first + 32 * u, vectors - 1);  // a vector past the row is loaded, not used
      const int group = v * N / GROUP;
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
#pragma unroll
        for (int j = 0; j < M; ++j) {
          // 32-bit offsets from an opaque base: an address is a multiply-add and a 64-bit add
          // (SASS: 434 instructions a loop step of Qwen3's gate+up against 483). Global loads
          // (ld.global, __ldg): the opaque pointer lost its address space.
          const unsigned word = (unsigned)rows[r] * (unsigned)words + (unsigned)(v * WORDS_PER_VECTOR);
          const unsigned group_index = (unsigned)rows[r] * (unsigned)groups + (unsigned)group;
          packed[u][j * RPW + r] = load_streamed(opaque(m[j].w) + word);
          if constexpr (TWO_GROUPS) {
            scale[u][j * RPW + r] = __ldg(reinterpret_cast<const uint16_t*>(opaque(m[j].s) + group_index));
          } else {
            scale[u][j * RPW + r] = __ldg(opaque(m[j].s) + group_index);
          }
          if constexpr (!CODES) bias[u][j * RPW + r] = __ldg(opaque(m[j].b) + group_index);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = first + 32 * u;
      if (u > 0 && v >= vectors) break;
      if constexpr (FIXED_POINT<T>) {
        FixedVector<BITS> f;
#pragma unroll
        for (int i = 0; i < M * RPW; ++i) {
          if constexpr (SHARED_SPLIT) {
            if (i == 0) f = split[v].f;
          } else if (i % (M * RPW / A) == 0) {
            load_fixed_vector<BITS, CODES>(f, activations[i / (M * RPW / A)], v);  // one split live at a time
          }
          if constexpr (TWO_GROUPS) {
            // e4m3_over_256's 2^-8 and the codes' doubling put back by 128
            constexpr int HALF = FIXED_ENTRIES<BITS> / 2;
            const float low = static_cast<float>(dot_fixed<BITS, true, 0, HALF>(packed[u][i], f));
            const float high = static_cast<float>(dot_fixed<BITS, true, HALF>(packed[u][i], f));
            const unsigned bytes = scale[u][i];
            acc[i] += fmaf(e4m3_over_256(bytes & 0xFFu), low, e4m3_over_256(bytes >> 8) * high) * (f.unscale * 128.f);
            continue;
          }
          const float dot = static_cast<float>(dot_fixed<BITS, CODES>(packed[u][i], f)) * f.unscale;
          if constexpr (CODES) {
            acc[i] += e8m0_half(scale[u][i]) * dot;
          } else {
            acc[i] += static_cast<float>(scale[u][i]) * dot + static_cast<float>(bias[u][i]) * f.sum;
          }
        }
      } else {
        float x[N];
        load_vector<BITS>(x, activations[0], v);
        float x_sum = 0.f;
#pragma unroll
        for (int i = 0; i < N; ++i) x_sum += x[i];
        prescale<BITS>(x);
#pragma unroll
        for (int i = 0; i < M * RPW; ++i) {
          acc[i] += static_cast<float>(scale[u][i]) * dot_vector<BITS>(packed[u][i], x) + static_cast<float>(bias[u][i]) * x_sum;
        }
      }
    }
  }
  float by_row[RPW * M];  // grouped by row for the spread
#pragma unroll
  for (int i = 0; i < M * RPW; ++i) by_row[i % RPW * M + i / RPW] = acc[i];
  warp_sum_spread(out, by_row);
}

// A warp's RPW rows (from first_row) of one pair's hidden row: the gate and up GEMVs of its
// expert on the token's `activations`, additive biases, the gate scale, the activation.
// `gate_matrices` / `up_matrices` hold every expert's. GATED false: an MLP's first projection:
// only `up_matrices` is read. SHARED_SPLIT: `activations` also split in `split` (split_row).
// `hidden_scale`: where given, one value that the activation's rows are multiplied by, rounded (a
// shared expert's weight, applied before its down projection as Inkling's block applies it).
template <int BITS, int GROUP, int RPW, bool GATED, bool HAS_BIAS, bool SHARED_SPLIT, typename T, typename S, typename GB, typename UB,
          typename SC>
__device__ __forceinline__ void gate_up_rows(
    T* hidden, int pair, size_t expert, int first_row, const T* activations, const SharedFixed<BITS>* split,
    QuantizedRows<S> gate_matrices, QuantizedRows<S> up_matrices, const GB* gate_bias, const UB* up_bias, const SC* gate_scale,
    const Dims& d, const float* params, const T* hidden_scale = nullptr) {
  static_assert(bias_signature_matches<HAS_BIAS, AdditiveBias<S, T>, const GB*> &&
                bias_signature_matches<HAS_BIAS, AdditiveBias<S, T>, const UB*>,
                "HAS_BIAS disagrees with the bias inputs");
  const int lane = threadIdx.x % 32;
  // This warp's RPW rows of the expert's matrices, up then gate (rows past OUT_DIM read the last
  // row and are not written).
  const QuantizedRows<S> up_rows = up_matrices.template of_expert<BITS, GROUP>(expert, d);
  float dots[GATED ? 2 : 1];  // the lane's row's (rows_dot)
  if constexpr (GATED) {
    const QuantizedRows<S> matrices[2] = {up_rows, gate_matrices.template of_expert<BITS, GROUP>(expert, d)};
    rows_dot<BITS, GROUP, 2, RPW, 1, 1, SHARED_SPLIT>(dots, matrices, first_row, d.out_dim - 1, {activations}, d.in_dim, lane, split);
  } else {
    const QuantizedRows<S> matrices[1] = {up_rows};
    rows_dot<BITS, GROUP, 1, RPW, 1, 1, SHARED_SPLIT>(dots, matrices, first_row, d.out_dim - 1, {activations}, d.in_dim, lane, split);
  }
  // Lane l holds row first_row + l / (32 / RPW)'s sums; the first lane of each row writes it, so
  // that the rows' epilogues run side by side (a pass a row repeated the activation's
  // instructions RPW times over the warp).
  const int row = first_row + lane / (32 / RPW);
  if (lane % (32 / RPW) != 0 || row >= d.out_dim) return;
  float up = rnd<T>(dots[0]), gate = GATED ? rnd<T>(dots[GATED ? 1 : 0]) : 0.f;
  if (d.has_bias) {
    up = rnd<T>(up + static_cast<float>(up_bias[expert * d.out_dim + row]));
    if (GATED) gate = rnd<T>(gate + static_cast<float>(gate_bias[expert * d.out_dim + row]));
  }
  if (d.has_scale) gate = rnd<T>(gate * rnd<T>(static_cast<float>(gate_scale[expert])));
  float h = activate<T>(d.act, d.has_limit, up, gate, params[0], params[1]);
  if (hidden_scale != nullptr) h = rnd<T>(h * static_cast<float>(*hidden_scale));
  hidden[(size_t)pair * d.out_dim + row] = static_cast<T>(h);
}

// A block's share of the down GEMV: its RPW-row slots of OUT_DIM, for one pair (blockIdx.y), or
// with COMBINE for one token's TOP_K pairs (blockIdx.y = token), the pairs' rows weighted by
// `weights` and summed; with RESIDUAL, each output the sum rounded to T and added to `residual`'s
// element in fp32 (MLX's add of two T arrays, bit for bit); with SHARED (and COMBINE), the token's
// SHARED shared experts after its TOP_K pairs (hidden rows TOP_K + SHARED a token, the shared ones
// already weighted: gate_up_rows' hidden_scale), whose down projection `shared` is one matrix of
// SHARED x IN_DIM columns (Inkling's concatenated experts): their sums are added unrounded, as one
// GEMV over the concatenation adds them, and the output is that sum rounded plus the routed sum
// rounded (upstream's add of the two). See the `down` section for the block's layout.
template <int BITS, int GROUP, int WARPS, int RPW, bool INPUT_PER_PAIR, bool COMBINE, bool HAS_BIAS, bool RESIDUAL, int SHARED, typename T,
          typename S, typename B, typename SC, typename WT, typename R>
__device__ __forceinline__ void down_rows(
    T* out, const T* hidden, const uint32_t* indices, const WT* weights, QuantizedRows<S> matrices_of_all,
    const B* bias, const SC* out_scale, const Dims& d, const R* residual, QuantizedRows<S> shared = {}) {
  static_assert(bias_signature_matches<HAS_BIAS, AdditiveBias<S, T>, const B*>, "HAS_BIAS disagrees with the bias input");
  static_assert(SHARED == 0 || (COMBINE && INPUT_PER_PAIR && !RESIDUAL), "shared experts in a combining down of per-pair rows");
  __shared__ float partial[WARPS * RPW];  // COMBINE: each warp's sums, [WARPS][RPW]
  __shared__ float shared_partial[SHARED ? WARPS * RPW : 1];
  const int first_pair = COMBINE ? blockIdx.y * d.top_k : blockIdx.y;
  const int pairs = COMBINE ? d.top_k : 1;
  const int slots = pairs + SHARED;  // a token's hidden rows (COMBINE), from first_slot on
  const int first_slot = COMBINE ? blockIdx.y * slots : blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int pair_slots = COMBINE ? min(slots, WARPS) : 1;
  const int row_slots = WARPS / pair_slots;
  const int pair_slot = warp % pair_slots, row_slot = warp / pair_slots;
  const int first_row = (blockIdx.x * row_slots + row_slot) * RPW;
  const bool active = row_slot < row_slots && first_row < d.out_dim;
  // Two pairs at once where the fixed-point GEMV takes an activation row a matrix: their weights
  // are then in flight together, where one pair after the other cost a round trip to memory each
  // (at 4 rows a warp and top-k 8 a warp has two of its token's eight pairs). More than two
  // spill at the bound, and so do two of mxfp4 codes (12 bytes at 128 registers).
  constexpr int PAIRS_AT_ONCE = FIXED_POINT<T> && BITS == 4 && RPW <= 4 && !FP4_EXPERTS<S> ? 2 : 1;
  // The rows whose sums a lane keeps after the GEMV (rows_dot's KEPT): its own, so that the
  // warp's lanes run the rows' epilogues side by side, or at two pairs at once every row (where
  // keeping one spilled at the bound): lanes own_first + k, for k < KEPT_ROWS.
  constexpr int KEPT_ROWS = PAIRS_AT_ONCE == 2 ? RPW : 1;
  constexpr int LANES_A_GROUP = 32 * KEPT_ROWS / RPW;
  const int own_first = lane / LANES_A_GROUP * KEPT_ROWS;
  float total[KEPT_ROWS], shared_total[KEPT_ROWS];
#pragma unroll
  for (int k = 0; k < KEPT_ROWS; ++k) total[k] = shared_total[k] = 0.f;
  // The pairs j, j + pair_slots, ... (P of them) of this warp: their rows' dot products in one
  // rows_dot, then the kept rows' epilogue of each pair, added in pair order.
  auto add_pairs = [&](auto pairs_at_once, int j) {
    constexpr int P = decltype(pairs_at_once)::value;
    QuantizedRows<S> matrices[P];
    const T* activations[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int pair = first_pair + j + p * pair_slots;
      matrices[p] = matrices_of_all.template of_expert<BITS, GROUP>(indices[pair], d);
      activations[p] = hidden + (size_t)(INPUT_PER_PAIR ? first_slot + j + p * pair_slots : pair / d.top_k) * d.in_dim;
    }
    float dots[KEPT_ROWS * P];
    rows_dot<BITS, GROUP, P, RPW, P, KEPT_ROWS>(dots, matrices, first_row, d.out_dim - 1, activations, d.in_dim, lane);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int pair = first_pair + j + p * pair_slots;
      const size_t expert = indices[pair];  // read again rather than held through rows_dot: registers
#pragma unroll
      for (int k = 0; k < KEPT_ROWS; ++k) {
        const int row = min(first_row + own_first + k, d.out_dim - 1);
        float y = rnd<T>(dots[k * P + p]);
        if (d.has_bias) y = rnd<T>(y + static_cast<float>(bias[expert * d.out_dim + row]));
        if (d.has_scale) y = rnd<T>(y * rnd<T>(static_cast<float>(out_scale[expert])));
        if (COMBINE) y = rnd<T>(y * rnd<T>(static_cast<float>(weights[pair])));
        total[k] += y;
      }
    }
  };
  // Shared expert `expert`'s columns of the shared down projection on its hidden row.
  auto add_shared = [&](int expert, int j) {
    const size_t column = (size_t)expert * d.in_dim;
    const QuantizedRows<S> matrices[1] = {{shared.w + column * BITS / 32, shared.s + column / GROUP, shared.b + column / GROUP}};
    const T* activations[1] = {hidden + (size_t)(first_slot + j) * d.in_dim};
    float dots[KEPT_ROWS];
    rows_dot<BITS, GROUP, 1, RPW, 1, KEPT_ROWS>(dots, matrices, first_row, d.out_dim - 1, activations, d.in_dim, lane, nullptr,
                                                SHARED * d.in_dim);
#pragma unroll
    for (int k = 0; k < KEPT_ROWS; ++k) shared_total[k] += dots[k];
  };
  for (int j = pair_slot; active && j < slots; j += PAIRS_AT_ONCE * pair_slots) {
    if constexpr (SHARED > 0) {
      if (j >= pairs) {
        add_shared(j - pairs, j);
        if (PAIRS_AT_ONCE == 2 && j + pair_slots < slots) add_shared(j + pair_slots - pairs, j + pair_slots);  // the step's second slot
        continue;
      }
    }
    if constexpr (PAIRS_AT_ONCE == 2) {
      if (j + pair_slots < pairs) {
        add_pairs(cuda::std::integral_constant<int, 2>{}, j);
        continue;
      }
    }
    add_pairs(cuda::std::integral_constant<int, 1>{}, j);
    if constexpr (SHARED > 0 && PAIRS_AT_ONCE == 2) {
      if (j + pair_slots >= pairs && j + pair_slots < slots) add_shared(j + pair_slots - pairs, j + pair_slots);
    }
  }
  const bool first_of_group = lane % LANES_A_GROUP == 0;
  if (COMBINE) {
#pragma unroll
    for (int k = 0; k < KEPT_ROWS; ++k) {
      if (first_of_group) {
        partial[warp * RPW + own_first + k] = total[k];
        if (SHARED) shared_partial[warp * RPW + own_first + k] = shared_total[k];
      }
    }
    __syncthreads();
    if (pair_slot != 0 || !active) return;  // warps past the last row slot (TOP_K not dividing WARPS) sum nothing
#pragma unroll
    for (int k = 0; k < KEPT_ROWS; ++k) {
      total[k] = shared_total[k] = 0.f;
      for (int slot = 0; slot < pair_slots; ++slot) {
        const int at = (row_slot * pair_slots + slot) * RPW + own_first + k;
        total[k] += partial[at];
        if (SHARED) shared_total[k] += shared_partial[at];
      }
      if (SHARED) total[k] = rnd<T>(total[k]) + rnd<T>(shared_total[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < KEPT_ROWS; ++k) {
    if (active && first_of_group && first_row + own_first + k < d.out_dim) {
      const size_t at = (size_t)blockIdx.y * d.out_dim + first_row + own_first + k;
      out[at] = static_cast<T>(RESIDUAL ? static_cast<float>(residual[at]) + rnd<T>(total[k]) : total[k]);
    }
  }
}

// Where routed_gate_up and sigmoid_shared_gate_up (moe_routed_decode.cu) keep each routed pair's
// expert (uint32) and routing weight (T): in their hidden output, after its `rows` OUT_DIM-wide
// rows (16-byte aligned, as OUT_DIM is a multiple of the group size; `rows` counts the shared
// experts' rows too, where a token has them). Not outputs of their own: MLX's host cost per kernel
// call grows with its outputs times its inputs (docs/benchmarks.md, tenth session, section 2),
// and a decode step pays it per layer.
template <typename T>
struct RoutingTail {
  uint32_t* indices;
  T* weights;
  __device__ RoutingTail(const T* hidden, int rows, int out_dim, int pairs)
      : indices(reinterpret_cast<uint32_t*>(const_cast<T*>(hidden) + (size_t)rows * out_dim)),
        weights(reinterpret_cast<T*>(indices + pairs)) {}
};

// A shared_gate_up block's rows: its token's routed pair `slot` (< TOP_K) of expert
// `routed_expert`, or shared expert slot - TOP_K, its activation times `*shared_weight` where
// given (else unweighted), without the routed experts' additive biases and gate scale. The shared
// experts' gate and up projections are one matrix each of SHARED x OUT_DIM rows (upstream
// concatenates them), read as SHARED experts' matrices.
template <int BITS, int GROUP, int RPW, bool HAS_BIAS, bool SHARED_SPLIT, typename T, typename S, typename GB, typename UB,
          typename SC>
__device__ __forceinline__ void shared_gate_up_rows(
    T* hidden, int pair, int slot, size_t routed_expert, const T* shared_weight, int first_row, const T* activations,
    const SharedFixed<BITS>* split, QuantizedRows<S> gate_matrices, QuantizedRows<S> up_matrices,
    QuantizedRows<S> shared_gate, QuantizedRows<S> shared_up, const GB* gate_bias, const UB* up_bias, const SC* gate_scale,
    const Dims& d, const float* params) {
  if (slot < d.top_k) {
    gate_up_rows<BITS, GROUP, RPW, true, HAS_BIAS, SHARED_SPLIT, T, S>(
        hidden, pair, routed_expert, first_row, activations, split, gate_matrices, up_matrices, gate_bias, up_bias, gate_scale,
        d, params);
  } else {
    Dims plain = d;
    plain.has_bias = plain.has_scale = false;
    gate_up_rows<BITS, GROUP, RPW, true, false, SHARED_SPLIT, T, S>(
        hidden, pair, slot - d.top_k, first_row, activations, split, shared_gate, shared_up,
        static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), plain, params,
        shared_weight);
  }
}

}  // namespace moe_decode

//// gate_up
// inputs: x [N, IN_DIM], indices [N * TOP_K], gate_w / up_w [E, OUT_DIM, IN_DIM * BITS / 32],
//         gate_s, gate_b, up_s, up_b [E, OUT_DIM, IN_DIM / GROUP], gate_bias, up_bias [E, OUT_DIM],
//         gate_scale [E], dims, params;  output: hidden [N * TOP_K, OUT_DIM]
// One block per (pair, WARPS x RPW output rows); SHARED_SPLIT: the pair's activation row split
// once a block (split_row).
{
  using namespace moe_decode;
  const Dims d(dims);
  const int pair = blockIdx.y;
  const T* activations = x + (size_t)(pair / d.top_k) * d.in_dim;
  const SharedFixed<BITS>* split = split_row<BITS, SHARED_SPLIT, FP4_EXPERTS<S>>(activations, d.in_dim);
  if (SHARED_SPLIT) __syncthreads();
  const int first_row = (blockIdx.x * WARPS + threadIdx.x / 32) * RPW;
  if (first_row >= d.out_dim) return;
  gate_up_rows<BITS, GROUP, RPW, GATED, HAS_BIAS, SHARED_SPLIT, T, S>(
      hidden, pair, indices[pair], first_row, activations, split,
      {gate_w, gate_s, gate_b}, {up_w, up_s, up_b}, gate_bias, up_bias, gate_scale, d, params);
}

//// down
// inputs: hidden [rows, IN_DIM] (one row per pair, or per token when !INPUT_PER_PAIR),
//         indices [N * TOP_K], weights [N * TOP_K], w [E, OUT_DIM, IN_DIM * BITS / 32],
//         s, b [E, OUT_DIM, IN_DIM / GROUP], bias [E, OUT_DIM], out_scale [E], dims
// output: out [N, OUT_DIM] (COMBINE: the routing-weighted sum over TOP_K) or [N * TOP_K, OUT_DIM]
// One block per (pair, WARPS x RPW output rows), or with COMBINE per (token, output rows): its
// warps split over the token's pairs (warp % PAIR_SLOTS, PAIR_SLOTS = min(TOP_K, WARPS)) and
// over rows (warp / PAIR_SLOTS, RPW rows each), so a block covers WARPS / PAIR_SLOTS x RPW rows
// and the grid has as many blocks as without the combine; the pairs' partial sums meet in shared
// memory and are added in pair order.
{
  using namespace moe_decode;
  down_rows<BITS, GROUP, WARPS, RPW, INPUT_PER_PAIR, COMBINE, HAS_BIAS, false, 0, T, S>(
      out, hidden, indices, weights, {w, s, b}, bias, out_scale, Dims(dims), static_cast<const T*>(nullptr));
}

//// routed_down
// The combining down launch (COMBINE, INPUT_PER_PAIR) after moe_routed_decode.cu's
// routed_gate_up, each pair's expert and weight read from its output's RoutingTail; RESIDUAL:
// `residual` [N, OUT_DIM] added to the output (the decoder layer's add after its MoE block).
// inputs: hidden (routed_gate_up's output; IN_DIM = its OUT_DIM), residual, w, s, b, bias,
// out_scale, dims;  output: out [N, OUT_DIM]. A section of this file, not of moe_routed_decode.cu, so that its
// source leaves out the router's device code: MLX hashes a kernel's whole source at every
// evaluation (sources.py).
{
  using namespace moe_decode;
  const Dims d(dims);
  const RoutingTail<T> tail(hidden, gridDim.y * d.top_k, d.in_dim, gridDim.y * d.top_k);
  down_rows<BITS, GROUP, WARPS, RPW, true, true, HAS_BIAS, RESIDUAL, 0, T, S>(
      out, hidden, tail.indices, static_cast<const T*>(tail.weights), {w, s, b}, bias, out_scale, d, residual);
}

//// shared_gate_up
// gate_up for a block with SHARED always-on shared experts beside its routed ones (Inkling's,
// DeepSeek-V4's): a token's TOP_K pairs, then its shared experts, TOP_K + SHARED hidden rows a
// token (shared_gate_up_rows); with SHARED_WEIGHTS a shared expert's row times its weight
// (`shared_weights`, else absent).
// inputs: x, indices, shared_weights [N, SHARED] (or absent), gate_up's from gate_w to gate_scale,
//         shared_gate_w, shared_up_w [SHARED * OUT_DIM, IN_DIM * BITS / 32], shared_gate_s,
//         shared_gate_b, shared_up_s, shared_up_b [SHARED * OUT_DIM, IN_DIM / GROUP], dims, params
// output: hidden [N * (TOP_K + SHARED), OUT_DIM]
{
  using namespace moe_decode;
  const Dims d(dims);
  const int slots = d.top_k + SHARED;
  const int pair = blockIdx.y, token = pair / slots, slot = pair % slots;
  const T* activations = x + (size_t)token * d.in_dim;
  const SharedFixed<BITS>* split = split_row<BITS, SHARED_SPLIT, FP4_EXPERTS<S>>(activations, d.in_dim);
  if (SHARED_SPLIT) __syncthreads();
  const int first_row = (blockIdx.x * WARPS + threadIdx.x / 32) * RPW;
  if (first_row >= d.out_dim) return;
  const T* weight = nullptr;
  if constexpr (SHARED_WEIGHTS) {
    if (slot >= d.top_k) weight = reinterpret_cast<const T*>(shared_weights) + (size_t)token * SHARED + slot - d.top_k;
  }
  shared_gate_up_rows<BITS, GROUP, RPW, HAS_BIAS, SHARED_SPLIT, T, S>(
      hidden, pair, slot, slot < d.top_k ? indices[token * d.top_k + slot] : 0u, weight, first_row, activations, split,
      {gate_w, gate_s, gate_b}, {up_w, up_s, up_b}, {shared_gate_w, shared_gate_s, shared_gate_b},
      {shared_up_w, shared_up_s, shared_up_b}, gate_bias, up_bias, gate_scale, d, params);
}

//// shared_down
// The combining down after shared_gate_up: each token's TOP_K routed pairs weighted and summed,
// plus its shared experts' down projection (down_rows' SHARED).
// inputs: hidden [N * (TOP_K + SHARED), IN_DIM], indices, weights [N * TOP_K], w, s, b, bias,
//         out_scale as down's, shared_w [OUT_DIM, SHARED * IN_DIM * BITS / 32], shared_s, shared_b
//         [OUT_DIM, SHARED * IN_DIM / GROUP], dims;  output: out [N, OUT_DIM]
{
  using namespace moe_decode;
  down_rows<BITS, GROUP, WARPS, RPW, true, true, HAS_BIAS, false, SHARED, T, S>(
      out, hidden, indices, weights, {w, s, b}, bias, out_scale, Dims(dims), static_cast<const T*>(nullptr),
      {shared_w, shared_s, shared_b});
}

//// routed_shared_down
// shared_down after moe_routed_decode.cu's sigmoid_shared_gate_up, each routed pair's expert and
// weight read from its output's RoutingTail (after the tokens' TOP_K + SHARED rows).
// inputs: hidden, w, s, b, bias, out_scale, shared_w, shared_s, shared_b, dims (as shared_down's);
// output: out [N, OUT_DIM]
{
  using namespace moe_decode;
  const Dims d(dims);
  const int tokens = gridDim.y;
  const RoutingTail<T> tail(hidden, tokens * (d.top_k + SHARED), d.in_dim, tokens * d.top_k);
  down_rows<BITS, GROUP, WARPS, RPW, true, true, HAS_BIAS, false, SHARED, T, S>(
      out, hidden, tail.indices, static_cast<const T*>(tail.weights), {w, s, b}, bias, out_scale, d,
      static_cast<const T*>(nullptr), {shared_w, shared_s, shared_b});
}
