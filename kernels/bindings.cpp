// Python bindings of the CUDA kernels (kept out of the .cu files so nvcc never compiles
// the pybind11 headers, and the sources build in parallel).

#include <torch/extension.h>

void gather_logprobs_out(const at::Tensor& logits, const at::Tensor& cand, const at::Tensor& out,
                         bool logits_mode);
void gather_logprobs_partial_out(const at::Tensor& logits, const at::Tensor& cand, const at::Tensor& out,
                                 const at::Tensor& stats_m, const at::Tensor& stats_s, int64_t vocab_start,
                                 bool logits_mode);
void silu_mul_out(const at::Tensor& gate_up, const at::Tensor& out, const c10::optional<at::Tensor>& end);
void clamped_swiglu_out(const at::Tensor& gate_up, const at::Tensor& bias, const at::Tensor& expert, double alpha,
                        double limit, const at::Tensor& out, const c10::optional<at::Tensor>& end);
void qkv_rope_out(const at::Tensor& qkv, const at::Tensor& cs, const c10::optional<at::Tensor>& q_w,
                  const c10::optional<at::Tensor>& k_w, double eps, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const c10::optional<at::Tensor>& k_cache,
                  const c10::optional<at::Tensor>& v_cache, const c10::optional<at::Tensor>& slots,
                  int64_t items_per_group);
void moe_combine_out(const at::Tensor& y, const at::Tensor& pos, const at::Tensor& w, int64_t pad,
                     const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& expert,
                     const at::Tensor& out);
void merge_attn_out(const at::Tensor& o1, const at::Tensor& l1, const at::Tensor& o2, const at::Tensor& l2,
                    const at::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_logprobs_out", &gather_logprobs_out,
        "out[r, j] = log_softmax(logits[r])[cand[r, j]] (or the logit in logits mode); "
        "cand < 0 gives -inf",
        py::arg("logits"), py::arg("cand"), py::arg("out"), py::arg("logits_mode"));
  m.def("gather_logprobs_partial_out", &gather_logprobs_partial_out,
        "one vocab shard's share: out[r, j] = the logit of cand[r, j] when in the shard, else 0; "
        "stats_m / stats_s = the rows' max and sum exp(x - max)",
        py::arg("logits"), py::arg("cand"), py::arg("out"), py::arg("stats_m"), py::arg("stats_s"),
        py::arg("vocab_start"), py::arg("logits_mode"));
  m.def("silu_mul_out", &silu_mul_out,
        "out = silu(gate) * up for gate_up = [gate | up] (rows before end only, when given)", py::arg("gate_up"),
        py::arg("out"), py::arg("end") = py::none());
  m.def("clamped_swiglu_out", &clamped_swiglu_out,
        "gpt-oss's clamped SwiGLU of gate_up plus its rows' experts' bias (rows before end only, when given)",
        py::arg("gate_up"), py::arg("bias"), py::arg("expert"), py::arg("alpha"), py::arg("limit"), py::arg("out"),
        py::arg("end") = py::none());
  m.def("qkv_rope_out", &qkv_rope_out,
        "split fused QKV, per-head RMSNorm (optional), rotary, and write k/v into the KV pool", py::arg("qkv"),
        py::arg("cs"), py::arg("q_w"), py::arg("k_w"), py::arg("eps"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("items_per_group") = 4);
  m.def("moe_combine_out", &moe_combine_out,
        "out[t] = sum_j w[t, j] * (y[pos[t, j]] (+ bias[expert[pos[t, j]]])) in float32, slots at pad skipped",
        py::arg("y"), py::arg("pos"), py::arg("w"), py::arg("pad"), py::arg("bias"), py::arg("expert"),
        py::arg("out"));
  m.def("merge_attn_out", &merge_attn_out,
        "merge two partial attentions over disjoint keys by their log-sum-exp", py::arg("o1"), py::arg("l1"),
        py::arg("o2"), py::arg("l2"), py::arg("out"));
}
