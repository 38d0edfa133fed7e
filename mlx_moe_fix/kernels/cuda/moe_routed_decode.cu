// Fused decode MoE with its routing, for mx.fast.cuda_kernel: the gate+up launch of
// moe_decode.cu that also routes. The first warp of each block ranks its token's router logits
// with moe_router.cu's device code (the whole row is one 16-byte load per lane: cheaper than the
// launch it saves), shares its pair's expert through shared memory, and the block goes on as
// moe_decode's gate_up; the blocks of row 0 write each pair's expert and routing weight into the
// hidden output's tail (moe_decode.cu's RoutingTail), which its routed_down launch reads. A
// decode step's MoE block is then three launches: router matmul, this, routed_down; or two, where
// `router_gate_up` computes the logits too. `sigmoid_shared_gate_up` does the same for Inkling's
// block, its shared experts' rows included (moe_decode.cu's shared_gate_up, routed_shared_down).
//
// Template constants: moe_decode.cu's gate_up ones (T is also the logits' and the
// weights' type) and moe_router.cu's topk ones (SOFTMAX_FIRST, NORMALIZE, LAST_K); router_gate_up
// also ROUTER_BITS and ROUTER_GROUP (its router's quantization); sigmoid_shared_gate_up
// shared_gate_up's instead of the topk ones. Run-time values: moe_decode's dims with the number of
// (routed) experts after them (dims[7]), and params.

//// uses moe_router.cu moe_decode.cu

//// header
namespace moe_routed {

using namespace moe_common;

// Warp 0's part of a routed gate+up block: routes the pair's token from its `logits`, leaves the
// pair's expert in `block_expert` (shared) and, in the blocks of row group 0, the pair's expert and
// routing weight in the hidden output's RoutingTail.
template <bool SOFTMAX_FIRST, bool NORMALIZE, bool LAST_K, typename T>
__device__ __forceinline__ void route_pair(const T* logits, int experts, int top_k, int pair, T* hidden, int out_dim, int& block_expert) {
  int index;
  float weight;
  moe_router::route_token<SOFTMAX_FIRST, NORMALIZE, LAST_K>(logits, experts, top_k, index, weight);
  const int round = moe_router::stock_position<LAST_K>(pair % top_k, top_k);
  index = __shfl_sync(0xffffffffu, index, round);
  weight = __shfl_sync(0xffffffffu, weight, round);
  if (threadIdx.x == 0) {
    block_expert = index;
    if (blockIdx.x == 0) {
      const moe_decode::RoutingTail<T> tail(hidden, gridDim.y, out_dim, gridDim.y);
      tail.indices[pair] = static_cast<uint32_t>(index);
      tail.weights[pair] = static_cast<T>(weight);
    }
  }
}

// Warp 0's part of a sigmoid_shared_gate_up block: routes the token from its row of logits
// (moe_router's Inkling routing), leaves the block's expert (a routed slot's) in `block_expert` and
// its weight in `block_weight` (a shared slot's: the weight its rows are multiplied by) and, in the
// blocks of row group 0 of a routed slot, the pair's expert and routing weight in the hidden
// output's RoutingTail (after the `rows` rows of the tokens' routed and shared experts).
template <int SHARED, typename T, typename C, typename G>
__device__ __forceinline__ void route_shared_slot(const T* logits, const C* correction, const G* global_scale, int experts,
                                                  int top_k, float route_scale, int token, int slot, T* hidden, int rows,
                                                  int out_dim, int& block_expert, T& block_weight) {
  int index;
  float weight;
  moe_router::route_sigmoid_token(logits, correction, global_scale, experts, top_k, SHARED, route_scale, index, weight);
  index = __shfl_sync(0xffffffffu, index, slot);
  weight = __shfl_sync(0xffffffffu, weight, slot);
  if (threadIdx.x == 0) {
    block_expert = index;
    block_weight = static_cast<T>(weight);
    if (blockIdx.x == 0 && slot < top_k) {
      const int pairs = rows / (top_k + SHARED) * top_k;
      const moe_decode::RoutingTail<T> tail(hidden, rows, out_dim, pairs);
      tail.indices[token * top_k + slot] = static_cast<uint32_t>(index);
      tail.weights[token * top_k + slot] = static_cast<T>(weight);
    }
  }
}

// One row of MLX 0.32's quantized_matmul at one bf16 token, by a warp, bit for bit as MLX
// computes it: its qmv kernel (mlx/backend/cuda/quantized/qmm/qmv.cu, qmv_kernel_impl, which MLX
// runs at M = 1 for affine 4- and 8-bit weights) takes a row a warp, lane l the EPT values from
// l * EPT of each span of 32 EPT (then of the rest of the row, where the spans leave one). Each
// value is dequantised as one bf16 fma of q, scale and bias (MLX writes a multiply and an add,
// which ptxas fuses: checked on the H200 against quantized_matmul, where each other order
// differs), accumulated per slot (8-bit: fp32 fma of the widened values; 4-bit: bf16 fma); the
// lane adds its slots in order into fp32, and the warp sums by cooperative_groups' butterfly.
// The loads of AHEAD spans and their activations are issued before any is used: a span at a
// time waits a round trip to memory per span.
// Every block of router_gate_up computes its token's logits whole (Qwen3's router 384 times a
// layer), so the arithmetic is two values an instruction where it can be: a pair of q as exact
// bf16 without a conversion (8-bit: small_uint_to_float, then the floats' upper halves; I2F and
// F2F run at a quarter of the FMA rate, and two per value made the router inside the launch cost
// more GPU time than its own launch), dequantised by one bf16x2 fma, and at 4 bits accumulated by
// one bf16x2 fma: each lane of a bf16x2 instruction rounds as the scalar one does.
template <int BITS>
__device__ __forceinline__ __nv_bfloat162 exact_pair(uint32_t word, int first) {
  if constexpr (BITS == 8) {
    const float lo = small_uint_to_float(__byte_perm(word, 0u, 0x4440 + first));  // byte `first`, zero-extended
    const float hi = small_uint_to_float(__byte_perm(word, 0u, 0x4441 + first));
    const uint32_t packed = __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);  // exact: q < 2^8
    return *reinterpret_cast<const __nv_bfloat162*>(&packed);
  } else {
    const uint32_t nibbles = word >> (4 * first);
    const uint32_t biased = (nibbles & 0xFu) | ((nibbles << 12) & 0xF0000u) | 0x43004300u;  // 128 + q, each half
    const __nv_bfloat162 offset = __floats2bfloat162_rn(128.f, 128.f);
    return __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased), offset);
  }
}

