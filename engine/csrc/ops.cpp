// The module engine.kernels builds: the CPU kernels of paged_decode.cpp, linear.cpp and qlinear.cpp.
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor pool, torch::Tensor k_rows,
                           torch::Tensor v_rows, torch::Tensor lens, double scale);
torch::Tensor paged_decode_q8(torch::Tensor q, torch::Tensor stage, torch::Tensor qpool,
                              torch::Tensor qscale, torch::Tensor qlow, torch::Tensor stage_of,
                              torch::Tensor k_rows, torch::Tensor v_rows, torch::Tensor lens,
                              int64_t block_size, double scale);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t n);
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor panels, int64_t n);
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor panels, int64_t n);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("paged_decode_q8", &paged_decode_q8, "paged decode attention over the int8 pool (CPU)");
  m.def("panel_linear", &panel_linear, "x @ W^T over W packed in 16-feature panels (CPU, float32)");
  m.def("q4_1_linear", &q4_1_linear, "x @ W^T over W in Q4_1 blocks packed in panels (CPU, float32 x)");
  m.def("q8_0_linear", &q8_0_linear, "x @ W^T over W in Q8_0 blocks packed in panels (CPU, float32 x)");
}
