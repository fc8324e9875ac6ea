// CUDA kernels of the diffusion_kernels ops (schemas and CPU kernels: diffusion_ops.cpp).
//
// Both kernels read the step index from device memory (the one-element int64 step counter),
// so nothing here synchronizes with the host and one captured CUDA graph serves every step of a
// sampling plan. Every launch goes to the current stream, c10::cuda::getCurrentCUDAStream()
// (the same as at::cuda::getCurrentCUDAStream(); graph capture makes its capture stream
// current), and is checked with C10_CUDA_KERNEL_LAUNCH_CHECK().
//
// fused_step_ is memory bound: per element it reads x, eps [, the unconditional eps when guided]
// [, noise] [, xstart] and writes x [, xstart], each exactly once. It moves 16 bytes per load/store of the widest tensor when every
// pointer is aligned for that (a scalar tail covers numel % VEC), and falls back to one element
// per load otherwise (e.g. a view that starts at an odd element). Arithmetic is float32 with
// round-to-nearest products and sums (no FMA contraction), which matches noise_schedule.p_step
// bit for bit.
// Only c10/cuda headers: ATen/cuda/CUDAContext.h would pull in the cuBLAS/cuSPARSE headers,
// which a bare CUDA toolkit (as on the CI machines) may not ship.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "diffusion_kernels.h"

namespace diffusion_kernels {
namespace {

constexpr int kThreads = 256;
// Grid cap: 4096 blocks of 256 threads are about four times what an H100 (132 SMs x 2048
// threads) holds at once, enough to saturate memory bandwidth; larger tensors grid-stride. A
// fixed cap needs no device query, so launching stays cheap and capture-safe.
constexpr int64_t kMaxBlocks = 4096;

// VEC elements of T loaded or stored as one aligned access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Packed {
  T v[VEC];
};

// The step counter, range-checked on the device. An out-of-range step is a programming error
// (the host never reads the counter, so it cannot raise): the device assert aborts the kernel,
// and the early return keeps builds without device asserts from reading out of bounds.
__device__ __forceinline__ bool read_step(const int64_t* step, int64_t num_steps, int64_t* s) {
  *s = *step;
  CUDA_KERNEL_ASSERT(*s >= 0 && *s < num_steps);
  return *s >= 0 && *s < num_steps;
}

// One thread handles VEC consecutive elements per grid-stride iteration; VEC == 1 is the
// unaligned (scalar) path. The elements past the last whole vector go through the scalar tail.
template <typename T, typename E, int VEC>
__global__ void __launch_bounds__(kThreads) fused_step_kernel(
    T* __restrict__ x,
    const E* __restrict__ eps,
    const E* __restrict__ eps_uncond,  // nullptr: unguided; else the unconditional half (eps + numel)
    float guidance,
    const T* __restrict__ noise,  // nullptr: deterministic step
    T* __restrict__ xstart,  // nullptr: pred_xstart is not stored
    const float* __restrict__ coefficients,  // (S, 7)
    const int64_t* __restrict__ step,  // ()
    int64_t num_steps,
    int64_t numel,
    bool clip_denoised,
    bool use_prev) {
  int64_t s;
  if (!read_step(step, num_steps, &s)) {
    return;
  }
  // Six broadcast loads per thread, served from cache after the first warp.
  const StepCoefficients c = load_coefficients(coefficients + s * kNumCoefficients);
  const bool guided = eps_uncond != nullptr;
  const bool has_noise = noise != nullptr;
  const bool store_xstart = xstart != nullptr;

  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t num_vec = numel / VEC;

  for (int64_t v = first; v < num_vec; v += stride) {
    const Packed<T, VEC> xv = reinterpret_cast<const Packed<T, VEC>*>(x)[v];
    const Packed<E, VEC> ev = reinterpret_cast<const Packed<E, VEC>*>(eps)[v];
    Packed<E, VEC> uv{};
    if (guided) {
      uv = reinterpret_cast<const Packed<E, VEC>*>(eps_uncond)[v];
    }
    Packed<T, VEC> nv{};
    Packed<T, VEC> pv{};
    if (has_noise) {
      nv = reinterpret_cast<const Packed<T, VEC>*>(noise)[v];
    }
    if (use_prev) {
      pv = reinterpret_cast<const Packed<T, VEC>*>(xstart)[v];
    }
    Packed<T, VEC> x_out;
    Packed<T, VEC> pred_out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float e = guided ? guide(static_cast<float>(ev.v[k]), static_cast<float>(uv.v[k]), guidance)
                             : static_cast<float>(ev.v[k]);
      const StepResult r = step_element(
          c,
          static_cast<float>(xv.v[k]),
          e,
          static_cast<float>(nv.v[k]),
          static_cast<float>(pv.v[k]),
          clip_denoised,
          has_noise,
          use_prev);
      x_out.v[k] = static_cast<T>(r.x_prev);
      pred_out.v[k] = static_cast<T>(r.pred_xstart);
    }
    reinterpret_cast<Packed<T, VEC>*>(x)[v] = x_out;
    if (store_xstart) {
      reinterpret_cast<Packed<T, VEC>*>(xstart)[v] = pred_out;
    }
  }

