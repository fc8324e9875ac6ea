// The diffusion_kernels custom ops: schemas, argument checks and CPU kernels.
// (Named diffusion_ops.cpp, not diffusion_kernels.cpp: torch's ninja build names object files
// after the source's stem, so a .cpp and a .cu of the same stem would collide.)
//
// Built by setup.py (`pip install -e . --no-build-isolation` or
// `python setup.py build_ext --inplace`) into the Python module _diffusion_kernels, or
// JIT-compiled by ddpm/kernels/ops.py's load_extension(). Importing the module registers the ops
// under torch.ops.diffusion_kernels; diffusion_kernels.cu adds the CUDA kernels of the same ops.
//
// Ops (the step ops mutate their first arguments in place and return nothing, so one CUDA graph can
// replay them with every buffer fixed; the U-Net runner's ops return new tensors):
//
//   fused_step_(x, eps, noise, xstart, coefficients, step, *, clip_denoised, use_prev, guidance=None)
//       One reverse-diffusion step of any sampler (noise_schedule.p_step), in one pass over
//       memory: reads row `step` of the (S, 7) float32 coefficient table, writes x_prev into
//       `x` and pred_xstart into `xstart` (when given). With use_prev the old `xstart` (the
//       previous step's pred_xstart, DPM-Solver++'s history) is read before it is overwritten.
//       `step` is a one-element int64 tensor on the same device: the device-side step counter.
//       With `guidance` w, eps is (2B, ...): the U-Net's conditional rows, then its unconditional
//       ones, and the step uses eps_u + w * (eps_c - eps_u) (classifier-free guidance) per element.
//
//   gather_timestep_(t, timesteps, step)
//       t[:] = timesteps[step]: the U-Net's (B,) timestep input, gathered on the device.
//
//   group_norm_act(x, x2, weight, bias, x_bias, scale, shift, *, groups, eps, silu) -> Tensor
//       GroupNorm of the channels of [x, x2] (x2: a skip connection to concatenate, or None; a group
//       may straddle the two), with x_bias (the producing convolution's bias) added to x first, the
//       per-sample scale and shift of the time embedding (y * (1 + scale) + shift) and SiLU, in one
//       pass; a new tensor in x's dtype and memory format. The arithmetic and the fixed reduction
//       order are in diffusion_kernels.h (group_norm_act_element); the CUDA kernel matches this CPU
//       twin bit for bit.
//
//   bias_add_(h, bias, residual, residual2)
//       h += bias (per channel) [+ the residual stream: residual's channels, then residual2's], in place,
//       for a channels-last h: a convolution's bias and a U-Net block's identity skip in one pass over
//       memory (on a GPU cuDNN leaves the bias to a separate broadcast add). Arithmetic in diffusion_kernels.h
//       (bias_add_element); the CUDA kernel matches this CPU twin bit for bit.
//
//   seeded_dropout(x, seed, p) -> Tensor
//       Dropout: x * keep / (1 - p) in x's dtype, as a new contiguous tensor, where keep for element i (in
//       row-major order) is a pure function of (seed, i) (splitmix64 in diffusion_kernels.h). The same call on
//       the gradient is the backward pass (ddpm/kernels/ops.py registers it). CPU only: on a CPU torch's
//       dropout draws one Bernoulli variable at a time, on a GPU it is fused already.
//
//   conv3x3_winograd(x, weight, bias, *, upsample=False) -> Tensor
//       A 3x3 convolution (stride 1, padding 1) of a channels-last float32 x, CPU only, in Winograd's
//       F(2x2, 3x3): 2.25x fewer multiply-adds than oneDNN's direct convolution. weight is the kernel's
//       (16, Cin, Cout) transform (ddpm.kernels.ops.winograd_weight; F(4x4, 3x3)'s: below); channel counts
//       multiples of 16.
//       upsample: the convolution of x upsampled 2x (nearest), without the upsampled tensor: each output
//       phase's 2x2 kernel in F(2x2, 2x2), weight (36, Cin, Cout), output (B, Cout, 2H, 2W).
//       A bfloat16 x takes the transform in bfloat16 pairs, (16 or 36, Cin / 2, Cout, 2), and returns bfloat16:
//       the GEMMs on AVX512-BF16's dot product where the CPU has it (plain C++ elsewhere), float32 sums.
//
//       A float32 (36, Cin, Cout) weight without upsample is the kernel in F(4x4, 3x3) (winograd_weight(..., tile=4)):
//       4x fewer multiply-adds than direct convolution, with more rounding than F(2x2, 3x3).
//
//   conv3x3_winograd_weight_grad(x, grad_out, tile=2) -> Tensor
//       The training pass's gradient of conv3x3_winograd's transformed weight: (16, Cin, Cout) float32 (tile=4:
//       (36, Cin, Cout), F(4x4, 3x3)'s), dL/dU for the loss gradient grad_out (B, Cout, H, W) of the output of x
//       (B, Cin, H, W), both channels-last float32.
//
//   winograd_kernel(weight, tile, rotated=False) -> Tensor
//       A float32 (Cout, Cin, 3, 3) kernel's transform U = G g G^T, conv3x3_winograd's (n * n, Cin, Cout) operand
//       (n = tile + 2); rotated: the kernel turned 180 degrees with its channels swapped, (n * n, Cout, Cin).
//
//   conv3x3_winograd_backward(grad_out, x, weight, tile, output_mask) -> (Tensor, Tensor, Tensor)
//       The backward of conv2d(x, weight, bias, padding=1) computed in Winograd's domain, for training: dL/dx,
//       dL/dweight in weight's layout and dL/dbias, each where output_mask says (empty otherwise).
#include <Python.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "diffusion_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace diffusion_kernels {
namespace {

bool is_step_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

// Same sizes and the same memory layout: the strides agree in every dimension of size > 1
// (a size-1 dimension's stride never addresses anything). Elementwise work in memory order is
// then correct for any shared layout, contiguous and channels-last alike.
void check_same_layout(const at::Tensor& x, const at::Tensor& other, const char* name) {
  TORCH_CHECK(other.device() == x.device(), "fused_step_: ", name, " is on ", other.device(), " but x is on ", x.device());
  TORCH_CHECK(other.sizes() == x.sizes(), "fused_step_: ", name, " has shape ", other.sizes(), " but x has shape ", x.sizes());
  for (int64_t d = 0; d < x.dim(); ++d) {
    TORCH_CHECK(
        x.size(d) <= 1 || other.stride(d) == x.stride(d),
        "fused_step_: ", name, " must have the same memory layout as x (strides ", other.strides(), " vs ",
        x.strides(), "); make both contiguous");
  }
}

void check_step_counter(const at::Tensor& step, const at::Device& device, const char* op) {
  TORCH_CHECK(step.device() == device, op, ": step is on ", step.device(), " but the data is on ", device);
  TORCH_CHECK(step.scalar_type() == at::kLong, op, ": step must be int64, got ", step.scalar_type());
  TORCH_CHECK(step.numel() == 1, op, ": step must hold one element, got shape ", step.sizes());
}

}  // namespace

void check_fused_step_args(
    const at::Tensor& x,
    const at::Tensor& eps,
    const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& xstart,
    const at::Tensor& coefficients,
    const at::Tensor& step,
    bool use_prev,
    bool guided) {
  TORCH_CHECK(is_step_dtype(x.scalar_type()), "fused_step_: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(is_step_dtype(eps.scalar_type()), "fused_step_: eps must be float32, float16 or bfloat16, got ", eps.scalar_type());
  TORCH_CHECK(
      x.is_non_overlapping_and_dense(),
      "fused_step_: x must be dense and non-overlapping (contiguous or channels-last), got strides ", x.strides());
  if (guided) {
    // (2B, ...): each half laid out as x, the unconditional half right after the conditional one.
    TORCH_CHECK(x.dim() >= 1 && eps.dim() == x.dim() && eps.size(0) == 2 * x.size(0),
        "fused_step_: guided, eps must hold 2B rows (conditional, then unconditional) for x's B, got ", eps.sizes(), " for ", x.sizes());
    check_same_layout(x, eps.narrow(0, 0, x.size(0)), "eps (conditional half)");
    check_same_layout(x, eps.narrow(0, x.size(0), x.size(0)), "eps (unconditional half)");
    TORCH_CHECK(x.numel() == 0 || eps.narrow(0, x.size(0), x.size(0)).const_data_ptr() ==
        static_cast<const char*>(eps.const_data_ptr()) + x.numel() * eps.element_size(),
        "fused_step_: guided, eps's unconditional half must follow its conditional half in memory; make eps contiguous");
  } else {
    check_same_layout(x, eps, "eps");
  }
  // The outputs (x and xstart) may not share memory with any other argument.
  at::assert_no_overlap(x, eps);
  if (noise.has_value()) {
    check_same_layout(x, *noise, "noise");
    TORCH_CHECK(noise->scalar_type() == x.scalar_type(), "fused_step_: noise must have x's dtype ", x.scalar_type(), ", got ", noise->scalar_type());
    at::assert_no_overlap(x, *noise);
  }
  TORCH_CHECK(!use_prev || xstart.has_value(), "fused_step_: use_prev=True needs the xstart buffer (the previous pred_xstart)");
  if (xstart.has_value()) {
    check_same_layout(x, *xstart, "xstart");
    TORCH_CHECK(xstart->scalar_type() == x.scalar_type(), "fused_step_: xstart must have x's dtype ", x.scalar_type(), ", got ", xstart->scalar_type());
    at::assert_no_overlap(x, *xstart);
    at::assert_no_overlap(*xstart, eps);
    if (noise.has_value()) {
      at::assert_no_overlap(*xstart, *noise);
    }
  }
  TORCH_CHECK(coefficients.device() == x.device(), "fused_step_: coefficients are on ", coefficients.device(), " but x is on ", x.device());
  TORCH_CHECK(coefficients.scalar_type() == at::kFloat, "fused_step_: coefficients must be float32, got ", coefficients.scalar_type());
  TORCH_CHECK(
      coefficients.dim() == 2 && coefficients.size(0) >= 1 && coefficients.size(1) == kNumCoefficients,
      "fused_step_: coefficients must have shape (S, ", kNumCoefficients, ") with S >= 1, got ", coefficients.sizes());
  TORCH_CHECK(coefficients.is_contiguous(), "fused_step_: coefficients must be contiguous");
  check_step_counter(step, x.device(), "fused_step_");
}

void check_gather_timestep_args(const at::Tensor& t, const at::Tensor& timesteps, const at::Tensor& step) {
  TORCH_CHECK(t.scalar_type() == at::kLong, "gather_timestep_: t must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "gather_timestep_: t must be a contiguous (B,) tensor, got shape ", t.sizes());
  TORCH_CHECK(timesteps.device() == t.device(), "gather_timestep_: timesteps are on ", timesteps.device(), " but t is on ", t.device());
  TORCH_CHECK(timesteps.scalar_type() == at::kLong, "gather_timestep_: timesteps must be int64, got ", timesteps.scalar_type());
  TORCH_CHECK(
      timesteps.dim() == 1 && timesteps.size(0) >= 1 && timesteps.is_contiguous(),
      "gather_timestep_: timesteps must be a contiguous (S,) tensor with S >= 1, got shape ", timesteps.sizes());
  at::assert_no_overlap(t, timesteps);
  check_step_counter(step, t.device(), "gather_timestep_");
}

namespace {

// The positions of a (B, C, *spatial) tensor as one stride: contiguous (stride 1) or channels-last
// (stride C) layouts, and any other whose spatial dimensions are dense among themselves.
int64_t position_stride(const at::Tensor& t, const char* name) {
  int64_t stride = t.dim() > 2 ? t.stride(t.dim() - 1) : 1;
  int64_t expected = stride;
  for (int64_t d = t.dim() - 1; d >= 2; --d) {
    TORCH_CHECK(t.size(d) <= 1 || t.stride(d) == expected,
        "group_norm_act: ", name, "'s spatial dimensions must be dense (contiguous or channels-last), got strides ", t.strides());
    expected *= t.size(d);
  }
  return stride;
}

}  // namespace

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
    at::Tensor* out) {
  TORCH_CHECK(is_step_dtype(x.scalar_type()), "group_norm_act: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 3, "group_norm_act: x must be (B, C, *spatial) with at least one spatial dimension, got ", x.sizes());
  const int64_t c1 = x.size(1);
  int64_t channels = c1;
  GroupNormSources s{x.const_data_ptr(), nullptr, nullptr, c1, x.stride(0), x.stride(1), position_stride(x, "x"), 0, 0, 0};
  if (x2.has_value()) {
    TORCH_CHECK(x2->device() == x.device(), "group_norm_act: x2 is on ", x2->device(), " but x is on ", x.device());
    TORCH_CHECK(x2->scalar_type() == x.scalar_type(), "group_norm_act: x2 must have x's dtype ", x.scalar_type(), ", got ", x2->scalar_type());
    TORCH_CHECK(x2->dim() == x.dim() && x2->size(0) == x.size(0) && x2->sizes().slice(2) == x.sizes().slice(2),
        "group_norm_act: x2 must have x's batch and spatial sizes, got ", x2->sizes(), " for ", x.sizes());
    channels += x2->size(1);
    s.x2 = x2->const_data_ptr();
    s.stride_b2 = x2->stride(0);
    s.stride_c2 = x2->stride(1);
    s.stride_p2 = position_stride(*x2, "x2");
  }
  TORCH_CHECK(groups >= 1 && channels % groups == 0, "group_norm_act: ", channels, " channels do not split into ", groups, " groups");
  auto check_param = [&](const at::Tensor& p, const char* name, at::IntArrayRef shape) {
    TORCH_CHECK(p.device() == x.device(), "group_norm_act: ", name, " is on ", p.device(), " but x is on ", x.device());
    TORCH_CHECK(p.scalar_type() == at::kFloat, "group_norm_act: ", name, " must be float32, got ", p.scalar_type());
    TORCH_CHECK(p.sizes() == shape && p.is_contiguous(), "group_norm_act: ", name, " must be a contiguous ", shape, " tensor, got ", p.sizes());
  };
  check_param(weight, "weight", {channels});
  check_param(bias, "bias", {channels});
  if (x_bias.has_value()) {
    check_param(*x_bias, "x_bias", {c1});
    s.x_bias = x_bias->const_data_ptr<float>();
  }
  TORCH_CHECK(scale.has_value() == shift.has_value(), "group_norm_act: scale and shift go together");
  int64_t modulation_stride = 0;
  if (scale.has_value()) {  // rows of one wider table (or one row expanded) are fine: channels must be dense
    for (const auto* m : {&*scale, &*shift}) {
      const char* name = m == &*scale ? "scale" : "shift";
      TORCH_CHECK(m->device() == x.device(), "group_norm_act: ", name, " is on ", m->device(), " but x is on ", x.device());
      TORCH_CHECK(m->scalar_type() == at::kFloat, "group_norm_act: ", name, " must be float32, got ", m->scalar_type());
      TORCH_CHECK(m->dim() == 2 && m->size(0) == x.size(0) && m->size(1) == channels && m->stride(1) == 1 && m->stride(0) >= 0,
          "group_norm_act: ", name, " must be a (", x.size(0), ", ", channels, ") tensor with dense rows, got ", m->sizes(),
          " with strides ", m->strides());
    }
    TORCH_CHECK(scale->stride(0) == shift->stride(0), "group_norm_act: scale and shift must have the same row stride, got ",
        scale->stride(0), " and ", shift->stride(0));
    modulation_stride = scale->stride(0);
  }
  int64_t positions = 1;
  for (int64_t d = 2; d < x.dim(); ++d) {
    positions *= x.size(d);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[1] = channels;
  *out = at::empty(shape, x.options().memory_format(x.suggest_memory_format()));
  return GroupNormAct{
      s, out->mutable_data_ptr(), out->stride(0), out->stride(1), position_stride(*out, "the output"),
      weight.const_data_ptr<float>(), bias.const_data_ptr<float>(),
      scale.has_value() ? scale->const_data_ptr<float>() : nullptr, shift.has_value() ? shift->const_data_ptr<float>() : nullptr,
      modulation_stride,
      x.size(0), channels, groups, channels / groups, positions, static_cast<float>(eps), silu};
}

namespace {

// Elements per parallel_for task: small tensors stay on one thread.
constexpr int64_t kCpuGrain = 1 << 15;

// The step counter of a CPU op lives in host memory: reading it is free (no sync), so the CPU
// kernels range-check it with a proper error instead of a device-side assert.
int64_t read_cpu_step(const at::Tensor& step, int64_t num_steps, const char* op) {
  const int64_t s = *step.const_data_ptr<int64_t>();
  TORCH_CHECK(s >= 0 && s < num_steps, op, ": step ", s, " is out of range for a plan of ", num_steps, " steps");
  return s;
}

// Calls f(std::true_type{}) or f(std::false_type{}): turns a runtime flag into a compile-time one.
template <typename F>
void dispatch_flag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// The loop for one combination of flags. Compile-time flags (no per-element branches) and
// __restrict__ pointers (the outputs overlap no input: checked) let the compiler vectorize it.
template <typename T, typename E, bool kClip, bool kGuided, bool kNoise, bool kPrev, bool kStore>
void fused_step_cpu_range(
    T* __restrict__ x,
    const E* __restrict__ eps,
    const E* __restrict__ eps_uncond,
    float guidance,
    const T* __restrict__ noise,
    T* __restrict__ xstart,
    const StepCoefficients c,
    int64_t begin,
    int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    step_at(c, i, x, eps, eps_uncond, guidance, noise, xstart, kClip, kGuided, kNoise, kPrev, kStore);
  }
}

template <typename T, typename E>
void fused_step_cpu_kernel(
    T* x,
    const E* eps,
    const E* eps_uncond,  // nullptr: unguided
    float guidance,
    const T* noise,
    T* xstart,
    StepCoefficients c,
    int64_t numel,
    bool clip_denoised,
    bool use_prev) {
  if constexpr (!std::is_same_v<T, float>) {
    // x in half precision is rare (the samplers keep x_t in float32): one loop with the flags read at run time,
    // the same arithmetic. A loop per flag combination and dtype pair would triple the extension's build time.
    at::parallel_for(0, numel, kCpuGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        step_at(c, i, x, eps, eps_uncond, guidance, noise, xstart, clip_denoised, eps_uncond != nullptr,
                noise != nullptr, use_prev && xstart != nullptr, xstart != nullptr);
      }
    });
  } else {
    // use_prev implies a stored xstart (checked), so (kPrev, kStore) = (true, false) never runs.
    dispatch_flag(clip_denoised, [&](auto clip) {
      dispatch_flag(eps_uncond != nullptr, [&](auto guided) {
        dispatch_flag(noise != nullptr, [&](auto has_noise) {
          dispatch_flag(xstart != nullptr, [&](auto store) {
            dispatch_flag(use_prev && store, [&](auto prev) {
              at::parallel_for(0, numel, kCpuGrain, [&](int64_t begin, int64_t end) {
                fused_step_cpu_range<T, E, decltype(clip)::value, decltype(guided)::value, decltype(has_noise)::value,
                                     decltype(prev)::value, decltype(store)::value>(
                    x, eps, eps_uncond, guidance, noise, xstart, c, begin, end);
              });
            });
          });
        });
      });
    });
  }
}

void fused_step_cpu(
    const at::Tensor& x,
    const at::Tensor& eps,
    const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& xstart,
    const at::Tensor& coefficients,
    const at::Tensor& step,
    bool clip_denoised,
    bool use_prev,
    std::optional<double> guidance) {
  check_fused_step_args(x, eps, noise, xstart, coefficients, step, use_prev, guidance.has_value());
  const int64_t s = read_cpu_step(step, coefficients.size(0), "fused_step_");
  const StepCoefficients c = load_coefficients(coefficients.const_data_ptr<float>() + s * kNumCoefficients);
  // All tensors share x's dense layout (checked), so flat indexing from each data pointer
  // visits the same logical element in every tensor.
  dispatch_step_dtype(x.scalar_type(), "x", [&](auto x_tag) {
    using T = decltype(x_tag);
    dispatch_step_dtype(eps.scalar_type(), "eps", [&](auto eps_tag) {
      using E = decltype(eps_tag);
      const E* eps_ptr = eps.const_data_ptr<E>();
      fused_step_cpu_kernel<T, E>(
          x.mutable_data_ptr<T>(),
          eps_ptr,
          guidance.has_value() ? eps_ptr + x.numel() : nullptr,
          static_cast<float>(guidance.value_or(1.0)),
          noise.has_value() ? noise->const_data_ptr<T>() : nullptr,
          xstart.has_value() ? xstart->mutable_data_ptr<T>() : nullptr,
          c,
          x.numel(),
          clip_denoised,
          use_prev);
    });
  });
}

void gather_timestep_cpu(const at::Tensor& t, const at::Tensor& timesteps, const at::Tensor& step) {
  check_gather_timestep_args(t, timesteps, step);
  const int64_t s = read_cpu_step(step, timesteps.size(0), "gather_timestep_");
  const int64_t value = timesteps.const_data_ptr<int64_t>()[s];
  int64_t* out = t.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    out[i] = value;
  }
}

