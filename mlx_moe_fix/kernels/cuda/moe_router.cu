// Top-k routing of a MoE block for mx.fast.cuda_kernel: router logits -> (experts, weights) per
// token in one launch, one warp per token, the token's logits in registers (lane l holds the
// CHUNK experts l * CHUNK ...: the chunk one thread of MLX's softmax reads).
//
// It reproduces stock's routing on MLX's CUDA backend bit for bit, ties included:
// - argpartition there is a stable ascending sort (mlx/backend/cuda/sort.cu): of equal values,
//   the k taken from the end (LAST_K: qwen3_moe's probabilities, gpt-oss's logits) favour the
//   higher expert index, the k taken from the front of the negated logits (mixtral) the lower,
//   and the k come in the sort's order, which the weighted sum over them follows;
// - softmax (precise) and sum follow MLX's kernels (softmax.cu, reduce/row_reduce.cu): chunks
//   of CHUNK = 16 / sizeof(T) consecutive values, one per thread, reduced in order, chunks
//   combined by a warp butterfly; softmax's normaliser rescaled per chunk maximum, __expf, one
//   IEEE reciprocal, results rounded to T; the sum accumulates in T.
//
// Sections are split on "//// <name>" lines (`header`, `topk`, `sigmoid_topk`, `sqrtsoftplus_topk`,
// `sqrtsoftplus_hash`). Template constants:
//   T (the logits' and weights' type), SOFTMAX_FIRST (softmax over all experts, then the k
//   largest probabilities, as qwen3_moe; else the k largest logits, then softmax over them),
//   NORMALIZE (SOFTMAX_FIRST only: the k probabilities divided by their sum), LAST_K (above).
// Run-time values: sizes = tokens, experts, top_k (experts <= 32 * CHUNK, top_k <= 32).
//
// `sqrtsoftplus_topk` is DeepSeek-V4's (mlx_vlm.models.deepseek_v4.language, _expert_select with
// its sqrt-softplus scoring): MLX's logaddexp(x, 0) and IEEE sqrt of the float32 logits, plus the
// correction bias, choose the experts as sigmoid_topk's do; their scores, divided by their sum
// (MLX's sum of float32) plus 1e-20 where NORMALIZE, times the routed scaling factor, are their
// float32 weights. Template: T, NORMALIZE; run-time: sizes = tokens, experts, top_k, params =
// routed_scaling_factor. `sqrtsoftplus_hash` is its token-hash layers' (_hash_expert_select): the
// experts of the token's id in the layer's table (a negative id counts from the table's end, as
// MLX's gather takes it), weighed so. Template: T, NORMALIZE, I (the ids' type), E (the table's);
// run-time: sizes = tokens, experts, top_k, the table's rows, params = routed_scaling_factor.
//
// `sigmoid_topk` is Inkling's routing (mlx_vlm.models.inkling.language, InklingSparseMoE._route
// off Metal), following the MLX ops that route there: MLX's sigmoid (unary_ops.cuh) plus the
// correction bias chooses the experts (the k from the front of the negated scores: the lower
// index among equals), the chosen and the shared experts' logits go through MLX's logaddexp
// (binary_ops.cuh) and logsumexp (logsumexp.cu: 4 values per thread, online normaliser, __expf),
// then exp, route_scale and global_scale. Template: T; run-time: sizes = tokens, experts, top_k,
// shared (top_k + shared <= 32), params = route_scale.

//// header
#include <cuda/std/limits>

namespace moe_router {

using namespace moe_common;

constexpr float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
constexpr float LOWEST = cuda::std::numeric_limits<float>::lowest();

template <typename T>
constexpr int CHUNK = 16 / sizeof(T);

// cooperative_groups' reduce of a warp: a butterfly from offset 16 down (as warp_sum).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = v > other ? v : other;
  }
  return v;
}

// MLX's softmax statistics over a row held as one chunk per lane (NEG_INF past the row's end):
// the row maximum and the reciprocal of the normaliser; then p = __expf(v - max) * reciprocal.
template <int N>
__device__ __forceinline__ void softmax_stats(const float (&chunk)[N], float& row_max, float& reciprocal) {
  float chunk_max = LOWEST;
#pragma unroll
  for (int i = 0; i < N; ++i) chunk_max = chunk_max > chunk[i] ? chunk_max : chunk[i];
  float normaliser = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) normaliser = __fadd_rn(normaliser, __expf(chunk[i] - chunk_max));
  row_max = warp_max(chunk_max);
  normaliser = warp_sum(__fmul_rn(normaliser, __expf(chunk_max - row_max)));
  reciprocal = __frcp_rn(normaliser);
}

