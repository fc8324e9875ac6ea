// The conv3x3_thin ops' CPU kernels: 3x3 convolutions (stride 1, padding 1) with a few channels on one side, the
// U-Net's first and last convolutions (the image's or the latent's 1 to 4 channels against the model's width), and
// their training backward. oneDNN's direct kernels block over both channel counts, so a side of one to four channels
// leaves most of each vector idle; here the wide side runs along the vectors and the thin side in scalars:
// - reduce (few output channels): out[p, t] = bias[t] + sum over the 9 taps and the wide input channels c of
//   x[p + tap, c] * K[t, tap, c], 4 pixels at a time sharing the kernel's loads;
// - broadcast (few input channels): out[p, c] = bias[c] + sum over the taps and the thin input channels t of
//   x[p + tap, t] * K[tap, t, c], 2 pixels' wide rows in registers sharing the kernel's loads;
// - the weight gradient: D[tap, t, c] = sum over the pixels p of thin[p (+ tap), t] * wide[p (+ tap), c], along each
//   row of pixels per tap, in fixed chunks of rows added in order (the same bits whatever the threads).
// The input's gradient of one kind is the other kind on the kernel turned 180 degrees with its channels swapped.
// Their schemas and registration are in diffusion_ops.cpp; a file of their own so that it compiles beside the others.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "diffusion_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace diffusion_kernels {
namespace {

// The taps of output row y (of H) or column x (of W) that fall inside the map: [first, last).
inline int first_tap(int64_t i) {
  return i == 0 ? 1 : 0;
}

inline int last_tap(int64_t i, int64_t n) {
  return i == n - 1 ? 2 : 3;
}

// NP pixels of row r (sample b, row y) from column x0, reduce kind: K (T, 3, 3, C). NP > 1 only where all NP pixels
// and their taps lie inside the row (x0 >= 1, x0 + NP <= W - 1).
template <int NP>
inline __attribute__((always_inline)) void reduce_pixels(const float* __restrict__ x, const float* __restrict__ K,
    const float* __restrict__ bias, float* __restrict__ out, int64_t b, int64_t y, int64_t x0, int64_t H, int64_t W,
    int64_t C, int64_t T) {
  const int ky0 = first_tap(y), ky1 = last_tap(y, H);
  const int kx0 = NP == 1 ? first_tap(x0) : 0, kx1 = NP == 1 ? last_tap(x0, W) : 3;
  for (int64_t t = 0; t < T; ++t) {
    Vec8 acc[NP][2] = {};  // two chains a pixel: consecutive vectors of its channels
    for (int ky = ky0; ky < ky1; ++ky) {
      for (int kx = kx0; kx < kx1; ++kx) {
        const float* in = x + ((b * H + y + ky - 1) * W + x0 + kx - 1) * C;
        const float* k = K + ((t * 3 + ky) * 3 + kx) * C;
        int64_t c = 0;
        for (; c + 16 <= C; c += 16) {
          const Vec8 k0 = loadv<Vec8>(k + c), k1 = loadv<Vec8>(k + c + 8);
          for (int p = 0; p < NP; ++p) {
            acc[p][0] += loadv<Vec8>(in + p * C + c) * k0;
            acc[p][1] += loadv<Vec8>(in + p * C + c + 8) * k1;
          }
        }
        if (c < C) {  // C % 16 == 8
          const Vec8 k0 = loadv<Vec8>(k + c);
          for (int p = 0; p < NP; ++p) {
            acc[p][0] += loadv<Vec8>(in + p * C + c) * k0;
          }
        }
      }
    }
    for (int p = 0; p < NP; ++p) {
      const Vec8 s = acc[p][0] + acc[p][1];
      const float sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
      out[((b * H + y) * W + x0 + p) * T + t] = bias != nullptr ? sum + bias[t] : sum;
    }
  }
}

DIFFUSION_KERNELS_FMA_CLONES
void reduce_rows(const float* __restrict__ x, const float* __restrict__ K, const float* __restrict__ bias,
    float* __restrict__ out, int64_t H, int64_t W, int64_t C, int64_t T, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t b = r / H, y = r % H;
    reduce_pixels<1>(x, K, bias, out, b, y, 0, H, W, C, T);
    int64_t x0 = 1;
    for (; x0 + 4 <= W - 1; x0 += 4) {
      reduce_pixels<4>(x, K, bias, out, b, y, x0, H, W, C, T);
    }
    for (; x0 < W; ++x0) {
      reduce_pixels<1>(x, K, bias, out, b, y, x0, H, W, C, T);
    }
  }
}

