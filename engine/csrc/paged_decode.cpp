// Paged decode attention for the CPU: one query token per request, keys and
// values read in place from the head-major block pool (no gather copy).
//
//   q      [nd, Hkv, G, D]   query heads grouped by the KV head they share
//   pool   [Hkv, S, D]       this layer's pool (K and V rows live in different blocks)
//   k_rows [nd, L] int64     pool row of each context token's K (padded past lens[r])
//   v_rows [nd, L] int64     pool row of each context token's V
//   lens   [nd]    int64     context length of each request (including this token)
//   out    [nd, Hkv, G, D]
//
// paged_decode_q8 reads the int8 pool of engine/quantpool.py the same way.
//
// Work is split over (request, kv head) pairs with at::parallel_for, so it
// uses exactly torch's intra-op threads. Accumulation is in fp32.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// Cache lines of [p, p + bytes) asked for ahead of their use.
static inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

// Row readers: where a context token's K or V row comes from, as fp32; ``prefetch`` asks for a
// row that will be read soon.
template <typename T>
struct FullRows {                   // the full-precision pool [Hkv, S, D]
  const T* pool;
  int64_t S;
  inline void prefetch(int64_t h, int64_t row, int64_t d) const {
    prefetch_bytes(pool + (h * S + row) * d, d * static_cast<int64_t>(sizeof(T)));
  }
  inline void load(int64_t h, int64_t row, float* dst, int64_t d) const {
    const T* r = pool + (h * S + row) * d;
    for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(r[c]);
  }
};

template <typename T>
struct QuantRows {                  // the int8 pool (engine/quantpool.py): closed blocks as
  const T* stage;                   // lo + scale * q per block and channel, open blocks staged
  const uint8_t* q;                 // [Hkv, S, D]
  const float* scale;               // [Hkv, NB, D]
  const float* low;                 // [Hkv, NB, D]
  const int64_t* stage_of;          // [NB] staging slot of an open block, -1 when closed
  int64_t S_stage, S, NB, B;
  inline void prefetch(int64_t h, int64_t row, int64_t d) const {   // the codes (open blocks are few)
    prefetch_bytes(q + (h * S + row) * d, d);
  }
  inline void load(int64_t h, int64_t row, float* dst, int64_t d) const {
    const int64_t b = row / B, s = stage_of[b];
    if (s >= 0) {
      const T* r = stage + (h * S_stage + s * B + row % B) * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(r[c]);
      return;
    }
    const uint8_t* r = q + (h * S + row) * d;
    const float* sc = scale + (h * NB + b) * d;
    const float* lo = low + (h * NB + b) * d;
    // lo + scale * q, where scale * q passes float32's range if a channel spans more than it: a
    // fused multiply-add never rounds that product; without one, on halves as engine/kvquant.py
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) {
#if defined(__FMA__)
      dst[c] = std::fma(sc[c], static_cast<float>(r[c]), lo[c]);
#else
      dst[c] = 2.f * (0.5f * lo[c] + (0.5f * sc[c]) * static_cast<float>(r[c]));
#endif
    }
  }
};

// Rows ahead of the one being read that are prefetched. A request's context is scattered over
// the pool block by block, so the hardware prefetcher, which follows one stream inside a page,
// stalls at every block boundary; asking for the row a block ahead hides that latency. Same
// result bit for bit; on fp32 pools 1.2-1.7x faster at OPT-13B's and Llama-8B's head shapes
// (python -m bench kernels --cpu, 2-core AMD EPYC), the int8 pool about unchanged.
constexpr int64_t PREFETCH_ROWS = 16;

