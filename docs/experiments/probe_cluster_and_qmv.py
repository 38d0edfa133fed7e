"""Probe (session 31): (1) can a cuda_kernel run as thread-block clusters (__cluster_dims__ put in
through the __global__ macro) with distributed shared memory, in an MLX graph; (2) which
replica of MLX 0.32's qmv gives stock's router logits bit for bit."""

import mlx.core as mx
import numpy as np

CLUSTER = """
#if defined(__global__) && defined(__location__)
#undef __global__
#define __global__ __location__(global) __cluster_dims__(8, 1, 1)
#endif
"""
src = """
  __shared__ float v;
  unsigned rank, size;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
  if (threadIdx.x == 0) v = x[blockIdx.x];
  cg::cluster_group cl = cg::this_cluster();
  cl.sync();
  const float* remote = cl.map_shared_rank(&v, (rank + 1) % size);
  const float r = *remote;
  if (threadIdx.x == 0) { out[blockIdx.x * 3] = rank; out[blockIdx.x * 3 + 1] = size; out[blockIdx.x * 3 + 2] = r; }
  cl.sync();
"""
try:
    k = mx.fast.cuda_kernel(name="cluster_probe_s31", input_names=["x"], output_names=["out"], source=src, header=CLUSTER)
    x = mx.arange(16, dtype=mx.float32) * 10
    def f(x):
        (o,) = k(inputs=[x], grid=(16 * 32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(48,)], output_dtypes=[mx.float32])
        return o
    o = f(x)
    mx.eval(o)
    print("cluster eager:", np.array(o).reshape(16, 3).tolist())
    cf = mx.compile(lambda x: f(f(x)[:16] + 1))
    o2 = cf(x); mx.eval(o2)
    print("cluster compiled chain:", np.array(o2).reshape(16, 3)[:, 2].tolist())
except Exception as e:
    print("cluster FAILED:", type(e).__name__, str(e)[:2000])

QMV_HEADER = r"""
#include <cuda_bf16.h>
template <int VARIANT>
__device__ __forceinline__ __nv_bfloat16 dequant(__nv_bfloat16 q, __nv_bfloat16 s, __nv_bfloat16 b) {
  if constexpr (VARIANT == 0) return __hadd_rn(__hmul_rn(q, s), b);
  else if constexpr (VARIANT == 1) return __hfma(q, s, b);
  else return __hadd(__hmul(q, s), b);
}
template <int ACC>
__device__ __forceinline__ __nv_bfloat16 bf16_fma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  if constexpr (ACC == 0) return __hfma(a, b, c);
  else return __float2bfloat16_rn(fmaf(__bfloat162float(a), __bfloat162float(b), __bfloat162float(c)));
}
"""
QMV_SRC = r"""
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= E) return;
  constexpr int EPT = BITS == 8 ? 8 : 16;
  constexpr int PER_WARP = 32 * EPT;
  const unsigned char* wb = reinterpret_cast<const unsigned char*>(w) + (size_t)row * (K * BITS / 8);
  const __nv_bfloat16* srow = s + (size_t)row * (K / GROUP);
  const __nv_bfloat16* brow = b + (size_t)row * (K / GROUP);
  float fsums[EPT];
  __nv_bfloat16 hsums[EPT];
  for (int i = 0; i < EPT; ++i) { fsums[i] = 0.f; hsums[i] = __float2bfloat16(0.f); }
  auto tile = [&](int idx) {
    const __nv_bfloat16 sc = srow[idx / GROUP], bi = brow[idx / GROUP];
    for (int i = 0; i < EPT; ++i) {
      unsigned q = BITS == 8 ? wb[idx + i] : (wb[(idx + i) / 2] >> (4 * ((idx + i) % 2))) & 15u;
      __nv_bfloat16 wd = dequant<VARIANT>(__float2bfloat16((float)q), sc, bi);
      if (BITS == 8) fsums[i] = fmaf(__bfloat162float(x[idx + i]), __bfloat162float(wd), fsums[i]);
      else hsums[i] = bf16_fma<ACC>(x[idx + i], wd, hsums[i]);
    }
  };
  for (int r = 0; r < K / PER_WARP; ++r) tile(lane * EPT + r * PER_WARP);
  if (K % PER_WARP) { const int rest = K % PER_WARP; const int idx = lane * EPT + K - rest; if (idx < K) tile(idx); }
  float sum = 0.f;
  for (int i = 0; i < EPT; ++i) sum += BITS == 8 ? fsums[i] : __bfloat162float(hsums[i]);
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) out[row] = __float2bfloat16(sum);
"""
import hashlib
qk = mx.fast.cuda_kernel(name="qmv_probe_" + hashlib.sha1((QMV_HEADER + QMV_SRC).encode()).hexdigest()[:10], input_names=["x", "w", "s", "b"], output_names=["out"], source=QMV_SRC, header=QMV_HEADER)

for name, E, K, bits in (("qwen3 router 8-bit", 128, 2048, 8), ("mixtral router 4-bit", 8, 4096, 4), ("small 8-bit k=960", 64, 960, 8), ("small 4-bit k=1472", 16, 1472, 4)):
    mx.random.seed(0)
    W = (mx.random.normal((E, K)) * 0.02).astype(mx.bfloat16)
    w, s, b = mx.quantize(W, group_size=64, bits=bits)
    variants = [(v, a) for v in (0, 1, 2) for a in ((0, 1) if bits == 4 else (0,))]
    bad = {va: 0 for va in variants}
    total = 0
    for trial in range(100):
        x = (mx.random.normal((1, K)) * (1.0 + trial % 5)).astype(mx.bfloat16)
        stock = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits)
        for va in variants:
            (o,) = qk(inputs=[x.reshape(-1), w, s, b], template=[("BITS", bits), ("GROUP", 64), ("E", E), ("K", K), ("VARIANT", va[0]), ("ACC", va[1])],
                      grid=(E * 32, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(E,)], output_dtypes=[mx.bfloat16])
            a = np.array(o.astype(mx.float32)); c = np.array(stock.reshape(-1).astype(mx.float32))
            bad[va] += int((a != c).sum())
            if trial == 0:
                print(name, va, "max |diff|", float(np.abs(a - c).max()), "max |stock|", float(np.abs(c).max()))
        total += E
    print(f"{name}: mismatched logits per variant (dequant variant, acc variant) of {total}: {bad}")