__device__ __forceinline__ float low_float(uint32_t pair) {
  return __uint_as_float(pair << 16);
}
__device__ __forceinline__ float high_float(uint32_t pair) {
  return __uint_as_float(pair & 0xFFFF0000u);
}

template <int BITS, int GROUP>
__device__ __forceinline__ float mlx_qmv_row(
    const __nv_bfloat16* x, const uint32_t* w, const __nv_bfloat16* scales, const __nv_bfloat16* biases, int row, int k, int lane) {
  static_assert(BITS == 4 || BITS == 8, "affine 4- or 8-bit");
  constexpr int EPT = BITS == 8 ? 8 : 16;  // a lane's 8 bytes of packed weights a span
  constexpr int SPAN = 32 * EPT;
  constexpr int AHEAD = BITS == 8 ? 8 : 4;  // spans in flight: a span's activations take 4 (8-bit) or 8 registers
  constexpr int PER_WORD = 32 / BITS;
  const int spans = k / SPAN, rest = k % SPAN;
  const int lane_spans = spans + (lane * EPT < rest);  // the rest's values as one more span
  float sums[BITS == 8 ? EPT : 1];  // 8-bit slots
  __nv_bfloat162 pair_sums[BITS == 4 ? EPT / 2 : 1];  // 4-bit slots, two a register
#pragma unroll
  for (int i = 0; i < EPT; ++i) sums[BITS == 8 ? i : 0] = 0.f;
#pragma unroll
  for (int p = 0; p < EPT / 2; ++p) pair_sums[BITS == 4 ? p : 0] = __floats2bfloat162_rn(0.f, 0.f);
  for (int first = 0; first < lane_spans; first += AHEAD) {
    uint2 q[AHEAD];
    __nv_bfloat16 scale[AHEAD], bias[AHEAD];
    uint4 values[AHEAD][EPT / 8];
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      const int span = min(first + a, lane_spans - 1);  // a span past the row is loaded again, not used
      const int index = (span < spans ? span * SPAN : k - rest) + lane * EPT;
#pragma unroll
      for (int v = 0; v < EPT / 8; ++v) values[a][v] = reinterpret_cast<const uint4*>(x + index)[v];
      q[a] = reinterpret_cast<const uint2*>(w)[((size_t)row * k + index) * BITS / 64];
      scale[a] = scales[((size_t)row * k + index) / GROUP];
      bias[a] = biases[((size_t)row * k + index) / GROUP];
    }
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      if (first + a >= lane_spans) continue;
      const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(values[a]);
      const __nv_bfloat162 scale2 = __bfloat162bfloat162(scale[a]), bias2 = __bfloat162bfloat162(bias[a]);
#pragma unroll
      for (int p = 0; p < EPT / 2; ++p) {
        const int i = 2 * p;
        const __nv_bfloat162 weights = __hfma2(exact_pair<BITS>(i < PER_WORD ? q[a].x : q[a].y, i % PER_WORD), scale2, bias2);
        if constexpr (BITS == 8) {
          const uint32_t weight_bits = *reinterpret_cast<const uint32_t*>(&weights);
          sums[i] = fmaf(low_float(x_pairs[p]), low_float(weight_bits), sums[i]);
          sums[i + 1] = fmaf(high_float(x_pairs[p]), high_float(weight_bits), sums[i + 1]);
        } else {
          pair_sums[p] = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&x_pairs[p]), weights, pair_sums[p]);
        }
      }
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    if constexpr (BITS == 8) {
      sum += sums[i];
    } else {
      sum += i % 2 ? __high2float(pair_sums[i / 2]) : __low2float(pair_sums[i / 2]);
    }
  }
  return warp_sum(sum);
}

}  // namespace moe_routed