// Lane p's value at stock's position p of a row of n (lane `source(p)` holds it), regrouped as
// lane c's chunk: positions c * N ... c * N + N - 1, `fill` past n.
template <int N, typename F>
__device__ __forceinline__ void gather_chunk(float (&chunk)[N], float value, int n, F source, float fill) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int p = lane * N + i;
    const float v = __shfl_sync(0xffffffffu, value, source(min(p, n - 1)));
    chunk[i] = p < n ? v : fill;
  }
}

// A float's 32-bit key, which orders as the floats do (the bits made monotone, +0 for -0), and
// the float of a key.
__device__ __forceinline__ unsigned float_key(float value) {
  const unsigned bits = __float_as_uint(value == 0.f ? 0.f : value);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ float key_float(unsigned key) {
  return __uint_as_float(key & 0x80000000u ? key & 0x7FFFFFFFu : ~key);
}

// k rounds of the highest-ranked expert not yet taken, in stock's sort (of equal values the
// higher index where LAST_K, else the lower), the lane holding expert lane * N + i in value[i];
// lane j keeps round j's choice (value and index), which the others leave as they were. A round
// is two warp reductions (redux.sync): the best value's key, then the winner among the experts
// holding it (five shuffle rounds of a value and an index each made a warp that routes inside a
// gate+up block keep the block's other warps waiting).
template <bool LAST_K, int N>
__device__ __forceinline__ void top_k_rounds(
    const float (&value)[N], int experts, int top_k, float& chosen_value, int& chosen_index) {
  const int lane = threadIdx.x % 32;
  unsigned key[N];  // 0: past the experts or taken (every value's key is above it)
#pragma unroll
  for (int i = 0; i < N; ++i) key[i] = lane * N + i < experts ? float_key(value[i]) : 0u;
  for (int j = 0; j < top_k; ++j) {
    unsigned best = 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) best = max(best, key[i]);
    best = __reduce_max_sync(0xffffffffu, best);
    unsigned holder = LAST_K ? 0u : 0xFFFFFFFFu;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (key[i] == best) holder = LAST_K ? lane * N + i : min(holder, static_cast<unsigned>(lane * N + i));
    }
    const unsigned expert = LAST_K ? __reduce_max_sync(0xffffffffu, holder) : __reduce_min_sync(0xffffffffu, holder);
#pragma unroll
    for (int i = 0; i < N; ++i) key[i] = lane * N + i == expert ? 0u : key[i];
    if (lane == j) chosen_value = key_float(best), chosen_index = static_cast<int>(expert);
  }
}

// top_k_rounds for values that T of 16 bits holds exactly: each value and its expert as one
// 32-bit key in stock's order (the value's bits made monotone, +0 for -0, over the expert index,
// or its complement where the lower index wins), so that a round is one redux.sync.
template <typename T>
__device__ __forceinline__ unsigned short bits_of(float value) {
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) return __bfloat16_as_ushort(static_cast<T>(value));
  else return __half_as_ushort(static_cast<T>(value));
}

template <typename T>
__device__ __forceinline__ float value_of(unsigned short bits) {
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) return static_cast<float>(__ushort_as_bfloat16(bits));
  else return static_cast<float>(__ushort_as_half(bits));
}

template <bool LAST_K, typename T>
__device__ __forceinline__ unsigned rank_key(float value, int expert) {
  const unsigned bits = bits_of<T>(value == 0.f ? 0.f : value);
  const unsigned monotone = bits & 0x8000u ? ~bits & 0xFFFFu : bits | 0x8000u;
  return monotone << 16 | (LAST_K ? expert : 0xFFFF - expert);
}

template <bool LAST_K, typename T>
__device__ __forceinline__ void ranked(unsigned key, float& value, int& expert) {
  const unsigned monotone = key >> 16;
  value = value_of<T>(monotone & 0x8000u ? monotone & 0x7FFFu : ~monotone & 0xFFFFu);
  expert = LAST_K ? key & 0xFFFFu : 0xFFFF - (key & 0xFFFFu);
}

