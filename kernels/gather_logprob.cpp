// Python binding of the gather-logprob CUDA kernel (kept out of the .cu so nvcc never
// compiles the pybind11 headers, and the two files build in parallel).

#include <torch/extension.h>

void gather_logprobs_out(const at::Tensor& logits, const at::Tensor& cand, const at::Tensor& out,
                         bool logits_mode);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_logprobs_out", &gather_logprobs_out,
        "out[r, j] = log_softmax(logits[r])[cand[r, j]] (or the logit in logits mode); "
        "cand < 0 gives -inf",
        py::arg("logits"), py::arg("cand"), py::arg("out"), py::arg("logits_mode"));
}