//// routed_gate_up
// inputs: x [N, IN_DIM], logits [N, E], then moe_decode's gate_up inputs from gate_w on (dims
// with E after them); output: hidden [N * TOP_K * OUT_DIM + tail]: each pair's hidden row, then
// the RoutingTail (the k of each token in stock's order).
{
  using namespace moe_decode;
  __shared__ int block_expert;
  const Dims d(dims);
  const int experts = dims[7];
  const int pair = blockIdx.y;
  const int token = pair / d.top_k;
  const T* activations = x + (size_t)token * d.in_dim;
  // One warp routes for the block (all its warps share the pair): the routing is the same
  // arithmetic in every block. The others split the activation row meanwhile (SHARED_SPLIT), else
  // wait at the barrier: at Qwen3's shape waiting was a quarter of the kernel's warp time (ncu),
  // hence moe_router's top-k by redux.
  if (threadIdx.x < 32) {
    moe_routed::route_pair<SOFTMAX_FIRST, NORMALIZE, LAST_K>(logits + (size_t)token * experts, experts, d.top_k, pair, hidden,
                                                            d.out_dim, block_expert);
  }
  const SharedFixed<BITS>* split = split_row<BITS, SHARED_SPLIT, FP4_EXPERTS<S>>(activations, d.in_dim);
  __syncthreads();
  const int first_row = (blockIdx.x * WARPS + threadIdx.x / 32) * RPW;
  if (first_row >= d.out_dim) return;
  gate_up_rows<BITS, GROUP, RPW, GATED, HAS_BIAS, SHARED_SPLIT, T, S>(
      hidden, pair, block_expert, first_row, activations, split,
      {gate_w, gate_s, gate_b}, {up_w, up_s, up_b}, gate_bias, up_bias, gate_scale, d, params);
}

