// Shared by diffusion_ops.cpp (schemas, CPU kernels, argument checks) and
// diffusion_kernels.cu (CUDA kernels): the per-element step arithmetic, the dtype
// dispatch and the argument checks, so that the CPU and CUDA kernels cannot drift apart.
//
// The reference for everything here is noise_schedule.p_step:
//
//   eps         = eps_u + w * (eps_c - eps_u)          (guided only: noise_schedule.guided_eps)
//   pred_xstart = a * (k_xt * x_t - s * eps)           (optionally clamped to [-1, 1]; eps is the
//                                                     model's output: noise, velocity or x_0)
//   x_prev      = c_xt * x_t + c_x0 * pred_xstart [+ c_prev * prev_xstart] [+ sigma * noise]
//
// evaluated in float32 with every product and sum rounded separately, in that order, so the
// kernels reproduce the reference bit for bit (no fused multiply-add: see mul_rn below).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace diffusion_kernels {

// Columns of SamplingPlan.coefficients (noise_schedule.COEFFICIENT_NAMES).
constexpr int64_t kNumCoefficients = 7;

struct StepCoefficients {
  float a, s, c_xt, c_x0, c_prev, sigma, k_xt;  // noise_schedule.COEFFICIENT_NAMES
};

// One row of the (S, 7) float32 coefficient table.
C10_HOST_DEVICE inline StepCoefficients load_coefficients(const float* row) {
  return {row[0], row[1], row[2], row[3], row[4], row[5], row[6]};
}

// Products and sums rounded one at a time, as PyTorch's separate elementwise ops round them.
// On the device the _rn intrinsics keep nvcc from contracting a * b + c into one FMA; on the
// host the .cpp is compiled with -ffp-contract=off for the same reason.
C10_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

C10_HOST_DEVICE inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

C10_HOST_DEVICE inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// a * b + c with a single rounding (IEEE fma): the same bits on the host (std::fma: one instruction in
// the CPU twin's AVX2/AVX-512 clones, libm's exact fmaf in the baseline one) and on the device. Used only
// where a kernel's definition says so (group_norm_act), never to reproduce PyTorch's separate ops.
C10_HOST_DEVICE inline float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// Classifier-free guidance of one element: eps_uncond + w * (eps_cond - eps_uncond), rounded as
// noise_schedule.guided_eps rounds it.
C10_HOST_DEVICE inline float guide(float eps_cond, float eps_uncond, float w) {
  return add_rn(eps_uncond, mul_rn(w, sub_rn(eps_cond, eps_uncond)));
}

struct StepResult {
  float x_prev;
  float pred_xstart;
};

// The whole reverse step for one element. `noise` and `prev_xstart` are read only when their
// flags are set (the reference skips those terms entirely rather than adding zeros).
C10_HOST_DEVICE inline StepResult step_element(
    const StepCoefficients& c,
    float x_t,
    float eps,
    float noise,
    float prev_xstart,
    bool clip_denoised,
    bool has_noise,
    bool use_prev) {
  // Predict x_0 from eps; optionally clip it to the data range. Written with comparisons
  // (not fminf/fmaxf) so that a NaN propagates exactly as torch.clamp propagates it; both
  // comparisons are evaluated unconditionally so the host compiler can vectorize the select.
  // k_xt is exactly 1 (eps, v) or 0 (x_0), so an eps model's step rounds as it did without it.
  float pred = mul_rn(c.a, sub_rn(mul_rn(c.k_xt, x_t), mul_rn(c.s, eps)));  // a * (k_xt * x_t - s * eps)
  if (clip_denoised) {
    const bool below = pred < -1.0f;
    const bool above = pred > 1.0f;
    pred = below ? -1.0f : (above ? 1.0f : pred);
  }
  // Move to the next timestep: posterior mean / DDIM / DPM-Solver++ combination.
  float x_prev = add_rn(mul_rn(c.c_xt, x_t), mul_rn(c.c_x0, pred));
  if (use_prev) {
    x_prev = add_rn(x_prev, mul_rn(c.c_prev, prev_xstart));
  }
  // Add sigma * z on stochastic steps.
  if (has_noise) {
    x_prev = add_rn(x_prev, mul_rn(c.sigma, noise));
  }
  return {x_prev, pred};
}

