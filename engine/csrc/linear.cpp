// Projections y = x @ W^T for float32 on the CPU, over weights packed once into column panels.
//
//   x       [M, K]           the step's rows (tokens), contiguous
//   panels  [P, K, 16]       panels[p][k][j] = W[16 p + j][k], rows past N zero (W is [N, K])
//   y       [M, N]
//
// Each panel is 16 output features over the whole of K, stored k-major, so one panel is read
// as one contiguous stream and each of its 16-float rows is a vector; panel_tile.h multiplies
// tiles of up to MR rows of x by it with the products in registers.
//
// Decoding multiplies a few rows by every weight of the model, so a step streams all the
// weights once. On a 2-core AVX2 EPYC (one thread, SmolLM2) oneDNN's packed products took 1.5x
// the time of reading the weights once at 1 row and 2.0-2.4x at 8 rows; this kernel 0.9-1.2x
// and 1.5-1.7x (engine/linear.py has the table). The vectors are GCC vector types,
// lowered to whatever the compiler targets (-march=native: AVX2, AVX-512 or NEON), and the
// accumulation is in float32 in k order. Panels are split over torch's intra-op threads.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>

#include "panel_tile.h"

using panel_tile::NR;

at::Tensor panel_linear(at::Tensor x, at::Tensor panels, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x [M,K] float32, contiguous");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kFloat &&
              panels.size(2) == NR, "panels [P,K,16] float32, contiguous");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " features, the weight ", panels.size(1));
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "out_features ", n, " does not match ", P, " panels");
  auto y = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      panel_tile::panel_rows(xp, M, K, pp + p * K * NR, yp + p * NR, n, std::min(NR, n - p * NR));
    }
  });
  return y;
}