  // Scalar tail: the numel % VEC elements after the last whole vector (none when VEC == 1).
  for (int64_t i = num_vec * VEC + first; i < numel; i += stride) {
    step_at(c, i, x, eps, eps_uncond, guidance, noise, xstart, clip_denoised, guided, has_noise, use_prev, store_xstart);
  }
}

// t[:] = timesteps[step] for the U-Net's (B,) timestep input.
__global__ void gather_timestep_kernel(
    int64_t* __restrict__ t,
    int64_t batch,
    const int64_t* __restrict__ timesteps,  // (S,)
    const int64_t* __restrict__ step,  // ()
    int64_t num_steps) {
  int64_t s;
  if (!read_step(step, num_steps, &s)) {
    return;
  }
  const int64_t value = timesteps[s];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < batch; i += stride) {
    t[i] = value;
  }
}

bool is_aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// Enough blocks to cover `work` items, at most kMaxBlocks; the kernels grid-stride the rest.
unsigned int grid_size(int64_t work) {
  const int64_t wanted = (std::max<int64_t>(work, 1) + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::min(wanted, kMaxBlocks));
}

template <typename T, typename E>
void launch_fused_step(
    const at::Tensor& x,
    const at::Tensor& eps,
    const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& xstart,
    const at::Tensor& coefficients,
    const at::Tensor& step,
    bool clip_denoised,
    bool use_prev,
    std::optional<double> guidance) {
  // 16-byte accesses for the wider of the two element types; the narrower one moves 8 bytes.
  constexpr int kVec = static_cast<int>(16 / std::max(sizeof(T), sizeof(E)));
  T* x_ptr = x.mutable_data_ptr<T>();
  const E* eps_ptr = eps.const_data_ptr<E>();
  const E* uncond_ptr = guidance.has_value() ? eps_ptr + x.numel() : nullptr;
  const float w = static_cast<float>(guidance.value_or(1.0));
  const T* noise_ptr = noise.has_value() ? noise->const_data_ptr<T>() : nullptr;
  T* xstart_ptr = xstart.has_value() ? xstart->mutable_data_ptr<T>() : nullptr;
  const bool vectorize = is_aligned(x_ptr, kVec * sizeof(T)) && is_aligned(eps_ptr, kVec * sizeof(E)) &&
      is_aligned(uncond_ptr, kVec * sizeof(E)) && is_aligned(noise_ptr, kVec * sizeof(T)) &&
      is_aligned(xstart_ptr, kVec * sizeof(T));  // nullptr is aligned
  const int64_t numel = x.numel();
  const int64_t num_steps = coefficients.size(0);
  const float* coefficient_ptr = coefficients.const_data_ptr<float>();
  const int64_t* step_ptr = step.const_data_ptr<int64_t>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (vectorize) {
    fused_step_kernel<T, E, kVec><<<grid_size(numel / kVec), kThreads, 0, stream>>>(
        x_ptr, eps_ptr, uncond_ptr, w, noise_ptr, xstart_ptr, coefficient_ptr, step_ptr, num_steps, numel, clip_denoised,
        use_prev);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    fused_step_kernel<T, E, 1><<<grid_size(numel), kThreads, 0, stream>>>(
        x_ptr, eps_ptr, uncond_ptr, w, noise_ptr, xstart_ptr, coefficient_ptr, step_ptr, num_steps, numel, clip_denoised,
        use_prev);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void fused_step_cuda(
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
  if (x.numel() == 0) {
    return;
  }
  const c10::cuda::CUDAGuard device_guard(x.device());
  dispatch_step_dtype(x.scalar_type(), "x", [&](auto x_tag) {
    using T = decltype(x_tag);
    dispatch_step_dtype(eps.scalar_type(), "eps", [&](auto eps_tag) {
      using E = decltype(eps_tag);
      launch_fused_step<T, E>(x, eps, noise, xstart, coefficients, step, clip_denoised, use_prev, guidance);
    });
  });
}

void gather_timestep_cuda(const at::Tensor& t, const at::Tensor& timesteps, const at::Tensor& step) {
  check_gather_timestep_args(t, timesteps, step);
  const int64_t batch = t.numel();
  if (batch == 0) {
    return;
  }
  const c10::cuda::CUDAGuard device_guard(t.device());
  gather_timestep_kernel<<<grid_size(batch), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      t.mutable_data_ptr<int64_t>(),
      batch,
      timesteps.const_data_ptr<int64_t>(),
      step.const_data_ptr<int64_t>(),
      timesteps.size(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One block per (sample, group): thread k owns partial sum k of diffusion_kernels.h's fixed order
// (elements j = k, k + period, ...; threads past the period hold 0), the partials meet in the same pairwise tree as the CPU
// twin's, then each thread normalizes its own elements. Three reads of the group (sum, squared
// deviations, output; the second and third mostly from L2) and one write.
template <typename T>
__global__ void __launch_bounds__(kGnPartials) group_norm_act_kernel(const GroupNormAct a) {
  __shared__ float partial[kGnPartials];
  const int k = threadIdx.x;
  const int64_t b = blockIdx.x / a.groups, g = blockIdx.x % a.groups;
  const int64_t n = a.cg * a.positions, c0 = g * a.cg, period = gn_period(a.cg);
  auto reduce = [&](float mine) {
    partial[k] = mine;
    __syncthreads();
    for (int half = kGnPartials / 2; half >= 1; half /= 2) {
      if (k < half) {
        partial[k] = add_rn(partial[k], partial[k + half]);
      }
      __syncthreads();
    }
    const float total = partial[0];
    __syncthreads();  // partial is reused by the next reduction
    return total;
  };
  float sum = 0.0f;
  for (int64_t j = k; k < period && j < n; j += period) {
    sum = add_rn(sum, load_source<T>(a.src, b, c0 + j % a.cg, j / a.cg));
  }
  const float count = static_cast<float>(n);
  const float mean = div_rn(reduce(sum), count);
  float squares = 0.0f;
  for (int64_t j = k; k < period && j < n; j += period) {
    const float d = sub_rn(load_source<T>(a.src, b, c0 + j % a.cg, j / a.cg), mean);
    squares = add_rn(squares, mul_rn(d, d));
  }
  const float rstd = group_rstd(reduce(squares), count, a.eps);
  for (int64_t j = k; j < n; j += kGnPartials) {
    const int64_t c = c0 + j % a.cg, p = j / a.cg;
    store_group_norm_act<T>(a, b, c, p, load_source<T>(a.src, b, c, p), mean, rstd);
  }
}

// A block normalizes `chunk` consecutive groups of one sample (chunk = groups per block, chosen on the host) with
// chunk * kGnPartials threads: thread t owns channel cc = t % width of the chunk's width = chunk * cg channels and
// the positions p = r, r + M, r + 2M, ... with r = t / width and M = period / cg (threads with r >= M, where the
// period is short of kGnPartials, own nothing). That is exactly partial sum k = r * cg + cc % cg of group cc / cg
// in diffusion_kernels.h's fixed order (partial k holds channel k % cg's positions p = k / cg (mod M), added in
// increasing p), so the sums are the CPU twin's bit for bit whatever the chunk, while a warp reads whole
// channels-last rows of `width` channels. Each thread keeps up to kGnCached of its values in registers, so the
// group is read from memory once (three times past that: the squared deviations and the output read it again,
// mostly from L2). The kernel is short, so its cost is its chain of dependent steps: indices in 32 bits, and each
// group's pairwise tree in shared memory down to 64 partials, then in one warp's registers (__shfl_down_sync adds
// lane k + half to lane k: the same pairs as the tree).
constexpr int kGnCached = 16;

template <typename T>
__global__ void __launch_bounds__(1024) group_norm_act_chunk_kernel(const GroupNormAct a, const int chunk) {
  extern __shared__ float partial[];  // (chunk, kGnPartials), then (chunk,) sums
  float* totals = partial + chunk * kGnPartials;
  const int t = threadIdx.x;
  const int cg = static_cast<int>(a.cg);
  const int period = static_cast<int>(gn_period(a.cg)), m_step = period / cg;
  const int width = chunk * cg;
  const int chunks_per_sample = static_cast<int>(a.groups) / chunk;
  const int64_t b = blockIdx.x / chunks_per_sample;
  const int64_t c = static_cast<int64_t>(blockIdx.x % chunks_per_sample) * width + t % width;
  const int r = t / width, g = (t % width) / cg;
  const bool active = r < m_step;
  const int slot = g * kGnPartials + r * cg + (t % width) % cg;  // this thread's partial of group g
  // This thread's source: x's channel (with the producing convolution's bias) or x2's.
  const bool first = c < a.src.c1;
  const T* src = static_cast<const T*>(first ? a.src.x : a.src.x2) +
      (first ? b * a.src.stride_b1 + c * a.src.stride_c1 : b * a.src.stride_b2 + (c - a.src.c1) * a.src.stride_c2);
  const int64_t stride_p = first ? a.src.stride_p1 : a.src.stride_p2;
  const bool add_bias = active && first && a.src.x_bias != nullptr;
  const float x_bias = add_bias ? a.src.x_bias[c] : 0.0f;
  auto load = [&](int64_t p) {
    const float v = static_cast<float>(src[p * stride_p]);
    return add_bias ? add_rn(v, x_bias) : v;
  };
  const int64_t mine = active && r < a.positions ? (a.positions - 1 - r) / m_step + 1 : 0;  // positions r, r + M, ...
  const bool cached = a.positions <= static_cast<int64_t>(kGnCached) * m_step;
  float values[kGnCached];
  if (period < kGnPartials) {  // partials past the period stay 0 (the tree below writes only below 128 < period)
    for (int i = t; i < chunk * kGnPartials; i += blockDim.x) {
      partial[i] = 0.0f;
    }
    __syncthreads();
  }
  // Each group's kGnPartials partials summed in the pairwise tree; thread t reduces group t / kGnPartials.
  auto reduce = [&](float own) {
    if (active) {
      partial[slot] = own;
    }
    __syncthreads();
    float* mine_group = partial + (t / kGnPartials) * kGnPartials;
    const int k = t % kGnPartials;
    if (k < 128) {
      mine_group[k] = add_rn(mine_group[k], mine_group[k + 128]);
    }
    __syncthreads();
    if (k < 64) {
      mine_group[k] = add_rn(mine_group[k], mine_group[k + 64]);
    }
    __syncthreads();
    if (k < 32) {  // the group's first warp, whole
      float v = add_rn(mine_group[k], mine_group[k + 32]);
#pragma unroll
      for (int half = 16; half >= 1; half /= 2) {
        v = add_rn(v, __shfl_down_sync(0xffffffffu, v, half));
      }
      if (k == 0) {
        totals[t / kGnPartials] = v;
      }
    }
    __syncthreads();
    const float total = totals[g];
    __syncthreads();  // partial and totals are reused by the next reduction
    return total;
  };
  const float count = static_cast<float>(a.cg * a.positions);
  float sum = 0.0f;
  if (cached) {
#pragma unroll
    for (int i = 0; i < kGnCached; ++i) {
      if (i < mine) {
        values[i] = load(r + i * m_step);
        sum = add_rn(sum, values[i]);
      }
    }
  } else {
    for (int64_t i = 0; i < mine; ++i) {
      sum = add_rn(sum, load(r + i * m_step));
    }
  }
  const float mean = div_rn(reduce(sum), count);
  float squares = 0.0f;
  if (cached) {
#pragma unroll
    for (int i = 0; i < kGnCached; ++i) {
      if (i < mine) {
        const float d = sub_rn(values[i], mean);
        squares = add_rn(squares, mul_rn(d, d));
      }
    }
  } else {
    for (int64_t i = 0; i < mine; ++i) {
      const float d = sub_rn(load(r + i * m_step), mean);
      squares = add_rn(squares, mul_rn(d, d));
    }
  }
  const float rstd = group_rstd(reduce(squares), count, a.eps);
  if (!active) {
    return;
  }
  // The output: the same positions, with this channel's affine, scale and shift read once.
  const bool modulate = a.scale != nullptr;
  const float weight = a.weight[c], bias = a.bias[c];
  const float scale1 = modulate ? add_rn(1.0f, a.scale[b * a.modulation_stride + c]) : 0.0f;
  const float shift = modulate ? a.shift[b * a.modulation_stride + c] : 0.0f;
  T* out = static_cast<T*>(a.out) + b * a.out_stride_b + c * a.out_stride_c;
  auto store = [&](int64_t p, float v) {
    out[p * a.out_stride_p] =
        static_cast<T>(group_norm_act_element(v, mean, rstd, weight, bias, scale1, shift, modulate, a.silu));
  };
  if (cached) {
#pragma unroll
    for (int i = 0; i < kGnCached; ++i) {
      if (i < mine) {
        store(r + i * m_step, values[i]);
      }
    }
  } else {
    for (int64_t i = 0; i < mine; ++i) {
      store(r + i * m_step, load(r + i * m_step));
    }
  }
}

// Channels-last and 16-byte aligned (the runner's layout): a block normalizes `chunk` consecutive groups of one
// sample, and thread t owns one vector of V = 16 / sizeof(T) consecutive channels (vi = t % vectors) at the positions
// r, r + M, r + 2M, ... (r = t / vectors, M = period / cg), so a warp reads whole 16-byte pieces of consecutive rows
// and each thread keeps V independent sums: channel c's sum at residue r is exactly partial r * cg + c % cg of c's
// group in diffusion_kernels.h's fixed order, added in increasing p. The partials meet in shared memory; warp w then
// reduces group w: lane l holds partials l + 32 i (i < 8), adds levels 128, 64 and 32 of the tree in its registers
// (the tree's own pairs: k + 128 = l + 32 (i + 4), ...) and levels 16 to 1 by __shfl_down_sync. Same bits as the CPU
// twin for any chunk, with three barriers and a fraction of group_norm_act_chunk_kernel's threads (one per V values
// of a row instead of one per value): its latency was the cost, not its bytes. Up to kGnRowCachedValues values (64 / V
// vectors) stay in registers; past that the two later passes read again (mostly from L1/L2). Where it applies it is the
// default (gn_rows_chunk).
constexpr int kGnRowCachedValues = 64;
constexpr int kGnRowThreads = 512;

// The rows kernel's threads for `chunk` groups per block: one per vector of each residue row, and at least one warp
// per group for the trees, in whole warps.
int gn_rows_threads(const GroupNormAct& a, int chunk, int64_t vec) {
  const int64_t period = gn_period(a.cg);
  const int64_t threads = std::max<int64_t>(chunk * a.cg / vec * (period / a.cg), 32 * chunk);
  return static_cast<int>((threads + 31) / 32 * 32);
}

// group_norm_act_rows_kernel's reduction: this thread's V sums into their partial slots, then each group's tree
// (warp w: group w), then every thread reads the totals of its channels' groups into sums. No barrier at the end:
// the next reduction writes partial and totals only after its own first barrier, which every thread reaches after
// reading these. (A function forced inline, not a lambda called twice: a lambda's array arguments went to the stack.)
template <int V>
__device__ __forceinline__ void gn_rows_reduce(
    float (&sums)[V], float* partial, float* totals, bool active, int vi, int r, int cg, int chunk) {
  const int t = threadIdx.x;
  if (active) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int local = vi * V + j;  // channel within the block
      partial[(local / cg) * kGnPartials + r * cg + local % cg] = sums[j];
    }
  }
  __syncthreads();
  if (t < 32 * chunk) {
    const float* group = partial + (t / 32) * kGnPartials;
    const int l = t % 32;
    float s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      s[i] = group[l + 32 * i];
    }
#pragma unroll
    for (int half = 4; half >= 1; half /= 2) {
#pragma unroll
      for (int i = 0; i < half; ++i) {
        s[i] = add_rn(s[i], s[i + half]);
      }
    }
    float v = s[0];
#pragma unroll
    for (int half = 16; half >= 1; half /= 2) {
      v = add_rn(v, __shfl_down_sync(0xffffffffu, v, half));
    }
    if (l == 0) {
      totals[t / 32] = v;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < V; ++j) {
    sums[j] = totals[(vi * V + j) / cg];
  }
}

template <typename T>
__global__ void __launch_bounds__(kGnRowThreads, 1) group_norm_act_rows_kernel(const GroupNormAct a, const int chunk) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  using Vec = Packed<T, V>;
  constexpr int kGnRowCached = kGnRowCachedValues / V;
  extern __shared__ float partial[];  // (chunk, kGnPartials), then (chunk,) totals
  float* totals = partial + chunk * kGnPartials;
  const int t = threadIdx.x;
  const int cg = static_cast<int>(a.cg);
  const int period = static_cast<int>(gn_period(a.cg)), m_step = period / cg;
  const int vectors = chunk * cg / V;  // per row of the block's channels
  const int chunks_per_sample = static_cast<int>(a.groups) / chunk;
  const int64_t b = blockIdx.x / chunks_per_sample;
  const int c_block = (blockIdx.x % chunks_per_sample) * chunk * cg;
  const int vi = t % vectors, r = t / vectors;
  const bool active = r < m_step;  // threads past the M residues (or the block's rounding to warps) load nothing
  const int c = c_block + vi * V;  // this thread's first channel
  const bool first = c < a.src.c1;  // a vector never straddles x and x2 (c1 % V == 0, checked on the host)
  const T* src = first ? static_cast<const T*>(a.src.x) + b * a.src.stride_b1 + c
                       : static_cast<const T*>(a.src.x2) + b * a.src.stride_b2 + (c - a.src.c1);
  const int64_t stride_p = first ? a.src.stride_p1 : a.src.stride_p2;
  const int64_t positions = a.positions;
  const int64_t mine = active && r < positions ? (positions - 1 - r) / m_step + 1 : 0;
  const bool add_bias = first && a.src.x_bias != nullptr;
  auto x_bias = [&](int j) { return add_bias ? a.src.x_bias[c + j] : 0.0f; };
  auto value = [&](const Vec& v, int j, float bias) {
    const float f = static_cast<float>(v.v[j]);
    return add_bias ? add_rn(f, bias) : f;
  };
  auto load = [&](int64_t i) { return *reinterpret_cast<const Vec*>(src + (r + i * m_step) * stride_p); };
  // Partials past the period (cg not a power of two) stay 0; the reductions below write only slots below it.
  for (int i = t; i < chunk * (kGnPartials - period); i += blockDim.x) {
    partial[(i / (kGnPartials - period)) * kGnPartials + period + i % (kGnPartials - period)] = 0.0f;
  }
  // The cached vectors are walked channel by channel (j outer), so only one channel's constants are live at a time;
  // each partial still adds its positions in increasing order (the cached ones, then the rest).
  const float count = static_cast<float>(a.cg * a.positions);
  Vec cache[kGnRowCached];
#pragma unroll
  for (int i = 0; i < kGnRowCached; ++i) {
    if (i < mine) {
      cache[i] = load(i);
    }
  }
  float mean[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float xb = x_bias(j);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kGnRowCached; ++i) {
      if (i < mine) {
        sum = add_rn(sum, value(cache[i], j, xb));
      }
    }
    mean[j] = sum;
  }
  for (int64_t i = kGnRowCached; i < mine; ++i) {
    const Vec v = load(i);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      mean[j] = add_rn(mean[j], value(v, j, x_bias(j)));
    }
  }
  gn_rows_reduce<V>(mean, partial, totals, active, vi, r, cg, chunk);
  float rstd[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    mean[j] = div_rn(mean[j], count);
    const float xb = x_bias(j);
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < kGnRowCached; ++i) {
      if (i < mine) {
        const float d = sub_rn(value(cache[i], j, xb), mean[j]);
        squares = add_rn(squares, mul_rn(d, d));
      }
    }
    rstd[j] = squares;
  }
  for (int64_t i = kGnRowCached; i < mine; ++i) {
    const Vec v = load(i);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = sub_rn(value(v, j, x_bias(j)), mean[j]);
      rstd[j] = add_rn(rstd[j], mul_rn(d, d));
    }
  }
  gn_rows_reduce<V>(rstd, partial, totals, active, vi, r, cg, chunk);
  if (!active) {
    return;
  }
  // The output, each channel's affine, scale and shift read once: the cached vectors turned into outputs in place.
  const bool modulate = a.scale != nullptr;
  const int64_t row = b * a.modulation_stride + c;
  auto scale1 = [&](int j) { return modulate ? add_rn(1.0f, a.scale[row + j]) : 0.0f; };
  auto shift = [&](int j) { return modulate ? a.shift[row + j] : 0.0f; };
  auto output = [&](float v, int j) {
    return static_cast<T>(group_norm_act_element(
        v, mean[j], rstd[j], a.weight[c + j], a.bias[c + j], scale1(j), shift(j), modulate, a.silu));
  };
