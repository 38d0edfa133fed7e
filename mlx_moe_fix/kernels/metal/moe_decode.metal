// Fused decode MoE for mx.fast.metal_kernel, the counterpart of ../cuda/moe_decode.cu: the same
// sections, stages, template constants and run-time inputs, one simdgroup where CUDA has one warp.
// Written to the CUDA kernels' contract and NOT compiled or run on Apple hardware by this
// project (no Metal machine here); the GPU parity tests are written to run on one unchanged, and
// tests/test_metal_emulation.py runs this source, as C++, on a CPU emulation of its grid.
// Its GEMV loop (rows_dot, dot_vector) is the CUDA one before the twelfth session's tuning for
// the H200's issue rate (loads issued ahead, values dequantised in place against prescaled
// activations): those were measured on NVIDIA only, and nothing says they pay on Apple GPUs.
// Nor the twenty-second session's fixed-point dot products (FIXED_POINT in the CUDA source):
// they rest on CUDA's dp4a, which Metal has no counterpart of; this loop stays in fp32.
//
// One simdgroup per (pair or token, output rows), 16-byte loads of packed affine-quantized (or
// mxfp4 / nvfp4) weights, dequantisation in registers, fp32 accumulation. Template constants and
// types:
//   T   activation / output type        S   scales, affine biases and additive bias type; uint8_t:
//       FP4 experts (FP4_EXPERTS: e2m1 codes, no affine biases, additive biases of T): mxfp4 at
//       GROUP 32 (e8m0 scales), nvfp4 at GROUP 16 (e4m3 scales)
//   SC  per-expert scale type           WT  routing weight type
//   BITS 4 or 8, GROUP 16 (nvfp4)/32/64/128, WARPS (simdgroups per threadgroup), RPW (output rows per
//   simdgroup), HAS_BIAS (kept for the CUDA launchers' template list; unused here)
//   gate_up: GATED;  down: INPUT_PER_PAIR, COMBINE
// Run-time values (an int32 array `dims` and a float array `params`):
//   dims: IN_DIM, OUT_DIM, TOP_K, ACT (0 swiglu, 1 swiglu_oai, 2 gelu, 3 gelu_approx,
//         4 gelu_fast), HAS_LIMIT, HAS_BIAS, HAS_SCALE (gate_scale / out_scale)
//   params: limit, alpha

//// header
namespace moe_decode {

using namespace moe_common;

constant constexpr int WORDS_PER_VECTOR = 4;  // one 16-byte load of packed weights

template <int BITS>
constexpr int vector_values() {
  return WORDS_PER_VECTOR * 32 / BITS;
}

// Activation vector v of `row` (vector_values<BITS>() values of T from v * that) as fp32.
template <int BITS, typename P>
inline void load_vector(thread float* x, P row, int v) {
  constexpr int N = vector_values<BITS>();
#pragma clang loop unroll(full)
  for (int i = 0; i < N; ++i) x[i] = static_cast<float>(row[v * N + i]);
}

// MLX's mxfp4 and nvfp4 experts, told by their scales: bytes, e8m0 (2^(e - 127)) a group of 32
// or e4m3 a group of 16, the supported quantizations with 8-bit scales. Their 4-bit values are
// e2m1 codes (sign, two exponent bits, one mantissa bit), with no affine biases; their additive
// biases are of the activations' type. Each code is read as twice its value (an integer), the
// group's scale halved, as in the CUDA kernel.
template <typename S>
constexpr constant bool FP4_EXPERTS = metal::is_same_v<S, uint8_t>;

// Twice an e2m1 code's value: magnitudes 0, 1, 2, 3, 4, 6, 8, 12 by its low three bits, the top
// bit its sign.
inline float e2m1_doubled(uint code) {
  const uint m = code & 7u;
  const float magnitude = float(m < 2u ? m : (2u | (m & 1u)) << ((m >> 1) - 1u));
  return (code & 8u) != 0u ? -magnitude : magnitude;
}

// 2^(e - 128): an e8m0 scale byte's power of two, halved (e = 0 and 1 as fp32 subnormals, which
// a GPU that flushes them reads as 0, as MLX's own dequantisation there would).
inline float e8m0_half(uint e) {
  return e > 1u ? as_type<float>((e - 1u) << 23) : as_type<float>(0x00200000u << e);
}

// An e4m3 byte (nvfp4's group scales: sign, 4 exponent bits of bias 7, 3 mantissa bits,
// subnormals below 2^-6) as fp32, exactly.
inline float e4m3_value(uint b) {
  const uint e = (b >> 3) & 15u, m = b & 7u;
  const float magnitude = e != 0u ? as_type<float>((e + 120u) << 23 | m << 20) : float(m) * (1.f / 512.f);
  return (b & 0x80u) != 0u ? -magnitude : magnitude;
}

// Sum over values of words FIRST_WORD to LAST_WORD - 1 of a vector of q x: q the unsigned
// BITS-bit integers, or with CODES twice the e2m1 codes' values.
template <int BITS, bool CODES, int FIRST_WORD = 0, int LAST_WORD = WORDS_PER_VECTOR>
inline float dot_vector(uint4 packed, thread const float* x) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr uint MASK = (1u << BITS) - 1u;
  float acc = 0.f;
#pragma clang loop unroll(full)
  for (int w = FIRST_WORD; w < LAST_WORD; ++w) {
#pragma clang loop unroll(full)
    for (int i = 0; i < PER_WORD; ++i) {
      const uint q = (packed[w] >> (BITS * i)) & MASK;
      acc = metal::fma(CODES ? e2m1_doubled(q) : small_uint_to_float(q), x[w * PER_WORD + i], acc);
    }
  }
  return acc;
}