// step_element on element i of the buffers, in place: reads x (and noise / the previous
// pred_xstart when their flags are set), writes x_prev into x and, with store_xstart,
// pred_xstart into xstart. Guided, eps holds the conditional half and eps_uncond (eps + numel)
// the unconditional one. The CPU loop passes compile-time flags, which fold away when inlined.
template <typename T, typename E>
C10_HOST_DEVICE inline void step_at(
    const StepCoefficients& c,
    int64_t i,
    T* __restrict__ x,
    const E* __restrict__ eps,
    const E* __restrict__ eps_uncond,
    float guidance,
    const T* __restrict__ noise,
    T* __restrict__ xstart,
    bool clip_denoised,
    bool guided,
    bool has_noise,
    bool use_prev,
    bool store_xstart) {
  const float e = guided ? guide(static_cast<float>(eps[i]), static_cast<float>(eps_uncond[i]), guidance)
                         : static_cast<float>(eps[i]);
  const StepResult r = step_element(
      c,
      static_cast<float>(x[i]),
      e,
      has_noise ? static_cast<float>(noise[i]) : 0.0f,
      use_prev ? static_cast<float>(xstart[i]) : 0.0f,
      clip_denoised,
      has_noise,
      use_prev);
  x[i] = static_cast<T>(r.x_prev);
  if (store_xstart) {
    xstart[i] = static_cast<T>(r.pred_xstart);
  }
}

// ----------------------------------------------------------------------------------------------
// group_norm_act: GroupNorm, the time embedding's per-sample scale and shift, and SiLU, in one pass
// ----------------------------------------------------------------------------------------------
// For sample b, channel c of the concatenation [x, x2] (x2: the skip connection, or none), position p:
//
//   v = x[b, c, p] (+ x_bias[c], the producing convolution's bias; x's channels only)
//   mean, var over the (channels of c's group) x (all positions), in float32
//   y = fma((v - mean) * (1 / sqrt(var + eps)), weight[c], bias[c])
//   y = fma(y, 1 + scale[b, c], shift[b, c])                  (when scale and shift are given)
//   y = y / (1 + exp(-y))                                    (SiLU, when silu)
//
// Every product, sum, quotient and square root is rounded separately but for the fma_rn written out
// below (the affine steps of group_norm_act_element and of exp_rn: one rounding each), exp is the
// polynomial exp_rn below, and both sums of a group run in one fixed order: element j = p * cg + cl
// (position-major, like the channels-last layout) goes to partial sum j % period, period =
// gn_period(cg) (the largest multiple of cg up to kGnPartials, so partial (p % M) * cg + cl holds
// channel cl's positions p = m, m + M, ... with M = period / cg), each partial adding its elements in
// increasing j; then the kGnPartials partials (those past period stay 0) meet in a pairwise tree
// (k += k + half, halving). The CPU twin and the CUDA kernel (one block of kGnPartials threads per
// (b, group), thread k owning partial k) do exactly this, so they agree bit for bit.
constexpr int kGnPartials = 256;

// The partial sums a group of cg channels uses: a whole number of its rows of channels (cg > kGnPartials: all).
C10_HOST_DEVICE inline int64_t gn_period(int64_t cg) {
  return cg <= kGnPartials ? (kGnPartials / cg) * cg : kGnPartials;
}

C10_HOST_DEVICE inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

C10_HOST_DEVICE inline float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// The bits of a float as an integer.
C10_HOST_DEVICE inline int32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(f);
#else
  int32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

