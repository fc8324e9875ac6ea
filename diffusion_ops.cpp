// The diffusion_kernels custom ops: schemas, argument checks and CPU kernels (the Winograd convolutions' kernels are in
// diffusion_winograd.cpp, the thin convolutions' in diffusion_thin_conv.cpp, compiled beside this file;
// diffusion_cpu.h holds what they share).
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
//
//   conv3x3_thin(x, weight, bias) -> Tensor
//   conv3x3_thin_backward(grad_out, x, weight, output_mask) -> (Tensor, Tensor, Tensor)
//       A 3x3 convolution (stride 1, padding 1) of a channels-last float32 x, CPU only, whose weight (Cout, Cin,
//       3, 3) has 1 to 4 channels on one side and a multiple of 8 on the other (the U-Net's first and last
//       convolutions), computed directly (diffusion_thin_conv.cpp); its backward as conv3x3_winograd_backward's.
#include <Python.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "diffusion_cpu.h"
#include "diffusion_kernels.h"

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
  GroupNormAct a{s, nullptr, 0, 0, 0, weight.const_data_ptr<float>(), bias.const_data_ptr<float>(),
      scale.has_value() ? scale->const_data_ptr<float>() : nullptr, shift.has_value() ? shift->const_data_ptr<float>() : nullptr,
      modulation_stride, x.size(0), channels, groups, channels / groups, positions, static_cast<float>(eps), silu};
  if (out != nullptr) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape[1] = channels;
    *out = at::empty(shape, x.options().memory_format(x.suggest_memory_format()));
    a.out = out->mutable_data_ptr();
    a.out_stride_b = out->stride(0);
    a.out_stride_c = out->stride(1);
    a.out_stride_p = position_stride(*out, "the output");
  }
  return a;
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

// Rows of float32 narrowed to bf16, 16 elements at a time (vectorized; torch's scalar conversions are not): the group
// norm's bf16 output (widen_bf16, below, its input).
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

}  // namespace

// Rows of bf16 widened to float32, 16 elements at a time (vectorized; torch's scalar conversions are not): the group
// norm's bf16 input, and a bf16 gradient's rows summed for a bias (diffusion_winograd.cpp).
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

// sums[c] += v[c] for c = 0, 1, ..., n - 1 (one level of the channels-last loop's row tree; the Winograd gradients'
// sums too).
DIFFUSION_KERNELS_CLONES
void add_row(const float* __restrict__ v, int64_t n, float* __restrict__ sums) {
  for (int64_t c = 0; c < n; ++c) {
    sums[c] = add_rn(sums[c], v[c]);
  }
}

