// Device helpers shared by every Metal kernel source, the counterpart of ../cuda/common.cuh (same
// names, same rounding points): mlx_moe_fix/kernels/sources.py puts this file in front of each
// source's `header` section. Written to the CUDA kernels' contract and NOT compiled or run on
// Apple hardware by this project (no Metal machine here): see the README's support matrix.
//
// MLX passes an input of fewer than 8 elements in the `constant` address space and the others
// in `device` (mlx/backend/common/metal_kernel.cpp), so helpers that take inputs are templates
// over the pointer type.

namespace moe_common {

// Stock MLX rounds every op's result to the array dtype T: the kernels round at the same points.
template <typename T>
inline float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// An unsigned integer below 2^23 as fp32, exactly: its bits under the exponent of 2^23, minus 2^23.
inline float small_uint_to_float(uint q) {
  return as_type<float>(0x4B000000u | q) - 8388608.f;
}

inline float sigmoid(float v) {
  return 1.f / (1.f + metal::precise::exp(-v));
}

// erf, which Metal's library lacks: Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7).
inline float erf_approx(float v) {
  const float a = metal::fabs(v);
  const float t = 1.f / (1.f + 0.3275911f * a);
  const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const float y = 1.f - poly * metal::precise::exp(-a * a);
  return v < 0.f ? -y : y;
}

// silu(v) as stock computes it in T: the sigmoid rounded, then the product.
template <typename T>
inline float silu(float v) {
  return rnd<T>(v * rnd<T>(sigmoid(v)));
}

inline float gelu_tanh(float v) {
  return 0.5f * v * (1.f + metal::precise::tanh(0.79788456080286536f * (v + 0.044715f * v * v * v)));
}

// act: 0 SwiGLU (with DeepSeek-V4's clamp stage when limited), 1 gpt-oss SwiGLU,
// 2 GELU, 3 GELU tanh approximation, 4 GELU sigmoid approximation, 5 DeepSeek-V4.1's SwiGLU (0
// in fp32, its limit unrounded, left to the caller's one rounding), 6 Step-3.5's (silu(gate)
// clamped from above), 7 Gemma 4's GeGLU (3 of gate, times up), 8 Kimi-K3's SiTU (in fp32; alpha
// its beta, limit its linear_beta where has_limit), 9 ReLU^2 (Nemotron-H's), 10 Kimi-VL's SwiGLU
// (silu(gate) clipped to +-limit).
template <typename T>
inline float activate(int act, bool has_limit, float up, float gate, float limit, float alpha) {
  if (act == 0 || act == 1) {
    if (act == 1 || has_limit) {
      limit = rnd<T>(limit);
      gate = metal::fmin(gate, limit);
      up = metal::fmin(metal::fmax(up, -limit), limit);
    }
    if (act == 0) return rnd<T>(silu<T>(gate) * up);
    const float glu = rnd<T>(gate * rnd<T>(sigmoid(rnd<T>(rnd<T>(alpha) * gate))));
    return rnd<T>(rnd<T>(up + 1.f) * glu);
  } else if (act == 2) {
    return 0.5f * up * (1.f + erf_approx(up * 0.70710678118654752f));
  } else if (act == 3) {
    return gelu_tanh(up);
  } else if (act == 4) {
    return up * sigmoid(1.702f * up);
  } else if (act == 5) {
    if (has_limit) {
      gate = metal::fmin(gate, limit);
      up = metal::fmin(metal::fmax(up, -limit), limit);
    }
    return gate * sigmoid(gate) * up;
  } else if (act == 6) {
    limit = rnd<T>(limit);
    const float clamped = metal::fmin(silu<T>(gate), limit);
    return rnd<T>(clamped * metal::fmin(metal::fmax(up, -limit), limit));
  } else if (act == 7) {
    return rnd<T>(rnd<T>(gelu_tanh(gate)) * up);
  } else if (act == 8) {
    if (has_limit) up = limit * metal::precise::tanh(up / limit);
    return alpha * metal::precise::tanh(gate / alpha) * sigmoid(gate) * up;
  } else if (act == 9) {
    const float positive = metal::fmax(up, 0.f);
    return positive * positive;
  } else {
    limit = rnd<T>(limit);
    return rnd<T>(metal::fmin(metal::fmax(silu<T>(gate), -limit), limit) * up);
  }
}

// The kernels' run-time `dims` input.
struct Dims {
  int in_dim, out_dim, top_k, act;
  bool has_limit, has_bias, has_scale;
};

template <typename P>
inline Dims read_dims(P d) {
  Dims r;
  r.in_dim = d[0], r.out_dim = d[1], r.top_k = d[2], r.act = d[3];
  r.has_limit = d[4] != 0, r.has_bias = d[5] != 0, r.has_scale = d[6] != 0;
  return r;
}

}  // namespace moe_common