// Channels [c0, c0 + 8 * NV) of NP pixels from column x0, broadcast kind: K (3, 3, T, C). NP > 1 only where all NP
// pixels and their taps lie inside the row, as for reduce_pixels.
template <int NP, int NV, int kT>
inline __attribute__((always_inline)) void broadcast_pixels(const float* __restrict__ x, const float* __restrict__ K,
    const float* __restrict__ bias, float* __restrict__ out, int64_t b, int64_t y, int64_t x0, int64_t H, int64_t W,
    int64_t C, int64_t c0) {
  constexpr int64_t T = kT;
  const int kx0 = NP == 1 ? first_tap(x0) : 0, kx1 = NP == 1 ? last_tap(x0, W) : 3;
  Vec8 acc[NP][NV];
  for (int p = 0; p < NP; ++p) {
    for (int j = 0; j < NV; ++j) {
      acc[p][j] = bias != nullptr ? loadv<Vec8>(bias + c0 + 8 * j) : Vec8{};
    }
  }
  for (int ky = first_tap(y); ky < last_tap(y, H); ++ky) {
    for (int kx = kx0; kx < kx1; ++kx) {
      const float* in = x + ((b * H + y + ky - 1) * W + x0 + kx - 1) * T;
      for (int64_t t = 0; t < T; ++t) {
        const float* k = K + ((ky * 3 + kx) * T + t) * C + c0;
        Vec8 kv[NV];
        for (int j = 0; j < NV; ++j) {
          kv[j] = loadv<Vec8>(k + 8 * j);
        }
        for (int p = 0; p < NP; ++p) {
          const float s = in[p * T + t];
          for (int j = 0; j < NV; ++j) {
            acc[p][j] += s * kv[j];
          }
        }
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    float* o = out + ((b * H + y) * W + x0 + p) * C + c0;
    for (int j = 0; j < NV; ++j) {
      storev(o + 8 * j, acc[p][j]);
    }
  }
}

// All channels of NP pixels from column x0.
template <int NP, int kT>
inline __attribute__((always_inline)) void broadcast_columns(const float* __restrict__ x, const float* __restrict__ K,
    const float* __restrict__ bias, float* __restrict__ out, int64_t b, int64_t y, int64_t x0, int64_t H, int64_t W,
    int64_t C) {
  int64_t c0 = 0;
  for (; c0 + 32 <= C; c0 += 32) {
    broadcast_pixels<NP, 4, kT>(x, K, bias, out, b, y, x0, H, W, C, c0);
  }
  for (; c0 < C; c0 += 8) {
    broadcast_pixels<NP, 1, kT>(x, K, bias, out, b, y, x0, H, W, C, c0);
  }
}

// The thin side's count kT a constant, so that its loop unrolls.
template <int kT>
inline __attribute__((always_inline)) void broadcast_rows_t(const float* __restrict__ x, const float* __restrict__ K,
    const float* __restrict__ bias, float* __restrict__ out, int64_t H, int64_t W, int64_t C, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t b = r / H, y = r % H;
    broadcast_columns<1, kT>(x, K, bias, out, b, y, 0, H, W, C);
    int64_t x0 = 1;
    for (; x0 + 2 <= W - 1; x0 += 2) {
      broadcast_columns<2, kT>(x, K, bias, out, b, y, x0, H, W, C);
    }
    for (; x0 < W; ++x0) {
      broadcast_columns<1, kT>(x, K, bias, out, b, y, x0, H, W, C);
    }
  }
}

DIFFUSION_KERNELS_FMA_CLONES
void broadcast_rows(const float* __restrict__ x, const float* __restrict__ K, const float* __restrict__ bias,
    float* __restrict__ out, int64_t H, int64_t W, int64_t C, int64_t T, int64_t r0, int64_t r1) {
  static_assert(kThinChannels == 4, "one case per thin channel count");
  switch (T) {  // 1 to kThinChannels (checked)
    case 1:
      broadcast_rows_t<1>(x, K, bias, out, H, W, C, r0, r1);
      break;
    case 2:
      broadcast_rows_t<2>(x, K, bias, out, H, W, C, r0, r1);
      break;
    case 3:
      broadcast_rows_t<3>(x, K, bias, out, H, W, C, r0, r1);
      break;
    default:
      broadcast_rows_t<4>(x, K, bias, out, H, W, C, r0, r1);
  }
}

// d[0, 8 * NV) += sum over n pixels i of thin[i * thin_stride] * wide[i * wide_stride + (0, 8 * NV)].
template <int NV>
inline __attribute__((always_inline)) void weight_grad_run(const float* __restrict__ thin, int64_t thin_stride,
    const float* __restrict__ wide, int64_t wide_stride, int64_t n, float* __restrict__ d) {
  Vec8 acc[NV] = {};
  for (int64_t i = 0; i < n; ++i) {
    const float s = thin[i * thin_stride];
    for (int j = 0; j < NV; ++j) {
      acc[j] += s * loadv<Vec8>(wide + i * wide_stride + 8 * j);
    }
  }
  for (int j = 0; j < NV; ++j) {
    storev(d + 8 * j, loadv<Vec8>(d + 8 * j) + acc[j]);
  }
}

// D (9, T, C) += rows [r0, r1)'s share. thin_at_output: thin is the output's gradient (at the pixel) and wide the input
// (at the pixel plus the tap), the reduce kind's weights; otherwise wide is the output's gradient and thin the input.
DIFFUSION_KERNELS_FMA_CLONES
void weight_grad_rows(const float* __restrict__ thin, const float* __restrict__ wide, bool thin_at_output,
    float* __restrict__ D, int64_t H, int64_t W, int64_t C, int64_t T, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t y = r % H;
    for (int ky = first_tap(y); ky < last_tap(y, H); ++ky) {
      const int64_t row_in = r + ky - 1;  // the same sample's row y + ky - 1
      for (int kx = 0; kx < 3; ++kx) {
        // Output columns whose tap kx lies inside the row: [x0, x1), their inputs x0 + kx - 1, ...
        const int64_t x0 = kx == 0 ? 1 : 0, x1 = kx == 2 ? W - 1 : W;
        if (x1 <= x0) {
          continue;
        }
        const int64_t at_output = r * W + x0, at_input = row_in * W + x0 + kx - 1;
        const float* wide_row = wide + (thin_at_output ? at_input : at_output) * C;
        for (int64_t t = 0; t < T; ++t) {
          const float* thin_row = thin + (thin_at_output ? at_output : at_input) * T + t;
          float* d = D + ((ky * 3 + kx) * T + t) * C;
          int64_t c0 = 0;
          for (; c0 + 32 <= C; c0 += 32) {
            weight_grad_run<4>(thin_row, T, wide_row + c0, C, x1 - x0, d + c0);
          }
          for (; c0 < C; c0 += 8) {
            weight_grad_run<1>(thin_row, T, wide_row + c0, C, x1 - x0, d + c0);
          }
        }
      }
    }
  }
}

