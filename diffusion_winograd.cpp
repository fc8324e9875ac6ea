// The conv3x3_winograd ops' CPU kernels: the forward convolution (F(2x2, 3x3), F(4x4, 3x3), the upsampling phases,
// bf16), its weight gradient, the kernels' transforms and the training backward. Their schemas and registration are
// in diffusion_ops.cpp with the other ops'; a file of their own so that the two compile side by side.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "diffusion_cpu.h"
#include "diffusion_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace diffusion_kernels {
namespace {

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

// Blocks of up to 48 tiles where every thread still gets two of them, never fewer tiles than `at_least`.
int64_t larger_block_tiles(int64_t at_least, int64_t tiles) {
  const int64_t share = tiles / (2 * std::max(1, at::get_num_threads()));
  return std::max(at_least, std::min<int64_t>(48, share / 6 * 6));
}

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
  return larger_block_tiles(in_cache, tiles);
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
  // Elements from one tile's products to the next in V and in dM (the weight gradient's); 0: products * Cin and
  // products * Cout, as the forward pass's V and M are laid out.
  int64_t v_stride = 0, m_stride = 0;
};

inline int64_t tile_stride_v(const WinogradConv& a) { return a.v_stride != 0 ? a.v_stride : a.products * a.cin; }
inline int64_t tile_stride_m(const WinogradConv& a) { return a.m_stride != 0 ? a.m_stride : a.products * a.cout; }

// A vector of lanes from bf16 p, widened, and back, beside the float32 ones (diffusion_cpu.h, brought into this
// scope): the transforms' loads and stores, 16 lanes at a time (AVX-512, and the bf16 path) or 8 (AVX2).
using diffusion_kernels::loadv;
using diffusion_kernels::storev;

template <typename V>
inline __attribute__((always_inline)) V loadv(const uint16_t* p) {
  return load_bf16<V>(p);
}

template <typename V>
inline __attribute__((always_inline)) void storev(uint16_t* p, V v) {
  store_bf16(p, v);
}

// Tile number `tile` (tile = (b * tiles_h + ty) * tiles_w + tx) as its sample and tile row and column.
struct TileAt {
  int64_t b, ty, tx;
};

inline __attribute__((always_inline)) TileAt tile_at(const WinogradConv& a, int64_t tile) {
  return {tile / (a.tiles_w * a.tiles_h), tile / a.tiles_w % a.tiles_h, tile % a.tiles_w};
}

// How many tiles ahead of the one it computes an F(4x4, 3x3) transform asks the cache for the tile's rows.
constexpr int64_t kPrefetchTiles = 2;

