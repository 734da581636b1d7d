// Projections y = x @ W^T for float32 rows on the CPU, over weights kept in GGUF's 4- and 8-bit
// blocks (Q4_1, Q8_0) and packed into column panels as linear.cpp's are.
//
// A GGUF block holds 32 consecutive weights of one row of W (one output feature, 32 inputs):
//   Q4_1: w = d q + m, q in 0..15, d and m half floats     (0.625 bytes a weight in GGUF)
//   Q8_0: w = d q,     q in -128..127, d a half float      (1.0625 bytes a weight)
// Packed, a panel is 16 output features; per block of 32 inputs it holds
//   Q4_1 (384 bytes): d[16] float32, m[16] float32, then for each of the 32 inputs k 8 bytes,
//        byte j = q[j][k] | q[j + 8][k] << 4                         (0.75 bytes a weight)
//   Q8_0 (576 bytes): d[16] float32, then for each input k the 16 int8 q[j][k]   (1.125 bytes)
// so a block is one contiguous piece of the panel's stream, and each input's 16 weights unpack
// into two 8-float vectors: w = q * d + m, exactly the float32 the dequantized model holds (the
// product q * d is exact in float32, so one rounding either way). The rest is panel_tile.h's
// tile: MR x 16 accumulators in registers, the panel read once per MR rows of x. For products of
// many rows (prompts) a panel is unpacked once into float32 and multiplied by that tile itself.
//
// Decoding streams every weight once a step, so the bytes per weight set its time: float32 panels
// read 4 bytes a weight, these 0.75 (Q4_1) and 1.125 (Q8_0). Unpacking costs a few vector
// instructions per 16 weights, which the tiles of several rows share.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "panel_tile.h"