//// router_gate_up
// routed_gate_up with its token's router logits computed in the launch, bit for bit as MLX's
// quantized_matmul computes them (mlx_qmv_row), so that the block needs no router node (at batch
// 1 a node costs the host more than its GPU time: docs/decode-attribution.md, section 28).
// Each block computes all its token's logits into its shared memory, so the launch is only for
// one token and as many blocks as the GPU runs at once (moe_routed_decode.fused_router_reason).
// Not in clusters sharing the logits: MLX keys a cached CUDA graph's kernel nodes without their
// cluster shape (docs/benchmarks.md, forty-second session).
// inputs: x [N, IN_DIM] (bf16), router_w [E, IN_DIM * ROUTER_BITS / 32], router_s, router_b
//         [E, IN_DIM / ROUTER_GROUP] (bf16), then routed_gate_up's inputs from gate_w on;
// output: as routed_gate_up's.
{
  using namespace moe_decode;
  static_assert(cuda::std::is_same_v<T, __nv_bfloat16>, "MLX's bf16 qmv");
  constexpr int LOGITS = 32 * moe_router::CHUNK<T>;  // as many as route_token takes
  __shared__ int block_expert;
  __shared__ T logits[LOGITS];
  const Dims d(dims);
  const int experts = dims[7];
  const int pair = blockIdx.y;
  const T* activations = x + (size_t)(pair / d.top_k) * d.in_dim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int row = warp; row < experts; row += blockDim.x / 32) {
    const float logit = moe_routed::mlx_qmv_row<ROUTER_BITS, ROUTER_GROUP>(activations, router_w, router_s, router_b, row, d.in_dim, lane);
    if (lane == 0) logits[row] = static_cast<T>(logit);
  }
  const SharedFixed<BITS>* split = split_row<BITS, SHARED_SPLIT, FP4_EXPERTS<S>>(activations, d.in_dim);
  __syncthreads();  // every logit written (and this block's split)
  if (warp == 0) {
    moe_routed::route_pair<SOFTMAX_FIRST, NORMALIZE, LAST_K>(logits, experts, d.top_k, pair, hidden, d.out_dim, block_expert);
  }
  __syncthreads();
  const int first_row = (blockIdx.x * WARPS + warp) * RPW;
  if (first_row >= d.out_dim) return;
  gate_up_rows<BITS, GROUP, RPW, GATED, HAS_BIAS, SHARED_SPLIT, T, S>(
      hidden, pair, block_expert, first_row, activations, split,
      {gate_w, gate_s, gate_b}, {up_w, up_s, up_b}, gate_bias, up_bias, gate_scale, d, params);
}

//// sigmoid_shared_gate_up
// moe_decode.cu's shared_gate_up (SHARED_WEIGHTS) routing its tokens too, by Inkling's routing
// (moe_router.cu's sigmoid_topk): warp 0 of each block routes its token (route_shared_slot), so
// that the block needs no router launch; the routed pairs' experts and weights go to the output's
// RoutingTail, which routed_shared_down reads.
// inputs: x [N, IN_DIM], logits [N, E + SHARED], correction [E], global_scale [1], then
//         shared_gate_up's inputs from gate_w on (dims with E after them: dims[7]; params with
//         the route scale after the activation's: params[2]);
// output: hidden [N * (TOP_K + SHARED) * OUT_DIM + tail]
{
  using namespace moe_decode;
  __shared__ int block_expert;
  __shared__ T block_weight;
  const Dims d(dims);
  const int experts = dims[7];
  const int slots = d.top_k + SHARED;
  const int pair = blockIdx.y, token = pair / slots, slot = pair % slots;
  const T* activations = x + (size_t)token * d.in_dim;
  if (threadIdx.x < 32) {
    moe_routed::route_shared_slot<SHARED>(logits + (size_t)token * (experts + SHARED), correction, global_scale, experts,
                                          d.top_k, params[2], token, slot, hidden, gridDim.y, d.out_dim, block_expert,
                                          block_weight);
  }
  const SharedFixed<BITS>* split = split_row<BITS, SHARED_SPLIT, FP4_EXPERTS<S>>(activations, d.in_dim);
  __syncthreads();
  const int first_row = (blockIdx.x * WARPS + threadIdx.x / 32) * RPW;
  if (first_row >= d.out_dim) return;
  shared_gate_up_rows<BITS, GROUP, RPW, HAS_BIAS, SHARED_SPLIT, T, S>(
      hidden, pair, slot, block_expert, &block_weight, first_row, activations, split,
      {gate_w, gate_s, gate_b}, {up_w, up_s, up_b}, {shared_gate_w, shared_gate_s, shared_gate_b},
      {shared_up_w, shared_up_s, shared_up_b}, gate_bias, up_bias, gate_scale, d, params);
}