// Chunks of rows the weight gradient sums apart, then in order: fixed, so the bits do not depend on the threads.
constexpr int64_t kWeightGradChunks = 64;

// Whether weight (Cout, Cin, 3, 3) has few output channels (the reduce kind) rather than few input channels.
bool reduces(const at::Tensor& weight) {
  return weight.size(0) <= weight.size(1);
}

void check_thin_weight(const at::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 3 && weight.size(3) == 3 && weight.scalar_type() == at::kFloat &&
      weight.is_contiguous() && weight.device().is_cpu(),
      op, ": weight must be a contiguous float32 (Cout, Cin, 3, 3) CPU tensor, got ", weight.scalar_type(), " ",
      weight.sizes(), " with strides ", weight.strides());
  const int64_t thin = std::min(weight.size(0), weight.size(1)), wide = std::max(weight.size(0), weight.size(1));
  TORCH_CHECK(thin >= 1 && thin <= kThinChannels && wide % 8 == 0,
      op, ": one channel count must be 1 to ", kThinChannels, " and the other a positive multiple of 8, got Cout=",
      weight.size(0), ", Cin=", weight.size(1));
}

void check_channels_last(const at::Tensor& t, int64_t channels, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.size(1) == channels &&
      t.is_contiguous(at::MemoryFormat::ChannelsLast),
      op, ": ", name, " must be a channels-last float32 (B, ", channels, ", H, W) CPU tensor, got ", t.scalar_type(),
      " ", t.sizes(), " with strides ", t.strides());
}

