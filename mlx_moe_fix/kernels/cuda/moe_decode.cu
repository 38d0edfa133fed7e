// Fused decode MoE for mx.fast.cuda_kernel: one warp per (pair or token, output row), 16-byte
// loads of packed affine-quantized weights, dequantisation in registers, fp32 accumulation.
//
// Sections are split on "//// <name>" lines: `header` goes into cuda_kernel's header, the others
// are kernel bodies. Template constants and types (set from Python; few, since each distinct
// set is one NVRTC compile):
//   T   activation / output type        S   scales, affine biases and additive bias type
//   SC  per-expert scale type           WT  routing weight type
//   BITS 4 or 8, GROUP 32/64/128, WARPS (rows per block)
//   gate_up: GATED;  down: INPUT_PER_PAIR, COMBINE
// Run-time values (an int32 array `dims` and a float array `params`, uniform across the grid):
//   dims: IN_DIM, OUT_DIM, TOP_K, ACT (0 swiglu, 1 swiglu_oai, 2 gelu, 3 gelu_approx,
//         4 gelu_fast), HAS_LIMIT, HAS_BIAS, HAS_SCALE (gate_scale / out_scale)
//   params: limit, alpha

//// header
namespace moe_decode {

constexpr int WORDS_PER_VECTOR = 4;  // one 16-byte load

template <int BITS>
__device__ __forceinline__ float dot_vector(const uint4& packed, const float* x) {
  // x holds the 32 / BITS * 4 activations that this vector's weights multiply.
  const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
  constexpr int PER_WORD = 32 / BITS;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  float acc = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int i = 0; i < PER_WORD; ++i) {
      acc = fmaf(static_cast<float>((words[w] >> (BITS * i)) & MASK), x[w * PER_WORD + i], acc);
    }
  }
  return acc;
}

// Dot product of one quantized weight row with an activation row, summed over the warp.
// Each lane takes whole 16-byte vectors; a vector never straddles a quantization group because
// GROUP >= 32 values >= one vector's values.
template <int BITS, int GROUP, typename T, typename S>
__device__ __forceinline__ float row_dot(
    const uint32_t* w_row, const S* scale_row, const S* bias_row, const T* x_row, int in_dim, int lane) {
  constexpr int VALUES = WORDS_PER_VECTOR * 32 / BITS;
  const int vectors = in_dim / VALUES;
  float acc = 0.f;
  for (int v = lane; v < vectors; v += 32) {
    const uint4 packed = *reinterpret_cast<const uint4*>(w_row + v * WORDS_PER_VECTOR);
    float x[VALUES];
    float x_sum = 0.f;
#pragma unroll
    for (int i = 0; i < VALUES; ++i) {
      x[i] = static_cast<float>(x_row[v * VALUES + i]);
      x_sum += x[i];
    }
    const int group = (v * VALUES) / GROUP;
    acc += static_cast<float>(scale_row[group]) * dot_vector<BITS>(packed, x) +
        static_cast<float>(bias_row[group]) * x_sum;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  }
  return acc;
}

__device__ __forceinline__ float sigmoid(float v) {
  return 1.f / (1.f + expf(-v));
}

__device__ __forceinline__ float activate(int act, bool has_limit, float up, float gate, float limit, float alpha) {
  if (act == 0) {  // SwiGLU, with DeepSeek-V4's clamp stage when limited
    if (has_limit) {
      gate = fminf(gate, limit);
      up = fminf(fmaxf(up, -limit), limit);
    }
    return gate * sigmoid(gate) * up;
  } else if (act == 1) {  // gpt-oss
    gate = fminf(gate, limit);
    up = fminf(fmaxf(up, -limit), limit);
    return (up + 1.f) * (gate * sigmoid(alpha * gate));
  } else if (act == 2) {
    return 0.5f * up * (1.f + erff(up * 0.70710678118654752f));
  } else if (act == 3) {
    return 0.5f * up * (1.f + tanhf(0.79788456080286536f * (up + 0.044715f * up * up * up)));
  } else {
    return up * sigmoid(1.702f * up);
  }
}

