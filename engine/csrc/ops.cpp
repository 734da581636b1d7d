// The module engine.kernels builds: the CPU kernels of paged_decode.cpp, linear.cpp, qlinear.cpp and,
// where the compiler targets AVX-512 BF16, qlinear_bf16.cpp.
#include <torch/csrc/utils/pybind.h>

at::Tensor paged_decode(at::Tensor q, at::Tensor pool, at::Tensor k_rows,
                        at::Tensor v_rows, at::Tensor lens, double scale);
at::Tensor paged_decode_q8(at::Tensor q, at::Tensor stage, at::Tensor qpool,
                           at::Tensor qscale, at::Tensor qlow, at::Tensor stage_of,
                           at::Tensor k_rows, at::Tensor v_rows, at::Tensor lens,
                           int64_t block_size, double scale);
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, int64_t n);
at::Tensor q4_1_linear(at::Tensor x, at::Tensor panels, int64_t n);
at::Tensor q8_0_linear(at::Tensor x, at::Tensor panels, int64_t n);
#if defined(__AVX512BF16__)
at::Tensor q4_1_bf16_linear(at::Tensor x, at::Tensor panels, int64_t n);
at::Tensor q8_0_bf16_linear(at::Tensor x, at::Tensor panels, int64_t n);
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("paged_decode_q8", &paged_decode_q8, "paged decode attention over the int8 pool (CPU)");
  m.def("panel_linear", &panel_linear, "x @ W^T over W packed in 16-feature panels (CPU, float32)");
  m.def("q4_1_linear", &q4_1_linear, "x @ W^T over W in Q4_1 blocks packed in panels (CPU, float32 x)");
  m.def("q8_0_linear", &q8_0_linear, "x @ W^T over W in Q8_0 blocks packed in panels (CPU, float32 x)");
#if defined(__AVX512BF16__)
  m.def("q4_1_bf16_linear", &q4_1_bf16_linear,
        "x @ W^T over W in Q4_1 blocks packed in bfloat16 pairs (CPU, bfloat16 x)");
  m.def("q8_0_bf16_linear", &q8_0_bf16_linear,
        "x @ W^T over W in Q8_0 blocks packed in bfloat16 pairs (CPU, bfloat16 x)");
#endif
}