template <bool LAST_K, int N, typename T>
__device__ __forceinline__ void top_k_rounds_by_key(
    const float (&value)[N], int experts, int top_k, float& chosen_value, int& chosen_index) {
  static_assert(sizeof(T) == 2, "keys hold 16-bit values");
  const int lane = threadIdx.x % 32;
  unsigned key[N];  // 0: past the experts or taken (every value's key is above it)
#pragma unroll
  for (int i = 0; i < N; ++i) key[i] = lane * N + i < experts ? rank_key<LAST_K, T>(value[i], lane * N + i) : 0u;
  for (int j = 0; j < top_k; ++j) {
    unsigned best = 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) best = max(best, key[i]);
    best = __reduce_max_sync(0xffffffffu, best);
#pragma unroll
    for (int i = 0; i < N; ++i) key[i] = key[i] == best ? 0u : key[i];
    if (lane == j) ranked<LAST_K, T>(best, chosen_value, chosen_index);
  }
}

// The position in stock's order of the k of the choice made in round `round` (rounds go from
// the top rank down; stock's order is ascending where it takes the last k); its own inverse.
template <bool LAST_K>
__device__ __forceinline__ int stock_position(int round, int top_k) {
  return LAST_K ? top_k - 1 - round : round;
}

// MLX's sum of a row of n values of T (its row reduce: chunks of CHUNK<T> consecutive values, one
// a lane, each added in order in T, the chunks by a warp butterfly), lane source(p) holding the
// row's position p.
template <typename T, typename F>
__device__ __forceinline__ T mlx_row_sum(float value, int n, F source) {
  constexpr int N = CHUNK<T>;
  float chunk[N];
  gather_chunk<N>(chunk, value, n, source, 0.f);
  T chunk_sum = T(0.f);
#pragma unroll
  for (int i = 0; i < N; ++i) chunk_sum = chunk_sum + static_cast<T>(chunk[i]);
  return warp_sum(chunk_sum);
}

// Lane l's chunk of a token's row of logits (experts l * CHUNK<T> ...) as score(logit, expert),
// NEG_INF past `experts`.
template <typename T, typename F>
__device__ __forceinline__ void lane_chunk(float (&value)[CHUNK<T>], const T* row, int experts, F score) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < CHUNK<T>; ++i) {
    const int e = lane * CHUNK<T> + i;
    value[i] = e < experts ? score(static_cast<float>(row[e]), e) : NEG_INF;
  }
}

// Stock's top-k routing of one token (SOFTMAX_FIRST, NORMALIZE, LAST_K: see the top of this
// file) by the whole warp: lane j < top_k gets round j's expert and routing weight, which stock
// puts at stock_position(j).
template <bool SOFTMAX_FIRST, bool NORMALIZE, bool LAST_K, typename T>
__device__ __forceinline__ void route_token(const T* row, int experts, int top_k, int& index, float& weight) {
  constexpr int N = CHUNK<T>;
  float value[N];
  lane_chunk(value, row, experts, [](float logit, int) { return logit; });
  if (SOFTMAX_FIRST) {
    float row_max, reciprocal;
    softmax_stats<N>(value, row_max, reciprocal);
#pragma unroll
    for (int i = 0; i < N; ++i) value[i] = rnd<T>(__fmul_rn(__expf(value[i] - row_max), reciprocal));
  }
  float chosen_value = 0.f;
  index = 0;
  if constexpr (sizeof(T) == 2) {
    top_k_rounds_by_key<LAST_K, N, T>(value, experts, top_k, chosen_value, index);
  } else {
    top_k_rounds<LAST_K>(value, experts, top_k, chosen_value, index);
  }
  auto holder = [top_k](int position) { return stock_position<LAST_K>(position, top_k); };
  weight = chosen_value;
  if (SOFTMAX_FIRST && NORMALIZE) {
    const T sum = mlx_row_sum<T>(chosen_value, top_k, holder);
    weight = static_cast<float>(static_cast<T>(chosen_value) / sum);
  } else if (!SOFTMAX_FIRST) {
    float chunk[N], row_max, reciprocal;
    gather_chunk<N>(chunk, chosen_value, top_k, holder, NEG_INF);
    softmax_stats<N>(chunk, row_max, reciprocal);
    weight = __fmul_rn(__expf(chosen_value - row_max), reciprocal);
  }
}

// MLX's sigmoid of a float (unary_ops.cuh).
__device__ __forceinline__ float mlx_sigmoid(float x) {
  const float y = 1.f / (1.f + expf(fabsf(x)));
  return x < 0.f ? y : 1.f - y;
}