// ----- group_norm_act's CPU twin ----------------------------------------------------------------------
// Same arithmetic and reduction order as the CUDA kernel (diffusion_kernels.h), laid out for the CPU: each
// (sample, group) is first gathered into a float buffer in the order j = p * cg + cl, so both sums run over
// contiguous memory (partial k takes the elements j = k, k + period, ... in increasing j,
// as the CUDA kernel's thread k does); then the output is written a row at a time along its innermost
// dimension (channels for channels-last, positions otherwise); channels-last tensors skip the gather (see
// group_norm_act_channels_last). The loops over contiguous rows are compiled for AVX-512 and for x86-64-v3
// (AVX2 with FMA) as well as the baseline (target_clones: chosen at load time by CPU features), without FMA
// contraction (-ffp-contract=off): the only fused multiply-adds are the fma_rn the definition writes out
// (one instruction in both clones; the baseline clone calls libm's exact fmaf), so every clone rounds
// exactly like the scalar definition. GCC's jump threading would duplicate selects into branches, which
// stops the vectorizer: off here.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__APPLE__)
#define DIFFUSION_KERNELS_CLONES \
  __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"), optimize("no-thread-jumps")))
#elif defined(__clang__) && defined(__x86_64__) && !defined(__APPLE__)
#define DIFFUSION_KERNELS_CLONES __attribute__((target_clones("avx512f", "default")))
#else
#define DIFFUSION_KERNELS_CLONES
#endif

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

// bfloat16 <-> float32, 16 channels at a time. bf16 is float32's upper half: widening is a shift; narrowing rounds
// to nearest even (as torch's and oneDNN's conversions do), NaN kept a quiet NaN.
typedef uint16_t Bf16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));

inline __attribute__((always_inline)) Vec16 load16(const uint16_t* p) {
  Bf16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return (Vec16)(__builtin_convertvector(h, U32x16) << 16);
}

inline __attribute__((always_inline)) void store16(uint16_t* p, Vec16 v) {
  U32x16 u = (U32x16)v;
  u += 0x7FFFu + ((u >> 16) & 1u);
  const I32x16 nan = v != v;  // all ones where v is NaN
  const Bf16x16 h = __builtin_convertvector((u >> 16) | ((U32x16)nan & 0x7FC0u), Bf16x16);
  std::memcpy(p, &h, sizeof(h));
}

// Rows of bf16 widened to float32 and back, 16 elements at a time (vectorized; torch's scalar conversions are not):
// the group norm's bf16 input and output.
DIFFUSION_KERNELS_CLONES
void widen_bf16(const uint16_t* __restrict__ src, int64_t n, float* __restrict__ dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store16(dst + i, load16(src + i));
  }
  for (; i < n; ++i) {
    dst[i] = static_cast<float>(c10::bit_cast<c10::BFloat16>(src[i]));
  }
}

DIFFUSION_KERNELS_CLONES
void narrow_bf16(const float* __restrict__ src, int64_t n, uint16_t* __restrict__ dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store16(dst + i, load16(src + i));
  }
  for (; i < n; ++i) {
    dst[i] = c10::BFloat16(src[i]).x;
  }
}

// partial[j % period] += v[j] for j = 0, 1, ..., n - 1 (square: (v[j] - mean)^2 instead).
DIFFUSION_KERNELS_CLONES
void add_to_partials(const float* __restrict__ v, int64_t n, int64_t period, float mean, bool square, float* __restrict__ partial) {
  for (int64_t j0 = 0; j0 < n; j0 += period) {
    const int64_t m = std::min<int64_t>(period, n - j0);
    const float* __restrict__ row = v + j0;
    if (square) {
      for (int64_t k = 0; k < m; ++k) {
        const float d = sub_rn(row[k], mean);
        partial[k] = add_rn(partial[k], mul_rn(d, d));
      }
    } else {
      for (int64_t k = 0; k < m; ++k) {
        partial[k] = add_rn(partial[k], row[k]);
      }
    }
  }
}

// sums[c] += v[c] for c = 0, 1, ..., n - 1 (one level of the channels-last loop's row tree).
DIFFUSION_KERNELS_CLONES
void add_row(const float* __restrict__ v, int64_t n, float* __restrict__ sums) {
  for (int64_t c = 0; c < n; ++c) {
    sums[c] = add_rn(sums[c], v[c]);
  }
}

// The pairwise tree of diffusion_kernels.h over the kGnPartials partial sums, of which only the first
// `used` are read: the rest are 0, and adding 0 changes no partial (none is -0: each starts at +0).
float reduce_partials(float* partial, int64_t used = kGnPartials) {
  for (int64_t half = kGnPartials / 2; half >= 1; half /= 2) {
    for (int64_t k = 0; k < half && k + half < used; ++k) {
      partial[k] = add_rn(partial[k], partial[k + half]);
    }
    used = std::min(used, half);
  }
  return partial[0];
}

// One output row: element i's statistics and parameters at index i of each array (kPerChannel: per-channel
// arrays along a channels-last row) or index 0 (one channel's scalars along a row of positions); kBias: x_bias
// added to each value first; scale1 = 1 + scale, computed once per (sample, channel). Flags are compile-time,
// so the loop has no per-element branches and vectorizes.
template <bool kPerChannel, bool kBias, bool kModulate, bool kSilu>
inline __attribute__((always_inline)) void normalize_loop(const float* __restrict__ v, int64_t n,
    const float* __restrict__ x_bias, const float* __restrict__ mean, const float* __restrict__ rstd,
    const float* __restrict__ weight, const float* __restrict__ bias, const float* __restrict__ scale1,
    const float* __restrict__ shift, float* __restrict__ y) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = kPerChannel ? i : 0;
    const float value = kBias ? add_rn(v[i], x_bias[c]) : v[i];
    y[i] = group_norm_act_element(value, mean[c], rstd[c], weight[c], bias[c], kModulate ? scale1[c] : 0.0f,
        kModulate ? shift[c] : 0.0f, kModulate, kSilu);
  }
}

// The gathering loop's output row (its values already biased by load_channels).
DIFFUSION_KERNELS_CLONES
void normalize_row(const float* __restrict__ v, int64_t n, bool per_channel, const float* __restrict__ mean,
    const float* __restrict__ rstd, const float* __restrict__ weight, const float* __restrict__ bias,
    const float* __restrict__ scale1, const float* __restrict__ shift, bool silu, float* __restrict__ y) {
  const int variant = (per_channel ? 4 : 0) + (scale1 != nullptr ? 2 : 0) + (silu ? 1 : 0);
  switch (variant) {
#define DIFFUSION_KERNELS_ROW(k)                                                                                 \
  case k:                                                                                                        \
    normalize_loop<(k & 4) != 0, false, (k & 2) != 0, (k & 1) != 0>(v, n, nullptr, mean, rstd, weight, bias, scale1, \
        shift, y);                                                                                               \
    break;
    DIFFUSION_KERNELS_ROW(0) DIFFUSION_KERNELS_ROW(1) DIFFUSION_KERNELS_ROW(2) DIFFUSION_KERNELS_ROW(3)
    DIFFUSION_KERNELS_ROW(4) DIFFUSION_KERNELS_ROW(5) DIFFUSION_KERNELS_ROW(6) DIFFUSION_KERNELS_ROW(7)
#undef DIFFUSION_KERNELS_ROW
  }
}

// Input values (x + x_bias, or x2) of sample b for channels [c, c + n) at position p into dst[0, n).
template <typename T>
void load_channels(const GroupNormSources& s, int64_t b, int64_t c, int64_t n, int64_t p, float* dst) {
  const int64_t in_x = std::clamp<int64_t>(s.c1 - c, 0, n);
  const T* x = static_cast<const T*>(s.x) + b * s.stride_b1 + p * s.stride_p1;
  for (int64_t i = 0; i < in_x; ++i) {
    const float v = static_cast<float>(x[(c + i) * s.stride_c1]);
    dst[i] = s.x_bias != nullptr ? add_rn(v, s.x_bias[c + i]) : v;
  }
  if (in_x < n) {
    const T* x2 = static_cast<const T*>(s.x2) + b * s.stride_b2 + p * s.stride_p2 - s.c1 * s.stride_c2;
    for (int64_t i = in_x; i < n; ++i) {
      dst[i] = static_cast<float>(x2[(c + i) * s.stride_c2]);
    }
  }
}

// The channels-last loop's passes over one sample's rows of n channels (x's share of the row, or x2's):
// v = src[p * stride + c] (+ x_bias[c]) for positions p < P. Flags are compile-time (no per-element branches).
//
// Statistics: table[(p % M) * ld + c] += v (kSquare: (v - mean[c])^2), each partial adding its positions in
// increasing p, as the fixed order says.
template <bool kBias, bool kSquare>
inline __attribute__((always_inline)) void add_rows_loop(const float* __restrict__ src, int64_t stride, int64_t P, int64_t n,
    const float* __restrict__ x_bias, const float* __restrict__ mean, int64_t M, int64_t ld, float* __restrict__ table) {
  for (int64_t p = 0, m = 0; p < P; ++p, m = (m + 1 == M ? 0 : m + 1)) {
    const float* __restrict__ row = src + p * stride;
    float* __restrict__ sums = table + m * ld;
    for (int64_t c = 0; c < n; ++c) {
      const float v = kBias ? add_rn(row[c], x_bias[c]) : row[c];
      if (kSquare) {
        const float d = sub_rn(v, mean[c]);
        sums[c] = add_rn(sums[c], mul_rn(d, d));
      } else {
        sums[c] = add_rn(sums[c], v);
      }
    }
  }
}

DIFFUSION_KERNELS_CLONES
void add_rows(const float* __restrict__ src, int64_t stride, int64_t P, int64_t n, const float* __restrict__ x_bias,
    const float* __restrict__ mean, bool square, int64_t M, int64_t ld, float* __restrict__ table) {
  if (x_bias != nullptr) {
    square ? add_rows_loop<true, true>(src, stride, P, n, x_bias, mean, M, ld, table)
           : add_rows_loop<true, false>(src, stride, P, n, x_bias, mean, M, ld, table);
  } else {
    square ? add_rows_loop<false, true>(src, stride, P, n, x_bias, mean, M, ld, table)
           : add_rows_loop<false, false>(src, stride, P, n, x_bias, mean, M, ld, table);
  }
}

// Output: out[p * out_stride, ... + n) = normalize_loop over src's row p, per-channel statistics and parameters.
template <bool kBias, bool kModulate, bool kSilu>
inline __attribute__((always_inline)) void normalize_rows_loop(const float* __restrict__ src, int64_t stride, int64_t P,
    int64_t n, const float* __restrict__ x_bias, const float* __restrict__ mean, const float* __restrict__ rstd,
    const float* __restrict__ weight, const float* __restrict__ bias, const float* __restrict__ scale1,
    const float* __restrict__ shift, float* __restrict__ out, int64_t out_stride) {
  for (int64_t p = 0; p < P; ++p) {
    normalize_loop<true, kBias, kModulate, kSilu>(
        src + p * stride, n, x_bias, mean, rstd, weight, bias, scale1, shift, out + p * out_stride);
  }
}

