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
// Work is split over (request, kv head) pairs with at::parallel_for, so it
// uses exactly torch's intra-op threads. Accumulation is in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// D > 0: head_dim known at compile time (loops fully unrolled and vectorized);
// D == 0: generic, head_dim passed at run time.
template <typename T, int D>
static void decode_kernel(const T* q, const T* pool, const int64_t* k_rows, const int64_t* v_rows,
                          const int64_t* lens, T* out, int64_t nd, int64_t hkv, int64_t g,
                          int64_t d_rt, int64_t S, int64_t L, float scale) {
  const int64_t d = D > 0 ? D : d_rt;
  at::parallel_for(0, nd * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), sc;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / hkv, h = idx % hkv, n = lens[r];
      const T* qh = q + (r * hkv + h) * g * d;
      for (int64_t i = 0; i < g * d; ++i) qf[i] = static_cast<float>(qh[i]) * scale;
      sc.resize(g * n);
      const T* base = pool + h * S * d;
      const int64_t* kr_idx = k_rows + r * L;
      const int64_t* vr_idx = v_rows + r * L;
      for (int64_t t = 0; t < n; ++t) {
        const T* kr = base + kr_idx[t] * d;
        float kf[D > 0 ? D : 256];
        for (int64_t c = 0; c < d; ++c) kf[c] = static_cast<float>(kr[c]);
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
        const T* vr = base + vr_idx[t] * d;
        float vf[D > 0 ? D : 256];
        for (int64_t c = 0; c < d; ++c) vf[c] = static_cast<float>(vr[c]);
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

template <typename T>
static void dispatch_d(const T* q, const T* pool, const int64_t* k_rows, const int64_t* v_rows,
                       const int64_t* lens, T* out, int64_t nd, int64_t hkv, int64_t g, int64_t d,
                       int64_t S, int64_t L, float scale) {
  switch (d) {
    case 64: return decode_kernel<T, 64>(q, pool, k_rows, v_rows, lens, out, nd, hkv, g, d, S, L, scale);
    case 128: return decode_kernel<T, 128>(q, pool, k_rows, v_rows, lens, out, nd, hkv, g, d, S, L, scale);
    case 32: return decode_kernel<T, 32>(q, pool, k_rows, v_rows, lens, out, nd, hkv, g, d, S, L, scale);
    case 16: return decode_kernel<T, 16>(q, pool, k_rows, v_rows, lens, out, nd, hkv, g, d, S, L, scale);
    default: return decode_kernel<T, 0>(q, pool, k_rows, v_rows, lens, out, nd, hkv, g, d, S, L, scale);
  }
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor pool, torch::Tensor k_rows,
                           torch::Tensor v_rows, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 4 && pool.dim() == 3, "q [nd,Hkv,G,D], pool [Hkv,S,D]");
  TORCH_CHECK(q.is_contiguous() && pool.is_contiguous() && k_rows.is_contiguous() &&
              v_rows.is_contiguous() && lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == pool.scalar_type(), "q and pool dtypes differ");
  TORCH_CHECK(k_rows.scalar_type() == at::kLong && v_rows.scalar_type() == at::kLong &&
              lens.scalar_type() == at::kLong, "int64 rows and lens");
  const int64_t nd = q.size(0), hkv = q.size(1), g = q.size(2), d = q.size(3);
  TORCH_CHECK(pool.size(0) == hkv && pool.size(2) == d, "pool shape");
  TORCH_CHECK(d <= 256, "head_dim > 256 is not supported by the CPU kernel");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    dispatch_d<scalar_t>(q.data_ptr<scalar_t>(), pool.data_ptr<scalar_t>(),
                            k_rows.data_ptr<int64_t>(), v_rows.data_ptr<int64_t>(),
                            lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), nd, hkv, g, d,
                            pool.size(1), k_rows.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
}