// One convolution of either kind on x (B, H, W, Cin rows) with its kernel K in that kind's layout; out channels-last.
at::Tensor thin_conv(const at::Tensor& x, const at::Tensor& K, const float* bias, bool reduce, int64_t cout) {
  const int64_t B = x.size(0), cin = x.size(1), H = x.size(2), W = x.size(3);
  at::Tensor out = at::empty({B, cout, H, W}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  const float* xp = x.const_data_ptr<float>();
  const float* kp = K.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    reduce ? reduce_rows(xp, kp, bias, op, H, W, cin, cout, begin, end)
           : broadcast_rows(xp, kp, bias, op, H, W, cout, cin, begin, end);
  });
  return out;
}

}  // namespace

at::Tensor conv3x3_thin_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_thin_weight(weight, "conv3x3_thin");
  check_channels_last(x, weight.size(1), "conv3x3_thin", "x");
  const int64_t cout = weight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == cout && bias->scalar_type() == at::kFloat &&
        bias->is_contiguous() && bias->device().is_cpu(),
        "conv3x3_thin: bias must be a contiguous float32 (", cout, ",) CPU tensor, got ", bias->scalar_type(), " ",
        bias->sizes());
  }
  const bool reduce = reduces(weight);
  // reduce: K[t, tap, c] = weight[t, c, tap]; broadcast: K[tap, t, c] = weight[c, t, tap].
  const at::Tensor K = reduce ? weight.permute({0, 2, 3, 1}).contiguous() : weight.permute({2, 3, 1, 0}).contiguous();
  return thin_conv(x, K, bias.has_value() ? bias->const_data_ptr<float>() : nullptr, reduce, cout);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv3x3_thin_backward_cpu(const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& weight, std::array<bool, 3> output_mask) {
  check_thin_weight(weight, "conv3x3_thin_backward");
  const int64_t cout = weight.size(0), cin = weight.size(1);
  check_channels_last(grad_out, cout, "conv3x3_thin_backward", "grad_out");
  check_channels_last(x, cin, "conv3x3_thin_backward", "x");
  TORCH_CHECK(x.size(0) == grad_out.size(0) && x.size(2) == grad_out.size(2) && x.size(3) == grad_out.size(3),
      "conv3x3_thin_backward: x ", x.sizes(), " and grad_out ", grad_out.sizes(), " differ in batch or size");
  const bool reduce = reduces(weight);
  const auto empty = [&] { return at::empty({0}, weight.options()); };
  at::Tensor grad_x = empty();
  if (output_mask[0]) {
    // The kernel turned 180 degrees with its channels swapped, in the other kind's layout: grad_out's thin side is
    // the reduce kind's output, the broadcast kind's input.
    const at::Tensor flipped = weight.flip({2, 3});
    const at::Tensor K = reduce ? flipped.permute({2, 3, 0, 1}).contiguous() : flipped.permute({1, 2, 3, 0}).contiguous();
    grad_x = thin_conv(grad_out, K, nullptr, !reduce, cin);
  }
  at::Tensor grad_weight = empty();
  if (output_mask[1]) {
    const int64_t B = x.size(0), H = x.size(2), W = x.size(3), rows = B * H;
    const int64_t T = reduce ? cout : cin, C = reduce ? cin : cout, size = 9 * T * C;
    const int64_t chunks = std::min(rows, kWeightGradChunks);
    at::Tensor parts = at::zeros({std::max<int64_t>(chunks, 1), size}, weight.options());
    const float* thin = (reduce ? grad_out : x).const_data_ptr<float>();
    const float* wide = (reduce ? x : grad_out).const_data_ptr<float>();
    float* pp = parts.mutable_data_ptr<float>();
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        weight_grad_rows(thin, wide, reduce, pp + chunk * size, H, W, C, T, chunk * rows / chunks,
            (chunk + 1) * rows / chunks);
      }
    });
    for (int64_t chunk = 1; chunk < chunks; ++chunk) {
      add_row(pp + chunk * size, size, pp);
    }
    // D (3, 3, T, C) to (Cout, Cin, 3, 3): reduce T = Cout, C = Cin; broadcast T = Cin, C = Cout.
    const at::Tensor D = parts[0].view({3, 3, T, C});
    grad_weight = (reduce ? D.permute({2, 3, 0, 1}) : D.permute({3, 2, 0, 1})).contiguous();
  }
  at::Tensor grad_bias = output_mask[2] ? bias_grad_cpu(grad_out) : empty();
  return {grad_x, grad_weight, grad_bias};
}

}  // namespace diffusion_kernels
