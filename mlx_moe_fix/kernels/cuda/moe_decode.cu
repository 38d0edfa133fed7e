// Fused decode MoE for mx.fast.cuda_kernel: one warp per (pair or token, output row), 16-byte
// loads of packed affine-quantized weights, dequantisation in registers, fp32 accumulation.
//
// Sections are split on "//// <name>" lines: `header` goes into cuda_kernel's header, the others
// are kernel bodies. Template constants and types (set from Python; few, since each distinct
// set is one NVRTC compile):
//   T   activation / output type        S   scales, affine biases and additive bias type
//   SC  per-expert scale type           WT  routing weight type
//   BITS 4 or 8, GROUP 32/64/128, WARPS (warps per block), RPW (output rows per warp: the
//   warp reads each staged activation vector once for all of them), HAS_BIAS (the bias inputs' signature:
//   S, or the float32 placeholder; see moe_common::bias_signature_matches)
//   gate_up: GATED;  down: INPUT_PER_PAIR, COMBINE
// Run-time values (an int32 array `dims` and a float array `params`, uniform across the grid):
//   dims: IN_DIM, OUT_DIM, TOP_K, ACT (0 swiglu, 1 swiglu_oai, 2 gelu, 3 gelu_approx,
//         4 gelu_fast), HAS_LIMIT, HAS_BIAS, HAS_SCALE (gate_scale / out_scale)
//   params: limit, alpha

//// header
namespace moe_decode {

using namespace moe_common;

constexpr int WORDS_PER_VECTOR = 4;  // one 16-byte load of packed weights
constexpr int PAD = 4;               // floats of padding after each vector's activations

// Activations are staged in shared memory as float, VALUES per weight vector followed by PAD
// floats, so that the float4 reads of 8 consecutive lanes land in distinct banks.
template <int BITS>
struct Layout {
  static constexpr int VALUES = WORDS_PER_VECTOR * 32 / BITS;  // activations per weight vector
  static constexpr int STRIDE = VALUES + PAD;
  __device__ static int floats(int in_dim) { return in_dim / VALUES * STRIDE; }
};

// Coalesced copy of one activation row into the padded shared layout.
template <int BITS, typename T>
__device__ __forceinline__ void stage(float* staged, const T* row, int in_dim) {
  using L = Layout<BITS>;
  for (int i = threadIdx.x; i < in_dim; i += blockDim.x) {
    staged[i / L::VALUES * L::STRIDE + i % L::VALUES] = static_cast<float>(row[i]);
  }
}

template <int BITS>
__device__ __forceinline__ float dot_vector(const uint4& packed, const float* x) {
  const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
  constexpr int PER_WORD = 32 / BITS;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  float acc = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int i = 0; i < PER_WORD; ++i) {
      acc = fmaf(small_uint_to_float((words[w] >> (BITS * i)) & MASK), x[w * PER_WORD + i], acc);
    }
  }
  return acc;
}

template <int VALUES>
__device__ __forceinline__ void load_vector(float* x, const float* staged, int v) {
  const float4* src = reinterpret_cast<const float4*>(staged + v * (VALUES + PAD));
#pragma unroll
  for (int i = 0; i < VALUES / 4; ++i) {
    const float4 q = src[i];
    x[4 * i] = q.x;
    x[4 * i + 1] = q.y;
    x[4 * i + 2] = q.z;
    x[4 * i + 3] = q.w;
  }
}

