// The float32 register tile over a column panel, shared by linear.cpp (float32 panels) and
// qlinear.cpp (GGUF blocks unpacked a panel at a time for products of many rows).
//
//   x      [M, K]       rows of x, row stride K
//   panel  [K, 16]      panel[k][j] = W[16 p + j][k]
//   y      rows of y at the panel's first output feature, row stride ldy
//
// For a tile of up to MR rows of x, the kernel keeps MR x 16 accumulators in registers and, per
// k, multiplies the panel's row by each x[m][k] (broadcast): y[m][16 p + j] = sum_k x[m][k]
// panel[k][j]. The panel is read from memory once per MR rows of x, and from the cache for the
// next tiles. Accumulation is in float32, in k order.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace panel_tile {

constexpr int64_t NR = 16;   // output features per panel
constexpr int MR = 6;        // rows of x per tile: 6 x 16 accumulators (12 AVX2 registers)
// Two 8-float vectors per 16 features: one 16-float vector type measured 3-5x slower here (GCC
// kept its accumulators in memory)
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));

// acc[c] += w * x[c][k] for the C rows of x (row stride K): the tile's inner step, shared with
// qlinear.cpp's tile over GGUF blocks.
template <int C>
inline void accumulate(vec8 (&lo)[C], vec8 (&hi)[C], vec8 w_lo, vec8 w_hi, const float* __restrict x,
                       int64_t K, int64_t k) {
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    const float xv = x[c * K + k];
    lo[c] += w_lo * xv;
    hi[c] += w_hi * xv;
  }
}

// y[c][0:n_valid] = the C rows' accumulators.
template <int C>
inline void store(const vec8 (&lo)[C], const vec8 (&hi)[C], float* __restrict y, int64_t ldy, int64_t n_valid) {
  for (int c = 0; c < C; ++c) {
    float out[NR];
    std::memcpy(out, &lo[c], sizeof(lo[c]));
    std::memcpy(out + 8, &hi[c], sizeof(hi[c]));
    std::memcpy(y + c * ldy, out, n_valid * sizeof(float));
  }
}

// y[c][0:n_valid] = x[c] . panel for the C rows of x at ``x`` (row stride K).
template <int C>
inline void tile(const float* __restrict x, const float* __restrict panel, int64_t K,
                 float* __restrict y, int64_t ldy, int64_t n_valid) {
  vec8 lo[C], hi[C];
  for (int c = 0; c < C; ++c) lo[c] = hi[c] = vec8{};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(panel + NR * (k + 64));   // 4 KB ahead in the panel's stream
    vec8 w_lo, w_hi;
    std::memcpy(&w_lo, panel + NR * k, sizeof(w_lo));
    std::memcpy(&w_hi, panel + NR * k + 8, sizeof(w_hi));
    accumulate<C>(lo, hi, w_lo, w_hi, x, K, k);
  }
  store<C>(lo, hi, y, ldy, n_valid);
}

// Every row of x [M, K] in tiles of R rows, the last M % R in one tile of exactly that many:
// tile(std::integral_constant<int, C>{}, x + m K, y + m ldy) runs a tile of C rows (x of any
// element type: qlinear_bf16.cpp's rows are bfloat16).
template <int R, int C = R - 1, typename T, typename Tile>
inline void tail(int64_t rows, const T* x, int64_t K, float* y, int64_t ldy, Tile&& tile) {
  if constexpr (C > 0) {
    if (rows == C) tile(std::integral_constant<int, C>{}, x, y);
    else tail<R, C - 1>(rows, x, K, y, ldy, tile);
  }
}

template <int R, typename T, typename Tile>
inline void for_tiles(int64_t M, const T* x, int64_t K, float* y, int64_t ldy, Tile&& tile) {
  int64_t m = 0;
  for (; m + R <= M; m += R) tile(std::integral_constant<int, R>{}, x + m * K, y + m * ldy);
  if (m < M) tail<R>(M - m, x + m * K, K, y + m * ldy, ldy, tile);
}

// y[:, a panel's features] for all M rows of x over the float32 panel.
inline void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, float* y, int64_t ldy,
                       int64_t n_valid) {
  for_tiles<MR>(M, x, K, y, ldy, [&](auto C, const float* xr, float* yr) {
    tile<decltype(C)::value>(xr, panel, K, yr, ldy, n_valid);
  });
}

}  // namespace panel_tile
