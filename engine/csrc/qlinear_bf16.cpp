// Projections y = x @ W^T for bfloat16 rows over weights kept in GGUF's blocks (Q4_1, Q8_0), on
// CPUs with AVX-512 BF16 (vdpbf16ps: 32 bfloat16 products a register, summed in pairs into 16
// float32).
//
// A block holds 32 inputs of one output feature j: w = d_j q + m_j (Q4_1: q in 0..15; Q8_0:
// q in -128..127, m = 0). Over a block, with X = the sum of its 32 inputs of x,
//
//     sum_k x_k w_jk = d_j (sum_k x_k q_jk) + m_j X,
//
// and q is exact in bfloat16 (at most 8 significant bits), as x is (the activations of a
// bfloat16 model), so each product x_k q_jk is exact in float32 and vdpbf16ps sums them two
// inputs at a time. qlinear.cpp instead rebuilds every float32 weight (a convert and an FMA per
// 16 weights and input) before its product; here a register of 16 features x 2 inputs costs a
// few instructions (Q4_1: a mask or shift, a widening and a table lookup; Q8_0: two widenings,
// two converts and one rounding to bfloat16, exact), shared by the rows of a tile, and each row
// one vdpbf16ps.
//
// Layout (engine.blocks.pack_bf16_pairs), per panel of 16 features and block of 32 inputs:
// d[16] (and for Q4_1 m[16]) as float32, then for each group of four inputs k = 4g .. 4g + 3
//   Q4_1 (32 bytes): byte 2j + e = q[j][4g + e] | q[j][4g + 2 + e] << 4
//   Q8_0 (64 bytes): byte 2j + e = q[j][4g + e], then byte 32 + 2j + e = q[j][4g + 2 + e]
// so that a group gives two registers of pairs (q[j][k], q[j][k + 1]) in feature order, which
// vdpbf16ps pairs with a broadcast pair (x_k, x_k+1): 384 bytes a block for Q4_1 (0.75 bytes a
// weight), 576 for Q8_0 (1.125), as qlinear.cpp's.
//
// The sums are float32 in a fixed order (pairs, then a block's d and m), so a row's result does
// not depend on the other rows of the product. x q is formed before d scales it, so an input
// beyond 2^120 or so overflows and an infinite one meets q = 0 (NaN where w = m is finite):
// activations that large are lost either way. vdpbf16ps flushes subnormal inputs to zero.
#if defined(__AVX512BF16__)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel_tile.h"

namespace {

using panel_tile::NR;                       // output features per panel
constexpr int64_t QB = 32;                 // inputs per block
constexpr int MR = 8;                      // rows per tile: 3 x 8 accumulators of the 32 registers

enum class Kind { Q4_1, Q8_0 };

template <Kind K>
constexpr int64_t SCALES = K == Kind::Q4_1 ? 2 * NR * 4 : NR * 4;   // d (and m) of a block's 16 features
template <Kind K>
constexpr int64_t BYTES = SCALES<K> + (K == Kind::Q4_1 ? QB * NR / 2 : QB * NR);   // 384, 576

// bfloat16 of 0..15 in the low 16 words (vpermw looks up the low five bits of each index)
inline __m512i q_table() {
  alignas(64) uint16_t t[32] = {0};
  for (int q = 0; q < 16; ++q) {
    const float f = static_cast<float>(q);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    t[q] = static_cast<uint16_t>(bits >> 16);      // exact: q has at most four significant bits
  }
  return _mm512_load_si512(t);
}

inline __m512 xpair(const uint16_t* x) {   // (x_k, x_k+1) in every 32-bit lane
  uint32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair)));
}

// The two registers of group g of a block (inputs 4g, 4g + 1 and 4g + 2, 4g + 3), as bfloat16
// pairs (q[j][k], q[j][k + 1]) in feature order.
template <Kind K>
inline void unpack(const uint8_t* blk, int64_t g, const __m512i table, __m512bh& w0, __m512bh& w1) {
  if constexpr (K == Kind::Q4_1) {
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + SCALES<K> + 32 * g));
    w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(v, low)), table);
    w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low)),
                                            table);
  } else {
    const uint8_t* q = blk + SCALES<K> + 64 * g;
    auto pairs = [](const uint8_t* p) {      // 32 int8 -> 32 bfloat16 in order (exact: |q| <= 128)
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
      return _mm512_cvtne2ps_pbh(hi, lo);
    };
    w0 = pairs(q);
    w1 = pairs(q + 32);
  }
}