// Dot products of ROWS quantized weight rows (same in_dim) with one staged activation row,
// summed over the warp. Each lane takes whole 16-byte vectors; a vector never straddles a
// quantization group (GROUP >= 32 values >= one vector's values).
template <int BITS, int GROUP, int ROWS, typename S>
__device__ __forceinline__ void rows_dot(
    float* out, const uint32_t* const* w, const S* const* scales, const S* const* biases, const float* staged,
    int in_dim, int lane) {
  constexpr int VALUES = Layout<BITS>::VALUES;
  const int vectors = in_dim / VALUES;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  for (int v = lane; v < vectors; v += 32) {
    uint4 packed[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) packed[r] = *reinterpret_cast<const uint4*>(w[r] + v * WORDS_PER_VECTOR);
    float x[VALUES];
    load_vector<VALUES>(x, staged, v);
    float x_sum = 0.f;
#pragma unroll
    for (int i = 0; i < VALUES; ++i) x_sum += x[i];
    const int group = v * VALUES / GROUP;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      acc[r] += static_cast<float>(scales[r][group]) * dot_vector<BITS>(packed[r], x) +
          static_cast<float>(biases[r][group]) * x_sum;
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) out[r] = warp_sum(acc[r]);
}

}  // namespace moe_decode

//// gate_up
// inputs: x [N, IN_DIM], indices [N * TOP_K], gate_w / up_w [E, OUT_DIM, IN_DIM * BITS / 32],
//         gate_s, gate_b, up_s, up_b [E, OUT_DIM, IN_DIM / GROUP], gate_bias, up_bias [E, OUT_DIM],
//         gate_scale [E], dims, params;  output: hidden [N * TOP_K, OUT_DIM]
// One block per (pair, WARPS output rows); the pair's activation row is staged once per block.
// GATED false: an MLP's first projection: only up_* is read.
{
  using namespace moe_decode;
  static_assert(bias_signature_matches<HAS_BIAS, S, decltype(up_bias)> &&
                bias_signature_matches<HAS_BIAS, S, decltype(gate_bias)>, "HAS_BIAS disagrees with the bias inputs");
  extern __shared__ float staged[];
  const Dims d(dims);
  const int pair = blockIdx.y;
  stage<BITS>(staged, x + (size_t)(pair / d.top_k) * d.in_dim, d.in_dim);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int first_row = (blockIdx.x * WARPS + threadIdx.x / 32) * RPW;
  if (first_row >= d.out_dim) return;
  const size_t expert = indices[pair];
  // This warp's RPW rows (rows past OUT_DIM read the last row and are not written), up then gate.
  const uint32_t* w[2 * RPW];
  const S* s[2 * RPW];
  const S* b[2 * RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const size_t at = expert * d.out_dim + min(first_row + r, d.out_dim - 1);
    w[r] = up_w + at * (d.in_dim * BITS / 32), s[r] = up_s + at * (d.in_dim / GROUP), b[r] = up_b + at * (d.in_dim / GROUP);
    w[RPW + r] = gate_w + at * (d.in_dim * BITS / 32), s[RPW + r] = gate_s + at * (d.in_dim / GROUP);
    b[RPW + r] = gate_b + at * (d.in_dim / GROUP);
  }
  float dots[2 * RPW];
  if (GATED) {
    rows_dot<BITS, GROUP, 2 * RPW>(dots, w, s, b, staged, d.in_dim, lane);
  } else {
    rows_dot<BITS, GROUP, RPW>(dots, w, s, b, staged, d.in_dim, lane);
  }
  // Every lane holds every row's sums: lane r writes row first_row + r.
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = first_row + r;
    if (lane != r || row >= d.out_dim) continue;
    float up = rnd<T>(dots[r]), gate = GATED ? rnd<T>(dots[RPW + r]) : 0.f;
    if (d.has_bias) {
      up = rnd<T>(up + static_cast<float>(up_bias[expert * d.out_dim + row]));
      if (GATED) gate = rnd<T>(gate + static_cast<float>(gate_bias[expert * d.out_dim + row]));
    }
    if (d.has_scale) gate = rnd<T>(gate * rnd<T>(static_cast<float>(gate_scale[expert])));
    hidden[(size_t)pair * d.out_dim + row] = static_cast<T>(activate<T>(d.act, d.has_limit, up, gate, params[0], params[1]));
  }
}