#pragma unroll
  for (int j = 0; j < V; ++j) {
    rstd[j] = group_rstd(rstd[j], count, a.eps);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float xb = x_bias(j), scale1_j = scale1(j), shift_j = shift(j);
    const float weight = a.weight[c + j], bias = a.bias[c + j];
#pragma unroll
    for (int i = 0; i < kGnRowCached; ++i) {
      if (i < mine) {
        cache[i].v[j] = static_cast<T>(group_norm_act_element(
            value(cache[i], j, xb), mean[j], rstd[j], weight, bias, scale1_j, shift_j, modulate, a.silu));
      }
    }
  }
  T* out = static_cast<T*>(a.out) + b * a.out_stride_b + c;
  auto store = [&](int64_t i, const Vec& y) { *reinterpret_cast<Vec*>(out + (r + i * m_step) * a.out_stride_p) = y; };
#pragma unroll
  for (int i = 0; i < kGnRowCached; ++i) {
    if (i < mine) {
      store(i, cache[i]);
    }
  }
  for (int64_t i = kGnRowCached; i < mine; ++i) {
    const Vec v = load(i);
    Vec y;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      y.v[j] = output(value(v, j, x_bias(j)), j);
    }
    store(i, y);
  }
}

// The device's SM count, asked once per device (a launch under graph capture then asks the driver nothing).
int sm_count(int device) {
  static int counts[64] = {0};
  if (device < 0 || device >= 64) {
    return 132;
  }
  if (counts[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    counts[device] = n;
  }
  return counts[device];
}

// Groups per block for group_norm_act_chunk_kernel: the most (a divisor of groups, at most 512 threads: two blocks
// fit an SM's registers, where one 1024-thread block would leave it idle at each of its barriers) whose chunk of
// channels spans at most 64 bytes (two 32-byte sectors of a channels-last row), then fewer while that would leave
// under two blocks per SM. Measured (BENCHMARKS.md, "The default path on a GPU"): 2 groups per block beat 1 and 4.
// DIFFUSION_KERNELS_GN_CHUNK=N forces N where it fits (a measuring knob: the result is the same bits for any chunk).
int gn_chunk(const GroupNormAct& a, int64_t element_size, int sm_count) {
  auto fits = [&](int64_t n, int64_t threads) { return n >= 1 && a.groups % n == 0 && n * kGnPartials <= threads; };
  if (const char* forced = std::getenv("DIFFUSION_KERNELS_GN_CHUNK")) {
    const int64_t n = std::atoll(forced);
    if (fits(n, 1024)) {
      return static_cast<int>(n);
    }
  }
  int64_t chunk = 1;
  while (fits(chunk * 2, 512) && chunk * 2 * a.cg * element_size <= 64) {
    chunk *= 2;
  }
  while (chunk > 1 && a.batch * (a.groups / chunk) < 2 * sm_count) {
    chunk /= 2;
  }
  return static_cast<int>(chunk);
}

// Groups per block for group_norm_act_rows_kernel, or 0 where it does not run: with DIFFUSION_KERNELS_GN_KERNEL=chunk
// (the chunk kernel, kept for comparison and as a way back), and where it does not apply (not channels-last with
// 16-byte aligned rows, or a vector of V channels straddling x and x2; groups of more than kGnPartials channels never
// get here: group_norm_act_cuda gives them the one-group kernel). The fewest groups whose channels make whole vectors,
// then twice as many while the block's piece of a row stays within 64 bytes (two 32-byte sectors) and at least two
// blocks per SM remain. DIFFUSION_KERNELS_GN_CHUNK=N forces N where it fits (the same bits for any N).
int gn_rows_chunk(const GroupNormAct& a, int64_t element_size, int sm_count) {
  const char* kernel = std::getenv("DIFFUSION_KERNELS_GN_KERNEL");
  if (kernel != nullptr && std::string(kernel) == "chunk") {
    return 0;
  }
  const int64_t vec = 16 / element_size;
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const GroupNormSources& s = a.src;
  auto rows_of_vectors = [&](int64_t stride_b, int64_t stride_c, int64_t stride_p) {
    return stride_c == 1 && stride_b % vec == 0 && stride_p % vec == 0;
  };
  const bool layout = rows_of_vectors(s.stride_b1, s.stride_c1, s.stride_p1) && s.c1 % vec == 0 &&
      (s.x2 == nullptr || rows_of_vectors(s.stride_b2, s.stride_c2, s.stride_p2)) &&
      rows_of_vectors(a.out_stride_b, 1, a.out_stride_p) && a.out_stride_c == 1 && aligned(s.x) && aligned(s.x2) &&
      aligned(a.out);
  if (!layout) {
    return 0;
  }
  auto fits = [&](int64_t n) {
    return n >= 1 && n <= a.groups && a.groups % n == 0 && (n * a.cg) % vec == 0 &&
        gn_rows_threads(a, static_cast<int>(n), vec) <= kGnRowThreads;
  };
  if (const char* forced = std::getenv("DIFFUSION_KERNELS_GN_CHUNK")) {
    const int64_t n = std::atoll(forced);
    if (fits(n)) {
      return static_cast<int>(n);
    }
  }
  int64_t chunk = 1;
  while (chunk < a.groups && !fits(chunk)) {
    chunk *= 2;
  }
  if (!fits(chunk)) {
    return 0;
  }
  while (fits(chunk * 2) && chunk * 2 * a.cg * element_size <= 64 && a.batch * (a.groups / (chunk * 2)) >= 2 * sm_count) {
    chunk *= 2;
  }
  return static_cast<int>(chunk);
}

// bias_add_: VEC elements per thread when every channel count is a multiple of VEC and the pointers are aligned for
// it (a vector then never straddles a position or the two residuals), one otherwise.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) bias_add_kernel(const BiasAdd a, const int64_t vectors) {
  T* h = static_cast<T*>(a.h);
  const T* r1 = static_cast<const T*>(a.residual);
  const T* r2 = static_cast<const T*>(a.residual2);
  const int64_t c2 = a.channels - a.c1;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vectors;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = v * VEC, q = i / a.channels, c = i % a.channels;
    Packed<T, VEC> out = *reinterpret_cast<const Packed<T, VEC>*>(h + i);
    Packed<T, VEC> res;
    if (r1 != nullptr) {
      res = c < a.c1 ? *reinterpret_cast<const Packed<T, VEC>*>(r1 + q * a.c1 + c)
                     : *reinterpret_cast<const Packed<T, VEC>*>(r2 + q * c2 + (c - a.c1));
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float r = r1 != nullptr ? static_cast<float>(res.v[j]) : 0.0f;
      out.v[j] = static_cast<T>(bias_add_element(static_cast<float>(out.v[j]), a.bias[c + j], r, r1 != nullptr));
    }
    *reinterpret_cast<Packed<T, VEC>*>(h + i) = out;
  }
}