namespace {

using panel_tile::NR;           // output features per panel
constexpr int64_t QB = 32;     // inputs per GGUF block
constexpr int64_t Q4_BYTES = 2 * NR * 4 + QB * NR / 2;   // 384
constexpr int64_t Q8_BYTES = NR * 4 + QB * NR;           // 576
constexpr int MR = 6;          // rows per tile: 12 accumulators, the weights of one input, x
// From this many rows on, a panel is unpacked once into float32 and multiplied as linear.cpp's
// panels are: unpacking in every tile costs more than one pass through the cache. [measured]
// SmolLM2's projections on one thread of a 2-core Zen 2 (AVX2), ms a sweep, unpacked from 7 rows
// on / from 24: 45 / 38 at 7-8 rows, 48.5 / 50 at 12, 70 / 67 at 16, 77 / 87 at 19 (a 1-row tile
// beside three full ones): no threshold below 24 is faster at every row count.
constexpr int64_t UNPACK_ROWS = 24;
using panel_tile::vec8;
typedef int32_t ivec8 __attribute__((vector_size(8 * sizeof(int32_t))));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

enum class Kind { Q4_1, Q8_0 };

inline vec8 load8(const uint8_t* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Eight bytes at p widened to eight int32 (zero- or sign-extended). GCC lowers the generic
// conversion one byte at a time, which made the kernel compute-bound; AVX2 has one instruction.
template <bool SIGNED>
inline ivec8 widen(const uint8_t* p) {
#if defined(__AVX2__)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i v = SIGNED ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  ivec8 out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
#else
  if constexpr (SIGNED) {
    i8x8 raw;
    std::memcpy(&raw, p, sizeof(raw));
    return __builtin_convertvector(raw, ivec8);
  } else {
    u8x8 raw;
    std::memcpy(&raw, p, sizeof(raw));
    return __builtin_convertvector(raw, ivec8);
  }
#endif
}

// The scales of a block: d and m of its 16 output features (m zero for Q8_0).
struct Scales {
  vec8 d_lo, d_hi, m_lo, m_hi;
};

template <Kind K>
inline Scales scales(const uint8_t* blk) {
  if constexpr (K == Kind::Q4_1) return {load8(blk), load8(blk + 32), load8(blk + 64), load8(blk + 96)};
  return {load8(blk), load8(blk + 32), vec8{}, vec8{}};
}

// The 16 weights of input k of a block, as two 8-float vectors.
template <Kind K>
inline void unpack(const uint8_t* blk, int64_t k, const Scales& s, vec8& w_lo, vec8& w_hi) {
  if constexpr (K == Kind::Q4_1) {
    const ivec8 q = widen<false>(blk + 2 * NR * 4 + 8 * k);
    w_lo = __builtin_convertvector(q & 15, vec8) * s.d_lo + s.m_lo;
    w_hi = __builtin_convertvector(q >> 4, vec8) * s.d_hi + s.m_hi;
  } else {
    w_lo = __builtin_convertvector(widen<true>(blk + NR * 4 + NR * k), vec8) * s.d_lo;
    w_hi = __builtin_convertvector(widen<true>(blk + NR * 4 + NR * k + 8), vec8) * s.d_hi;
  }
}

// The whole panel as float32 [K, 16] (linear.cpp's panel layout), into ``out``.
template <Kind KIND>
void unpack_panel(const uint8_t* panel, int64_t K, float* __restrict out) {
  constexpr int64_t BYTES = KIND == Kind::Q4_1 ? Q4_BYTES : Q8_BYTES;
  for (int64_t b = 0; b < K / QB; ++b) {
    const uint8_t* blk = panel + b * BYTES;
    const Scales s = scales<KIND>(blk);
    for (int64_t k = 0; k < QB; ++k) {
      vec8 w_lo, w_hi;
      unpack<KIND>(blk, k, s, w_lo, w_hi);
      std::memcpy(out + NR * (b * QB + k), &w_lo, sizeof(w_lo));
      std::memcpy(out + NR * (b * QB + k) + 8, &w_hi, sizeof(w_hi));
    }
  }
}

// y[c][0:n_valid] = x[c] . panel for the C rows of x at ``x`` (row stride K).
template <Kind KIND, int C>
inline void tile(const float* __restrict x, const uint8_t* __restrict panel, int64_t K,
                 float* __restrict y, int64_t ldy, int64_t n_valid) {
  constexpr int64_t BYTES = KIND == Kind::Q4_1 ? Q4_BYTES : Q8_BYTES;
  vec8 lo[C], hi[C];
  for (int c = 0; c < C; ++c) lo[c] = hi[c] = vec8{};
  for (int64_t b = 0; b < K / QB; ++b) {
    const uint8_t* blk = panel + b * BYTES;
    for (int64_t line = 0; line < BYTES; line += 64) __builtin_prefetch(blk + 8 * BYTES + line);
    const Scales s = scales<KIND>(blk);
    const float* xb = x + b * QB;
    for (int64_t k = 0; k < QB; ++k) {
      vec8 w_lo, w_hi;
      unpack<KIND>(blk, k, s, w_lo, w_hi);
      panel_tile::accumulate<C>(lo, hi, w_lo, w_hi, xb, K, k);
    }
  }
  panel_tile::store<C>(lo, hi, y, ldy, n_valid);
}

// y[:, panel's features] for all M rows of x, over the panel's blocks. Not inlined (nor is
// panel_tile.h's loop over the unpacked panel, below): inside the threads' loop GCC kept the
// tile's accumulators on the stack, 2x slower.
template <Kind KIND>
__attribute__((noinline)) void block_panel(const float* x, int64_t M, int64_t K, const uint8_t* panel,
                                           float* y, int64_t ldy, int64_t n_valid) {
  panel_tile::for_tiles<MR>(M, x, K, y, ldy, [&](auto C, const float* xr, float* yr) {
    tile<KIND, decltype(C)::value>(xr, panel, K, yr, ldy, n_valid);
  });
}

__attribute__((noinline)) void float_panel(const float* x, int64_t M, int64_t K, const float* panel,
                                           float* y, int64_t ldy, int64_t n_valid) {
  panel_tile::panel_rows(x, M, K, panel, y, ldy, n_valid);
}

template <Kind KIND>
at::Tensor block_linear(at::Tensor x, at::Tensor panels, int64_t n) {
  constexpr int64_t BYTES = KIND == Kind::Q4_1 ? Q4_BYTES : Q8_BYTES;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x [M,K] float32, contiguous");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kByte &&
              panels.size(2) == BYTES, "panels [P,K/32,", BYTES, "] uint8, contiguous");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) * QB == K, "x has ", K, " features, the weight ", panels.size(1) * QB);
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "out_features ", n, " does not match ", P, " panels");
  auto y = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = panels.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t stride = (K / QB) * BYTES;
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> unpacked(M >= UNPACK_ROWS ? K * NR : 0);
    for (int64_t p = lo; p < hi; ++p) {
      const uint8_t* panel = pp + p * stride;
      const int64_t n_valid = std::min(NR, n - p * NR);
      if (M >= UNPACK_ROWS) {
        unpack_panel<KIND>(panel, K, unpacked.data());
        float_panel(xp, M, K, unpacked.data(), yp + p * NR, n, n_valid);
      } else {
        block_panel<KIND>(xp, M, K, panel, yp + p * NR, n, n_valid);
      }
    }
  });
  return y;
}

}  // namespace

at::Tensor q4_1_linear(at::Tensor x, at::Tensor panels, int64_t n) {
  return block_linear<Kind::Q4_1>(x, panels, n);
}

at::Tensor q8_0_linear(at::Tensor x, at::Tensor panels, int64_t n) {
  return block_linear<Kind::Q8_0>(x, panels, n);
}