//// down
// inputs: hidden [rows, IN_DIM] (one row per pair, or per token when !INPUT_PER_PAIR),
//         indices [N * TOP_K], w [E, OUT_DIM, IN_DIM * BITS / 32], s, b [E, OUT_DIM, IN_DIM / GROUP],
//         bias [E, OUT_DIM], out_scale [E], weights [N * TOP_K], dims
// output: out [N, OUT_DIM] (COMBINE: the routing-weighted sum over TOP_K) or [N * TOP_K, OUT_DIM]
// One block per (pair, WARPS x RPW output rows), or with COMBINE per (token, output rows): its
// warps split over the token's pairs (warp % PAIR_SLOTS, PAIR_SLOTS = min(TOP_K, WARPS)) and
// over rows (warp / PAIR_SLOTS, RPW rows each), so a block covers WARPS / PAIR_SLOTS x RPW rows
// and the grid has as many blocks as without the combine; the pairs' partial sums meet in shared
// memory and are added in pair order. The block's input rows are staged once.
{
  using namespace moe_decode;
  static_assert(bias_signature_matches<HAS_BIAS, S, decltype(bias)>, "HAS_BIAS disagrees with the bias input");
  extern __shared__ float staged[];
  const Dims d(dims);
  const int first_pair = COMBINE ? blockIdx.y * d.top_k : blockIdx.y;
  const int pairs = COMBINE ? d.top_k : 1;
  const int staged_floats = Layout<BITS>::floats(d.in_dim);
  for (int j = 0; j < pairs; ++j) {
    const int pair = first_pair + j;
    stage<BITS>(staged + j * staged_floats, hidden + (size_t)(INPUT_PER_PAIR ? pair : pair / d.top_k) * d.in_dim, d.in_dim);
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int pair_slots = COMBINE ? min(d.top_k, WARPS) : 1;
  const int row_slots = WARPS / pair_slots;
  const int pair_slot = warp % pair_slots, row_slot = warp / pair_slots;
  const int first_row = (blockIdx.x * row_slots + row_slot) * RPW;
  const bool active = row_slot < row_slots && first_row < d.out_dim;
  float total[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) total[r] = 0.f;
  for (int j = pair_slot; active && j < pairs; j += pair_slots) {
    const int pair = first_pair + j;
    const size_t expert = indices[pair];
    const uint32_t* wr[RPW];
    const S* sr[RPW];
    const S* br[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const size_t at = expert * d.out_dim + min(first_row + r, d.out_dim - 1);
      wr[r] = w + at * (d.in_dim * BITS / 32), sr[r] = s + at * (d.in_dim / GROUP), br[r] = b + at * (d.in_dim / GROUP);
    }
    float dots[RPW];
    rows_dot<BITS, GROUP, RPW>(dots, wr, sr, br, staged + j * staged_floats, d.in_dim, lane);
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int row = min(first_row + r, d.out_dim - 1);
      float y = rnd<T>(dots[r]);
      if (d.has_bias) y = rnd<T>(y + static_cast<float>(bias[expert * d.out_dim + row]));
      if (d.has_scale) y = rnd<T>(y * rnd<T>(static_cast<float>(out_scale[expert])));
      if (COMBINE) y = rnd<T>(y * rnd<T>(static_cast<float>(weights[pair])));
      total[r] += y;
    }
  }
  if (COMBINE) {
    // Every lane holds its warp's sums; lane r of each warp leaves row r's, after the staged rows.
    float* partial = staged + pairs * staged_floats;  // [WARPS][RPW]
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      if (lane == r) partial[warp * RPW + r] = total[r];
    }
    __syncthreads();
    if (pair_slot != 0 || !active) return;  // warps past the last row slot (TOP_K not dividing WARPS) sum nothing
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      total[r] = 0.f;
      for (int slot = 0; slot < pair_slots; ++slot) total[r] += partial[(row_slot * pair_slots + slot) * RPW + r];
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    if (active && lane == r && first_row + r < d.out_dim) out[(size_t)blockIdx.y * d.out_dim + first_row + r] = static_cast<T>(total[r]);
  }
}
