// Fused decode MoE with its routing, for mx.fast.cuda_kernel: the gate+up launch of
// moe_decode.cu that also routes. The first warp of each block ranks its token's router logits
// with moe_router.cu's device code (the whole row is one 16-byte load per lane: cheaper than the
// launch it saves), shares its pair's expert through shared memory, and the block goes on as
// moe_decode's gate_up; the blocks of row 0 write each pair's expert and routing weight into the
// hidden output's tail (moe_decode.cu's RoutingTail), which its routed_down launch reads. A
// decode step's MoE block is then three launches: router matmul, this, routed_down.
//
// Template constants: moe_decode.cu's gate_up ones (T is also the logits' and the
// weights' type) and moe_router.cu's topk ones (SOFTMAX_FIRST, NORMALIZE, LAST_K). Run-time
// values: moe_decode's dims with the number of experts after them (dims[7]), and params.

//// uses moe_router.cu moe_decode.cu

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
    int index;
    float weight;
    moe_router::route_token<SOFTMAX_FIRST, NORMALIZE, LAST_K>(logits + (size_t)token * experts, experts, d.top_k, index, weight);
    const int round = moe_router::stock_position<LAST_K>(pair % d.top_k, d.top_k);
    index = __shfl_sync(0xffffffffu, index, round);
    weight = __shfl_sync(0xffffffffu, weight, round);
    if (threadIdx.x == 0) {
      block_expert = index;
      if (blockIdx.x == 0) {
        const RoutingTail<T> tail(hidden, gridDim.y, d.out_dim);
        tail.indices[pair] = static_cast<uint32_t>(index);
        tail.weights[pair] = static_cast<T>(weight);
      }
    }
  }
  const SharedFixed<BITS>* split = split_row<BITS, SHARED_SPLIT>(activations, d.in_dim);
  __syncthreads();
  const int first_row = (blockIdx.x * WARPS + threadIdx.x / 32) * RPW;
  if (first_row >= d.out_dim) return;
  gate_up_rows<BITS, GROUP, RPW, GATED, HAS_BIAS, SHARED_SPLIT, T, S>(
      hidden, pair, block_expert, first_row, activations, split,
      {gate_w, gate_s, gate_b}, {up_w, up_s, up_b}, gate_bias, up_bias, gate_scale, d, params);
}