DIFFUSION_KERNELS_CLONES
void normalize_rows(const float* __restrict__ src, int64_t stride, int64_t P, int64_t n, const float* __restrict__ x_bias,
    const float* __restrict__ mean, const float* __restrict__ rstd, const float* __restrict__ weight,
    const float* __restrict__ bias, const float* __restrict__ scale1, const float* __restrict__ shift, bool silu,
    float* __restrict__ out, int64_t out_stride) {
  const int variant = (x_bias != nullptr ? 4 : 0) + (scale1 != nullptr ? 2 : 0) + (silu ? 1 : 0);
  switch (variant) {
#define DIFFUSION_KERNELS_ROWS(k)                                                                                   \
  case k:                                                                                                           \
    normalize_rows_loop<(k & 4) != 0, (k & 2) != 0, (k & 1) != 0>(                                                  \
        src, stride, P, n, x_bias, mean, rstd, weight, bias, scale1, shift, out, out_stride);                      \
    break;
    DIFFUSION_KERNELS_ROWS(0) DIFFUSION_KERNELS_ROWS(1) DIFFUSION_KERNELS_ROWS(2) DIFFUSION_KERNELS_ROWS(3)
    DIFFUSION_KERNELS_ROWS(4) DIFFUSION_KERNELS_ROWS(5) DIFFUSION_KERNELS_ROWS(6) DIFFUSION_KERNELS_ROWS(7)
#undef DIFFUSION_KERNELS_ROWS
  }
}

// Channels-last (groups of up to kGnPartials channels): no gather. Element j = p * cg + cl of group g goes to
// partial j % period = m * cg + cl with m = p % M, M = period / cg; so partial m * cg + cl of every group is one
// (M, C) table's entry [m][g * cg + cl], and position p's whole row of C channels adds into table row p % M,
// one contiguous (vectorized) add per position, each partial still in increasing j. Each pass runs over a
// sample's rows in one call per source (x's channels, then x2's), reading float32 sources where they lie.
template <typename T>
bool group_norm_act_channels_last(const GroupNormAct& a) {
  const int64_t B = a.batch, C = a.channels, P = a.positions, cg = a.cg, G = a.groups;
  const GroupNormSources& s = a.src;
  const bool channels_last = s.stride_c1 == 1 && (s.x2 == nullptr || s.stride_c2 == 1) && a.out_stride_c == 1;
  if (!channels_last || cg > kGnPartials || C < 2) {
    return false;
  }
  if (B == 0 || P == 0) {
    return true;  // nothing to write
  }
  const int64_t M = gn_period(cg) / cg, rows_used = std::min(M, P);  // table rows past P stay 0: left out
  const int64_t c1 = s.x2 == nullptr ? C : s.c1;  // x's channels; x2 has the rest
  constexpr bool kFloat = std::is_same_v<T, float>;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> table(rows_used * C), mean(C), rstd(C), scale1(C);
    std::vector<float> tree(kGnPartials % cg != 0 ? rows_used * C : 0);  // (partials, groups): see reduce_groups
    std::vector<float> converted(kFloat ? 0 : P * C), normalized(kFloat ? 0 : P * C);  // (P, C) float rows
    struct Segment {
      const float* src;
      int64_t stride, c0, n;
      const float* x_bias;
    };
    // The tree of diffusion_kernels.h on every group at once (partial k = m * cg + cl is table[m][g * cg + cl]):
    // the pairs (k, k + half) are whole rows m, m + half / cg while half >= cg, then channels within row 0.
    // Rows past rows_used are 0 and left out (adding 0 changes no partial). One statistic per group, expanded.
    auto reduce_groups = [&](std::vector<float>& per_channel, bool squares) {
      if (kGnPartials % cg != 0) {
        // Partials past the period are 0, so each group's tree runs on its own (reduce_partials' pairs), but all
        // groups side by side: partial k of group g at tree[k * G + g], one vectorized add of G per pair.
        int64_t used = rows_used * cg;
        for (int64_t k = 0; k < used; ++k) {  // row k of the tree: every group's partial k, read every cg-th
          const float* from = table.data() + (k / cg) * C + k % cg;
          float* to = tree.data() + k * G;
          for (int64_t g = 0; g < G; ++g) {
            to[g] = from[g * cg];
          }
        }
        for (int64_t half = kGnPartials / 2; half >= 1; half /= 2) {
          for (int64_t k = 0; k < half && k + half < used; ++k) {
            add_row(tree.data() + (k + half) * G, G, tree.data() + k * G);
          }
          used = std::min(used, half);
        }
        for (int64_t g = 0; g < G; ++g) {
          table[g * cg] = tree[g];  // where the row tree leaves it
        }
      } else {
        int64_t used = rows_used;
        for (int64_t half = kGnPartials / 2; half >= 1; half /= 2) {
          if (half >= cg) {
            const int64_t rows = half / cg;
            for (int64_t m = 0; m + rows < used; ++m) {
              add_row(table.data() + (m + rows) * C, C, table.data() + m * C);
            }
            used = std::min(used, rows);
          } else {
            for (int64_t g = 0; g < G; ++g) {
              for (int64_t cl = 0; cl < half; ++cl) {
                table[g * cg + cl] = add_rn(table[g * cg + cl], table[g * cg + cl + half]);
              }
            }
          }
        }
      }
      const float count = static_cast<float>(cg * P);
      for (int64_t g = 0; g < G; ++g) {
        const float sum = table[g * cg];
        const float value = squares ? group_rstd(sum, count, a.eps) : div_rn(sum, count);
        std::fill(per_channel.begin() + g * cg, per_channel.begin() + (g + 1) * cg, value);
      }
    };
    for (int64_t b = begin; b < end; ++b) {
      // The sample's sources as rows of float32: x and x2 themselves, or (half types) one converted (P, C) copy.
      Segment segments[2];
      if constexpr (kFloat) {
        segments[0] = {static_cast<const float*>(s.x) + b * s.stride_b1, s.stride_p1, 0, c1, s.x_bias};
        if (c1 < C) {
          segments[1] = {static_cast<const float*>(s.x2) + b * s.stride_b2, s.stride_p2, c1, C - c1, nullptr};
        }
      } else {
        const T* x = static_cast<const T*>(s.x) + b * s.stride_b1;
        const T* x2 = c1 < C ? static_cast<const T*>(s.x2) + b * s.stride_b2 : nullptr;
        for (int64_t p = 0; p < P; ++p) {
          float* row = converted.data() + p * C;
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            widen_bf16(reinterpret_cast<const uint16_t*>(x + p * s.stride_p1), c1, row);
            if (c1 < C) {
              widen_bf16(reinterpret_cast<const uint16_t*>(x2 + p * s.stride_p2), C - c1, row + c1);
            }
            continue;
          }
          for (int64_t c = 0; c < c1; ++c) {
            row[c] = static_cast<float>(x[p * s.stride_p1 + c]);
          }
          for (int64_t c = c1; c < C; ++c) {
            row[c] = static_cast<float>(x2[p * s.stride_p2 + c - c1]);
          }
        }
        segments[0] = {converted.data(), C, 0, c1, s.x_bias};
        segments[1] = {converted.data() + c1, C, c1, C - c1, nullptr};
      }
      const int n_segments = c1 < C ? 2 : 1;
      for (const bool squares : {false, true}) {
        std::fill(table.begin(), table.end(), 0.0f);
        for (int i = 0; i < n_segments; ++i) {
          const Segment& g = segments[i];
          add_rows(g.src, g.stride, P, g.n, g.x_bias, mean.data() + g.c0, squares, M, C, table.data() + g.c0);
        }
        reduce_groups(squares ? rstd : mean, squares);
      }
      const float* shift = a.shift != nullptr ? a.shift + b * a.modulation_stride : nullptr;
      if (a.scale != nullptr) {
        const float* scale = a.scale + b * a.modulation_stride;
        for (int64_t c = 0; c < C; ++c) {
          scale1[c] = add_rn(1.0f, scale[c]);
        }
      }
      T* out = static_cast<T*>(a.out) + b * a.out_stride_b;
      float* y = kFloat ? reinterpret_cast<float*>(out) : normalized.data();
      const int64_t y_stride = kFloat ? a.out_stride_p : C;
      for (int i = 0; i < n_segments; ++i) {
        const Segment& g = segments[i];
        normalize_rows(g.src, g.stride, P, g.n, g.x_bias, mean.data() + g.c0, rstd.data() + g.c0, a.weight + g.c0,
            a.bias + g.c0, a.scale != nullptr ? scale1.data() + g.c0 : nullptr, shift != nullptr ? shift + g.c0 : nullptr,
            a.silu, y + g.c0, y_stride);
      }
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (int64_t p = 0; p < P; ++p) {
          narrow_bf16(normalized.data() + p * C, C, reinterpret_cast<uint16_t*>(out + p * a.out_stride_p));
        }
      } else if constexpr (!kFloat) {
        for (int64_t p = 0; p < P; ++p) {
          for (int64_t c = 0; c < C; ++c) {
            out[p * a.out_stride_p + c] = static_cast<T>(normalized[p * C + c]);
          }
        }
      }
    }
  });
  return true;
}

template <typename T>
void group_norm_act_cpu_impl(const GroupNormAct& a) {
  if (group_norm_act_channels_last<T>(a)) {
    return;
  }
  const int64_t B = a.batch, C = a.channels, P = a.positions, cg = a.cg;
  // 1. Statistics of every (sample, group), each expanded to its channels: (B, C) means and 1/stds.
  std::vector<float> mean(B * C), rstd(B * C);
  at::parallel_for(0, B * a.groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> values(cg * P);
    float partial[kGnPartials];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / a.groups, c0 = (i % a.groups) * cg;
      for (int64_t p = 0; p < P; ++p) {
        load_channels<T>(a.src, b, c0, cg, p, values.data() + p * cg);  // j = p * cg + cl
      }
      const float count = static_cast<float>(cg * P);
      std::fill(partial, partial + kGnPartials, 0.0f);
      add_to_partials(values.data(), cg * P, gn_period(cg), 0.0f, false, partial);
      const float group_mean = div_rn(reduce_partials(partial), count);
      std::fill(partial, partial + kGnPartials, 0.0f);
      add_to_partials(values.data(), cg * P, gn_period(cg), group_mean, true, partial);
      const float group_rstd_ = group_rstd(reduce_partials(partial), count, a.eps);
      std::fill(mean.begin() + b * C + c0, mean.begin() + b * C + c0 + cg, group_mean);
      std::fill(rstd.begin() + b * C + c0, rstd.begin() + b * C + c0 + cg, group_rstd_);
    }
  });
  // 2. The output, a row at a time along its innermost dimension; 1 + scale once per (sample, channel).
  std::vector<float> scale1(a.scale != nullptr ? B * C : 0);
  for (int64_t b = 0; b < B && a.scale != nullptr; ++b) {
    for (int64_t c = 0; c < C; ++c) {
      scale1[b * C + c] = add_rn(1.0f, a.scale[b * a.modulation_stride + c]);
    }
  }
  const bool channel_rows = a.out_stride_c == 1 && C > 1;
  const int64_t rows = channel_rows ? B * P : B * C, length = channel_rows ? C : P;
  at::parallel_for(0, rows, std::max<int64_t>(1, kCpuGrain / length), [&](int64_t begin, int64_t end) {
    std::vector<float> v(length), y(length);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = channel_rows ? r / P : r / C;
      const float* scale = a.scale != nullptr ? scale1.data() + b * C : nullptr;  // 1 + scale
      const float* shift = a.shift != nullptr ? a.shift + b * a.modulation_stride : nullptr;
      T* out = static_cast<T*>(a.out) + b * a.out_stride_b;
      if (channel_rows) {  // position p, channels 0..C-1
        const int64_t p = r % P;
        load_channels<T>(a.src, b, 0, C, p, v.data());
        normalize_row(v.data(), C, true, mean.data() + b * C, rstd.data() + b * C, a.weight, a.bias, scale, shift, a.silu, y.data());
        out += p * a.out_stride_p;
        for (int64_t c = 0; c < C; ++c) {
          out[c] = static_cast<T>(y[c]);
        }
      } else {  // channel c, positions 0..P-1
        const int64_t c = r % C;
        for (int64_t p = 0; p < P; ++p) {
          load_channels<T>(a.src, b, c, 1, p, v.data() + p);
        }
        const int64_t bc = b * C + c;
        normalize_row(v.data(), P, false, mean.data() + bc, rstd.data() + bc, a.weight + c, a.bias + c,
            scale != nullptr ? scale + c : nullptr, shift != nullptr ? shift + c : nullptr, a.silu, y.data());
        out += c * a.out_stride_c;
        for (int64_t p = 0; p < P; ++p) {
          out[p * a.out_stride_p] = static_cast<T>(y[p]);
        }
      }
    }
  });
}

at::Tensor group_norm_act_cpu(
    const at::Tensor& x,
    const std::optional<at::Tensor>& x2,
    const at::Tensor& weight,
    const at::Tensor& bias,
    const std::optional<at::Tensor>& x_bias,
    const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift,
    int64_t groups,
    double eps,
    bool silu) {
  at::Tensor out;
  const GroupNormAct a = prepare_group_norm_act(x, x2, weight, bias, x_bias, scale, shift, groups, eps, silu, &out);
  dispatch_step_dtype(x.scalar_type(), "x", [&](auto tag) { group_norm_act_cpu_impl<decltype(tag)>(a); });
  return out;
}

// ----- group_norm_act_backward: group_norm_act's gradients for training, CPU, channels-last -------------------
// For one sample, with xhat = (x - mean) * rstd, a = xhat * weight + bias, z = a * (1 + scale) + shift (or a) and
// y = silu(z) (or z): dz = dy * silu'(z), da = dz * (1 + scale); dshift = sum dz and dscale = sum dz * a over the
// positions; dbias = sum da and dweight = sum da * xhat over positions and samples; and, per group of N elements,
// dx = rstd * (da * weight - mean(da * weight) - xhat * mean(da * weight * xhat)). Everything in float32; the
// group's statistics are recomputed from x in one pass of shifted sums (the forward's values, to rounding).

// dz, da and the per-channel sums of one sample's rows (P positions of C channels), a row at a time.
template <bool kModulate, bool kSilu>
inline __attribute__((always_inline)) void gn_backward_rows_loop(const float* __restrict__ x,
    const float* __restrict__ dy, int64_t P, int64_t C, const float* __restrict__ mean, const float* __restrict__ rstd,
    const float* __restrict__ weight, const float* __restrict__ bias, const float* __restrict__ scale1,
    const float* __restrict__ shift, float* __restrict__ da, float* __restrict__ sums) {
  float* __restrict__ sum_dz = sums;
  float* __restrict__ sum_dz_a = sums + C;
  float* __restrict__ sum_da = sums + 2 * C;
  float* __restrict__ sum_da_xhat = sums + 3 * C;
  for (int64_t p = 0; p < P; ++p) {
    const float* __restrict__ xr = x + p * C;
    const float* __restrict__ dyr = dy + p * C;
    float* __restrict__ dar = da + p * C;
    for (int64_t c = 0; c < C; ++c) {
      const float xhat = (xr[c] - mean[c]) * rstd[c];
      const float a = xhat * weight[c] + bias[c];
      float dz = dyr[c];
      if constexpr (kSilu) {
        const float z = kModulate ? a * scale1[c] + shift[c] : a;
        const float s = 1.0f / (1.0f + exp_rn(-z));
        dz = dz * (s * (1.0f + z * (1.0f - s)));
      }
      float d = dz;
      if constexpr (kModulate) {
        sum_dz[c] += dz;
        sum_dz_a[c] += dz * a;
        d = dz * scale1[c];
      }
      dar[c] = d;
      sum_da[c] += d;
      sum_da_xhat[c] += d * xhat;
    }
  }
}

DIFFUSION_KERNELS_CLONES
void gn_backward_rows(const float* __restrict__ x, const float* __restrict__ dy, int64_t P, int64_t C,
    const float* __restrict__ mean, const float* __restrict__ rstd, const float* __restrict__ weight,
    const float* __restrict__ bias, const float* __restrict__ scale1, const float* __restrict__ shift, bool silu,
    float* __restrict__ da, float* __restrict__ sums) {
  // A switch, not lambdas: a lambda's body would not take this function's target clones.
  switch ((scale1 != nullptr ? 2 : 0) + (silu ? 1 : 0)) {
    case 0: gn_backward_rows_loop<false, false>(x, dy, P, C, mean, rstd, weight, bias, scale1, shift, da, sums); break;
    case 1: gn_backward_rows_loop<false, true>(x, dy, P, C, mean, rstd, weight, bias, scale1, shift, da, sums); break;
    case 2: gn_backward_rows_loop<true, false>(x, dy, P, C, mean, rstd, weight, bias, scale1, shift, da, sums); break;
    default: gn_backward_rows_loop<true, true>(x, dy, P, C, mean, rstd, weight, bias, scale1, shift, da, sums); break;
  }
}