// MLX's logaddexp of two finite or infinite floats (binary_ops.cuh).
__device__ __forceinline__ float mlx_logaddexp(float x, float y) {
  const float high = fmaxf(x, y), low = fminf(x, y);
  return low == NEG_INF || high == -NEG_INF ? high : high + log1pf(expf(low - high));
}

// MLX's logsumexp of a row of n <= 128 floats, lane p holding position p (< 32) of it: the
// kernel's block of 32 threads reads 4 consecutive values each (-inf past n), keeps a running
// maximum and a normaliser rescaled by __expf, and combines the threads by warp butterflies.
__device__ __forceinline__ float mlx_logsumexp(float value, int n) {
  const int lane = threadIdx.x % 32;
  float thread_max = LOWEST, normaliser = 0.f;
  float values[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int p = lane * 4 + i;
    const float v = __shfl_sync(0xffffffffu, value, min(p, 31));
    values[i] = p < n ? v : NEG_INF;
    thread_max = thread_max > values[i] ? thread_max : values[i];
  }
  normaliser = normaliser * __expf(LOWEST - thread_max);
#pragma unroll
  for (int i = 0; i < 4; ++i) normaliser = normaliser + __expf(values[i] - thread_max);
  const float row_max = warp_max(thread_max);
  normaliser = warp_sum(normaliser * __expf(thread_max - row_max));
  return isinf(row_max) ? row_max : logf(normaliser) + row_max;
}

// Inkling's routing of one token (see the top of this file) by the whole warp, from its row of
// `experts` routed then `shared` shared experts' logits: lane j < top_k gets round j's expert (the
// lower index among equal scores) and routing weight, stock's position j; lane top_k + s shared
// expert s's weight.
template <typename T, typename C, typename G>
__device__ __forceinline__ void route_sigmoid_token(const T* row, const C* correction, const G* global_scale, int experts,
                                                    int top_k, int shared, float route_scale, int& index, float& weight) {
  const int lane = threadIdx.x % 32;
  float score[CHUNK<T>];
  lane_chunk(score, row, experts, [correction](float logit, int e) { return mlx_sigmoid(logit) + static_cast<float>(correction[e]); });
  float chosen_score = 0.f;
  index = 0;
  top_k_rounds<false>(score, experts, top_k, chosen_score, index);
  // Lane p: position p of [chosen experts' logits, shared experts' logits].
  const int positions = top_k + shared;
  const float logit = lane < top_k ? static_cast<float>(row[index])
      : lane < positions ? static_cast<float>(row[experts + lane - top_k]) : 0.f;
  const float log_sigmoid = -mlx_logaddexp(0.f, -logit);
  const float normaliser = mlx_logsumexp(log_sigmoid, positions);
  weight = expf(log_sigmoid - normaliser) * route_scale * static_cast<float>(global_scale[0]);
}

// MLX's sqrt(softplus(x)) of a float: its softplus is logaddexp(x, 0), its sqrt the IEEE one.
__device__ __forceinline__ float mlx_sqrt_softplus(float x) {
  return sqrtf(mlx_logaddexp(x, 0.f));
}

// DeepSeek-V4's weights of a token's chosen experts (lane j < top_k: round j's `index`, its
// float32 weight), by the whole warp.
template <bool NORMALIZE, typename T>
__device__ __forceinline__ float sqrtsoftplus_weight(const T* row, int top_k, float scale, int index) {
  const int lane = threadIdx.x % 32;
  float weight = lane < top_k ? mlx_sqrt_softplus(static_cast<float>(row[index])) : 0.f;
  if (NORMALIZE) {
    const float sum = mlx_row_sum<float>(weight, top_k, [](int position) { return position; });
    weight = __fdiv_rn(weight, __fadd_rn(sum, 1e-20f));
  }
  return __fmul_rn(weight, scale);
}

// DeepSeek-V4's routing of one token by its scores (see the top of this file) by the whole warp:
// lane j < top_k gets round j's expert (the lower index among equal biased scores) and its float32
// weight, stock's position j.
template <bool NORMALIZE, typename T, typename C>
__device__ __forceinline__ void route_sqrtsoftplus_token(const T* row, const C* correction, int experts, int top_k, float scale,
                                                         int& index, float& weight) {
  float biased[CHUNK<T>];
  lane_chunk(biased, row, experts,
             [correction](float logit, int e) { return __fadd_rn(mlx_sqrt_softplus(logit), static_cast<float>(correction[e])); });
  float chosen = 0.f;
  index = 0;
  top_k_rounds<false>(biased, experts, top_k, chosen, index);
  weight = sqrtsoftplus_weight<NORMALIZE>(row, top_k, scale, index);
}