// 2^e as a float, for a normal exponent e in [-126, 127], built from its bits.
C10_HOST_DEVICE inline float pow2_normal(int32_t e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// Inlined wherever it is called: a CPU loop calling it stays a scalar loop. GCC inlines exp_rn by its size and the
// caller's, so without this some of the norm's loops vectorized and others (by chance of the build) did not.
#if defined(__CUDACC__)
#define DIFFUSION_KERNELS_INLINE C10_HOST_DEVICE __forceinline__
#else
#define DIFFUSION_KERNELS_INLINE inline __attribute__((always_inline))
#endif

// exp(x) as 2^k * P(r), r = x - k ln 2 in [-ln2/2, ln2/2] (Cody-Waite split of ln 2), P the degree-7
// Taylor polynomial in Horner form, every step one fma_rn: within 2 ulp of exp in float32, and the same
// bits on host and device (libm's expf and CUDA's differ in the last bits, which would break the twins'
// agreement). k = round(x / ln 2) (to nearest, ties to even) comes from adding 1.5 * 2^23 in the same fma:
// the sum's low bits are k, so no float-to-int conversion is needed. x is clamped to [-104, 100], where
// k lies in [-150, 145], and P * 2^k is (P * 2^(k1)) * 2^(k - k1) with k1 = floor(k / 2): the first
// product is exact (normal), the second rounds once, which is exactly ldexpf(P, k): below -104 that is 0
// (exp(-104) is under half the smallest subnormal), above 100 it overflows to inf, as exp does. A NaN
// passes the clamp and every step as a NaN. No branch, no select after the polynomial (a select there
// made GCC compute the SiLU's division twice), so the CPU twin's loops vectorize tightly.
DIFFUSION_KERNELS_INLINE float exp_rn(float x) {
  constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23
  float xc = x < -104.0f ? -104.0f : x;  // comparisons false for a NaN: it stays
  xc = xc > 100.0f ? 100.0f : xc;
  const float shifted = fma_rn(xc, 1.44269502f, kShifter);  // 1.5 * 2^23 + k, k = round(x / ln 2)
  const float k = sub_rn(shifted, kShifter);  // exact
  const float r = fma_rn(k, -1.42860677e-06f, fma_rn(k, -0.693145752f, xc));  // ln 2 = hi + lo
  float p = 1.98412701e-04f;  // 1/7!
  p = fma_rn(p, r, 1.38888892e-03f);  // 1/6!
  p = fma_rn(p, r, 8.33333377e-03f);  // 1/5!
  p = fma_rn(p, r, 4.16666679e-02f);  // 1/4!
  p = fma_rn(p, r, 1.66666672e-01f);  // 1/3!
  p = fma_rn(p, r, 0.5f);
  p = fma_rn(p, r, 1.0f);
  p = fma_rn(p, r, 1.0f);
  const int32_t ki = float_bits(shifted) - float_bits(kShifter);  // k as an integer (same binade: exact)
  const int32_t k1 = ki >> 1;  // floor(k / 2): arithmetic shift
  return mul_rn(mul_rn(p, pow2_normal(k1)), pow2_normal(ki - k1));
}

// The normalization, scale-shift and SiLU of one element, given its group's mean and 1/std; scale1 is
// add_rn(1, scale) (a kernel may compute it once per (sample, channel): the same value).
DIFFUSION_KERNELS_INLINE float group_norm_act_element(
    float v, float mean, float rstd, float weight, float bias, float scale1, float shift, bool modulate, bool silu) {
  float y = fma_rn(mul_rn(sub_rn(v, mean), rstd), weight, bias);
  if (modulate) {
    y = fma_rn(y, scale1, shift);
  }
  if (silu) {
    y = div_rn(y, add_rn(1.0f, exp_rn(-y)));
  }
  return y;
}

// Where sample b's channel c, position p lives: x's channels first, then x2's (the concatenation
// is never materialized). Strides in elements; positions flatten to one stride (checked).
struct GroupNormSources {
  const void* x;
  const void* x2;  // nullptr: one source
  const float* x_bias;  // (C1,) added to x's values, or nullptr
  int64_t c1;  // x's channels (x2 has C - c1)
  int64_t stride_b1, stride_c1, stride_p1;
  int64_t stride_b2, stride_c2, stride_p2;
};

template <typename T>
C10_HOST_DEVICE inline float load_source(const GroupNormSources& s, int64_t b, int64_t c, int64_t p) {
  if (c < s.c1) {
    const float v = static_cast<float>(static_cast<const T*>(s.x)[b * s.stride_b1 + c * s.stride_c1 + p * s.stride_p1]);
    return s.x_bias != nullptr ? add_rn(v, s.x_bias[c]) : v;
  }
  const int64_t c2 = c - s.c1;
  return static_cast<float>(static_cast<const T*>(s.x2)[b * s.stride_b2 + c2 * s.stride_c2 + p * s.stride_p2]);
}

// Everything a group_norm_act kernel reads and writes, checked and built once on the host by
// prepare_group_norm_act, then handed whole to the CPU loop or the CUDA kernel.
struct GroupNormAct {
  GroupNormSources src;
  void* out;  // (B, C, *spatial) in x's dtype
  int64_t out_stride_b, out_stride_c, out_stride_p;
  const float* weight;  // (C,)
  const float* bias;  // (C,)
  const float* scale;  // (B, C), or nullptr (then shift is too); rows modulation_stride apart (0: one row for all)
  const float* shift;
  int64_t modulation_stride;
  int64_t batch, channels, groups, cg, positions;  // cg: channels per group
  float eps;
  bool silu;
};

// Checks the arguments (shared by the CPU and CUDA kernels; reads no device memory), allocates the
// output in x's dtype and memory format into *out (none when out is null: the backward's outputs are x's and
// x2's shapes), and returns the kernels' view of it all.
GroupNormAct prepare_group_norm_act(
    const at::Tensor& x,
    const std::optional<at::Tensor>& x2,
    const at::Tensor& weight,
    const at::Tensor& bias,
    const std::optional<at::Tensor>& x_bias,
    const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift,
    int64_t groups,
    double eps,
    bool silu,
    at::Tensor* out);

// 1 / std of a group from its summed squared deviations.
C10_HOST_DEVICE inline float group_rstd(float sum_squares, float count, float eps) {
  return div_rn(1.0f, sqrt_rn(add_rn(div_rn(sum_squares, count), eps)));
}

// The output element of sample b, channel c, position p from its input value v and its group's statistics.
template <typename T>
C10_HOST_DEVICE inline void store_group_norm_act(
    const GroupNormAct& a, int64_t b, int64_t c, int64_t p, float v, float mean, float rstd) {
  const bool modulate = a.scale != nullptr;
  const float y = group_norm_act_element(
      v, mean, rstd, a.weight[c], a.bias[c], modulate ? add_rn(1.0f, a.scale[b * a.modulation_stride + c]) : 0.0f,
      modulate ? a.shift[b * a.modulation_stride + c] : 0.0f, modulate, a.silu);
  static_cast<T*>(a.out)[b * a.out_stride_b + c * a.out_stride_c + p * a.out_stride_p] = static_cast<T>(y);
}

// ----------------------------------------------------------------------------------------------
// bias_add_: a convolution's bias and the residual stream added to its output, in place, in one pass
// ----------------------------------------------------------------------------------------------
// For a channels-last output h (B, C, *spatial) in T, element q * C + c (q = b * positions + p):
//
//   h[q, c] = (h[q, c] + bias[c]) (+ residual[q, c] for c < c1, + residual2[q, c - c1] for c >= c1)
//
// in float32, each sum rounded separately (add_rn), one rounding to T at the end: in fp32 exactly what
// PyTorch's convolution bias add followed by the residual add computes; in bf16/fp16 one rounding
// where PyTorch rounds twice. residual (c1 channels) and residual2 (C - c1) are channels-last too: the
// U-Net's identity skip on [x, x2], never concatenated.
struct BiasAdd {
  void* h;
  const float* bias;  // (C,)
  const void* residual;  // (B, c1, *spatial) or nullptr
  const void* residual2;  // (B, C - c1, *spatial) or nullptr
  int64_t rows, channels, c1;  // rows = B * positions
};

C10_HOST_DEVICE inline float bias_add_element(float h, float bias, float residual, bool has_residual) {
  const float y = add_rn(h, bias);
  return has_residual ? add_rn(y, residual) : y;
}

// Checks the arguments (shared by the CPU and CUDA kernels; reads no device memory).
BiasAdd prepare_bias_add(
    const at::Tensor& h,
    const at::Tensor& bias,
    const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& residual2);

// seeded_dropout's mask: element i of a tensor is kept when bit-half (i & 1) of SplitMix64's output number
// i / 2 for `seed` (Steele, Lea & Flood 2014, the generator of java.util.SplittableRandom; passes BigCrush) is at
// least p * 2^32. A pure function of (seed, i): no generator state per element, the same mask whatever the
// threads or blocks, and a backward pass that recomputes the mask instead of storing it.
C10_HOST_DEVICE inline uint64_t splitmix64(uint64_t seed, uint64_t n) {
  uint64_t z = seed + (n + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Calls f(tag) with a value of the C++ type matching `dtype` (float, c10::Half or
// c10::BFloat16); anything else is a TORCH_CHECK error naming `what`.
template <typename F>
void dispatch_step_dtype(at::ScalarType dtype, const char* what, F&& f) {
  switch (dtype) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, "diffusion_kernels: ", what, " must be float32, float16 or bfloat16, got ", dtype);
  }
}

// Argument checks shared by the CPU and CUDA kernels of fused_step_. None of them reads device
// memory (no host-device sync); the step index is range-checked by each kernel itself.
void check_fused_step_args(
    const at::Tensor& x,
    const at::Tensor& eps,
    const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& xstart,
    const at::Tensor& coefficients,
    const at::Tensor& step,
    bool use_prev,
    bool guided);

// Argument checks shared by the CPU and CUDA kernels of gather_timestep_ (no sync either).
void check_gather_timestep_args(const at::Tensor& t, const at::Tensor& timesteps, const at::Tensor& step);

}  // namespace diffusion_kernels