// One expert's quantized matrix: packed rows, per-group scales and affine biases. B: the biases'
// pointer type (FP4 experts have none: their absent input, one element, comes in the `constant`
// address space and is never read).
template <typename S, typename B>
struct QuantizedRows {
  const device uint32_t* w;
  const device S* s;
  B b;

  // Expert `expert`'s matrix, where these are every expert's [E, out_dim, in_dim] ones.
  template <int BITS, int GROUP>
  QuantizedRows of_expert(ulong expert, thread const Dims& d) const {
    const ulong rows_before = expert * d.out_dim;
    const ulong groups = rows_before * (d.in_dim / GROUP);
    return {w + rows_before * (d.in_dim * BITS / 32), s + groups, FP4_EXPERTS<S> ? b : b + groups};
  }
};

template <typename S, typename B>
inline QuantizedRows<S, B> quantized_rows(const device uint32_t* w, const device S* s, B b) {
  return {w, s, b};
}

// Dot products of RPW consecutive rows (first_row on, each past last_row reading last_row) of
// each of M matrices with one activation row, summed over the simdgroup: out[m * RPW + r].
// Each lane takes whole 16-byte vectors; a vector lies within one quantization group, or nvfp4's
// two.
template <int BITS, int GROUP, int M, int RPW, typename S, typename B, typename P>
inline void rows_dot(thread float* out, thread const QuantizedRows<S, B>* m, int first_row, int last_row, P activations,
                     int in_dim, uint lane) {
  constexpr int N = vector_values<BITS>();
  constexpr bool CODES = FP4_EXPERTS<S>;
  constexpr bool TWO_GROUPS = CODES && GROUP == 16;  // nvfp4: a vector's halves, each its group's
  static_assert(!CODES || BITS == 4, "FP4 codes are 4-bit");
  const int vectors = in_dim / N, groups = in_dim / GROUP, words = in_dim * BITS / 32;
  float acc[M * RPW];
  for (int i = 0; i < M * RPW; ++i) acc[i] = 0.f;
  for (int v = int(lane); v < vectors; v += 32) {
    float x[N];
    load_vector<BITS>(x, activations, v);
    float x_sum = 0.f;  // the affine biases' multiplier
    for (int i = 0; i < N && !CODES; ++i) x_sum += x[i];
    const int group = v * N / GROUP;
    for (int r = 0; r < RPW; ++r) {
      const int at = metal::min(first_row + r, last_row);
      const ulong g = ulong(at) * groups + group;
      for (int j = 0; j < M; ++j) {
        const uint4 packed = *reinterpret_cast<const device uint4*>(m[j].w + ulong(at) * words + v * WORDS_PER_VECTOR);
        if constexpr (TWO_GROUPS) {
          acc[j * RPW + r] += 0.5f * metal::fma(e4m3_value(m[j].s[g]), dot_vector<BITS, true, 0, 2>(packed, x),
                                                e4m3_value(m[j].s[g + 1]) * dot_vector<BITS, true, 2, 4>(packed, x));
        } else if constexpr (CODES) {
          acc[j * RPW + r] += e8m0_half(m[j].s[g]) * dot_vector<BITS, true>(packed, x);
        } else {
          acc[j * RPW + r] += static_cast<float>(m[j].s[g]) * dot_vector<BITS, false>(packed, x)
                              + static_cast<float>(m[j].b[g]) * x_sum;
        }
      }
    }
  }
  for (int i = 0; i < M * RPW; ++i) out[i] = metal::simd_sum(acc[i]);
}