// The token of this thread's warp (a warp a token; whole warps, as blockDim.x is a multiple of
// 32), or -1 past the last.
__device__ __forceinline__ int warp_token(int tokens) {
  const int token = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  return token < tokens ? token : -1;
}

// A section's run-time sizes (tokens, experts, top_k first) and this thread's warp_token and lane.
struct TokenWarp {
  int tokens, experts, top_k, token, lane;
  __device__ explicit TokenWarp(const int* sizes)
      : tokens(sizes[0]), experts(sizes[1]), top_k(sizes[2]), token(warp_token(sizes[0])), lane(threadIdx.x % 32) {}
};

// Lane j < top_k's choice, its expert and its weight (as W), at the token's k-th place `position`.
template <typename W>
__device__ __forceinline__ void store_choice(uint32_t* indices, W* weights, const TokenWarp& warp, int position, int index,
                                             float weight) {
  if (warp.lane >= warp.top_k) return;
  const size_t at = (size_t)warp.token * warp.top_k + position;
  indices[at] = static_cast<uint32_t>(index);
  weights[at] = static_cast<W>(weight);
}

}  // namespace moe_router

//// topk
// inputs: logits [tokens, experts], sizes;  outputs: indices [tokens, top_k] (uint32),
// weights [tokens, top_k] (T), in stock's order.
{
  using namespace moe_router;
  const TokenWarp warp(sizes);
  if (warp.token < 0) return;
  int index;
  float weight;
  route_token<SOFTMAX_FIRST, NORMALIZE, LAST_K>(logits + (size_t)warp.token * warp.experts, warp.experts, warp.top_k, index, weight);
  store_choice(indices, weights, warp, stock_position<LAST_K>(warp.lane, warp.top_k), index, weight);
}

//// sigmoid_topk
// inputs: logits [tokens, experts + shared], correction [experts], global_scale [1], sizes,
// params;  outputs: indices [tokens, top_k] (uint32), weights [tokens, top_k] (T),
// shared_weights [tokens, shared] (T), in stock's order.
{
  using namespace moe_router;
  const TokenWarp warp(sizes);
  const int shared = sizes[3];
  if (warp.token < 0) return;
  int index;
  float weight;
  route_sigmoid_token(logits + (size_t)warp.token * (warp.experts + shared), correction, global_scale, warp.experts, warp.top_k,
                      shared, params[0], index, weight);
  store_choice(indices, weights, warp, warp.lane, index, weight);
  if (warp.lane >= warp.top_k && warp.lane < warp.top_k + shared) {
    shared_weights[(size_t)warp.token * shared + warp.lane - warp.top_k] = static_cast<T>(weight);
  }
}

//// sqrtsoftplus_topk
// inputs: logits [tokens, experts], correction [experts], sizes, params;  outputs: indices
// [tokens, top_k] (uint32), weights [tokens, top_k] (float32), in stock's order.
{
  using namespace moe_router;
  const TokenWarp warp(sizes);
  if (warp.token < 0) return;
  int index;
  float weight;
  route_sqrtsoftplus_token<NORMALIZE>(logits + (size_t)warp.token * warp.experts, correction, warp.experts, warp.top_k, params[0],
                                      index, weight);
  store_choice(indices, weights, warp, warp.lane, index, weight);
}

//// sqrtsoftplus_hash
// inputs: logits [tokens, experts], token_ids [tokens], expert_table [rows, top_k], sizes, params;
// outputs: indices [tokens, top_k] (uint32), weights [tokens, top_k] (float32), in the table's order.
{
  using namespace moe_router;
  const TokenWarp warp(sizes);
  const int rows = sizes[3];
  if (warp.token < 0) return;
  const long long id = static_cast<long long>(token_ids[warp.token]);
  const long long row = id < 0 ? id + rows : id;
  const int index = warp.lane < warp.top_k ? static_cast<int>(expert_table[row * warp.top_k + warp.lane]) : 0;
  const float weight = sqrtsoftplus_weight<NORMALIZE>(logits + (size_t)warp.token * warp.experts, warp.top_k, params[0], index);
  store_choice(indices, weights, warp, warp.lane, index, weight);
}