struct Dims {
  int in_dim, out_dim, top_k, act;
  bool has_limit, has_bias, has_scale;
  __device__ explicit Dims(const int* d)
      : in_dim(d[0]), out_dim(d[1]), top_k(d[2]), act(d[3]), has_limit(d[4]), has_bias(d[5]), has_scale(d[6]) {}
};

}  // namespace moe_decode

//// gate_up
// inputs: x [N, IN_DIM], indices [N * TOP_K], gate_w / up_w [E, OUT_DIM, IN_DIM * BITS / 32],
//         gate_s, gate_b, up_s, up_b [E, OUT_DIM, IN_DIM / GROUP], gate_bias, up_bias [E, OUT_DIM],
//         gate_scale [E], dims, params;  output: hidden [N * TOP_K, OUT_DIM]
// GATED false: an MLP's first projection: only up_* is read.
{
  using namespace moe_decode;
  const Dims d(dims);
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * WARPS + threadIdx.x / 32;
  const int pair = blockIdx.y;
  if (row >= d.out_dim) return;
  const size_t expert = indices[pair];
  const T* x_row = x + (size_t)(pair / d.top_k) * d.in_dim;
  const size_t w_offset = (expert * d.out_dim + row) * (d.in_dim * BITS / 32);
  const size_t s_offset = (expert * d.out_dim + row) * (d.in_dim / GROUP);

  float up = row_dot<BITS, GROUP>(up_w + w_offset, up_s + s_offset, up_b + s_offset, x_row, d.in_dim, lane);
  float gate = 0.f;
  if (GATED) {
    gate = row_dot<BITS, GROUP>(gate_w + w_offset, gate_s + s_offset, gate_b + s_offset, x_row, d.in_dim, lane);
  }
  if (lane != 0) return;
  if (d.has_bias) {
    up += static_cast<float>(up_bias[expert * d.out_dim + row]);
    if (GATED) gate += static_cast<float>(gate_bias[expert * d.out_dim + row]);
  }
  if (d.has_scale) gate *= static_cast<float>(gate_scale[expert]);
  hidden[(size_t)pair * d.out_dim + row] = static_cast<T>(activate(d.act, d.has_limit, up, gate, params[0], params[1]));
}

//// down
// inputs: hidden [rows, IN_DIM] (one row per pair, or per token when !INPUT_PER_PAIR),
//         indices [N * TOP_K], w [E, OUT_DIM, IN_DIM * BITS / 32], s, b [E, OUT_DIM, IN_DIM / GROUP],
//         bias [E, OUT_DIM], out_scale [E], weights [N * TOP_K], dims
// output: out [N, OUT_DIM] (COMBINE: the routing-weighted sum over TOP_K) or [N * TOP_K, OUT_DIM]
{
  using namespace moe_decode;
  const Dims d(dims);
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * WARPS + threadIdx.x / 32;
  if (row >= d.out_dim) return;
  // COMBINE: blockIdx.y is a token and the warp loops over its TOP_K pairs; else it is a pair.
  const int first_pair = COMBINE ? blockIdx.y * d.top_k : blockIdx.y;
  const int pairs = COMBINE ? d.top_k : 1;
  float total = 0.f;
  for (int j = 0; j < pairs; ++j) {
    const int pair = first_pair + j;
    const size_t expert = indices[pair];
    const T* in_row = hidden + (size_t)(INPUT_PER_PAIR ? pair : pair / d.top_k) * d.in_dim;
    const size_t w_offset = (expert * d.out_dim + row) * (d.in_dim * BITS / 32);
    const size_t s_offset = (expert * d.out_dim + row) * (d.in_dim / GROUP);
    float y = row_dot<BITS, GROUP>(w + w_offset, s + s_offset, b + s_offset, in_row, d.in_dim, lane);
    if (d.has_bias) y += static_cast<float>(bias[expert * d.out_dim + row]);
    if (d.has_scale) y *= static_cast<float>(out_scale[expert]);
    if (COMBINE) y *= static_cast<float>(weights[pair]);
    total += y;
  }
  if (lane == 0) out[(size_t)blockIdx.y * d.out_dim + row] = static_cast<T>(total);
}