// A simdgroup's RPW rows (from first_row) of one pair's hidden row: the gate and up GEMVs of
// its expert on the token's `activations`, additive biases, the gate scale, the activation.
// `gate_matrices` / `up_matrices` hold every expert's. GATED false: an MLP's first projection:
// only `up_matrices` is read. The bias, scale and params pointers come in whichever address space
// MLX passed them (`constant` below 8 elements: absent inputs, params, a few experts' scales).
template <int BITS, int GROUP, int RPW, bool GATED, typename T, typename S, typename B, typename P, typename GB, typename UB,
          typename SC, typename PP>
inline void gate_up_rows(device T* hidden, int pair, ulong expert, int first_row, P activations,
                         QuantizedRows<S, B> gate_matrices, QuantizedRows<S, B> up_matrices, GB gate_bias, UB up_bias,
                         SC gate_scale, thread const Dims& d, PP params, uint lane) {
  // This simdgroup's RPW rows of the expert's matrices, up then gate (rows past OUT_DIM read the
  // last row and are not written).
  float dots[2 * RPW];
  const QuantizedRows<S, B> matrices[2] = {up_matrices.template of_expert<BITS, GROUP>(expert, d),
                                        gate_matrices.template of_expert<BITS, GROUP>(expert, d)};
  if (GATED) {
    rows_dot<BITS, GROUP, 2, RPW>(dots, matrices, first_row, d.out_dim - 1, activations, d.in_dim, lane);
  } else {
    rows_dot<BITS, GROUP, 1, RPW>(dots, matrices, first_row, d.out_dim - 1, activations, d.in_dim, lane);
  }
  // Every lane holds every row's sums: lane r writes row first_row + r.
  for (int r = 0; r < RPW; ++r) {
    const int row = first_row + r;
    if (int(lane) != r || row >= d.out_dim) continue;
    float up = rnd<T>(dots[r]), gate = GATED ? rnd<T>(dots[RPW + r]) : 0.f;
    if (d.has_bias) {
      up = rnd<T>(up + static_cast<float>(up_bias[expert * d.out_dim + row]));
      if (GATED) gate = rnd<T>(gate + static_cast<float>(gate_bias[expert * d.out_dim + row]));
    }
    if (d.has_scale) gate = rnd<T>(gate * rnd<T>(static_cast<float>(gate_scale[expert])));
    hidden[ulong(pair) * d.out_dim + row] = static_cast<T>(activate<T>(d.act, d.has_limit, up, gate, params[0], params[1]));
  }
}

}  // namespace moe_decode

//// gate_up
// inputs: x [N, IN_DIM], indices [N * TOP_K], gate_w / up_w [E, OUT_DIM, IN_DIM * BITS / 32],
//         gate_s, gate_b, up_s, up_b [E, OUT_DIM, IN_DIM / GROUP], gate_bias, up_bias [E, OUT_DIM],
//         gate_scale [E], dims, params;  output: hidden [N * TOP_K, OUT_DIM]
// One threadgroup per (pair, WARPS x RPW output rows).
{
  using namespace moe_decode;
  const Dims d = read_dims(dims);
  const int pair = int(threadgroup_position_in_grid.y);
  const int first_row = (int(threadgroup_position_in_grid.x) * WARPS + int(simdgroup_index_in_threadgroup)) * RPW;
  if (first_row >= d.out_dim) return;
  gate_up_rows<BITS, GROUP, RPW, GATED, T, S>(
      hidden, pair, indices[pair], first_row, x + ulong(pair / d.top_k) * d.in_dim,
      quantized_rows(gate_w, gate_s, gate_b), quantized_rows(up_w, up_s, up_b), gate_bias, up_bias, gate_scale, d, params,
      thread_index_in_simdgroup);
}