// Asks the cache for the in-image part of F(4x4, 3x3) tile `tile`'s S x S window (rows 4 ty + shift.., columns
// 4 tx + shift..) of an NHWC (B, H, W, channels) tensor, kPrefetchTiles tiles before a transform reads it
// (kWrite 1: before the output transform writes it): a window's rows lie a row of the image apart, and the hardware's
// prefetchers do not bring them in time: the transform would wait on each of their cache lines.
template <int kWrite = 0, typename T>
inline __attribute__((always_inline)) void prefetch_tile(const T* data, const WinogradConv& a, int64_t channels,
    int64_t tile, int64_t shift, int64_t S) {
  const auto [b, ty, tx] = tile_at(a, tile);
  const int64_t y0 = 4 * ty + shift, x0 = 4 * tx + shift;
  const int64_t ya = std::max<int64_t>(0, y0), yb = std::min<int64_t>(a.H, y0 + S);
  const int64_t xa = std::max<int64_t>(0, x0), xb = std::min<int64_t>(a.W, x0 + S);
  const int64_t bytes = (xb - xa) * channels * static_cast<int64_t>(sizeof(T));
  for (int64_t y = ya; y < yb; ++y) {
    const char* run = reinterpret_cast<const char*>(data + ((b * a.H + y) * a.W + xa) * channels);
    for (int64_t offset = 0; offset < bytes; offset += 64) {
      __builtin_prefetch(run + offset, kWrite);
    }
  }
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
      VT* v = V + t * tile_stride_v(a) + c;  // product k at v + k * cin
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
//    In: x's element type (float32, or bf16 widened as it is read).
template <typename Vec, typename In = float>
inline __attribute__((always_inline)) void winograd4_input_transform(
    const WinogradConv& a, int64_t t0, int64_t n, float* __restrict__ V) {
  const In* x_in = static_cast<const In*>(a.x);
  const int64_t cin = a.cin;
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t row = a.W * cin;
  for (int64_t t = 0; t < n; ++t) {
    if (t + kPrefetchTiles < n) {
      prefetch_tile(x_in, a, cin, t0 + t + kPrefetchTiles, -1, 6);  // its 6x6 input window
    }
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    // A window wholly inside the image is read without the padding's checks.
    const int64_t y0 = 4 * ty - 1, x0 = 4 * tx - 1;
    const bool inside = y0 >= 0 && y0 + 6 <= a.H && x0 >= 0 && x0 + 6 <= a.W;
    const In* window = inside ? x_in + ((b * a.H + y0) * a.W + x0) * cin : x_in;
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
      float* v = V + t * tile_stride_v(a) + c;  // product k at v + k * cin
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

// 3. The 4x4 outputs A^T m A (+ bias) of each tile into the NHWC output of element type Out (float32, or bf16
//    rounded once as it is written); positions past the image's edge are not written.
template <typename Vec, typename Out = float>
inline __attribute__((always_inline)) void winograd4_output_transform(
    const WinogradConv& a, int64_t t0, int64_t n, const float* __restrict__ M) {
  Out* out = static_cast<Out*>(a.out);
  const int64_t H = a.H, W = a.W, cout = a.cout;
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  for (int64_t t = 0; t < n; ++t) {
    if (t + kPrefetchTiles < n) {
      prefetch_tile<1>(out, a, cout, t0 + t + kPrefetchTiles, 0, 4);  // its 4x4 outputs
    }
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    const int64_t rows = std::min<int64_t>(4, H - 4 * ty), cols = std::min<int64_t>(4, W - 4 * tx);
    Out* tile = out + ((b * H + 4 * ty) * W + 4 * tx) * cout;
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
template <typename Vec, typename T = float>
inline __attribute__((always_inline)) void winograd4_output_adjoint(
    const WinogradConv& a, const T* __restrict__ gy, int64_t t0, int64_t n, float* __restrict__ dM) {
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t cout = a.cout;
  const int64_t stride = a.W * cout;
  for (int64_t t = 0; t < n; ++t) {
    if (t + kPrefetchTiles < n) {
      prefetch_tile(gy, a, cout, t0 + t + kPrefetchTiles, 0, 4);  // its 4x4 output gradients
    }
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    const bool inside = 4 * ty + 4 <= a.H && 4 * tx + 4 <= a.W;  // read without the padding's checks
    const T* tile = inside ? gy + ((b * a.H + 4 * ty) * a.W + 4 * tx) * cout : gy;
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
      float* m = dM + t * tile_stride_m(a) + c;  // product k at m + k * cout
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

// The GEMM tiles' clones: the same, but without x86-64-v3's where GCC builds a kernel of their own for AVX2
// (winograd_tiles_avx2, winograd_grad_tiles_avx2), which such CPUs run instead: a clone nothing calls.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__APPLE__)
#define DIFFUSION_KERNELS_GEMM_CLONES \
  __attribute__((target_clones("avx512f", "default"), optimize("fp-contract=fast")))
#else
#define DIFFUSION_KERNELS_GEMM_CLONES DIFFUSION_KERNELS_FMA_CLONES
#endif

// Tiles [t0, t0 + n) (tile = (b * tiles_h + ty) * tiles_w + tx, outputs 2ty.., 2tx..), float32 transforms, U and
// GEMM: all three stages, on vectors Vec, the GEMM in register blocks of 6 tiles x QMAX vectors; activations (x and
// out) of element type T: float32, or bf16 (the mixed path). V: (n, products, Cin) and M: (n, products, Cout) scratch.
template <typename Vec, int QMAX, typename T = float>
inline __attribute__((always_inline)) void winograd_tiles_float(
    const WinogradConv& a, int64_t t0, int64_t n, float* __restrict__ V, float* __restrict__ M) {
#if defined(__clang__)
#pragma clang fp contract(fast)
#endif
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t cin = a.cin, cout = a.cout, P = a.products, ldv = P * cin, ldm = P * cout;
  if (a.m == 4) {
    winograd4_input_transform<Vec, T>(a, t0, n, V);
  } else {
    winograd_input_transform<T, float, Vec>(a, t0, n, V);
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
    winograd4_output_transform<Vec, T>(a, t0, n, M);
  } else {
    winograd_output_transform<T, Vec>(a, t0, n, M);
  }
}

// AVX-512 (and the baseline clone): 6 tiles x 64 channels per register block.
DIFFUSION_KERNELS_GEMM_CLONES
void winograd_tiles(const WinogradConv& a, int64_t t0, int64_t n, float* __restrict__ V, float* __restrict__ M) {
  winograd_tiles_float<Vec16, 4>(a, t0, n, V, M);
}

// The mixed path: bf16 x and out, everything between them float32 as winograd_tiles computes it (the same blocking).
DIFFUSION_KERNELS_GEMM_CLONES
void winograd_tiles_mixed(const WinogradConv& a, int64_t t0, int64_t n, float* __restrict__ V, float* __restrict__ M) {
  winograd_tiles_float<Vec16, 4, uint16_t>(a, t0, n, V, M);
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

// The mixed path's, for the same CPUs (bf16 rows widened and narrowed 8 at a time): the float32 kernel's bits.
__attribute__((target("avx2,fma"), optimize("fp-contract=fast")))
void winograd_tiles_mixed_avx2(
    const WinogradConv& a, int64_t t0, int64_t n, float* __restrict__ V, float* __restrict__ M) {
  winograd_tiles_float<Vec8, 2, uint16_t>(a, t0, n, V, M);
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

}  // namespace

at::Tensor conv3x3_winograd_cpu(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool upsample) {
  // A bfloat16 x with a float32 weight is the mixed path: bf16 activations in and out, float32 between them.
  const bool bf16 = x.scalar_type() == at::kBFloat16, mixed = bf16 && weight.scalar_type() == at::kFloat;
  const bool bf16_gemm = bf16 && !mixed;
  TORCH_CHECK(x.dim() == 4 && (bf16 || x.scalar_type() == at::kFloat) && x.is_contiguous(at::MemoryFormat::ChannelsLast),
      "conv3x3_winograd: x must be a channels-last float32 or bfloat16 (B, Cin, H, W) tensor, got ", x.scalar_type(), " ",
      x.sizes(), " with strides ", x.strides());
  // A float32 weight of 36 products without upsample is F(4x4, 3x3)'s transform (winograd_weight(..., tile=4)).
  const bool tile4 = !bf16_gemm && !upsample && weight.dim() == 3 && weight.size(0) == 36;
  const int64_t B = x.size(0), cin = x.size(1), H = x.size(2), W = x.size(3), products = upsample || tile4 ? 36 : 16;
  const char* transform =
      upsample ? "winograd_weight(..., upsample=True" : tile4 ? "winograd_weight(..., tile=4" : "winograd_weight(...";
  if (bf16_gemm) {
    TORCH_CHECK(weight.dim() == 4 && weight.size(0) == products && weight.size(1) * 2 == cin && weight.size(3) == 2 &&
        weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.device() == x.device(),
        "conv3x3_winograd: for a bfloat16 x, weight must be the contiguous bfloat16 (", products, ", Cin/2=", cin / 2,
        ", Cout, 2) transform of ", transform, ", dtype=torch.bfloat16), or its float32 (", products, ", Cin=", cin,
        ", Cout) one (the mixed path), got ", weight.scalar_type(), " ", weight.sizes());
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
  const TileBlocks blocks = tile_blocks(tiles, winograd_block_tiles(products, cin, cout, tiles, bf16_gemm ? 2 : 4));
  const int64_t per_block = blocks.largest();
  const bool native = bf16_gemm && cpu_has_avx512_bf16(), avx2_gemm = !bf16_gemm && winograd_uses_avx2_gemm();
  // The float32 GEMMs' kernel: on bf16 activations (mixed) or float32 ones, in AVX2's blocking or AVX-512's.
  auto float_tiles = mixed ? winograd_tiles_mixed : winograd_tiles;
#if defined(DIFFUSION_KERNELS_AVX2_GEMM)
  if (avx2_gemm) {
    float_tiles = mixed ? winograd_tiles_mixed_avx2 : winograd_tiles_avx2;
  }
#endif
  at::parallel_for(0, blocks.count, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> M(new float[products * per_block * cout]);
    std::unique_ptr<float[]> V(new float[bf16_gemm ? 0 : products * per_block * cin]);
    std::unique_ptr<uint16_t[]> V16(new uint16_t[bf16_gemm ? products * per_block * cin : 0]);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t t0 = blocks.begin(block), n = blocks.begin(block + 1) - t0;
      if (!bf16_gemm) {
        float_tiles(a, t0, n, V.get(), M.get());
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

namespace {

// ----- The weight gradient of conv3x3_winograd, for training ------------------------------------------------------
// y = A^T [U (.) V] A per tile and product k, so dL/dU[k] = sum over tiles V[k]^T (A dy A^T)[k]: the same input
// transform V as the forward pass, the adjoint of the output transform on the gradient of y (dM), and per product
// k a GEMM (Cin x tiles) @ (tiles x Cout) that sums over the tiles. The kernel's gradient is then G^T dU G
// (ddpm/training/winograd.py). Blocks of tiles as in the forward pass (larger on AVX2: winograd_grad_block_tiles),
// each thread summing into its own (products, Cin, Cout) partial, added up at the end. The input's gradient is
// conv3x3_winograd itself, of dy with the kernel rotated 180 degrees and its channels swapped.

// dM[t][k] = (A dy A^T)[k] for tiles [t0, t0 + n): dy's 2x2 outputs of each tile (zero past the image's edge).
// A = [1 0; 1 1; 1 -1; 0 -1] (A^T of the forward transform, transposed).
template <typename Vec, typename T = float>
inline __attribute__((always_inline)) void winograd_output_adjoint(
    const WinogradConv& a, const T* __restrict__ gy, int64_t t0, int64_t n, float* __restrict__ dM) {
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
      float* m = dM + t * tile_stride_m(a) + c;  // product k at m + k * cout
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
// that Vec); x and gy of element type T (float32, or bf16: the mixed path), V, dM and dU float32.
template <typename Vec, int QMAX, typename T = float>
inline __attribute__((always_inline)) void winograd_grad_tiles_float(const WinogradConv& a,
    const T* __restrict__ gy, int64_t t0, int64_t n, float* __restrict__ V, float* __restrict__ dM,
    float* __restrict__ dU) {
#if defined(__clang__)
#pragma clang fp contract(fast)
#endif
  constexpr int64_t L = sizeof(Vec) / sizeof(float);
  const int64_t cin = a.cin, cout = a.cout, ldv = tile_stride_v(a), ldm = tile_stride_m(a);
  if (a.m == 4) {
    winograd4_input_transform<Vec, T>(a, t0, n, V);
    winograd4_output_adjoint<Vec, T>(a, gy, t0, n, dM);
  } else {
    winograd_input_transform<T, float, Vec>(a, t0, n, V);
    winograd_output_adjoint<Vec, T>(a, gy, t0, n, dM);
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
DIFFUSION_KERNELS_GEMM_CLONES
void winograd_grad_tiles(const WinogradConv& a, const float* __restrict__ gy, int64_t t0, int64_t n,
    float* __restrict__ V, float* __restrict__ dM, float* __restrict__ dU) {
  winograd_grad_tiles_float<Vec16, 4>(a, gy, t0, n, V, dM, dU);
}

// The mixed path's: bf16 x and gy, the same blocking and sums.
DIFFUSION_KERNELS_GEMM_CLONES
void winograd_grad_tiles_mixed(const WinogradConv& a, const uint16_t* __restrict__ gy, int64_t t0, int64_t n,
    float* __restrict__ V, float* __restrict__ dM, float* __restrict__ dU) {
  winograd_grad_tiles_float<Vec16, 4, uint16_t>(a, gy, t0, n, V, dM, dU);
}

#if defined(DIFFUSION_KERNELS_AVX2_GEMM)
// AVX2 without AVX-512 (winograd_uses_avx2_gemm): 6 x 16 channels in 12 of the 16 registers, as the forward's; the
// same sums in the same order, so the same bits as the AVX-512 clone's.
__attribute__((target("avx2,fma"), optimize("fp-contract=fast")))
void winograd_grad_tiles_avx2(const WinogradConv& a, const float* __restrict__ gy, int64_t t0, int64_t n,
    float* __restrict__ V, float* __restrict__ dM, float* __restrict__ dU) {
  winograd_grad_tiles_float<Vec8, 2>(a, gy, t0, n, V, dM, dU);
}

__attribute__((target("avx2,fma"), optimize("fp-contract=fast")))
void winograd_grad_tiles_mixed_avx2(const WinogradConv& a, const uint16_t* __restrict__ gy, int64_t t0, int64_t n,
    float* __restrict__ V, float* __restrict__ dM, float* __restrict__ dU) {
  winograd_grad_tiles_float<Vec8, 2, uint16_t>(a, gy, t0, n, V, dM, dU);
}
#endif

// Tiles per block of the weight gradient: the forward pass's, but on AVX2 up to 48 (larger_block_tiles), since each
// block's GEMMs read and write all of dU again for only as many tiles' worth of sums.
int64_t winograd_grad_block_tiles(int64_t products, int64_t cin, int64_t cout, int64_t tiles, bool avx2_gemm) {
  const int64_t forward = winograd_block_tiles(products, cin, cout, tiles, 4);
  return avx2_gemm ? larger_block_tiles(forward, tiles) : forward;
}

// dL/dU as partial sums (parts, products, Cin, Cout) whose sum in order is conv3x3_winograd_weight_grad: the blocks
// of tiles go to at most one part a thread, each part zeroed and summed by its own thread (one part: nothing to add).
at::Tensor winograd_weight_grad_parts(const at::Tensor& x, const at::Tensor& grad_out, int64_t tile) {
  TORCH_CHECK(tile == 2 || tile == 4, "conv3x3_winograd_weight_grad: tile must be 2 (F(2x2, 3x3)) or 4 (F(4x4, 3x3)), got ", tile);
  const bool bf16 = x.scalar_type() == at::kBFloat16;  // the mixed path: bf16 x and grad_out, float32 sums
  TORCH_CHECK(x.dim() == 4 && (bf16 || x.scalar_type() == at::kFloat) && x.is_contiguous(at::MemoryFormat::ChannelsLast),
      "conv3x3_winograd_weight_grad: x must be a channels-last float32 or bfloat16 (B, Cin, H, W) tensor, got ",
      x.scalar_type(), " ", x.sizes(), " with strides ", x.strides());
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.scalar_type() == x.scalar_type() &&
      grad_out.is_contiguous(at::MemoryFormat::ChannelsLast) && grad_out.size(0) == x.size(0) &&
      grad_out.size(2) == x.size(2) && grad_out.size(3) == x.size(3) && grad_out.device() == x.device(),
      "conv3x3_winograd_weight_grad: grad_out must be a channels-last (B, Cout, H, W) tensor of x's dtype ",
      x.scalar_type(), ", batch and size ", x.sizes(), ", got ", grad_out.scalar_type(), " ", grad_out.sizes(),
      " with strides ", grad_out.strides());
  const int64_t B = x.size(0), cin = x.size(1), H = x.size(2), W = x.size(3), cout = grad_out.size(1);
  TORCH_CHECK(cin % 16 == 0 && cout % 16 == 0 && cin > 0 && cout > 0,
      "conv3x3_winograd_weight_grad: channel counts must be positive multiples of 16, got Cin=", cin, ", Cout=", cout);
  const int64_t products = (tile + 2) * (tile + 2);  // 16 or 36
  // V and dM are read down their columns, one cache line from each of a block's tiles: tiles an even number of lines
  // apart would share a few of L1's sets and evict each other, so each tile's row is padded to an odd number of them.
  auto odd_lines = [](int64_t floats) { return (floats / 16) % 2 == 0 ? floats + 16 : floats; };
  WinogradConv a{x.data_ptr(), nullptr, nullptr, nullptr, H, W, cin, cout, (H + tile - 1) / tile,
      (W + tile - 1) / tile, false, products, tile};
  a.v_stride = odd_lines(products * cin);
  a.m_stride = odd_lines(products * cout);
  const int64_t tiles = B * a.tiles_h * a.tiles_w, size = products * cin * cout;
  const bool avx2_gemm = winograd_uses_avx2_gemm();
  const TileBlocks blocks = tile_blocks(tiles, winograd_grad_block_tiles(products, cin, cout, tiles, avx2_gemm));
  const int64_t per_block = blocks.largest();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks.count));
  at::Tensor sums = at::empty(
      {parts, products, cin, cout}, x.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  const void* gy = grad_out.data_ptr();
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> V(new float[tile_stride_v(a) * per_block]);
    std::unique_ptr<float[]> dM(new float[tile_stride_m(a) * per_block]);
    for (int64_t part = begin; part < end; ++part) {
      float* dU = sums.data_ptr<float>() + part * size;
      std::fill_n(dU, size, 0.0f);
      for (int64_t block = part * blocks.count / parts; block < (part + 1) * blocks.count / parts; ++block) {
        const int64_t t0 = blocks.begin(block), n = blocks.begin(block + 1) - t0;
#if defined(DIFFUSION_KERNELS_AVX2_GEMM)
        if (avx2_gemm) {
          bf16 ? winograd_grad_tiles_mixed_avx2(a, static_cast<const uint16_t*>(gy), t0, n, V.get(), dM.get(), dU)
               : winograd_grad_tiles_avx2(a, static_cast<const float*>(gy), t0, n, V.get(), dM.get(), dU);
          continue;
        }
#endif
        bf16 ? winograd_grad_tiles_mixed(a, static_cast<const uint16_t*>(gy), t0, n, V.get(), dM.get(), dU)
             : winograd_grad_tiles(a, static_cast<const float*>(gy), t0, n, V.get(), dM.get(), dU);
      }
    }
  });
  return sums;
}

}  // namespace

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

namespace {

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
  // (G^T dU)[i][b], summed over a in increasing order as a row of dU at a time: dU's rows lie ld floats apart (a
  // power of two for most channel counts), so reading the kN rows of a column together would map them all onto the
  // same few sets of the L1 cache.
  alignas(64) float gd[3][kN][kKernelChunk] = {};
  for (int64_t a = 0; a < kN; ++a) {
    for (int64_t b = 0; b < kN; ++b) {
      for (int64_t c = 0; c < kKernelChunk; c += 16) {
        const Vec16 v = du(d + (a * kN + b) * ld + c);
        for (int64_t i = 0; i < 3; ++i) {
          if (G[a][i] != 0.0f) {
            store16(gd[i][b] + c, load16(gd[i][b] + c) + G[a][i] * v);
          }
        }
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

}  // namespace

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

// dL/db of a convolution: grad_out's rows of Cout channels (float32, or bf16 widened) summed in chunks of a fixed
// size, then the chunks in order: the same bits whatever the threads; float32.
at::Tensor bias_grad_cpu(const at::Tensor& grad_out) {
  const int64_t cout = grad_out.size(1), rows = grad_out.numel() / std::max<int64_t>(cout, 1);
  constexpr int64_t kRows = 256;
  const int64_t chunks = (rows + kRows - 1) / kRows;
  std::vector<float> partial(chunks * cout, 0.0f);
  const bool bf16 = grad_out.scalar_type() == at::kBFloat16;
  const float* gy = bf16 ? nullptr : grad_out.const_data_ptr<float>();
  const uint16_t* gh = bf16 ? reinterpret_cast<const uint16_t*>(grad_out.const_data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(bf16 ? cout : 0);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t r1 = std::min(rows, (chunk + 1) * kRows);
      for (int64_t r = chunk * kRows; r < r1; ++r) {
        if (bf16) {
          widen_bf16(gh + r * cout, cout, widened.data());
        }
        add_row(bf16 ? widened.data() : gy + r * cout, cout, partial.data() + chunk * cout);
      }
    }
  });
  at::Tensor grad_bias = at::zeros({cout}, grad_out.options().dtype(at::kFloat));
  float* gb = grad_bias.mutable_data_ptr<float>();
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    add_row(partial.data() + chunk * cout, cout, gb);
  }
  return grad_bias;
}

// One training step's backward of y = conv2d(x, g, b, padding=1) computed in Winograd's domain, each output only
// where asked (output_mask: dL/dx, dL/dg, dL/db; the others come back empty):
// dL/dx = conv3x3_winograd(dL/dy, the rotated kernel's transform); dL/dg = G^T conv3x3_winograd_weight_grad G, in
// g's (Cout, Cin, 3, 3) layout; dL/db = dL/dy summed over the batch and the positions, in a fixed order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv3x3_winograd_backward_cpu(const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& weight, int64_t tile, std::array<bool, 3> output_mask) {
  check_winograd_kernel(weight, tile, "conv3x3_winograd_backward");
  // bf16 grad_out and x: the mixed path's backward (bf16 dL/dx, float32 dL/dg and dL/db).
  TORCH_CHECK(grad_out.dim() == 4 &&
      (grad_out.scalar_type() == at::kFloat || grad_out.scalar_type() == at::kBFloat16) &&
      grad_out.scalar_type() == x.scalar_type() && grad_out.is_contiguous(at::MemoryFormat::ChannelsLast) &&
      grad_out.size(1) == weight.size(0),
      "conv3x3_winograd_backward: grad_out must be a channels-last float32 or bfloat16 (B, Cout=", weight.size(0),
      ", H, W) tensor of x's dtype ", x.scalar_type(), ", got ", grad_out.scalar_type(), " ", grad_out.sizes(),
      " with strides ", grad_out.strides());
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
  at::Tensor grad_bias = output_mask[2] ? bias_grad_cpu(grad_out) : empty();
  return {grad_x, grad_weight, grad_bias};
}

}  // namespace diffusion_kernels