void bias_add_cuda(
    const at::Tensor& h,
    const at::Tensor& bias,
    const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& residual2) {
  const c10::cuda::CUDAGuard device_guard(h.device());
  const BiasAdd a = prepare_bias_add(h, bias, residual, residual2);
  if (h.numel() == 0) {
    return;
  }
  dispatch_step_dtype(h.scalar_type(), "h", [&](auto tag) {
    using T = decltype(tag);
    constexpr int VEC = 16 / sizeof(T);
    auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const bool vector = a.channels % VEC == 0 && a.c1 % VEC == 0 && aligned(a.h) && aligned(a.residual) &&
        aligned(a.residual2);
    const int64_t vectors = vector ? h.numel() / VEC : h.numel();
    const auto blocks = static_cast<unsigned int>(std::min<int64_t>((vectors + kThreads - 1) / kThreads, kMaxBlocks));
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (vector) {
      bias_add_kernel<T, VEC><<<blocks, kThreads, 0, stream>>>(a, vectors);
    } else {
      bias_add_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(a, vectors);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor group_norm_act_cuda(
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
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor out;
  const GroupNormAct a = prepare_group_norm_act(x, x2, weight, bias, x_bias, scale, shift, groups, eps, silu, &out);
  const int64_t blocks = a.batch * a.groups;
  if (out.numel() == 0) {
    return out;
  }
  TORCH_CHECK(blocks <= INT32_MAX, "group_norm_act: ", blocks, " (sample, group) pairs are more than one launch takes");
  dispatch_step_dtype(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (a.cg > kGnPartials) {  // more channels per group than partials: the one-group kernel's general indexing
      group_norm_act_kernel<T><<<static_cast<unsigned int>(blocks), kGnPartials, 0, stream>>>(a);
    } else if (const int rows = gn_rows_chunk(a, x.element_size(), sm_count(x.get_device())); rows > 0) {
      const auto threads = static_cast<unsigned int>(gn_rows_threads(a, rows, 16 / x.element_size()));
      const size_t shared = (rows * kGnPartials + rows) * sizeof(float);
      group_norm_act_rows_kernel<T><<<static_cast<unsigned int>(blocks / rows), threads, shared, stream>>>(a, rows);
    } else {
      const int chunk = gn_chunk(a, x.element_size(), sm_count(x.get_device()));
      const auto threads = static_cast<unsigned int>(chunk * kGnPartials);
      const size_t shared = (chunk * kGnPartials + chunk) * sizeof(float);
      group_norm_act_chunk_kernel<T><<<static_cast<unsigned int>(blocks / chunk), threads, shared, stream>>>(a, chunk);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(diffusion_kernels, CUDA, m) {
  m.impl("fused_step_", &fused_step_cuda);
  m.impl("gather_timestep_", &gather_timestep_cuda);
  m.impl("group_norm_act", &group_norm_act_cuda);
  m.impl("bias_add_", &bias_add_cuda);
}

}  // namespace diffusion_kernels