// dx = rstd * (da * weight - k1 - xhat * k2), k1 and k2 the group's means expanded to its channels, into dx (which
// may be da itself).
DIFFUSION_KERNELS_CLONES
void gn_backward_dx(const float* __restrict__ x, int64_t P, int64_t C, const float* __restrict__ mean,
    const float* __restrict__ rstd, const float* __restrict__ weight, const float* __restrict__ k1,
    const float* __restrict__ k2, const float* da, float* dx) {
  for (int64_t p = 0; p < P; ++p) {
    const float* __restrict__ xr = x + p * C;
    const float* r = da + p * C;
    float* out = dx + p * C;
    for (int64_t c = 0; c < C; ++c) {
      const float xhat = (xr[c] - mean[c]) * rstd[c];
      out[c] = rstd[c] * (r[c] * weight[c] - k1[c] - xhat * k2[c]);
    }
  }
}

// Per-channel sums of one sample's rows shifted by the first row (so that a channel's mean far from 0 loses no
// precision): sums[c] = sum of (x - x[0][c]), squares[c] = sum of (x - x[0][c])^2, in one pass.
DIFFUSION_KERNELS_CLONES
void gn_channel_shifted_sums(const float* __restrict__ x, int64_t P, int64_t C, float* __restrict__ sums,
    float* __restrict__ squares) {
  std::fill(sums, sums + C, 0.0f);
  std::fill(squares, squares + C, 0.0f);
  for (int64_t p = 1; p < P; ++p) {
    const float* __restrict__ xr = x + p * C;
    for (int64_t c = 0; c < C; ++c) {
      const float v = xr[c] - x[c];
      sums[c] += v;
      squares[c] += v * v;
    }
  }
}

template <typename T>
void group_norm_act_backward_impl(const at::Tensor& grad, const at::Tensor& x, const float* weight, const float* bias,
    const float* scale, const float* shift, int64_t modulation_stride, int64_t groups, float eps, bool silu,
    at::Tensor& dx, float* dscale, float* dshift, float* per_sample) {
  const int64_t B = x.size(0), C = x.size(1), P = x.numel() / (B * C), cg = C / groups;
  const float count = static_cast<float>(P * cg);
  const T* xs = x.const_data_ptr<T>();
  const T* gs = grad.const_data_ptr<T>();
  T* dxs = dx.mutable_data_ptr<T>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    constexpr bool kFloat = std::is_same_v<T, float>;
    std::vector<float> xbuf(kFloat ? 0 : P * C), gbuf(kFloat ? 0 : P * C), da(P * C);
    std::vector<float> mean(C), rstd(C), sums(4 * C), scale1(scale != nullptr ? C : 0), k1(C), k2(C), tmp(C), squares(C);
    for (int64_t b = begin; b < end; ++b) {
      const float* xr;
      const float* gr;
      if constexpr (kFloat) {
        xr = xs + b * P * C;
        gr = gs + b * P * C;
      } else {
        widen_bf16(reinterpret_cast<const uint16_t*>(xs + b * P * C), P * C, xbuf.data());
        widen_bf16(reinterpret_cast<const uint16_t*>(gs + b * P * C), P * C, gbuf.data());
        xr = xbuf.data();
        gr = gbuf.data();
      }
      // The group's mean and 1/std, each expanded to its channels, from one pass of per-channel sums shifted by the
      // channel's first value k: the group's sum of (x - mean)^2 is, over its channels, squares + 2 (k - mean) sums
      // + P (k - mean)^2.
      gn_channel_shifted_sums(xr, P, C, tmp.data(), squares.data());
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.0f;
        for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
          s += tmp[c] + static_cast<float>(P) * xr[c];
        }
        const float m = s / count;
        float deviations = 0.0f;
        for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
          const float shift = xr[c] - m;
          deviations += squares[c] + 2.0f * shift * tmp[c] + static_cast<float>(P) * shift * shift;
        }
        const float r = group_rstd(std::max(deviations, 0.0f), count, eps);
        std::fill(mean.begin() + g * cg, mean.begin() + (g + 1) * cg, m);
        std::fill(rstd.begin() + g * cg, rstd.begin() + (g + 1) * cg, r);
      }
      const float* shift_b = shift != nullptr ? shift + b * modulation_stride : nullptr;
      if (scale != nullptr) {
        for (int64_t c = 0; c < C; ++c) {
          scale1[c] = 1.0f + scale[b * modulation_stride + c];
        }
      }
      std::fill(sums.begin(), sums.end(), 0.0f);
      gn_backward_rows(xr, gr, P, C, mean.data(), rstd.data(), weight, bias, scale != nullptr ? scale1.data() : nullptr,
          shift_b, silu, da.data(), sums.data());
      if (scale != nullptr) {
        std::copy(sums.begin(), sums.begin() + C, dshift + b * C);
        std::copy(sums.begin() + C, sums.begin() + 2 * C, dscale + b * C);
      }
      std::copy(sums.begin() + 2 * C, sums.end(), per_sample + b * 2 * C);  // this sample's dbias, dweight terms
      for (int64_t g = 0; g < groups; ++g) {
        float s1 = 0.0f, s2 = 0.0f;
        for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
          s1 += weight[c] * sums[2 * C + c];
          s2 += weight[c] * sums[3 * C + c];
        }
        std::fill(k1.begin() + g * cg, k1.begin() + (g + 1) * cg, s1 / count);
        std::fill(k2.begin() + g * cg, k2.begin() + (g + 1) * cg, s2 / count);
      }
      if constexpr (kFloat) {  // straight into dx
        gn_backward_dx(xr, P, C, mean.data(), rstd.data(), weight, k1.data(), k2.data(), da.data(), dxs + b * P * C);
      } else {
        gn_backward_dx(xr, P, C, mean.data(), rstd.data(), weight, k1.data(), k2.data(), da.data(), da.data());
        narrow_bf16(da.data(), P * C, reinterpret_cast<uint16_t*>(dxs + b * P * C));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_norm_act_backward_cpu(
    const at::Tensor& grad,
    const at::Tensor& x,
    const at::Tensor& weight,
    const at::Tensor& bias,
    const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift,
    int64_t groups,
    double eps,
    bool silu) {
  const auto cl = at::MemoryFormat::ChannelsLast;
  TORCH_CHECK(x.dim() == 4 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous(cl),
      "group_norm_act_backward: x must be a channels-last float32 or bfloat16 (B, C, H, W) tensor, got ", x.scalar_type(),
      " ", x.sizes(), " with strides ", x.strides());
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type() && grad.is_contiguous(cl),
      "group_norm_act_backward: grad must be a channels-last tensor of x's size and dtype, got ", grad.scalar_type(), " ",
      grad.sizes(), " with strides ", grad.strides());
  // The forward's checks of weight, bias, scale and shift (the same arguments); its output, x's shape, dtype and
  // layout, is dx.
  at::Tensor dx;
  const GroupNormAct a = prepare_group_norm_act(x, std::nullopt, weight, bias, std::nullopt, scale, shift, groups, eps, silu, &dx);
  const int64_t B = x.size(0), C = x.size(1);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor dscale = at::empty({scale.has_value() ? B : 0, C}, f32), dshift = at::empty({scale.has_value() ? B : 0, C}, f32);
  std::vector<float> per_sample(B * 2 * C);
  auto run = [&](auto tag) {
    group_norm_act_backward_impl<decltype(tag)>(grad, x, a.weight, a.bias, a.scale, a.shift, a.modulation_stride, groups,
        a.eps, silu, dx, dscale.mutable_data_ptr<float>(), dshift.mutable_data_ptr<float>(), per_sample.data());
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  // dbias and dweight: the samples' terms summed in order (the same bits whatever the threads).
  at::Tensor dweight = at::zeros({C}, f32), dbias = at::zeros({C}, f32);
  float* dw = dweight.mutable_data_ptr<float>();
  float* db = dbias.mutable_data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < C; ++c) {
      db[c] += per_sample[b * 2 * C + c];
      dw[c] += per_sample[b * 2 * C + C + c];
    }
  }
  return {dx, dweight, dbias, dscale, dshift};
}

// ----- conv3x3_winograd: a 3x3 convolution on the CPU in Winograd's F(2x2, 3x3) or F(4x4, 3x3) ----------
// (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016.) Each 2x2 tile of outputs is
// A^T [U (.) (B^T d B)] A for the 4x4 input tile d around it and the kernel's transform U = G g G^T
// (ddpm.kernels.ops.winograd_weight, computed once in float64): per tile and channel pair 16 multiply-adds
// instead of 36. The 16 products of a tile, summed over input channels, are 16 GEMMs
// (tiles x Cin) @ (Cin x Cout); F(4x4, 3x3) (further below) is the same with 6x6 input tiles and 36 products.
// Work goes by blocks of tiles (winograd_block_tiles), each block's three stages in one thread's cache: the input
// transform (V[t][k][:], k = 4 * row + column of B^T d B), the GEMMs (M[:][k] = V[:][k] @ U[k], a register-blocked
// kernel of 6 tiles x 64 output channels) and the output transform (plus the bias) into the NHWC output. V and M
// hold a tile's products side by side, (tiles, products, channels), so each transform writes or reads one
// contiguous run per tile where a (products, tiles, channels) layout had it scatter over 16 or 36 rows. oneDNN has
// Winograd kernels of its own, but PyTorch always asks it for direct convolution and does not export it to
// extensions; NNPACK's (F(6x6, 3x3), NCHW) is slower here and further from float64
// (BENCHMARKS.md, "Where the runner's time goes"). Not a twin of anything on the GPU (cuDNN picks its own algorithms
// there).
//
// B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1], A^T = [1 1 1 0; 0 1 -1 -1]: additions only, so F(2x2, 3x3)'s
// rounding comes from the GEMMs, whose fused multiply-adds are allowed here (fp-contract=fast, unlike the twins):
// this is not an op with a bitwise definition; tests compare it with float64 (it lands closer than oneDNN).
//
// upsample: conv(nearest-2x-upsample(x)) without the upsampled tensor. Per output phase (a, b) (position 2i + a,
// 2j + b) it is a 2x2 convolution of x (ddpm.kernels.ops.upsample_phase_weights), computed in F(2x2, 2x2):
// per 2x2 tile of x's positions the phase reads the 3x3 window at rows 2ty - 1 + a.., columns 2tx - 1 + b..,
// V = B2^T d B2 (9 products), U = G2 k G2^T, each output 2x2 A2^T (U (.) V) A2, written where the phase
// lands: 9 multiply-adds per tile and channel pair instead of 16, 36 products for the 4 phases.
// B2^T = [1 -1 0; 0 1 0; 0 -1 1], A2^T = [1 1 0; 0 1 1] (G2 = [1 0; 1 1; 0 1]).
//
// Tiles per block: 24 (four register blocks of 6), fewer for wide layers so that a block's V and M (products *
// tiles * (Cin + Cout) floats) stay within about 512 KiB of the core's L2 cache. But where U itself (products * Cin *
// Cout elements of u_bytes) is 2 MiB or more, it no longer stays in L2 and every block streams it again: there
// blocks of 48 tiles, each weight read serving twice as many, as long as every thread still gets two blocks.
int64_t winograd_block_tiles(int64_t products, int64_t cin, int64_t cout, int64_t tiles, int64_t u_bytes) {
  const int64_t fit = (512 * 1024) / (products * 4 * (cin + cout));
  const int64_t in_cache = std::clamp<int64_t>(fit / 6 * 6, 6, 24);
  if (products * cin * cout * u_bytes < (int64_t{2} << 20)) {
    return in_cache;
  }
  const int64_t share = tiles / (2 * std::max(1, at::get_num_threads()));
  return std::max(in_cache, std::min<int64_t>(48, share / 6 * 6));
}

// The blocks a convolution's tiles go by: at least tiles / per_block of them, their number a multiple of the
// threads' so that at::parallel_for gives every thread the same count, each of whole register rows of 6 tiles (but
// the last) and as even as that allows: a thread with one block more than the other would leave that one idle.
struct TileBlocks {
  int64_t tiles = 0, count = 0, rows = 0;  // rows: register rows of 6 tiles, the last one partial
  int64_t begin(int64_t block) const { return std::min(tiles, 6 * (block * rows / count)); }
  int64_t largest() const { return count == 0 ? 0 : 6 * ((rows + count - 1) / count); }
};

TileBlocks tile_blocks(int64_t tiles, int64_t per_block) {
  const int64_t rows = (tiles + 5) / 6, threads = std::max(1, at::get_num_threads());
  int64_t count = (tiles + per_block - 1) / per_block;
  if (count > 1 && count % threads != 0) {
    count += threads - count % threads;
  }
  return {tiles, std::min(count, rows), rows};
}

// M[r][0, L * Q) (+)= sum over c < K of V[r][c] * U[c][0, L * Q) for R rows, L the lanes of Vec (16 floats for
// AVX-512, 8 for AVX2): R * Q accumulators in registers. kTransposedV: V[r][c] lies at V[c * ldv + r] (the weight
// gradient's tiles-by-channels V read down its columns); kAccumulate: the sums start from M instead of zero.
template <int R, int Q, typename Vec = Vec16, bool kTransposedV = false, bool kAccumulate = false>
inline __attribute__((always_inline)) void winograd_gemm_tile(const float* __restrict__ V, int64_t ldv,
    const float* __restrict__ U, int64_t ldu, int64_t K, float* __restrict__ M, int64_t ldm) {
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  Vec acc[R][Q];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < Q; ++q) {
      if constexpr (kAccumulate) {
        std::memcpy(&acc[r][q], M + r * ldm + L * q, sizeof(Vec));
      } else {
        acc[r][q] = Vec{};
      }
    }
  }
  for (int64_t c = 0; c < K; ++c) {
    Vec u[Q];
    for (int q = 0; q < Q; ++q) {
      std::memcpy(&u[q], U + c * ldu + L * q, sizeof(Vec));
    }
    for (int r = 0; r < R; ++r) {
      // A scalar times a vector: one broadcast load (Vec{} + v would add 0.0 first, kept since -0.0 + 0.0 is +0.0:
      // one more instruction per broadcast on the ports the multiply-adds need).
      const float v = V[kTransposedV ? c * ldv + r : r * ldv + c];
      for (int q = 0; q < Q; ++q) {
        acc[r][q] += v * u[q];
      }
    }
  }
  // Unrolled, so each accumulator is stored from its register (as a loop, GCC copied them through the stack in
  // halves).
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) {
      std::memcpy(M + r * ldm + L * q, &acc[r][q], sizeof(Vec));
    }
  }
}

// winograd_gemm_tile for q <= QMAX vectors of Vec (the last block of a layer may be narrower).
template <int R, typename Vec = Vec16, int QMAX = 4, bool kTransposedV = false, bool kAccumulate = false>
inline __attribute__((always_inline)) void winograd_gemm_rows(int64_t q, const float* V, int64_t ldv, const float* U,
    int64_t ldu, int64_t K, float* M, int64_t ldm) {
  if constexpr (QMAX >= 4) {
    if (q == 4) {
      return winograd_gemm_tile<R, 4, Vec, kTransposedV, kAccumulate>(V, ldv, U, ldu, K, M, ldm);
    }
  }
  if constexpr (QMAX >= 3) {
    if (q == 3) {
      return winograd_gemm_tile<R, 3, Vec, kTransposedV, kAccumulate>(V, ldv, U, ldu, K, M, ldm);
    }
  }
  if constexpr (QMAX >= 2) {
    if (q == 2) {
      return winograd_gemm_tile<R, 2, Vec, kTransposedV, kAccumulate>(V, ldv, U, ldu, K, M, ldm);
    }
  }
  winograd_gemm_tile<R, 1, Vec, kTransposedV, kAccumulate>(V, ldv, U, ldu, K, M, ldm);
}

