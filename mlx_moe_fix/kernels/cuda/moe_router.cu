// Top-k routing of a MoE block for mx.fast.cuda_kernel: router logits -> (experts, weights) per
// token in one launch, one warp per token, the token's logits in registers (lane l holds experts
// l, l + 32, ...).
//
// Sections are split on "//// <name>" lines (`header`, `topk`). Template constants:
//   T (the logits' and weights' type), SOFTMAX_FIRST (softmax over all experts, then the k
//   largest probabilities, as qwen3_moe; else the k largest logits, then softmax over them, as
//   mixtral), NORMALIZE (SOFTMAX_FIRST only: the k probabilities divided by their sum),
//   PER_LANE (experts per lane, >= ceil(experts / 32): few values, each a compile).
// Run-time values: sizes = tokens, experts, top_k.
// Rounding follows the upstream ops: softmax in fp32 rounded to T, the k-sum rounded to T, the
// division rounded to T. Equal values go to the lower expert index (upstream's argpartition
// picks among ties its own way: a tie may route differently, as it may between stock's CPU and
// CUDA paths).

//// header
#include <cuda/std/limits>

namespace moe_router {

constexpr float NEG_INF = -cuda::std::numeric_limits<float>::infinity();

// The warp's largest (value, index) pair: larger value first, then lower index.
__device__ __forceinline__ void warp_top(float& value, int& index) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_value = __shfl_xor_sync(0xffffffffu, value, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, index, offset);
    if (other_value > value || (other_value == value && other_index < index)) {
      value = other_value;
      index = other_index;
    }
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace moe_router

//// topk
// inputs: logits [tokens, experts], sizes;  outputs: indices [tokens, top_k] (uint32),
// weights [tokens, top_k] (T), in the order chosen (largest first).
{
  using namespace moe_router;
  using namespace moe_common;
  const int tokens = sizes[0], experts = sizes[1], top_k = sizes[2];
  const int token = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (token >= tokens) return;  // whole warps: blockDim.x is a multiple of 32
  const T* row = logits + (size_t)token * experts;
  float value[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane + 32 * i;
    value[i] = e < experts ? static_cast<float>(row[e]) : NEG_INF;
  }
  if (SOFTMAX_FIRST) {
    float top = NEG_INF;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) top = fmaxf(top, value[i]);
    top = warp_max(top);
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      value[i] = lane + 32 * i < experts ? expf(value[i] - top) : 0.f;
      total += value[i];
    }
    total = warp_sum(total);
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) value[i] = lane + 32 * i < experts ? rnd<T>(value[i] / total) : NEG_INF;
  }
  // k rounds of the warp's largest value not yet taken; lane j keeps round j's (value, index).
  float chosen_value = 0.f, kept_sum = 0.f, largest = 0.f;
  int chosen_index = 0;
  unsigned taken = 0;  // bit i: expert lane + 32 i
  for (int j = 0; j < top_k; ++j) {
    float best = NEG_INF;
    int best_index = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int e = lane + 32 * i;
      if (e < experts && !(taken >> i & 1u) && (value[i] > best || best_index == 0x7fffffff)) {
        best = value[i];
        best_index = e;
      }
    }
    warp_top(best, best_index);
    if (best_index % 32 == lane) taken |= 1u << (best_index / 32);
    if (j == 0) largest = best;
    if (lane == j) chosen_value = best, chosen_index = best_index;
    kept_sum += SOFTMAX_FIRST ? best : expf(best - largest);
  }
  if (lane >= top_k) return;
  float weight;
  if (SOFTMAX_FIRST) {
    weight = chosen_value;
    if (NORMALIZE) weight = rnd<T>(chosen_value / rnd<T>(kept_sum));
  } else {
    weight = rnd<T>(expf(chosen_value - largest) / kept_sum);
  }
  indices[(size_t)token * top_k + lane] = static_cast<uint32_t>(chosen_index);
  weights[(size_t)token * top_k + lane] = static_cast<T>(weight);
}
