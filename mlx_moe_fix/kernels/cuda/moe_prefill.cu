// Sorted grouped prefill for mx.fast.cuda_kernel: one grouped GEMM over (token, expert) pairs
// sorted by expert, each expert's run padded to the tile height BM, so that every BM-row tile
// belongs to one expert (`tile_expert`, -1 for tiles past the last run). Tensor cores through
// ldmatrix + mma.sync (bf16 / fp16 in, fp32 accumulate); activations arrive by cp.async, the
// affine-quantized weights are dequantised through registers into shared memory.
//
// Sections are split on "//// <name>" lines (`header`, `grouped`). Template constants:
//   T (bf16 or fp16), S (scales, biases and additive bias type), SC (per-expert scale type),
//   BITS 4 or 8, GROUP 32/64/128,
//   PAIRS_IN:  A rows are x rows gathered per pair (pair / top_k); else the padded rows of `a`
//   ACTIVATE:  epilogue applies the activation and writes padded rows; else it writes the
//              projection per pair (rows of `out` in pair order)
//   GATED:     two weight matrices (gate = 0, up = 1) feed the activation
// Run-time values: dims = IN_DIM, OUT_DIM, TOP_K, ACT, HAS_LIMIT, HAS_BIAS, HAS_SCALE;
// params = limit, alpha. Needs IN_DIM and OUT_DIM to be multiples of 64.

//// header
#include <cuda/std/type_traits>

namespace grouped {

using namespace moe_common;

constexpr int BM = 64, BN = 64, BK = 64;
constexpr int LDS = BK + 8;  // shared row stride (elements): 144 bytes keeps ldmatrix conflict-free
constexpr int THREADS = 128; // 4 warps in a 2 x 2 grid of 32 x 32 warp tiles

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
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

}  // namespace grouped

//// grouped
// inputs: a [rows, IN_DIM] (x, or the padded hidden rows), row_pair [tiles * BM] (pair, -1: padding),
//         tile_expert [tiles], w0 / w1 [E, OUT_DIM, IN_DIM * BITS / 32], s0, b0, s1, b1
//         [E, OUT_DIM, IN_DIM / GROUP], bias0 / bias1 [E, OUT_DIM], scale [E], dims, params
// output: out [tiles * BM, OUT_DIM] (ACTIVATE) or [pairs, OUT_DIM]
{
  using namespace grouped;
  constexpr int MATRICES = GATED ? 2 : 1;
  constexpr int PER_WORD = 32 / BITS;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  __shared__ __align__(16) T sa[BM * LDS];
  __shared__ __align__(16) T sb[MATRICES][BN * LDS];

  const Dims d(dims);
  const int tile = blockIdx.y;
  const int expert = tile_expert[tile];
  if (expert < 0) return;
  const int n0 = blockIdx.x * BN;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / 2, wn = warp % 2;
  const int words_per_row = d.in_dim * BITS / 32, groups_per_row = d.in_dim / GROUP;
  const uint32_t* const w[2] = {w0, w1};
  const S* const s[2] = {s0, s1};
  const S* const b[2] = {b0, b1};

  float acc[MATRICES][2][4][4];
#pragma unroll
  for (int m = 0; m < MATRICES; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][i][j][e] = 0.f;

  for (int k0 = 0; k0 < d.in_dim; k0 += BK) {
    // A: BM rows x BK columns, 16 bytes (8 values) per cp.async; padding rows are zero-filled.
    for (int c = tid; c < BM * BK / 8; c += THREADS) {
      const int r = c / (BK / 8), chunk = c % (BK / 8);
      const int pair = row_pair[tile * BM + r];
      const size_t src_row = PAIRS_IN ? (pair >= 0 ? pair / d.top_k : 0) : (size_t)tile * BM + r;
      const T* src = a + src_row * d.in_dim + k0 + chunk * 8;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(&sa[r * LDS + chunk * 8])),
                   "l"(src), "r"(pair >= 0 ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
    // B: BN weight rows x BK values per matrix, dequantised (w = scale * q + bias) into shared.
#pragma unroll
    for (int m = 0; m < MATRICES; ++m) {
      for (int c = tid; c < BN * BK / PER_WORD; c += THREADS) {
        const int r = c / (BK / PER_WORD), word_in_tile = c % (BK / PER_WORD);
        const size_t row = (size_t)expert * d.out_dim + n0 + r;
        const int k = k0 + word_in_tile * PER_WORD;  // a word never straddles a group
        const uint32_t word = w[m][row * words_per_row + k / PER_WORD];
        const float scale = static_cast<float>(s[m][row * groups_per_row + k / GROUP]);
        const float bias = static_cast<float>(b[m][row * groups_per_row + k / GROUP]);
        T* dst = &sb[m][r * LDS + word_in_tile * PER_WORD];
#pragma unroll
        for (int i = 0; i < PER_WORD; ++i) dst[i] = static_cast<T>(fmaf(scale, static_cast<float>((word >> (BITS * i)) & MASK), bias));
      }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) ldmatrix_x4(af[mi], &sa[(wm * 32 + mi * 16 + lane % 16) * LDS + kk + (lane / 16) * 8]);
#pragma unroll
      for (int m = 0; m < MATRICES; ++m) {
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
          unsigned bf[4];  // n8 blocks 2 nj and 2 nj + 1, k halves 0 and 1
          ldmatrix_x4(bf, &sb[m][(wn * 32 + nj * 16 + lane % 8 + (lane / 16) * 8) * LDS + kk + ((lane / 8) % 2) * 8]);
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            mma<T>(acc[m][mi][2 * nj], af[mi], bf[0], bf[1]);
            mma<T>(acc[m][mi][2 * nj + 1], af[mi], bf[2], bf[3]);
          }
        }
      }
    }
    __syncthreads();
  }

  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wm * 32 + mi * 16 + g + half * 8;
      const int pair = row_pair[tile * BM + r];
      if (pair < 0) continue;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int n = n0 + wn * 32 + ni * 8 + 2 * t + j;
          const size_t bias_at = (size_t)expert * d.out_dim + n;
          float first = rnd<T>(acc[0][mi][ni][half * 2 + j]);
          if (d.has_bias) first = rnd<T>(first + static_cast<float>(bias0[bias_at]));
          if (ACTIVATE) {
            float up = first, gate = 0.f;
            if (GATED) {
              gate = first;
              up = rnd<T>(acc[MATRICES - 1][mi][ni][half * 2 + j]);
              if (d.has_bias) up = rnd<T>(up + static_cast<float>(bias1[bias_at]));
              if (d.has_scale) gate = rnd<T>(gate * rnd<T>(static_cast<float>(scale[expert])));
            }
            out[((size_t)tile * BM + r) * d.out_dim + n] = static_cast<T>(activate<T>(d.act, d.has_limit, up, gate, params[0], params[1]));
          } else {
            if (d.has_scale) first = rnd<T>(first * rnd<T>(static_cast<float>(scale[expert])));
            out[(size_t)pair * d.out_dim + n] = static_cast<T>(first);
          }
        }
      }
    }
  }
}