// The operands of one conv3x3_winograd call. x and out hold float32, or bfloat16 (bits as uint16_t) for the bf16
// path; weight is U in float32 (products, Cin, Cout), or in bfloat16 pairs (products, Cin / 2, Cout, 2) for the bf16
// GEMM (two input channels side by side, the operand layout of AVX512-BF16's dot product).
struct WinogradConv {
  const void* x;        // (B, H, W, Cin)
  const void* weight;   // U
  const float* bias;    // (Cout,) or nullptr
  void* out;            // (B, H, W, Cout), upsample: (B, 2H, 2W, Cout)
  int64_t H, W, cin, cout, tiles_h, tiles_w;
  bool upsample;
  int64_t products;  // 16, F(4x4, 3x3): 36, upsample: 4 phases x 9
  int64_t m = 2;     // the output tile's side: 2 (F(2x2, 3x3) and upsample) or 4 (F(4x4, 3x3))
};

// A vector of lanes from p (float32, or bf16 widened), and back: the transforms' loads and stores, 16 lanes at a time
// (AVX-512, and the bf16 path) or 8 (AVX2).
template <typename V>
inline __attribute__((always_inline)) V loadv(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
inline __attribute__((always_inline)) V loadv(const uint16_t* p) {
  static_assert(sizeof(V) == sizeof(Vec16), "bf16 rows are widened 16 at a time");
  return load16(p);
}

template <typename V>
inline __attribute__((always_inline)) void storev(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

inline __attribute__((always_inline)) void storev(uint16_t* p, Vec16 v) {
  store16(p, v);
}

// Tile number `tile` (tile = (b * tiles_h + ty) * tiles_w + tx) as its sample and tile row and column.
struct TileAt {
  int64_t b, ty, tx;
};

inline __attribute__((always_inline)) TileAt tile_at(const WinogradConv& a, int64_t tile) {
  return {tile / (a.tiles_w * a.tiles_h), tile / a.tiles_w % a.tiles_h, tile % a.tiles_w};
}

// Channels [c, c + lanes of Vec) at position (y, x) of sample b of an NHWC (B, H, W, channels) tensor, or zeros
// outside the image (the convolution's padding).
template <typename Vec, typename T>
inline __attribute__((always_inline)) Vec load_padded(
    const T* data, const WinogradConv& a, int64_t channels, int64_t b, int64_t y, int64_t x, int64_t c) {
  return (y >= 0 && y < a.H && x >= 0 && x < a.W) ? loadv<Vec>(data + ((b * a.H + y) * a.W + x) * channels + c) : Vec{};
}

// 1. V[t][k] = B^T d B for each tile's 4x4 window (upsample: each phase's 3x3 part of it), 16 channels at a
//    time; positions outside the image are the zero padding. In: x's element type; VT: V's (float32, or bf16 for
//    the bf16 GEMM).
template <typename In, typename VT, typename Vec = Vec16>
inline __attribute__((always_inline)) void winograd_input_transform(
    const WinogradConv& a, int64_t t0, int64_t n, VT* __restrict__ V) {
  const In* x_in = static_cast<const In*>(a.x);
  const int64_t cin = a.cin;
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  for (int64_t t = 0; t < n; ++t) {
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    for (int64_t c = 0; c < cin; c += L) {
      Vec d[4][4];
      for (int i = 0; i < 4; ++i) {
        const int64_t y = 2 * ty - 1 + i;
        for (int j = 0; j < 4; ++j) {
          const int64_t x = 2 * tx - 1 + j;
          d[i][j] = load_padded<Vec>(x_in, a, cin, b, y, x, c);
        }
      }
      VT* v = V + t * a.products * cin + c;  // product k at v + k * cin
      if (!a.upsample) {
        Vec s[4][4];
        for (int j = 0; j < 4; ++j) {  // B^T d
          s[0][j] = d[0][j] - d[2][j];
          s[1][j] = d[1][j] + d[2][j];
          s[2][j] = d[2][j] - d[1][j];
          s[3][j] = d[1][j] - d[3][j];
        }
        for (int i = 0; i < 4; ++i) {  // (B^T d) B
          storev(v + (4 * i) * cin, s[i][0] - s[i][2]);
          storev(v + (4 * i + 1) * cin, s[i][1] + s[i][2]);
          storev(v + (4 * i + 2) * cin, s[i][2] - s[i][1]);
          storev(v + (4 * i + 3) * cin, s[i][1] - s[i][3]);
        }
        continue;
      }
      for (int phase = 0; phase < 4; ++phase) {  // (a, b) = (phase / 2, phase % 2): rows a..a+2, columns b..b+2
        const int pa = phase / 2, pb = phase % 2;
        Vec s[3][3];
        for (int j = 0; j < 3; ++j) {  // B2^T d
          s[0][j] = d[pa][pb + j] - d[pa + 1][pb + j];
          s[1][j] = d[pa + 1][pb + j];
          s[2][j] = d[pa + 2][pb + j] - d[pa + 1][pb + j];
        }
        for (int i = 0; i < 3; ++i) {  // (B2^T d) B2
          VT* w = v + (9 * phase + 3 * i) * cin;
          storev(w, s[i][0] - s[i][1]);
          storev(w + cin, s[i][1]);
          storev(w + 2 * cin, s[i][2] - s[i][1]);
        }
      }
    }
  }
}

// 3. The 2x2 outputs A^T m A (+ bias) of each tile (upsample: of each phase, at 2 (2ty + r) + a, 2 (2tx + c) + b)
//    into the NHWC output of element type Out; a tile past the image's last odd row or column writes what is inside.
template <typename Out, typename Vec = Vec16>
inline __attribute__((always_inline)) void winograd_output_transform(
    const WinogradConv& a, int64_t t0, int64_t n, const float* __restrict__ M) {
  Out* out = static_cast<Out*>(a.out);
  const int64_t H = a.H, W = a.W, cout = a.cout;
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t out_w = a.upsample ? 2 * W : W, out_h = a.upsample ? 2 * H : H;
  for (int64_t t = 0; t < n; ++t) {
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    for (int64_t c = 0; c < cout; c += L) {
      const Vec bias = a.bias != nullptr ? loadv<Vec>(a.bias + c) : Vec{};
      const float* m = M + t * a.products * cout + c;  // product k at m + k * cout
      auto put = [&](int64_t y, int64_t x, Vec value) {  // y, x: x's positions (upsample: each phase's own)
        if (y < H && x < W) {
          storev(out + ((b * out_h + y) * out_w + x) * cout + c, value + bias);
        }
      };
      if (!a.upsample) {
        Vec s[2][4];
        for (int j = 0; j < 4; ++j) {  // A^T m
          const Vec m0 = loadv<Vec>(m + j * cout), m1 = loadv<Vec>(m + (4 + j) * cout);
          const Vec m2 = loadv<Vec>(m + (8 + j) * cout), m3 = loadv<Vec>(m + (12 + j) * cout);
          s[0][j] = m0 + m1 + m2;
          s[1][j] = m1 - m2 - m3;
        }
        for (int i = 0; i < 2; ++i) {  // (A^T m) A
          put(2 * ty + i, 2 * tx, s[i][0] + s[i][1] + s[i][2]);
          put(2 * ty + i, 2 * tx + 1, s[i][1] - s[i][2] - s[i][3]);
        }
        continue;
      }
      for (int phase = 0; phase < 4; ++phase) {
        const int pa = phase / 2, pb = phase % 2;
        const float* mp = m + 9 * phase * cout;
        Vec s[2][3];
        for (int j = 0; j < 3; ++j) {  // A2^T m
          const Vec m0 = loadv<Vec>(mp + j * cout), m1 = loadv<Vec>(mp + (3 + j) * cout),
              m2 = loadv<Vec>(mp + (6 + j) * cout);
          s[0][j] = m0 + m1;
          s[1][j] = m1 + m2;
        }
        for (int i = 0; i < 2; ++i) {  // (A2^T m) A2, at the phase's output positions
          const int64_t y = 2 * ty + i, x0 = 2 * tx;
          if (y < H && x0 < W) {
            storev(out + ((b * out_h + 2 * y + pa) * out_w + 2 * x0 + pb) * cout + c, s[i][0] + s[i][1] + bias);
          }
          if (y < H && x0 + 1 < W) {
            storev(out + ((b * out_h + 2 * y + pa) * out_w + 2 * (x0 + 1) + pb) * cout + c, s[i][1] + s[i][2] + bias);
          }
        }
      }
    }
  }
}

// F(4x4, 3x3), float32 only: each 4x4 tile of outputs is A^T [U (.) (B^T d B)] A for the 6x6 input tile d around
// it (points 0, +-1, +-2 and infinity): 36 multiply-adds per tile and channel pair for 16 outputs, against F(2x2,
// 3x3)'s 16 for 4. Its transforms scale by 2, 4, 5 and 8, so its rounding is larger than F(2x2, 3x3)'s (tests
// compare both with float64). B^T's rows, A^T's rows, and G (ddpm.kernels.ops) are Lavin and Gray's:
// B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1],
// A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1].

// B^T applied to six vectors (a column or a row of a tile).
template <typename Vec>
inline __attribute__((always_inline)) void winograd4_bt(const Vec (&d)[6], Vec (&r)[6]) {
  const Vec four = Vec{} + 4.0f, two = Vec{} + 2.0f, five = Vec{} + 5.0f;
  const Vec p = d[4] + d[3], q = d[1] + d[2], u = d[4] - d[3], w = d[1] - d[2], e = d[4] - d[2], f = d[3] - d[1];
  r[0] = four * d[0] - five * d[2] + d[4];
  r[1] = p - four * q;
  r[2] = u + four * w;
  r[3] = e + two * f;
  r[4] = e - two * f;
  r[5] = four * d[1] - five * d[3] + d[5];
}

// 1. V[t][k] = B^T d B of each tile's 6x6 window (rows 4ty - 1 .., columns 4tx - 1 ..), zero outside the image.
template <typename Vec>
inline __attribute__((always_inline)) void winograd4_input_transform(
    const WinogradConv& a, int64_t t0, int64_t n, float* __restrict__ V) {
  const float* x_in = static_cast<const float*>(a.x);
  const int64_t cin = a.cin;
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t row = a.W * cin;
  for (int64_t t = 0; t < n; ++t) {
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    // A window wholly inside the image is read without the padding's checks.
    const int64_t y0 = 4 * ty - 1, x0 = 4 * tx - 1;
    const bool inside = y0 >= 0 && y0 + 6 <= a.H && x0 >= 0 && x0 + 6 <= a.W;
    const float* window = inside ? x_in + ((b * a.H + y0) * a.W + x0) * cin : x_in;
    for (int64_t c = 0; c < cin; c += L) {
      Vec s[6][6];
      for (int j = 0; j < 6; ++j) {  // B^T d, a column at a time
        Vec col[6];
        for (int i = 0; i < 6; ++i) {
          col[i] = inside ? loadv<Vec>(window + i * row + j * cin + c)
                          : load_padded<Vec>(x_in, a, cin, b, y0 + i, x0 + j, c);
        }
        Vec r[6];
        winograd4_bt(col, r);
        for (int i = 0; i < 6; ++i) {
          s[i][j] = r[i];
        }
      }
      float* v = V + t * a.products * cin + c;  // product k at v + k * cin
      for (int i = 0; i < 6; ++i) {  // (B^T d) B, a row at a time
        Vec r[6];
        winograd4_bt(s[i], r);
        for (int j = 0; j < 6; ++j) {
          storev(v + (6 * i + j) * cin, r[j]);
        }
      }
    }
  }
}

// A^T applied to six vectors.
template <typename Vec>
inline __attribute__((always_inline)) void winograd4_at(const Vec (&m)[6], Vec (&o)[4]) {
  const Vec two = Vec{} + 2.0f, four = Vec{} + 4.0f, eight = Vec{} + 8.0f;
  const Vec p = m[1] + m[2], q = m[1] - m[2], u = m[3] + m[4], w = m[3] - m[4];
  o[0] = m[0] + p + u;
  o[1] = q + two * w;
  o[2] = p + four * u;
  o[3] = q + eight * w + m[5];
}

// 3. The 4x4 outputs A^T m A (+ bias) of each tile into the NHWC float32 output; positions past the image's edge
//    are not written.
template <typename Vec>
inline __attribute__((always_inline)) void winograd4_output_transform(
    const WinogradConv& a, int64_t t0, int64_t n, const float* __restrict__ M) {
  float* out = static_cast<float*>(a.out);
  const int64_t H = a.H, W = a.W, cout = a.cout;
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  for (int64_t t = 0; t < n; ++t) {
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    const int64_t rows = std::min<int64_t>(4, H - 4 * ty), cols = std::min<int64_t>(4, W - 4 * tx);
    float* tile = out + ((b * H + 4 * ty) * W + 4 * tx) * cout;
    for (int64_t c = 0; c < cout; c += L) {
      const Vec bias = a.bias != nullptr ? loadv<Vec>(a.bias + c) : Vec{};
      const float* m = M + t * a.products * cout + c;  // product k at m + k * cout
      Vec s[4][6];
      for (int j = 0; j < 6; ++j) {  // A^T m, a column at a time
        Vec col[6], o[4];
        for (int i = 0; i < 6; ++i) {
          col[i] = loadv<Vec>(m + (6 * i + j) * cout);
        }
        winograd4_at(col, o);
        for (int i = 0; i < 4; ++i) {
          s[i][j] = o[i];
        }
      }
      for (int i = 0; i < rows; ++i) {  // (A^T m) A, the rows and columns inside the image
        Vec o[4];
        winograd4_at(s[i], o);
        for (int j = 0; j < cols; ++j) {
          storev(tile + (i * W + j) * cout + c, o[j] + bias);
        }
      }
    }
  }
}

// A (= A^T transposed, 6x4) applied to four vectors: the weight gradient's adjoint of winograd4_at.
template <typename Vec>
inline __attribute__((always_inline)) void winograd4_a(const Vec (&g)[4], Vec (&e)[6]) {
  const Vec two = Vec{} + 2.0f, four = Vec{} + 4.0f, eight = Vec{} + 8.0f;
  const Vec p = g[0] + g[2], q = g[1] + g[3], u = g[0] + four * g[2], w = two * g[1] + eight * g[3];
  e[0] = g[0];
  e[1] = p + q;
  e[2] = p - q;
  e[3] = u + w;
  e[4] = u - w;
  e[5] = g[3];
}

// dM[t][k] = (A dy A^T)[k] for tiles [t0, t0 + n): dy's 4x4 outputs of each tile (zero past the image's edge).
template <typename Vec>
inline __attribute__((always_inline)) void winograd4_output_adjoint(
    const WinogradConv& a, const float* __restrict__ gy, int64_t t0, int64_t n, float* __restrict__ dM) {
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t cout = a.cout;
  const int64_t stride = a.W * cout;
  for (int64_t t = 0; t < n; ++t) {
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    const bool inside = 4 * ty + 4 <= a.H && 4 * tx + 4 <= a.W;  // read without the padding's checks
    const float* tile = inside ? gy + ((b * a.H + 4 * ty) * a.W + 4 * tx) * cout : gy;
    for (int64_t c = 0; c < cout; c += L) {
      Vec s[4][6];
      for (int i = 0; i < 4; ++i) {  // dy A^T, a row at a time
        Vec row[4];
        for (int j = 0; j < 4; ++j) {
          row[j] = inside ? loadv<Vec>(tile + i * stride + j * cout + c)
                          : load_padded<Vec>(gy, a, cout, b, 4 * ty + i, 4 * tx + j, c);
        }
        winograd4_a(row, s[i]);
      }
      float* m = dM + t * a.products * cout + c;  // product k at m + k * cout
      for (int j = 0; j < 6; ++j) {  // A (dy A^T), a column at a time
        Vec col[4], e[6];
        for (int i = 0; i < 4; ++i) {
          col[i] = s[i][j];
        }
        winograd4_a(col, e);
        for (int i = 0; i < 6; ++i) {
          storev(m + (6 * i + j) * cout, e[i]);
        }
      }
    }
  }
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

// Tiles [t0, t0 + n) (tile = (b * tiles_h + ty) * tiles_w + tx, outputs 2ty.., 2tx..), float32: all three stages,
// on vectors Vec, the GEMM in register blocks of 6 tiles x QMAX vectors. V: (n, products, Cin) and M: (n, products,
// Cout) scratch.
template <typename Vec, int QMAX>
inline __attribute__((always_inline)) void winograd_tiles_float(
    const WinogradConv& a, int64_t t0, int64_t n, float* __restrict__ V, float* __restrict__ M) {
#if defined(__clang__)
#pragma clang fp contract(fast)
#endif
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t cin = a.cin, cout = a.cout, P = a.products, ldv = P * cin, ldm = P * cout;
  if (a.m == 4) {
    winograd4_input_transform<Vec>(a, t0, n, V);
  } else {
    winograd_input_transform<float, float, Vec>(a, t0, n, V);
  }
  for (int64_t k = 0; k < P; ++k) {  // 2. M[:][k] (n, Cout) = V[:][k] (n, Cin) @ U[k] (Cin, Cout)
    const float* Vk = V + k * cin;
    const float* Uk = static_cast<const float*>(a.weight) + k * cin * cout;
    float* Mk = M + k * cout;
    for (int64_t co = 0; co < cout; co += QMAX * L) {
      // Channel counts are multiples of 16: a block of 16 channels is always whole.
      const int64_t q = QMAX * L == 16 ? QMAX : std::min<int64_t>(QMAX, (cout - co) / L);
      int64_t t = 0;
      for (; t + 6 <= n; t += 6) {
        winograd_gemm_rows<6, Vec, QMAX>(q, Vk + t * ldv, ldv, Uk + co, cout, cin, Mk + t * ldm + co, ldm);
      }
      for (; t < n; ++t) {
        winograd_gemm_rows<1, Vec, QMAX>(q, Vk + t * ldv, ldv, Uk + co, cout, cin, Mk + t * ldm + co, ldm);
      }
    }
  }
  if (a.m == 4) {
    winograd4_output_transform<Vec>(a, t0, n, M);
  } else {
    winograd_output_transform<float, Vec>(a, t0, n, M);
  }
}

// AVX-512 (and the baseline clone): 6 tiles x 64 channels per register block.
DIFFUSION_KERNELS_FMA_CLONES
void winograd_tiles(const WinogradConv& a, int64_t t0, int64_t n, float* __restrict__ V, float* __restrict__ M) {
  winograd_tiles_float<Vec16, 4>(a, t0, n, V, M);
}

// A CPU with AVX2 and FMA but not AVX-512. Its 16 vector registers hold 8 floats each, so the AVX-512 block of
// 6 tiles x 64 channels (48 of them as accumulators) would spill on every step: here 6 tiles x 16 channels in 12
// registers, with 2 for U's row and 1 for the broadcast V. The sums run over Cin in the same order with the same
// fused multiply-adds, and the transforms are the same per-lane expressions (F(4x4, 3x3)'s constant products
// contracted alike in both clones), so the output is the AVX-512 clone's bit for bit (a test checks both tiles).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__APPLE__)
#define DIFFUSION_KERNELS_AVX2_GEMM 1

__attribute__((target("avx2,fma"), optimize("fp-contract=fast")))
void winograd_tiles_avx2(const WinogradConv& a, int64_t t0, int64_t n, float* __restrict__ V, float* __restrict__ M) {
  winograd_tiles_float<Vec8, 2>(a, t0, n, V, M);
}
#endif

// Whether the float32 Winograd convolution runs winograd_tiles_avx2: on a CPU with AVX2 and FMA but no AVX-512, or on
// any CPU with AVX2 where DDPM_KERNELS_ISA=avx2 asks for it (the tests check that path on AVX-512 machines too).
bool winograd_uses_avx2_gemm() {
#if defined(DIFFUSION_KERNELS_AVX2_GEMM)
  static const bool use = [] {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const char* isa = std::getenv("DDPM_KERNELS_ISA");
    if (isa != nullptr && std::strcmp(isa, "avx2") == 0) {
      return avx2;
    }
    return avx2 && !__builtin_cpu_supports("avx512f");
  }();
  return use;
#else
  return false;
#endif
}

// ----- The bf16 path: bf16 activations, V and U; float32 transforms, accumulation, bias and M ---------------------
// On a CPU with AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and later) the GEMMs run on
// its dot-product instruction: per instruction 16 output channels x 2 input channels (32 multiply-adds into float32
// accumulators), twice an fp32 FMA's 16, on operands half the bytes. V and U are rounded to bf16 once, after the
// transforms in float32, so the error is a bf16 direct convolution's (tests compare both with float64). Elsewhere
// the same arithmetic in plain C++ (the twin the tests read on any CPU; slow, and never chosen by the runner, which
// keeps bf16 Winograd to CPUs with the instruction: optimized_diffusion.winograd_is_fast).

// M[:][k] (n, Cout) = V[:][k] (n, Cin) @ U[k], V and U bf16 (U in pairs: (Cin / 2, Cout, 2)), sums in float32.
inline __attribute__((always_inline)) void winograd_gemm_bf16_emulated(const WinogradConv& a, int64_t n,
    const uint16_t* __restrict__ V, float* __restrict__ M) {
  auto widen = [](uint16_t h) { return static_cast<float>(c10::bit_cast<c10::BFloat16>(h)); };
  const int64_t cin = a.cin, cout = a.cout;
  const uint16_t* U = static_cast<const uint16_t*>(a.weight);
  for (int64_t k = 0; k < a.products; ++k) {
    for (int64_t t = 0; t < n; ++t) {
      const uint16_t* v = V + (t * a.products + k) * cin;
      float* m = M + (t * a.products + k) * cout;
      for (int64_t co = 0; co < cout; ++co) {
        float acc = 0.0f;
        for (int64_t c2 = 0; c2 < cin / 2; ++c2) {
          const uint16_t* u = U + ((k * cin / 2 + c2) * cout + co) * 2;
          acc += widen(v[2 * c2]) * widen(u[0]) + widen(v[2 * c2 + 1]) * widen(u[1]);
        }
        m[co] = acc;
      }
    }
  }
}

void winograd_tiles_bf16_emulated(const WinogradConv& a, int64_t t0, int64_t n, uint16_t* V, float* M) {
  winograd_input_transform<uint16_t, uint16_t>(a, t0, n, V);
  winograd_gemm_bf16_emulated(a, n, V, M);
  winograd_output_transform<uint16_t>(a, t0, n, M);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(_MSC_VER)
#define DIFFUSION_KERNELS_AVX512_BF16 1
#define DIFFUSION_KERNELS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// M[r][0, 16 * Q) = sum over input channel pairs of V[r][2c, 2c + 1] . U[c][0, 16 * Q)[2]: R * Q accumulators.
template <int R, int Q>
DIFFUSION_KERNELS_BF16_TARGET inline __attribute__((always_inline)) void winograd_gemm_tile_bf16(
    const uint16_t* __restrict__ V, int64_t ldv, const uint16_t* __restrict__ U, int64_t ldu, int64_t K2,
    float* __restrict__ M, int64_t ldm) {
  __m512 acc[R][Q];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < Q; ++q) {
      acc[r][q] = _mm512_setzero_ps();
    }
  }
  for (int64_t c = 0; c < K2; ++c) {
    __m512i u[Q];
    for (int q = 0; q < Q; ++q) {
      u[q] = _mm512_loadu_si512(U + (c * ldu + 16 * q) * 2);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // input channels 2c and 2c + 1 of row r, broadcast to every output channel
      std::memcpy(&pair, V + r * ldv + 2 * c, sizeof(pair));
      const __m512i v = _mm512_set1_epi32(pair);
      for (int q = 0; q < Q; ++q) {
        acc[r][q] = _mm512_dpbf16_ps(acc[r][q], (__m512bh)v, (__m512bh)u[q]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < Q; ++q) {
      _mm512_storeu_ps(M + r * ldm + 16 * q, acc[r][q]);
    }
  }
}

template <int R>
DIFFUSION_KERNELS_BF16_TARGET inline __attribute__((always_inline)) void winograd_gemm_rows_bf16(int64_t q,
    const uint16_t* V, int64_t ldv, const uint16_t* U, int64_t ldu, int64_t K2, float* M, int64_t ldm) {
  switch (q) {
    case 4: winograd_gemm_tile_bf16<R, 4>(V, ldv, U, ldu, K2, M, ldm); break;
    case 3: winograd_gemm_tile_bf16<R, 3>(V, ldv, U, ldu, K2, M, ldm); break;
    case 2: winograd_gemm_tile_bf16<R, 2>(V, ldv, U, ldu, K2, M, ldm); break;
    default: winograd_gemm_tile_bf16<R, 1>(V, ldv, U, ldu, K2, M, ldm); break;
  }
}

// All three stages on the AVX512-BF16 dot product; the GEMMs blocked as the float32 path's (6 tiles x 64 channels).
DIFFUSION_KERNELS_BF16_TARGET
void winograd_tiles_bf16_native(const WinogradConv& a, int64_t t0, int64_t n, uint16_t* __restrict__ V, float* __restrict__ M) {
  const int64_t cin = a.cin, cout = a.cout, ldv = a.products * cin, ldm = a.products * cout;
  winograd_input_transform<uint16_t, uint16_t>(a, t0, n, V);
  for (int64_t k = 0; k < a.products; ++k) {
    const uint16_t* Vk = V + k * cin;
    const uint16_t* Uk = static_cast<const uint16_t*>(a.weight) + k * cin * cout;
    float* Mk = M + k * cout;
    for (int64_t co = 0; co < cout; co += 64) {
      const int64_t q = std::min<int64_t>(4, (cout - co) / 16);
      int64_t t = 0;
      for (; t + 6 <= n; t += 6) {
        winograd_gemm_rows_bf16<6>(q, Vk + t * ldv, ldv, Uk + 2 * co, cout, cin / 2, Mk + t * ldm + co, ldm);
      }
      for (; t < n; ++t) {
        winograd_gemm_rows_bf16<1>(q, Vk + t * ldv, ldv, Uk + 2 * co, cout, cin / 2, Mk + t * ldm + co, ldm);
      }
    }
  }
  winograd_output_transform<uint16_t>(a, t0, n, M);
}
#endif

// Whether this CPU has the AVX512-BF16 dot product (read once, from CPUID).
bool cpu_has_avx512_bf16() {
#if defined(DIFFUSION_KERNELS_AVX512_BF16)
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

at::Tensor conv3x3_winograd_cpu(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool upsample) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 4 && (bf16 || x.scalar_type() == at::kFloat) && x.is_contiguous(at::MemoryFormat::ChannelsLast),
      "conv3x3_winograd: x must be a channels-last float32 or bfloat16 (B, Cin, H, W) tensor, got ", x.scalar_type(), " ",
      x.sizes(), " with strides ", x.strides());
  // A float32 weight of 36 products without upsample is F(4x4, 3x3)'s transform (winograd_weight(..., tile=4)).
  const bool tile4 = !bf16 && !upsample && weight.dim() == 3 && weight.size(0) == 36;
  const int64_t B = x.size(0), cin = x.size(1), H = x.size(2), W = x.size(3), products = upsample || tile4 ? 36 : 16;
  const char* transform =
      upsample ? "winograd_weight(..., upsample=True" : tile4 ? "winograd_weight(..., tile=4" : "winograd_weight(...";
  if (bf16) {
    TORCH_CHECK(weight.dim() == 4 && weight.size(0) == products && weight.size(1) * 2 == cin && weight.size(3) == 2 &&
        weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.device() == x.device(),
        "conv3x3_winograd: for a bfloat16 x, weight must be the contiguous bfloat16 (", products, ", Cin/2=", cin / 2,
        ", Cout, 2) transform of ", transform, ", dtype=torch.bfloat16), got ", weight.scalar_type(), " ", weight.sizes());
  } else {
    TORCH_CHECK(weight.dim() == 3 && weight.size(0) == products && weight.size(1) == cin && weight.scalar_type() == at::kFloat &&
        weight.is_contiguous() && weight.device() == x.device(),
        "conv3x3_winograd: weight must be the contiguous float32 (", products, ", Cin=", cin, ", Cout) transform of ",
        transform, "), got ", weight.scalar_type(), " ", weight.sizes());
  }
  const int64_t cout = weight.size(2);
  TORCH_CHECK(cin % 16 == 0 && cout % 16 == 0 && cin > 0 && cout > 0,
      "conv3x3_winograd: channel counts must be positive multiples of 16, got Cin=", cin, ", Cout=", cout);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == cout && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
        bias->device() == x.device(),
        "conv3x3_winograd: bias must be a contiguous float32 (", cout, ",) tensor on ", x.device(), ", got ", bias->sizes());
  }
  const int64_t scale = upsample ? 2 : 1;  // (B, Cout, H, W), upsample (B, Cout, 2H, 2W), channels-last
  at::Tensor out = at::empty({B, scale * H, scale * W, cout}, x.options()).permute({0, 3, 1, 2});
  const int64_t m = tile4 ? 4 : 2;
  const WinogradConv a{x.data_ptr(), weight.data_ptr(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
      out.data_ptr(), H, W, cin, cout, (H + m - 1) / m, (W + m - 1) / m, upsample, products, m};
  const int64_t tiles = B * a.tiles_h * a.tiles_w;
  const TileBlocks blocks = tile_blocks(tiles, winograd_block_tiles(products, cin, cout, tiles, bf16 ? 2 : 4));
  const int64_t per_block = blocks.largest();
  const bool native = bf16 && cpu_has_avx512_bf16(), avx2_gemm = !bf16 && winograd_uses_avx2_gemm();
  at::parallel_for(0, blocks.count, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> M(new float[products * per_block * cout]);
    std::unique_ptr<float[]> V(new float[bf16 ? 0 : products * per_block * cin]);
    std::unique_ptr<uint16_t[]> V16(new uint16_t[bf16 ? products * per_block * cin : 0]);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t t0 = blocks.begin(block), n = blocks.begin(block + 1) - t0;
      if (!bf16) {
#if defined(DIFFUSION_KERNELS_AVX2_GEMM)
        if (avx2_gemm) {
          winograd_tiles_avx2(a, t0, n, V.get(), M.get());
          continue;
        }
#endif
        winograd_tiles(a, t0, n, V.get(), M.get());
      } else if (native) {
#if defined(DIFFUSION_KERNELS_AVX512_BF16)
        winograd_tiles_bf16_native(a, t0, n, V16.get(), M.get());
#endif
      } else {
        winograd_tiles_bf16_emulated(a, t0, n, V16.get(), M.get());
      }
    }
  });
  return out;
}