//// down
// inputs: hidden [rows, IN_DIM] (one row per pair, or per token when !INPUT_PER_PAIR),
//         indices [N * TOP_K], weights [N * TOP_K], w [E, OUT_DIM, IN_DIM * BITS / 32],
//         s, b [E, OUT_DIM, IN_DIM / GROUP], bias [E, OUT_DIM], out_scale [E], dims
// output: out [N, OUT_DIM] (COMBINE: the routing-weighted sum over TOP_K) or [N * TOP_K, OUT_DIM]
// One threadgroup per (pair, WARPS x RPW output rows), or with COMBINE per (token, output rows):
// its simdgroups split over the token's pairs (simdgroup % PAIR_SLOTS, PAIR_SLOTS =
// min(TOP_K, WARPS)) and over rows (simdgroup / PAIR_SLOTS, RPW rows each); the pairs' partial
// sums meet in threadgroup memory and are added in pair order.
{
  using namespace moe_decode;
  threadgroup float partial[WARPS * RPW];  // COMBINE: each simdgroup's sums, [WARPS][RPW]
  const Dims d = read_dims(dims);
  const int first_pair = COMBINE ? int(threadgroup_position_in_grid.y) * d.top_k : int(threadgroup_position_in_grid.y);
  const int pairs = COMBINE ? d.top_k : 1;
  const uint lane = thread_index_in_simdgroup;
  const int warp = int(simdgroup_index_in_threadgroup);
  const int pair_slots = COMBINE ? metal::min(d.top_k, WARPS) : 1;
  const int row_slots = WARPS / pair_slots;
  const int pair_slot = warp % pair_slots, row_slot = warp / pair_slots;
  const int first_row = (int(threadgroup_position_in_grid.x) * row_slots + row_slot) * RPW;
  const bool active = row_slot < row_slots && first_row < d.out_dim;
  float total[RPW];
  for (int r = 0; r < RPW; ++r) total[r] = 0.f;
  for (int j = pair_slot; active && j < pairs; j += pair_slots) {
    const int pair = first_pair + j;
    const ulong expert = indices[pair];
    const QuantizedRows<S, decltype(b)> matrices[1] = {quantized_rows(w, s, b).template of_expert<BITS, GROUP>(expert, d)};
    const auto activations = hidden + ulong(INPUT_PER_PAIR ? pair : pair / d.top_k) * d.in_dim;
    float dots[RPW];
    rows_dot<BITS, GROUP, 1, RPW>(dots, matrices, first_row, d.out_dim - 1, activations, d.in_dim, lane);
    for (int r = 0; r < RPW; ++r) {
      const int row = metal::min(first_row + r, d.out_dim - 1);
      float y = rnd<T>(dots[r]);
      if (d.has_bias) y = rnd<T>(y + static_cast<float>(bias[expert * d.out_dim + row]));
      if (d.has_scale) y = rnd<T>(y * rnd<T>(static_cast<float>(out_scale[expert])));
      if (COMBINE) y = rnd<T>(y * rnd<T>(static_cast<float>(weights[pair])));
      total[r] += y;
    }
  }
  if (COMBINE) {
    // Every lane holds its simdgroup's sums; lane r of each leaves row r's.
    for (int r = 0; r < RPW; ++r) {
      if (int(lane) == r) partial[warp * RPW + r] = total[r];
    }
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    if (pair_slot != 0 || !active) return;  // simdgroups past the last row slot (TOP_K not dividing WARPS) sum nothing
    for (int r = 0; r < RPW; ++r) {
      total[r] = 0.f;
      for (int slot = 0; slot < pair_slots; ++slot) total[r] += partial[(row_slot * pair_slots + slot) * RPW + r];
    }
  }
  for (int r = 0; r < RPW; ++r) {
    if (active && int(lane) == r && first_row + r < d.out_dim) {
      out[ulong(threadgroup_position_in_grid.y) * d.out_dim + first_row + r] = static_cast<T>(total[r]);
    }
  }
}
