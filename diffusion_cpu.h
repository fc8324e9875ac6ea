// The vector types and helpers that the CPU kernels of diffusion_ops.cpp and diffusion_winograd.cpp share, and the
// Winograd ops' CPU entry points that diffusion_ops.cpp registers. CPU only: diffusion_kernels.cu never includes it.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

namespace diffusion_kernels {

typedef float Vec16 __attribute__((vector_size(64)));  // 16 channels; one AVX-512 register (two AVX2 ones)

inline __attribute__((always_inline)) Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline __attribute__((always_inline)) void store16(float* p, Vec16 v) {
  std::memcpy(p, &v, sizeof(v));
}

typedef float Vec8 __attribute__((vector_size(32)));  // 8 channels; one AVX2 register

// A vector of floats (Vec8, Vec16) from memory and back, at any alignment.
template <typename V>
inline __attribute__((always_inline)) V loadv(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
inline __attribute__((always_inline)) void storev(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

// The same clones as the twins' loops, but with a * b + c contracted into fused multiply-adds (GCC: the optimize
// attribute; clang: the pragma in the body), which the GEMMs are made of.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__APPLE__)
#define DIFFUSION_KERNELS_FMA_CLONES \
  __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
#elif defined(__clang__) && defined(__x86_64__) && !defined(__APPLE__)
#define DIFFUSION_KERNELS_FMA_CLONES __attribute__((target_clones("avx512f", "default")))
#elif defined(__GNUC__) && !defined(__clang__)
#define DIFFUSION_KERNELS_FMA_CLONES __attribute__((optimize("fp-contract=fast")))
#else
#define DIFFUSION_KERNELS_FMA_CLONES
#endif

// bfloat16 <-> float32, a vector of lanes at a time (Vec16, or Vec8: AVX2's). bf16 is float32's upper half: widening
// is a shift; narrowing rounds to nearest even (as torch's and oneDNN's conversions do), NaN kept a quiet NaN.
template <typename V>
struct Bf16Lanes;  // V's lanes as bf16 halves (H), words (U) and signed words (I)

template <>
struct Bf16Lanes<Vec16> {
  typedef uint16_t H __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));
};

template <>
struct Bf16Lanes<Vec8> {
  typedef uint16_t H __attribute__((vector_size(16)));
  typedef uint32_t U __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
};

template <typename V>
inline __attribute__((always_inline)) V load_bf16(const uint16_t* p) {
  using L = Bf16Lanes<V>;
  typename L::H h;
  std::memcpy(&h, p, sizeof(h));
  return (V)(__builtin_convertvector(h, typename L::U) << 16);
}

template <typename V>
inline __attribute__((always_inline)) void store_bf16(uint16_t* p, V v) {
  using L = Bf16Lanes<V>;
  typename L::U u = (typename L::U)v;
  u += 0x7FFFu + ((u >> 16) & 1u);
  const typename L::I nan = v != v;  // all ones where v is NaN
  const typename L::H h = __builtin_convertvector((u >> 16) | ((typename L::U)nan & 0x7FC0u), typename L::H);
  std::memcpy(p, &h, sizeof(h));
}

inline __attribute__((always_inline)) Vec16 load16(const uint16_t* p) {
  return load_bf16<Vec16>(p);
}

inline __attribute__((always_inline)) void store16(uint16_t* p, Vec16 v) {
  store_bf16(p, v);
}

// sums[c] += v[c] for c = 0, 1, ..., n - 1, rounding each sum to float (diffusion_ops.cpp).
void add_row(const float* __restrict__ v, int64_t n, float* __restrict__ sums);

// dst[0, n) = the bf16 bits src[0, n) widened to float32 (diffusion_ops.cpp).
void widen_bf16(const uint16_t* __restrict__ src, int64_t n, float* __restrict__ dst);

// dL/db of a convolution from its channels-last float32 grad_out (B, Cout, H, W), in a fixed order
// (diffusion_winograd.cpp).
at::Tensor bias_grad_cpu(const at::Tensor& grad_out);

// The conv3x3_winograd ops' CPU kernels (diffusion_winograd.cpp; their schemas: diffusion_ops.cpp).
at::Tensor conv3x3_winograd_cpu(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool upsample);
at::Tensor conv3x3_winograd_weight_grad_cpu(const at::Tensor& x, const at::Tensor& grad_out, int64_t tile);
at::Tensor winograd_kernel_cpu(const at::Tensor& weight, int64_t tile, bool rotated);
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv3x3_winograd_backward_cpu(const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& weight, int64_t tile, std::array<bool, 3> output_mask);


// The conv3x3_thin ops' CPU kernels (diffusion_thin_conv.cpp): one side of at most kThinChannels channels, the other a
// multiple of 8.
constexpr int64_t kThinChannels = 4;
at::Tensor conv3x3_thin_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv3x3_thin_backward_cpu(const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& weight, std::array<bool, 3> output_mask);

}  // namespace diffusion_kernels