// ----- The weight gradient of conv3x3_winograd, for training ------------------------------------------------------
// y = A^T [U (.) V] A per tile and product k, so dL/dU[k] = sum over tiles V[k]^T (A dy A^T)[k]: the same input
// transform V as the forward pass, the adjoint of the output transform on the gradient of y (dM), and per product
// k a GEMM (Cin x tiles) @ (tiles x Cout) that sums over the tiles. The kernel's gradient is then G^T dU G
// (ddpm/training/winograd.py). Blocks of tiles as in the forward pass, each thread summing into its own
// (products, Cin, Cout) partial, added up at the end. The input's gradient is conv3x3_winograd itself, of dy with
// the kernel rotated 180 degrees and its channels swapped.

// dM[t][k] = (A dy A^T)[k] for tiles [t0, t0 + n): dy's 2x2 outputs of each tile (zero past the image's edge).
// A = [1 0; 1 1; 1 -1; 0 -1] (A^T of the forward transform, transposed).
template <typename Vec>
inline __attribute__((always_inline)) void winograd_output_adjoint(
    const WinogradConv& a, const float* __restrict__ gy, int64_t t0, int64_t n, float* __restrict__ dM) {
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t cout = a.cout;
  for (int64_t t = 0; t < n; ++t) {
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    for (int64_t c = 0; c < cout; c += L) {
      Vec dy[2][2];
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) {
          const int64_t y = 2 * ty + i, x = 2 * tx + j;
          dy[i][j] = load_padded<Vec>(gy, a, cout, b, y, x, c);
        }
      }
      Vec s[2][4];
      for (int i = 0; i < 2; ++i) {  // dy A^T
        s[i][0] = dy[i][0];
        s[i][1] = dy[i][0] + dy[i][1];
        s[i][2] = dy[i][0] - dy[i][1];
        s[i][3] = Vec{} - dy[i][1];
      }
      float* m = dM + t * a.products * cout + c;  // product k at m + k * cout
      for (int j = 0; j < 4; ++j) {  // A (dy A^T)
        storev(m + j * cout, s[0][j]);
        storev(m + (4 + j) * cout, s[0][j] + s[1][j]);
        storev(m + (8 + j) * cout, s[0][j] - s[1][j]);
        storev(m + (12 + j) * cout, Vec{} - s[1][j]);
      }
    }
  }
}