namespace {

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

// Rows of P positions: c1 channels of x1 then c2 of x2 (x2 null: c2 = 0) into dst's rows of c1 + c2 floats, and back
// from src's rows into dx1 and dx2; bf16 widened and narrowed on the way.
template <typename T>
void gather_rows(const T* x1, int64_t c1, const T* x2, int64_t c2, int64_t P, float* dst) {
  for (int64_t p = 0; p < P; ++p) {
    float* row = dst + p * (c1 + c2);
    if constexpr (std::is_same_v<T, float>) {
      std::copy(x1 + p * c1, x1 + (p + 1) * c1, row);
      if (c2 > 0) {
        std::copy(x2 + p * c2, x2 + (p + 1) * c2, row + c1);
      }
    } else {
      widen_bf16(reinterpret_cast<const uint16_t*>(x1 + p * c1), c1, row);
      if (c2 > 0) {
        widen_bf16(reinterpret_cast<const uint16_t*>(x2 + p * c2), c2, row + c1);
      }
    }
  }
}

template <typename T>
void scatter_rows(const float* src, int64_t c1, int64_t c2, int64_t P, T* dx1, T* dx2) {
  for (int64_t p = 0; p < P; ++p) {
    const float* row = src + p * (c1 + c2);
    if constexpr (std::is_same_v<T, float>) {
      std::copy(row, row + c1, dx1 + p * c1);
      if (c2 > 0) {
        std::copy(row + c1, row + c1 + c2, dx2 + p * c2);
      }
    } else {
      narrow_bf16(row, c1, reinterpret_cast<uint16_t*>(dx1 + p * c1));
      if (c2 > 0) {
        narrow_bf16(row + c1, c2, reinterpret_cast<uint16_t*>(dx2 + p * c2));
      }
    }
  }
}

// x: the norm's input, x2's channels (when given) after x's; dx and dx2 their gradients.
template <typename T>
void group_norm_act_backward_impl(const at::Tensor& grad, const at::Tensor& x, const at::Tensor* x2, const float* weight,
    const float* bias, const float* scale, const float* shift, int64_t modulation_stride, int64_t groups, float eps,
    bool silu, at::Tensor& dx, at::Tensor* dx2, float* dscale, float* dshift, float* per_sample) {
  const int64_t B = x.size(0), c1 = x.size(1), c2 = x2 != nullptr ? x2->size(1) : 0, C = c1 + c2;
  const int64_t P = x.numel() / (B * c1), cg = C / groups;
  const float count = static_cast<float>(P * cg);
  const T* xs = x.const_data_ptr<T>();
  const T* x2s = x2 != nullptr ? x2->const_data_ptr<T>() : nullptr;
  const T* gs = grad.const_data_ptr<T>();
  T* dxs = dx.mutable_data_ptr<T>();
  T* dx2s = dx2 != nullptr ? dx2->mutable_data_ptr<T>() : nullptr;
  // float32 of one source is read and written in place; the others go through a sample's rows in a buffer.
  constexpr bool kFloat = std::is_same_v<T, float>;
  const bool direct = kFloat && x2 == nullptr;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xbuf(direct ? 0 : P * C), gbuf(kFloat ? 0 : P * C), da(P * C);
    std::vector<float> mean(C), rstd(C), sums(4 * C), scale1(scale != nullptr ? C : 0), k1(C), k2(C), tmp(C), squares(C);
    for (int64_t b = begin; b < end; ++b) {
      const float* xr;
      const float* gr;
      if (direct) {
        xr = reinterpret_cast<const float*>(xs + b * P * C);
      } else {
        gather_rows(xs + b * P * c1, c1, x2s != nullptr ? x2s + b * P * c2 : nullptr, c2, P, xbuf.data());
        xr = xbuf.data();
      }
      if constexpr (kFloat) {
        gr = gs + b * P * C;
      } else {
        widen_bf16(reinterpret_cast<const uint16_t*>(gs + b * P * C), P * C, gbuf.data());
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
      if (direct) {
        gn_backward_dx(xr, P, C, mean.data(), rstd.data(), weight, k1.data(), k2.data(), da.data(),
            reinterpret_cast<float*>(dxs + b * P * C));
      } else {
        gn_backward_dx(xr, P, C, mean.data(), rstd.data(), weight, k1.data(), k2.data(), da.data(), da.data());
        scatter_rows(da.data(), c1, c2, P, dxs + b * P * c1, dx2s != nullptr ? dx2s + b * P * c2 : nullptr);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_norm_act_backward_cpu(
    const at::Tensor& grad,
    const at::Tensor& x,
    const std::optional<at::Tensor>& x2,
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
  TORCH_CHECK(!x2.has_value() || x2->is_contiguous(cl),
      "group_norm_act_backward: x2 must be a channels-last tensor, got strides ", x2->strides());
  // The forward's checks of x2, weight, bias, scale and shift (the same arguments); dx has x's shape, dtype and
  // layout, dx2 x2's.
  const GroupNormAct a = prepare_group_norm_act(x, x2, weight, bias, std::nullopt, scale, shift, groups, eps, silu, nullptr);
  const int64_t B = x.size(0), C = a.channels;
  TORCH_CHECK(grad.dim() == 4 && grad.size(0) == B && grad.size(1) == C && grad.sizes().slice(2) == x.sizes().slice(2) &&
      grad.scalar_type() == x.scalar_type() && grad.is_contiguous(cl),
      "group_norm_act_backward: grad must be a channels-last (", B, ", ", C, ", H, W) tensor of x's sizes and dtype, got ",
      grad.scalar_type(), " ", grad.sizes(), " with strides ", grad.strides());
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(cl));
  at::Tensor dx2 = x2.has_value() ? at::empty(x2->sizes(), x.options().memory_format(cl)) : at::empty({0}, x.options());
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor dscale = at::empty({scale.has_value() ? B : 0, C}, f32), dshift = at::empty({scale.has_value() ? B : 0, C}, f32);
  std::vector<float> per_sample(B * 2 * C);
  auto run = [&](auto tag) {
    group_norm_act_backward_impl<decltype(tag)>(grad, x, x2.has_value() ? &*x2 : nullptr, a.weight, a.bias, a.scale,
        a.shift, a.modulation_stride, groups, a.eps, silu, dx, x2.has_value() ? &dx2 : nullptr,
        dscale.mutable_data_ptr<float>(), dshift.mutable_data_ptr<float>(), per_sample.data());
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
  return {dx, dx2, dweight, dbias, dscale, dshift};
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
      "group_norm_act_backward(Tensor grad, Tensor x, Tensor? x2, Tensor weight, Tensor bias, Tensor? scale, "
      "Tensor? shift, *, int groups, float eps, bool silu) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("conv3x3_winograd(Tensor x, Tensor weight, Tensor? bias, *, bool upsample=False) -> Tensor");
  m.def("conv3x3_winograd_weight_grad(Tensor x, Tensor grad_out, int tile=2) -> Tensor");
  m.def("winograd_kernel(Tensor weight, int tile, bool rotated=False) -> Tensor");
  m.def(
      "conv3x3_winograd_backward(Tensor grad_out, Tensor x, Tensor weight, int tile, bool[3] output_mask) -> "
      "(Tensor, Tensor, Tensor)");
  m.def("conv3x3_thin(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("conv3x3_thin_backward(Tensor grad_out, Tensor x, Tensor weight, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
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
  m.impl("conv3x3_thin", &conv3x3_thin_cpu);
  m.impl("conv3x3_thin_backward", &conv3x3_thin_backward_cpu);
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