// D > 0: head_dim known at compile time (loops fully unrolled and vectorized);
// D == 0: generic, head_dim passed at run time.
template <typename T, int D, typename Rows>
static void decode_kernel(const T* q, const Rows& rows, const int64_t* k_rows, const int64_t* v_rows,
                          const int64_t* lens, T* out, int64_t nd, int64_t hkv, int64_t g,
                          int64_t d_rt, int64_t L, float scale) {
  const int64_t d = D > 0 ? D : d_rt;
  at::parallel_for(0, nd * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), sc;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / hkv, h = idx % hkv, n = lens[r];
      const T* qh = q + (r * hkv + h) * g * d;
      for (int64_t i = 0; i < g * d; ++i) qf[i] = static_cast<float>(qh[i]) * scale;
      sc.resize(g * n);
      const int64_t* kr_idx = k_rows + r * L;
      const int64_t* vr_idx = v_rows + r * L;
      for (int64_t t = 0; t < n; ++t) {
        float kf[D > 0 ? D : 256];
        if (t + PREFETCH_ROWS < n) rows.prefetch(h, kr_idx[t + PREFETCH_ROWS], d);
        rows.load(h, kr_idx[t], kf, d);
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf.data() + j * d;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t c = 0; c < d; ++c) s += qj[c] * kf[c];
          sc[j * n + t] = s;
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        float* sj = sc.data() + j * n;
        float m = -INFINITY, z = 0.f;
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sj[t]);
        for (int64_t t = 0; t < n; ++t) { sj[t] = std::exp(sj[t] - m); z += sj[t]; }
        const float inv = 1.f / z;
        for (int64_t t = 0; t < n; ++t) sj[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        float vf[D > 0 ? D : 256];
        if (t + PREFETCH_ROWS < n) rows.prefetch(h, vr_idx[t + PREFETCH_ROWS], d);
        rows.load(h, vr_idx[t], vf, d);
        for (int64_t j = 0; j < g; ++j) {
          const float p = sc[j * n + t];
          float* aj = acc.data() + j * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) aj[c] += p * vf[c];
        }
      }
      T* o = out + (r * hkv + h) * g * d;
      for (int64_t i = 0; i < g * d; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

template <typename T, typename Rows>
static void dispatch_d(const T* q, const Rows& rows, const int64_t* k_rows, const int64_t* v_rows,
                       const int64_t* lens, T* out, int64_t nd, int64_t hkv, int64_t g, int64_t d,
                       int64_t L, float scale) {
  switch (d) {
    case 64: return decode_kernel<T, 64>(q, rows, k_rows, v_rows, lens, out, nd, hkv, g, d, L, scale);
    case 128: return decode_kernel<T, 128>(q, rows, k_rows, v_rows, lens, out, nd, hkv, g, d, L, scale);
    case 32: return decode_kernel<T, 32>(q, rows, k_rows, v_rows, lens, out, nd, hkv, g, d, L, scale);
    case 16: return decode_kernel<T, 16>(q, rows, k_rows, v_rows, lens, out, nd, hkv, g, d, L, scale);
    default: return decode_kernel<T, 0>(q, rows, k_rows, v_rows, lens, out, nd, hkv, g, d, L, scale);
  }
}

static void check_common(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                         const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 4, "q [nd,Hkv,G,D]");
  TORCH_CHECK(q.is_contiguous() && k_rows.is_contiguous() && v_rows.is_contiguous() && lens.is_contiguous(),
              "contiguous inputs");
  TORCH_CHECK(k_rows.scalar_type() == at::kLong && v_rows.scalar_type() == at::kLong &&
              lens.scalar_type() == at::kLong, "int64 rows and lens");
  TORCH_CHECK(q.size(3) <= 256, "head_dim > 256 is not supported by the CPU kernel");
}

at::Tensor paged_decode(at::Tensor q, at::Tensor pool, at::Tensor k_rows,
                        at::Tensor v_rows, at::Tensor lens, double scale) {
  check_common(q, k_rows, v_rows, lens);
  TORCH_CHECK(pool.dim() == 3 && pool.is_contiguous(), "pool [Hkv,S,D], contiguous");
  TORCH_CHECK(q.scalar_type() == pool.scalar_type(), "q and pool dtypes differ");
  const int64_t nd = q.size(0), hkv = q.size(1), g = q.size(2), d = q.size(3);
  TORCH_CHECK(pool.size(0) == hkv && pool.size(2) == d, "pool shape");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    FullRows<scalar_t> rows{pool.data_ptr<scalar_t>(), pool.size(1)};
    dispatch_d<scalar_t>(q.data_ptr<scalar_t>(), rows, k_rows.data_ptr<int64_t>(),
                         v_rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                         nd, hkv, g, d, k_rows.size(1), static_cast<float>(scale));
  });
  return out;
}

// The same attention over the int8 pool: closed blocks dequantized as they are read.
at::Tensor paged_decode_q8(at::Tensor q, at::Tensor stage, at::Tensor qpool,
                           at::Tensor qscale, at::Tensor qlow, at::Tensor stage_of,
                           at::Tensor k_rows, at::Tensor v_rows, at::Tensor lens,
                           int64_t block_size, double scale) {
  check_common(q, k_rows, v_rows, lens);
  TORCH_CHECK(stage.dim() == 3 && qpool.dim() == 3 && qscale.dim() == 3 && qlow.dim() == 3,
              "stage [Hkv,S',D], q [Hkv,S,D], scale and low [Hkv,NB,D]");
  TORCH_CHECK(stage.is_contiguous() && qpool.is_contiguous() && qscale.is_contiguous() &&
              qlow.is_contiguous() && stage_of.is_contiguous(), "contiguous pool");
  TORCH_CHECK(q.scalar_type() == stage.scalar_type(), "q and staging dtypes differ");
  TORCH_CHECK(qpool.scalar_type() == at::kByte && qscale.scalar_type() == at::kFloat &&
              qlow.scalar_type() == at::kFloat && stage_of.scalar_type() == at::kLong,
              "uint8 values, fp32 scale and low, int64 staging slots");
  const int64_t nd = q.size(0), hkv = q.size(1), g = q.size(2), d = q.size(3);
  const int64_t nb = qscale.size(1);
  TORCH_CHECK(qpool.size(0) == hkv && qpool.size(2) == d && stage.size(0) == hkv && stage.size(2) == d &&
              qpool.size(1) == nb * block_size && stage_of.size(0) == nb, "pool shape");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_q8", [&] {
    QuantRows<scalar_t> rows{stage.data_ptr<scalar_t>(), qpool.data_ptr<uint8_t>(),
                             qscale.data_ptr<float>(), qlow.data_ptr<float>(), stage_of.data_ptr<int64_t>(),
                             stage.size(1), qpool.size(1), nb, block_size};
    dispatch_d<scalar_t>(q.data_ptr<scalar_t>(), rows, k_rows.data_ptr<int64_t>(),
                         v_rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                         nd, hkv, g, d, k_rows.size(1), static_cast<float>(scale));
  });
  return out;
}