// Tiles [t0, t0 + n): V and dM of the block, then dU (products, Cin, Cout) += V[:][k]^T dM[:][k] for each product
// k, on vectors Vec in register blocks of 6 input channels x QMAX vectors (the forward's GEMM tile and blocking for
// that Vec).
template <typename Vec, int QMAX>
inline __attribute__((always_inline)) void winograd_grad_tiles_float(const WinogradConv& a,
    const float* __restrict__ gy, int64_t t0, int64_t n, float* __restrict__ V, float* __restrict__ dM,
    float* __restrict__ dU) {
#if defined(__clang__)
#pragma clang fp contract(fast)
#endif
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t cin = a.cin, cout = a.cout, ldv = a.products * cin, ldm = a.products * cout;
  if (a.m == 4) {
    winograd4_input_transform<Vec>(a, t0, n, V);
    winograd4_output_adjoint<Vec>(a, gy, t0, n, dM);
  } else {
    winograd_input_transform<float, float, Vec>(a, t0, n, V);
    winograd_output_adjoint<Vec>(a, gy, t0, n, dM);
  }
  for (int64_t k = 0; k < a.products; ++k) {
    const float* Vk = V + k * cin;
    const float* Mk = dM + k * cout;
    float* Uk = dU + k * cin * cout;
    for (int64_t co = 0; co < cout; co += QMAX * L) {
      // Channel counts are multiples of 16: a block of 16 channels is always whole.
      const int64_t q = QMAX * L == 16 ? QMAX : std::min<int64_t>(QMAX, (cout - co) / L);
      int64_t ci = 0;
      for (; ci + 6 <= cin; ci += 6) {
        // dU[ci + r][co..] += sum over tiles t of V[t][ci + r] * dM[t][co..]: the forward's GEMM tile, V read down
        // its columns, the sums continued from dU.
        winograd_gemm_rows<6, Vec, QMAX, true, true>(q, Vk + ci, ldv, Mk + co, ldm, n, Uk + ci * cout + co, cout);
      }
      // Channel counts are multiples of 16, so what 6 leaves is 4 or 2 rows: one register block, not single rows.
      for (; ci + 4 <= cin; ci += 4) {
        winograd_gemm_rows<4, Vec, QMAX, true, true>(q, Vk + ci, ldv, Mk + co, ldm, n, Uk + ci * cout + co, cout);
      }
      for (; ci + 2 <= cin; ci += 2) {
        winograd_gemm_rows<2, Vec, QMAX, true, true>(q, Vk + ci, ldv, Mk + co, ldm, n, Uk + ci * cout + co, cout);
      }
    }
  }
}

// AVX-512 (and the baseline clone): 6 input channels x 64 output channels per register block.
DIFFUSION_KERNELS_FMA_CLONES
void winograd_grad_tiles(const WinogradConv& a, const float* __restrict__ gy, int64_t t0, int64_t n,
    float* __restrict__ V, float* __restrict__ dM, float* __restrict__ dU) {
  winograd_grad_tiles_float<Vec16, 4>(a, gy, t0, n, V, dM, dU);
}

#if defined(DIFFUSION_KERNELS_AVX2_GEMM)
// AVX2 without AVX-512 (winograd_uses_avx2_gemm): 6 x 16 channels in 12 of the 16 registers, as the forward's; the
// same sums in the same order, so the same bits as the AVX-512 clone's.
__attribute__((target("avx2,fma"), optimize("fp-contract=fast")))
void winograd_grad_tiles_avx2(const WinogradConv& a, const float* __restrict__ gy, int64_t t0, int64_t n,
    float* __restrict__ V, float* __restrict__ dM, float* __restrict__ dU) {
  winograd_grad_tiles_float<Vec8, 2>(a, gy, t0, n, V, dM, dU);
}
#endif

// dL/dU as partial sums (parts, products, Cin, Cout) whose sum in order is conv3x3_winograd_weight_grad: the blocks
// of tiles go to at most one part a thread, each part zeroed and summed by its own thread (one part: nothing to add).
at::Tensor winograd_weight_grad_parts(const at::Tensor& x, const at::Tensor& grad_out, int64_t tile) {
  TORCH_CHECK(tile == 2 || tile == 4, "conv3x3_winograd_weight_grad: tile must be 2 (F(2x2, 3x3)) or 4 (F(4x4, 3x3)), got ", tile);
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && x.is_contiguous(at::MemoryFormat::ChannelsLast),
      "conv3x3_winograd_weight_grad: x must be a channels-last float32 (B, Cin, H, W) tensor, got ", x.scalar_type(),
      " ", x.sizes(), " with strides ", x.strides());
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.scalar_type() == at::kFloat &&
      grad_out.is_contiguous(at::MemoryFormat::ChannelsLast) && grad_out.size(0) == x.size(0) &&
      grad_out.size(2) == x.size(2) && grad_out.size(3) == x.size(3) && grad_out.device() == x.device(),
      "conv3x3_winograd_weight_grad: grad_out must be a channels-last float32 (B, Cout, H, W) tensor of x's batch and "
      "size ", x.sizes(), ", got ", grad_out.scalar_type(), " ", grad_out.sizes(), " with strides ", grad_out.strides());
  const int64_t B = x.size(0), cin = x.size(1), H = x.size(2), W = x.size(3), cout = grad_out.size(1);
  TORCH_CHECK(cin % 16 == 0 && cout % 16 == 0 && cin > 0 && cout > 0,
      "conv3x3_winograd_weight_grad: channel counts must be positive multiples of 16, got Cin=", cin, ", Cout=", cout);
  const int64_t products = (tile + 2) * (tile + 2);  // 16 or 36
  const WinogradConv a{x.data_ptr(), nullptr, nullptr, nullptr, H, W, cin, cout, (H + tile - 1) / tile,
      (W + tile - 1) / tile, false, products, tile};
  const int64_t tiles = B * a.tiles_h * a.tiles_w, size = products * cin * cout;
  const TileBlocks blocks = tile_blocks(tiles, winograd_block_tiles(products, cin, cout, tiles, 4));
  const int64_t per_block = blocks.largest();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks.count));
  at::Tensor sums = at::empty({parts, products, cin, cout}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* gy = grad_out.data_ptr<float>();
  const bool avx2_gemm = winograd_uses_avx2_gemm();
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> V(new float[products * per_block * cin]);
    std::unique_ptr<float[]> dM(new float[products * per_block * cout]);
    for (int64_t part = begin; part < end; ++part) {
      float* dU = sums.data_ptr<float>() + part * size;
      std::fill_n(dU, size, 0.0f);
      for (int64_t block = part * blocks.count / parts; block < (part + 1) * blocks.count / parts; ++block) {
        const int64_t t0 = blocks.begin(block), n = blocks.begin(block + 1) - t0;
#if defined(DIFFUSION_KERNELS_AVX2_GEMM)
        if (avx2_gemm) {
          winograd_grad_tiles_avx2(a, gy, t0, n, V.get(), dM.get(), dU);
          continue;
        }
#endif
        winograd_grad_tiles(a, gy, t0, n, V.get(), dM.get(), dU);
      }
    }
  });
  return sums;
}

at::Tensor conv3x3_winograd_weight_grad_cpu(const at::Tensor& x, const at::Tensor& grad_out, int64_t tile) {
  const at::Tensor sums = winograd_weight_grad_parts(x, grad_out, tile);
  if (sums.size(0) == 1) {
    return sums[0];
  }
  at::Tensor out = at::empty(sums.sizes().slice(1), sums.options());
  const int64_t size = out.numel();
  const float* parts = sums.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, size, 16384, [&](int64_t begin, int64_t end) {  // the parts added in order
    std::copy(parts + begin, parts + end, o + begin);
    for (int64_t part = 1; part < sums.size(0); ++part) {
      add_row(parts + part * size + begin, end - begin, o + begin);
    }
  });
  return out;
}

// ----- The rest of a training step's 3x3 convolution in Winograd's domain: kernel transforms, backward ------------
// What ddpm/training/winograd.py's autograd Function calls, one op each way: per step the kernel g changes, so its
// transform U = G g G^T (and the rotated kernel's, for the input's gradient) is computed each step, and the
// gradient's dL/dg = G^T dL/dU G each backward. Both are small next to the convolutions; as ops they spare the step
// a dozen PyTorch calls per convolution.

// G of F(2x2, 3x3) and F(4x4, 3x3): ddpm/kernels/ops.py's WINOGRAD_G.
constexpr float kWinogradG2[4][3] = {{1.0f, 0.0f, 0.0f}, {0.5f, 0.5f, 0.5f}, {0.5f, -0.5f, 0.5f}, {0.0f, 0.0f, 1.0f}};
constexpr float kWinogradG4[6][3] = {{1.0f / 4, 0.0f, 0.0f}, {-1.0f / 6, -1.0f / 6, -1.0f / 6},
    {-1.0f / 6, 1.0f / 6, -1.0f / 6}, {1.0f / 24, 1.0f / 12, 1.0f / 6}, {1.0f / 24, -1.0f / 12, 1.0f / 6},
    {0.0f, 0.0f, 1.0f}};

// c0 v0 + c1 v1 + c2 v2 for a row (c0, c1, c2) of G, the rows' zeros and ones skipped (G's entries are constants
// where this is inlined, so the branches fold away).
inline __attribute__((always_inline)) Vec16 combine3(const float (&c)[3], Vec16 v0, Vec16 v1, Vec16 v2) {
  if (c[1] == 0.0f && c[2] == 0.0f) {
    return c[0] == 1.0f ? v0 : c[0] * v0;
  }
  if (c[0] == 0.0f && c[1] == 0.0f) {
    return c[2] == 1.0f ? v2 : c[2] * v2;
  }
  return c[0] * v0 + c[1] * v1 + c[2] * v2;
}

// The transforms go by chunks of kKernelChunk kernels (columns), each chunk's rows in a small buffer: every output row
// is then written as one contiguous run, where 16 kernels at a time would write 36 rows a few KiB apart, which the
// L1 cache's sets cannot hold at once.
constexpr int64_t kKernelChunk = 256;

// U = G g G^T for one chunk: taps[t][c], tap t = 3i + j of column c, into u[(a * n + b) * ld + c], separably (G g,
// then (G g) G^T), each row of both steps a vector loop along the chunk.
template <int64_t kN>
inline __attribute__((always_inline)) void winograd_kernel_chunk(
    const float (&taps)[9][kKernelChunk], const float (&G)[kN][3], float* __restrict__ u, int64_t ld) {
  alignas(64) float gg[kN][3][kKernelChunk];
  for (int64_t a = 0; a < kN; ++a) {
    for (int64_t j = 0; j < 3; ++j) {
      for (int64_t c = 0; c < kKernelChunk; c += 16) {
        store16(gg[a][j] + c, combine3(G[a], load16(taps[j] + c), load16(taps[3 + j] + c), load16(taps[6 + j] + c)));
      }
    }
  }
  for (int64_t a = 0; a < kN; ++a) {
    for (int64_t b = 0; b < kN; ++b) {
      float* __restrict__ out = u + (a * kN + b) * ld;
      for (int64_t c = 0; c < kKernelChunk; c += 16) {
        store16(out + c, combine3(G[b], load16(gg[a][0] + c), load16(gg[a][1] + c), load16(gg[a][2] + c)));
      }
    }
  }
}

// dL/dg = G^T dU G for one chunk: dU[(a * n + b) * ld + c] the sum of `parts` partial sums `stride` apart (in
// order), into taps[t][c], tap t = 3i + j.
template <int64_t kN>
inline __attribute__((always_inline)) void winograd_kernel_grad_chunk(const float* __restrict__ d, int64_t ld,
    int64_t parts, int64_t stride, const float (&G)[kN][3], float (&taps)[9][kKernelChunk]) {
  const auto du = [&](const float* p) {
    Vec16 sum = load16(p);
    for (int64_t part = 1; part < parts; ++part) {
      sum += load16(p + part * stride);
    }
    return sum;
  };
  alignas(64) float gd[3][kN][kKernelChunk];  // (G^T dU)[i][b]
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t b = 0; b < kN; ++b) {
      for (int64_t c = 0; c < kKernelChunk; c += 16) {
        Vec16 sum = {};
        for (int64_t a = 0; a < kN; ++a) {
          if (G[a][i] != 0.0f) {
            sum += G[a][i] * du(d + (a * kN + b) * ld + c);
          }
        }
        store16(gd[i][b] + c, sum);
      }
    }
  }
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t j = 0; j < 3; ++j) {
      for (int64_t c = 0; c < kKernelChunk; c += 16) {
        Vec16 sum = {};
        for (int64_t b = 0; b < kN; ++b) {
          if (G[b][j] != 0.0f) {
            sum += load16(gd[i][b] + c) * G[b][j];
          }
        }
        store16(taps[3 * i + j] + c, sum);
      }
    }
  }
}

// Chunks [k0, k1) of the transform into u (n * n, rows, inner): column r * inner + l is kernel g[co][ci] with
// (co, ci) = rotated ? (r, l) : (l, r), its taps reversed if rotated.
template <int64_t kN>
inline __attribute__((always_inline)) void winograd_kernel_chunks_impl(const float* __restrict__ g, int64_t cout,
    int64_t cin, bool rotated, const float (&G)[kN][3], int64_t k0, int64_t k1, float* __restrict__ u) {
  const int64_t inner = rotated ? cin : cout, columns = cin * cout;
  alignas(64) float taps[9][kKernelChunk];
  for (int64_t chunk = k0; chunk < k1; ++chunk) {
    const int64_t c0 = chunk * kKernelChunk;
    for (int64_t c = 0; c < kKernelChunk; ++c) {
      const int64_t r = (c0 + c) / inner, l = (c0 + c) % inner;
      const float* k = g + (rotated ? r * cin + l : l * cin + r) * 9;
      for (int64_t t = 0; t < 9; ++t) {
        taps[rotated ? 8 - t : t][c] = k[t];
      }
    }
    winograd_kernel_chunk<kN>(taps, G, u + c0, columns);
  }
}

DIFFUSION_KERNELS_FMA_CLONES
void winograd_kernel_chunks(const float* __restrict__ g, int64_t cout, int64_t cin, int64_t tile, bool rotated,
    int64_t k0, int64_t k1, float* __restrict__ u) {
  tile == 4 ? winograd_kernel_chunks_impl<6>(g, cout, cin, rotated, kWinogradG4, k0, k1, u)
            : winograd_kernel_chunks_impl<4>(g, cout, cin, rotated, kWinogradG2, k0, k1, u);
}

// Chunks [k0, k1) of dL/dg from dU (n * n, Cin, Cout) (column ci * Cout + co), given as `parts` partial sums, into
// the (Cout, Cin, 3, 3) gradient.
template <int64_t kN>
inline __attribute__((always_inline)) void winograd_kernel_grad_chunks_impl(const float* __restrict__ du,
    int64_t parts, int64_t cout, int64_t cin, const float (&G)[kN][3], int64_t k0, int64_t k1, float* __restrict__ dg) {
  alignas(64) float taps[9][kKernelChunk];
  for (int64_t chunk = k0; chunk < k1; ++chunk) {
    const int64_t c0 = chunk * kKernelChunk;
    winograd_kernel_grad_chunk<kN>(du + c0, cin * cout, parts, kN * kN * cin * cout, G, taps);
    for (int64_t c = 0; c < kKernelChunk; ++c) {
      const int64_t ci = (c0 + c) / cout, co = (c0 + c) % cout;
      float* k = dg + (co * cin + ci) * 9;
      for (int64_t t = 0; t < 9; ++t) {
        k[t] = taps[t][c];
      }
    }
  }
}