// y[c][0:n_valid] = x[c] . panel for the C rows of x (bfloat16, row stride K); xs[c * nb + b]:
// row c's sum over block b (Q4_1's m term).
template <Kind K, int C>
inline void tile(const uint16_t* __restrict x, const float* __restrict xs, const uint8_t* __restrict panel,
                 int64_t K_, const __m512i table, float* __restrict y, int64_t ldy, int64_t n_valid) {
  const int64_t nb = K_ / QB;
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * BYTES<K>;
    for (int64_t line = 0; line < BYTES<K>; line += 64) __builtin_prefetch(blk + 8 * BYTES<K> + line);
    __m512 s0[C], s1[C];               // two chains a row: the low and the high pairs of each group
    for (int c = 0; c < C; ++c) s0[c] = s1[c] = _mm512_setzero_ps();
    const uint16_t* xb = x + b * QB;
#pragma GCC unroll 8
    for (int64_t g = 0; g < QB / 4; ++g) {
      __m512bh w0, w1;
      unpack<K>(blk, g, table, w0, w1);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        s0[c] = _mm512_dpbf16_ps(s0[c], w0, (__m512bh)xpair(xb + c * K_ + 4 * g));
        s1[c] = _mm512_dpbf16_ps(s1[c], w1, (__m512bh)xpair(xb + c * K_ + 4 * g + 2));
      }
    }
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    for (int c = 0; c < C; ++c) {
      acc[c] = _mm512_fmadd_ps(d, _mm512_add_ps(s0[c], s1[c]), acc[c]);
      if constexpr (K == Kind::Q4_1) {
        const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + NR * 4));
        acc[c] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[c * nb + b]), acc[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    alignas(64) float out[NR];
    _mm512_store_ps(out, acc[c]);
    std::memcpy(y + c * ldy, out, n_valid * sizeof(float));
  }
}

// y[:, the panel's features] for all M rows, in tiles of MR rows (panel_tile.h's loop); not
// inlined, so that each tile's accumulators stay in registers inside the threads' loop
template <Kind K>
__attribute__((noinline)) void panel_rows(const uint16_t* x, const float* xs, int64_t M, int64_t K_,
                                          const uint8_t* panel, const __m512i table, float* y, int64_t ldy,
                                          int64_t n_valid) {
  const int64_t nb = K_ / QB;
  panel_tile::for_tiles<MR>(M, x, K_, y, ldy, [&](auto C, const uint16_t* xr, float* yr) {
    tile<K, decltype(C)::value>(xr, xs + (xr - x) / K_ * nb, panel, K_, table, yr, ldy, n_valid);
  });
}

// Each row's sum over each block, in input order (Q4_1's m term).
std::vector<float> block_sums(const uint16_t* x, int64_t M, int64_t nb) {
  std::vector<float> xs(M * nb);
  for (int64_t i = 0; i < M * nb; ++i) {
    float s = 0.f;
    for (int64_t k = 0; k < QB; ++k) {
      const uint32_t bits = static_cast<uint32_t>(x[i * QB + k]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      s += f;
    }
    xs[i] = s;
  }
  return xs;
}

template <Kind K>
at::Tensor bf16_linear(at::Tensor x, at::Tensor panels, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x [M,K] bfloat16, contiguous");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kByte &&
              panels.size(2) == BYTES<K>, "panels [P,K/32,", BYTES<K>, "] uint8, contiguous");
  const int64_t M = x.size(0), K_ = x.size(1), P = panels.size(0), nb = K_ / QB;
  TORCH_CHECK(panels.size(1) * QB == K_, "x has ", K_, " features, the weight ", panels.size(1) * QB);
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "out_features ", n, " does not match ", P, " panels");
  auto y = at::empty({M, n}, x.options().dtype(at::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const std::vector<float> xs = block_sums(xp, M, nb);
  const uint8_t* pp = panels.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const __m512i table = q_table();
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      panel_rows<K>(xp, xs.data(), M, K_, pp + p * nb * BYTES<K>, table, yp + p * NR, n, std::min(NR, n - p * NR));
    }
  });
  return y;
}

}  // namespace

at::Tensor q4_1_bf16_linear(at::Tensor x, at::Tensor panels, int64_t n) {
  return bf16_linear<Kind::Q4_1>(x, panels, n);
}

at::Tensor q8_0_bf16_linear(at::Tensor x, at::Tensor panels, int64_t n) {
  return bf16_linear<Kind::Q8_0>(x, panels, n);
}
#endif
