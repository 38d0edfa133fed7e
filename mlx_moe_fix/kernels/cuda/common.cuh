// Device helpers shared by every kernel source: mlx_moe_fix/kernels/sources.py puts this file
// in front of each source's `header` section.

#include <cuda/std/type_traits>

namespace moe_common {

// MLX names a compiled cuda_kernel by its name and template arguments, not by its inputs' types,
// and reuses the first compile under that name. An additive bias input comes as S, or as the
// float32 placeholder of an absent one: the launchers pass HAS_BIAS as a template constant so
// that the two signatures get two names, and each kernel checks the constant against its
// signature with this.
template <bool HAS_BIAS, typename S, typename Pointer>
inline constexpr bool bias_signature_matches =
    cuda::std::is_same_v<cuda::std::remove_cv_t<cuda::std::remove_pointer_t<Pointer>>, cuda::std::conditional_t<HAS_BIAS, S, float>>;

// Stock MLX rounds every op's result to the array dtype T: the kernels' epilogues round at the
// same points, so that outputs match stock bit for bit wherever the fp32 sums round alike.
template <typename T>
__device__ __forceinline__ float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// The sum over a warp, in every lane: a butterfly from offset 16 down, as cooperative_groups'
// reduce does (the router kernel reproduces MLX's reductions with it). FROM < 16: the butterfly's
// last steps, from offset FROM down (the sum over lanes that differ in those bits only).
template <int FROM = 16, typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = FROM; offset > 0; offset /= 2) v = v + __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// An unsigned integer below 2^23 as fp32, exactly: its bits under the exponent of 2^23, minus
// 2^23. Two full-rate instructions, where a conversion (I2F) runs at a fraction of the FMA rate
// (the prefill's dequantisation; the decode GEMVs read values in place, moe_decode.cu).
__device__ __forceinline__ float small_uint_to_float(unsigned q) {
  return __uint_as_float(0x4B000000u | q) - 8388608.f;
}

// An e4m3 byte (nvfp4's group scales: sign, 4 exponent bits of bias 7, 3 mantissa bits,
// subnormals below 2^-6) as fp32, times 2^-8: its bits under fp16's (bias 15) give that value
// exactly, subnormals included, and fp16 widens exactly.
__device__ __forceinline__ float e4m3_over_256(unsigned char b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>((b & 0x80u) << 8 | (b & 0x7Fu) << 7)));
}

__device__ __forceinline__ float sigmoid(float v) {
  return 1.f / (1.f + expf(-v));
}

// silu(v) as stock computes it in T: the sigmoid rounded, then the product.
template <typename T>
__device__ __forceinline__ float silu(float v) {
  return rnd<T>(v * rnd<T>(sigmoid(v)));
}

__device__ __forceinline__ float gelu_tanh(float v) {
  return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
}

// act: 0 SwiGLU (with DeepSeek-V4's clamp stage when limited), 1 gpt-oss SwiGLU,
// 2 GELU, 3 GELU tanh approximation, 4 GELU sigmoid approximation, 5 DeepSeek-V4.1's SwiGLU (0
// in fp32, its limit unrounded, left to the caller's one rounding), 6 Step-3.5's (silu(gate)
// clamped from above), 7 Gemma 4's GeGLU (3 of gate, times up), 8 Kimi-K3's SiTU (in fp32; alpha
// its beta, limit its linear_beta where has_limit), 9 ReLU^2 (Nemotron-H's), 10 Kimi-VL's SwiGLU
// (silu(gate) clipped to +-limit).
template <typename T>
__device__ __forceinline__ float activate(int act, bool has_limit, float up, float gate, float limit, float alpha) {
  if (act == 0 || act == 1) {
    if (act == 1 || has_limit) {
      limit = rnd<T>(limit);
      gate = fminf(gate, limit);
      up = fminf(fmaxf(up, -limit), limit);
    }
    if (act == 0) return rnd<T>(silu<T>(gate) * up);
    const float glu = rnd<T>(gate * rnd<T>(sigmoid(rnd<T>(rnd<T>(alpha) * gate))));
    return rnd<T>(rnd<T>(up + 1.f) * glu);
  } else if (act == 2) {
    return 0.5f * up * (1.f + erff(up * 0.70710678118654752f));
  } else if (act == 3) {
    return gelu_tanh(up);
  } else if (act == 4) {
    return up * sigmoid(1.702f * up);
  } else if (act == 5) {
    if (has_limit) {
      gate = fminf(gate, limit);
      up = fminf(fmaxf(up, -limit), limit);
    }
    return gate * sigmoid(gate) * up;
  } else if (act == 6) {
    limit = rnd<T>(limit);
    const float clamped = fminf(silu<T>(gate), limit);
    return rnd<T>(clamped * fminf(fmaxf(up, -limit), limit));
  } else if (act == 7) {
    return rnd<T>(rnd<T>(gelu_tanh(gate)) * up);
  } else if (act == 8) {
    if (has_limit) up = limit * tanhf(up / limit);
    return alpha * tanhf(gate / alpha) * sigmoid(gate) * up;
  } else if (act == 9) {
    const float positive = fmaxf(up, 0.f);
    return positive * positive;
  } else {
    limit = rnd<T>(limit);
    return rnd<T>(fminf(fmaxf(silu<T>(gate), -limit), limit) * up);
  }
}

// The kernels' run-time `dims` input.
struct Dims {
  int in_dim, out_dim, top_k, act;
  bool has_limit, has_bias, has_scale;
  __device__ explicit Dims(const int* d)
      : in_dim(d[0]), out_dim(d[1]), top_k(d[2]), act(d[3]), has_limit(d[4]), has_bias(d[5]), has_scale(d[6]) {}
};

}  // namespace moe_common