DIFFUSION_KERNELS_FMA_CLONES
void winograd_kernel_grad_chunks(const float* __restrict__ du, int64_t parts, int64_t cout, int64_t cin, int64_t tile,
    int64_t k0, int64_t k1, float* __restrict__ dg) {
  tile == 4 ? winograd_kernel_grad_chunks_impl<6>(du, parts, cout, cin, kWinogradG4, k0, k1, dg)
            : winograd_kernel_grad_chunks_impl<4>(du, parts, cout, cin, kWinogradG2, k0, k1, dg);
}

void check_winograd_kernel(const at::Tensor& weight, int64_t tile, const char* op) {
  TORCH_CHECK(tile == 2 || tile == 4, op, ": tile must be 2 (F(2x2, 3x3)) or 4 (F(4x4, 3x3)), got ", tile);
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 3 && weight.size(3) == 3 && weight.scalar_type() == at::kFloat &&
      weight.is_contiguous() && weight.device().is_cpu(),
      op, ": weight must be a contiguous float32 (Cout, Cin, 3, 3) CPU tensor, got ", weight.scalar_type(), " ",
      weight.sizes(), " with strides ", weight.strides());
  TORCH_CHECK(weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0 && weight.size(0) > 0 && weight.size(1) > 0,
      op, ": channel counts must be positive multiples of 16, got Cout=", weight.size(0), ", Cin=", weight.size(1));
}

// Chunks a thread takes at least: 4 of kKernelChunk kernels (too few to pay for a second thread below that).
constexpr int64_t kKernelChunkGrain = 4;

// U = G g G^T of a (Cout, Cin, 3, 3) float32 kernel as conv3x3_winograd's (n * n, Cin, Cout) operand; rotated: the
// kernel turned 180 degrees with its channels swapped, (n * n, Cout, Cin), the operand of the input's gradient.
at::Tensor winograd_kernel_cpu(const at::Tensor& weight, int64_t tile, bool rotated) {
  check_winograd_kernel(weight, tile, "winograd_kernel");
  const int64_t cout = weight.size(0), cin = weight.size(1), n = tile + 2;
  at::Tensor u = rotated ? at::empty({n * n, cout, cin}, weight.options()) : at::empty({n * n, cin, cout}, weight.options());
  const float* g = weight.const_data_ptr<float>();
  float* out = u.mutable_data_ptr<float>();
  at::parallel_for(0, cin * cout / kKernelChunk, kKernelChunkGrain, [&](int64_t begin, int64_t end) {
    winograd_kernel_chunks(g, cout, cin, tile, rotated, begin, end, out);
  });
  return u;
}

// One training step's backward of y = conv2d(x, g, b, padding=1) computed in Winograd's domain, each output only
// where asked (output_mask: dL/dx, dL/dg, dL/db; the others come back empty):
// dL/dx = conv3x3_winograd(dL/dy, the rotated kernel's transform); dL/dg = G^T conv3x3_winograd_weight_grad G, in
// g's (Cout, Cin, 3, 3) layout; dL/db = dL/dy summed over the batch and the positions, in a fixed order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv3x3_winograd_backward_cpu(const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& weight, int64_t tile, std::array<bool, 3> output_mask) {
  check_winograd_kernel(weight, tile, "conv3x3_winograd_backward");
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.scalar_type() == at::kFloat &&
      grad_out.is_contiguous(at::MemoryFormat::ChannelsLast) && grad_out.size(1) == weight.size(0),
      "conv3x3_winograd_backward: grad_out must be a channels-last float32 (B, Cout=", weight.size(0),
      ", H, W) tensor, got ", grad_out.scalar_type(), " ", grad_out.sizes(), " with strides ", grad_out.strides());
  TORCH_CHECK(x.dim() == 4 && x.size(1) == weight.size(1) && x.size(0) == grad_out.size(0) &&
      x.size(2) == grad_out.size(2) && x.size(3) == grad_out.size(3),
      "conv3x3_winograd_backward: x must be (B, Cin=", weight.size(1), ", H, W) of grad_out's ", grad_out.sizes(),
      ", got ", x.sizes());
  const auto empty = [&] { return at::empty({0}, weight.options()); };
  at::Tensor grad_x = output_mask[0]
      ? conv3x3_winograd_cpu(grad_out, winograd_kernel_cpu(weight, tile, true), std::nullopt, false)
      : empty();
  at::Tensor grad_weight = empty();
  if (output_mask[1]) {
    const at::Tensor du = winograd_weight_grad_parts(x, grad_out, tile);  // (parts, n * n, Cin, Cout)
    const int64_t cin = weight.size(1), cout = weight.size(0);
    grad_weight = at::empty(weight.sizes(), weight.options());
    const float* d = du.const_data_ptr<float>();
    float* gw = grad_weight.mutable_data_ptr<float>();
    at::parallel_for(0, cin * cout / kKernelChunk, kKernelChunkGrain, [&](int64_t begin, int64_t end) {
      winograd_kernel_grad_chunks(d, du.size(0), cout, cin, tile, begin, end, gw);
    });
  }
  at::Tensor grad_bias = empty();
  if (output_mask[2]) {
    // Rows of Cout channels summed in chunks of a fixed size, then the chunks in order: the same bits whatever the
    // threads.
    const int64_t cout = grad_out.size(1), rows = grad_out.numel() / std::max<int64_t>(cout, 1);
    constexpr int64_t kRows = 256;
    const int64_t chunks = (rows + kRows - 1) / kRows;
    std::vector<float> partial(chunks * cout, 0.0f);
    const float* gy = grad_out.const_data_ptr<float>();
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t r1 = std::min(rows, (chunk + 1) * kRows);
        for (int64_t r = chunk * kRows; r < r1; ++r) {
          add_row(gy + r * cout, cout, partial.data() + chunk * cout);
        }
      }
    });
    grad_bias = at::zeros({cout}, weight.options());
    float* gb = grad_bias.mutable_data_ptr<float>();
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      add_row(partial.data() + chunk * cout, cout, gb);
    }
  }
  return {grad_x, grad_weight, grad_bias};
}

// A dense channels-last image or volume: (B, C, H, W) or (B, C, D, H, W) with the channels innermost.
bool is_dense_channels_last(const at::Tensor& t) {
  return (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
      (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d));
}

}  // namespace

BiasAdd prepare_bias_add(
    const at::Tensor& h,
    const at::Tensor& bias,
    const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& residual2) {
  TORCH_CHECK(is_step_dtype(h.scalar_type()), "bias_add_: h must be float32, float16 or bfloat16, got ", h.scalar_type());
  TORCH_CHECK(is_dense_channels_last(h), "bias_add_: h must be a dense channels-last (B, C, H, W) or (B, C, D, H, W) tensor, got sizes ",
      h.sizes(), " and strides ", h.strides());
  const int64_t channels = h.size(1);
  TORCH_CHECK(bias.device() == h.device(), "bias_add_: bias is on ", bias.device(), " but h is on ", h.device());
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.dim() == 1 && bias.size(0) == channels && bias.is_contiguous(),
      "bias_add_: bias must be a contiguous float32 (", channels, ",) tensor, got ", bias.scalar_type(), " ", bias.sizes());
  TORCH_CHECK(residual.has_value() || !residual2.has_value(), "bias_add_: residual2 goes with residual");
  int64_t c1 = channels;
  for (const auto* r : {&residual, &residual2}) {
    if (!r->has_value()) {
      continue;
    }
    const at::Tensor& t = **r;
    const char* name = r == &residual ? "residual" : "residual2";
    TORCH_CHECK(t.device() == h.device(), "bias_add_: ", name, " is on ", t.device(), " but h is on ", h.device());
    TORCH_CHECK(t.scalar_type() == h.scalar_type(), "bias_add_: ", name, " must have h's dtype ", h.scalar_type(),
        ", got ", t.scalar_type());
    TORCH_CHECK(t.dim() == h.dim() && t.size(0) == h.size(0) && t.sizes().slice(2) == h.sizes().slice(2),
        "bias_add_: ", name, " must have h's batch and spatial sizes, got ", t.sizes(), " for ", h.sizes());
    TORCH_CHECK(is_dense_channels_last(t), "bias_add_: ", name, " must be dense channels-last, got strides ", t.strides());
    TORCH_CHECK(at::get_overlap_status(h, t) == at::MemOverlapStatus::No,
        "bias_add_: ", name, " must not overlap h");
  }
  if (residual.has_value()) {
    c1 = residual->size(1);
    const int64_t c2 = residual2.has_value() ? residual2->size(1) : 0;
    TORCH_CHECK(c1 + c2 == channels, "bias_add_: the residuals' ", c1, " + ", c2, " channels are not h's ", channels);
  }
  return BiasAdd{
      h.data_ptr(),
      bias.const_data_ptr<float>(),
      residual.has_value() ? residual->const_data_ptr() : nullptr,
      residual2.has_value() ? residual2->const_data_ptr() : nullptr,
      h.numel() / std::max<int64_t>(channels, 1),
      channels,
      c1};
}

namespace {

template <typename T>
void bias_add_cpu_impl(const BiasAdd& a) {
  T* h = static_cast<T*>(a.h);
  const T* r1 = static_cast<const T*>(a.residual);
  const T* r2 = static_cast<const T*>(a.residual2);
  const int64_t c2 = a.channels - a.c1;
  at::parallel_for(0, a.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      T* row = h + q * a.channels;
      for (int64_t c = 0; c < a.channels; ++c) {
        float res = 0.0f;
        if (r1 != nullptr) {
          res = c < a.c1 ? static_cast<float>(r1[q * a.c1 + c]) : static_cast<float>(r2[q * c2 + (c - a.c1)]);
        }
        row[c] = static_cast<T>(bias_add_element(static_cast<float>(row[c]), a.bias[c], res, r1 != nullptr));
      }
    }
  });
}

void bias_add_cpu(
    const at::Tensor& h,
    const at::Tensor& bias,
    const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& residual2) {
  const BiasAdd a = prepare_bias_add(h, bias, residual, residual2);
  if (h.numel() == 0) {
    return;
  }
  dispatch_step_dtype(h.scalar_type(), "h", [&](auto tag) { bias_add_cpu_impl<decltype(tag)>(a); });
}

// SplitMix64 numbers first .. first + n - 1 of `seed` into z. Also compiled for x86-64-v4 (AVX-512) and v3 (AVX2),
// picked when the library loads: the 64-bit multiplies are the op's whole cost, and baseline x86-64 has no vector
// form of them (one AVX-512 lane per number is several times the scalar loop).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void splitmix64_block(uint64_t seed, uint64_t first, int64_t n, uint64_t* __restrict__ z) {
  for (int64_t k = 0; k < n; ++k) {
    z[k] = splitmix64(seed, first + static_cast<uint64_t>(k));
  }
}

template <typename T>
void seeded_dropout_cpu_impl(const T* __restrict__ x, T* __restrict__ y, int64_t numel, uint64_t seed, double p) {
  // keep when the 32 bits are >= p * 2^32 (exact in double; below 2^32 for p < 1), scaled by 1 / (1 - p).
  const auto threshold = static_cast<uint32_t>(std::ldexp(p, 32));
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  constexpr int64_t kBlock = 1024;  // numbers per block: 2,048 elements, 16 KiB of bits on the stack
  const int64_t numbers = (numel + 1) / 2;
  at::parallel_for(0, numbers, kCpuGrain / 2, [&](int64_t begin, int64_t end) {
    uint64_t z[kBlock];
    uint32_t bits[2 * kBlock];  // element 2j's bits: number j's low half; element 2j + 1's: its high half
    for (int64_t j0 = begin; j0 < end; j0 += kBlock) {
      const int64_t n = std::min(kBlock, end - j0);
      splitmix64_block(seed, static_cast<uint64_t>(j0), n, z);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      std::memcpy(bits, z, static_cast<size_t>(n) * sizeof(uint64_t));  // low half first, as element order wants
#else
      for (int64_t k = 0; k < n; ++k) {
        bits[2 * k] = static_cast<uint32_t>(z[k]);
        bits[2 * k + 1] = static_cast<uint32_t>(z[k] >> 32);
      }
#endif
      const int64_t i0 = 2 * j0, count = std::min(2 * n, numel - i0);  // an odd numel's last number: half used
      for (int64_t k = 0; k < count; ++k) {  // x read whether kept or not: a branch-free loop GCC vectorizes
        const float kept = static_cast<float>(x[i0 + k]) * scale;
        y[i0 + k] = static_cast<T>(bits[k] >= threshold ? kept : 0.0f);
      }
    }
  });
}

at::Tensor seeded_dropout_cpu(const at::Tensor& x, int64_t seed, double p) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "seeded_dropout: p must be in [0, 1), got ", p);
  const at::Tensor input = x.contiguous();  // the mask is indexed in row-major order, whatever x's layout
  at::Tensor out = at::empty(input.sizes(), input.options());
  if (input.numel() == 0) {
    return out;
  }
  dispatch_step_dtype(input.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    seeded_dropout_cpu_impl<T>(
        input.const_data_ptr<T>(), out.mutable_data_ptr<T>(), input.numel(), static_cast<uint64_t>(seed), p);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(diffusion_kernels, m) {
  m.def(
      "fused_step_(Tensor(a!) x, Tensor eps, Tensor? noise, Tensor(b!)? xstart, Tensor coefficients, "
      "Tensor step, *, bool clip_denoised, bool use_prev, float? guidance=None) -> ()");
  m.def("gather_timestep_(Tensor(a!) t, Tensor timesteps, Tensor step) -> ()");
  m.def(
      "group_norm_act(Tensor x, Tensor? x2, Tensor weight, Tensor bias, Tensor? x_bias, Tensor? scale, "
      "Tensor? shift, *, int groups, float eps, bool silu) -> Tensor");
  m.def(
      "group_norm_act_backward(Tensor grad, Tensor x, Tensor weight, Tensor bias, Tensor? scale, Tensor? shift, *, "
      "int groups, float eps, bool silu) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("conv3x3_winograd(Tensor x, Tensor weight, Tensor? bias, *, bool upsample=False) -> Tensor");
  m.def("conv3x3_winograd_weight_grad(Tensor x, Tensor grad_out, int tile=2) -> Tensor");
  m.def("winograd_kernel(Tensor weight, int tile, bool rotated=False) -> Tensor");
  m.def(
      "conv3x3_winograd_backward(Tensor grad_out, Tensor x, Tensor weight, int tile, bool[3] output_mask) -> "
      "(Tensor, Tensor, Tensor)");
  m.def("bias_add_(Tensor(a!) h, Tensor bias, Tensor? residual, Tensor? residual2) -> ()");
  m.def("seeded_dropout(Tensor x, int seed, float p) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffusion_kernels, CPU, m) {
  m.impl("fused_step_", &fused_step_cpu);
  m.impl("gather_timestep_", &gather_timestep_cpu);
  m.impl("group_norm_act", &group_norm_act_cpu);
  m.impl("group_norm_act_backward", &group_norm_act_backward_cpu);
  m.impl("conv3x3_winograd", &conv3x3_winograd_cpu);
  m.impl("conv3x3_winograd_weight_grad", &conv3x3_winograd_weight_grad_cpu);
  m.impl("winograd_kernel", &winograd_kernel_cpu);
  m.impl("conv3x3_winograd_backward", &conv3x3_winograd_backward_cpu);
  m.impl("bias_add_", &bias_add_cpu);
  m.impl("seeded_dropout", &seeded_dropout_cpu);
}

}  // namespace diffusion_kernels

// `import _diffusion_kernels` only has to load this library (the static registrations above
// run at load time); the Python module itself is empty. TORCH_EXTENSION_NAME is set by
// torch.utils.cpp_extension for both setup.py and JIT builds.
#define DIFFUSION_KERNELS_CONCAT_(a, b) a##b
#define DIFFUSION_KERNELS_CONCAT(a, b) DIFFUSION_KERNELS_CONCAT_(a, b)
#define DIFFUSION_KERNELS_STR_(a) #a
#define DIFFUSION_KERNELS_STR(a) DIFFUSION_KERNELS_STR_(a)

PyMODINIT_FUNC DIFFUSION_KERNELS_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      DIFFUSION_KERNELS_STR(TORCH_EXTENSION_NAME), /* m_name */
      "diffusion_kernels custom ops (registered in torch.ops.diffusion_kernels on import)", /* m_doc */
      -1, /* m_size */
      nullptr, /* m_methods */
  };
  return PyModule_Create(&module_def);
}
