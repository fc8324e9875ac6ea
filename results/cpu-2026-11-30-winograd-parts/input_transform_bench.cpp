// A standalone copy of diffusion_winograd.cpp's F(4x4, 3x3) input transform (AVX2, 8 channels a vector) and variants,
// timed on one thread over a (B, 28, 28, C) NHWC input in blocks of 24 tiles (best of 20 runs):
//   g++ -O3 -ffp-contract=off -fno-trapping-math -o bench input_transform_bench.cpp && ./bench 128 32
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <chrono>
#include <algorithm>
typedef float Vec8 __attribute__((vector_size(32)));
struct A { const float* x; int64_t H, W, cin, tiles_h, tiles_w, products, B; };
template <typename V> inline __attribute__((always_inline)) V loadv(const float* p) { V v; std::memcpy(&v, p, sizeof(v)); return v; }
template <typename V> inline __attribute__((always_inline)) void storev(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }
struct TileAt { int64_t b, ty, tx; };
inline __attribute__((always_inline)) TileAt tile_at(const A& a, int64_t tile) { return {tile / (a.tiles_w * a.tiles_h), tile / a.tiles_w % a.tiles_h, tile % a.tiles_w}; }
template <typename Vec> inline __attribute__((always_inline)) Vec load_padded(const float* data, const A& a, int64_t channels, int64_t b, int64_t y, int64_t x, int64_t c) {
  return (y >= 0 && y < a.H && x >= 0 && x < a.W) ? loadv<Vec>(data + ((b * a.H + y) * a.W + x) * channels + c) : Vec{};
}
template <typename Vec> inline __attribute__((always_inline)) void bt(const Vec (&d)[6], Vec (&r)[6]) {
  const Vec four = Vec{} + 4.0f, two = Vec{} + 2.0f, five = Vec{} + 5.0f;
  const Vec p = d[4] + d[3], q = d[1] + d[2], u = d[4] - d[3], w = d[1] - d[2], e = d[4] - d[2], f = d[3] - d[1];
  r[0] = four * d[0] - five * d[2] + d[4]; r[1] = p - four * q; r[2] = u + four * w; r[3] = e + two * f; r[4] = e - two * f;
  r[5] = four * d[1] - five * d[3] + d[5];
}
// Variant 1: every tile through a padded window copy, then one fixed-stride path.
__attribute__((noinline, target("avx2,fma"), optimize("fp-contract=fast")))
void padcopy(const A& a, int64_t t0, int64_t n, float* __restrict__ V) {
  using Vec = Vec8;
  const float* x_in = a.x; const int64_t cin = a.cin;
  alignas(64) float win[36 * 64];
  for (int64_t t = 0; t < n; ++t) {
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    const int64_t y0 = 4 * ty - 1, x0 = 4 * tx - 1;
    std::fill_n(win, 36 * cin, 0.0f);
    for (int i = 0; i < 6; ++i) { const int64_t y = y0 + i; if (y < 0 || y >= a.H) continue;
      const int64_t xa = std::max<int64_t>(0, x0), xb = std::min<int64_t>(a.W, x0 + 6);
      if (xb > xa) std::memcpy(win + (i * 6 + (xa - x0)) * cin, x_in + ((b * a.H + y) * a.W + xa) * cin, (xb - xa) * cin * 4); }
    float* v = V + t * a.products * cin;
    for (int64_t c = 0; c < cin; c += 8) {
      Vec s[6][6];
      for (int j = 0; j < 6; ++j) { Vec col[6]; for (int i = 0; i < 6; ++i) col[i] = loadv<Vec>(win + (6 * i + j) * cin + c);
        Vec r[6]; bt(col, r); for (int i = 0; i < 6; ++i) s[i][j] = r[i]; }
      for (int i = 0; i < 6; ++i) { Vec r[6]; bt(s[i], r); for (int j = 0; j < 6; ++j) storev(v + (6 * i + j) * cin + c, r[j]); }
    }
  }
}
// Variant 2: no loads at all from x (transform of a constant window): the arithmetic + stores bound.
__attribute__((noinline, target("avx2,fma"), optimize("fp-contract=fast")))
void noload(const A& a, int64_t t0, int64_t n, float* __restrict__ V) {
  using Vec = Vec8; const int64_t cin = a.cin;
  for (int64_t t = 0; t < n; ++t) {
    float* v = V + t * a.products * cin;
    for (int64_t c = 0; c < cin; c += 8) {
      Vec s[6][6];
      for (int j = 0; j < 6; ++j) { Vec col[6]; for (int i = 0; i < 6; ++i) col[i] = Vec{} + (float)(i + j + c + t);
        Vec r[6]; bt(col, r); for (int i = 0; i < 6; ++i) s[i][j] = r[i]; }
      for (int i = 0; i < 6; ++i) { Vec r[6]; bt(s[i], r); for (int j = 0; j < 6; ++j) storev(v + (6 * i + j) * cin + c, r[j]); }
    }
  }
}
// The extension's F(4x4) input transform (AHEAD 0: as it was before the prefetch; AHEAD > 0: asking for the window of
// the tile AHEAD tiles on first).
template <int AHEAD>
__attribute__((noinline, target("avx2,fma"), optimize("fp-contract=fast")))
void prefetched(const A& a, int64_t t0, int64_t n, float* __restrict__ V) {
  using Vec = Vec8;
  const float* x_in = a.x; const int64_t cin = a.cin; constexpr int64_t L = 8; const int64_t row = a.W * cin;
  for (int64_t t = 0; t < n; ++t) {
    if (AHEAD > 0) {  // the window of tile t + AHEAD: its rows' in-image runs
      const auto [pb, pty, ptx] = tile_at(a, t0 + t + AHEAD);
      const int64_t ya = std::max<int64_t>(0, 4 * pty - 1), yb = std::min<int64_t>(a.H, 4 * pty + 5);
      const int64_t xa = std::max<int64_t>(0, 4 * ptx - 1), xb = std::min<int64_t>(a.W, 4 * ptx + 5);
      if (pb < a.B) for (int64_t y = ya; y < yb; ++y) {
        const char* r = (const char*)(x_in + ((pb * a.H + y) * a.W + xa) * cin);
        for (int64_t o = 0; o < (xb - xa) * cin * 4; o += 64) __builtin_prefetch(r + o);
      }
    }
    const auto [b, ty, tx] = tile_at(a, t0 + t);
    const int64_t y0 = 4 * ty - 1, x0 = 4 * tx - 1;
    const bool inside = y0 >= 0 && y0 + 6 <= a.H && x0 >= 0 && x0 + 6 <= a.W;
    const float* window = inside ? x_in + ((b * a.H + y0) * a.W + x0) * cin : x_in;
    for (int64_t c = 0; c < cin; c += L) {
      Vec s[6][6];
      for (int j = 0; j < 6; ++j) {
        Vec col[6];
        for (int i = 0; i < 6; ++i) col[i] = inside ? loadv<Vec>(window + i * row + j * cin + c) : load_padded<Vec>(x_in, a, cin, b, y0 + i, x0 + j, c);
        Vec r[6]; bt(col, r);
        for (int i = 0; i < 6; ++i) s[i][j] = r[i];
      }
      float* v = V + t * a.products * cin + c;
      for (int i = 0; i < 6; ++i) { Vec r[6]; bt(s[i], r); for (int j = 0; j < 6; ++j) storev(v + (6 * i + j) * cin, r[j]); }
    }
  }
}
int main(int argc, char** argv) {
  const int64_t B = atoi(argv[1]), H = 28, W = 28, C = atoi(argv[2]), block = 24;
  std::vector<float> x(B * H * W * C); for (auto& v : x) v = (rand() % 1000) / 500.0f - 1.0f;
  A a{x.data(), H, W, C, 7, 7, 36, B};
  const int64_t tiles = B * 49;
  std::vector<float> V(block * 36 * C);
  void (*fs[6])(const A&, int64_t, int64_t, float*) = {prefetched<0>, padcopy, noload, prefetched<1>, prefetched<2>, prefetched<4>};
  const char* names[6] = {"current", "padcopy", "noload", "prefetch+1", "prefetch+2", "prefetch+4"};
  for (int rep = 0; rep < 2; ++rep)
  for (int f = 0; f < 6; ++f) {
    double best = 1e30;
    for (int it = 0; it < 20; ++it) {
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t s = 0; s < tiles; s += block) fs[f](a, s, std::min(block, tiles - s), V.data());
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, dt);
    }
    printf("%s B=%ld C=%ld: %.3f ms, %.1f ns per tile, %.1f ns per tile and 8 channels\n", names[f], B, C, best * 1e3, best / tiles * 1e9, best / tiles / (C / 8) * 1e9);
  }
}
