// cuBLASLt GEMMs with an explicit algorithm: out[M, N] = x[M, K] @ w[N, K]^T (+ out when
// accumulate), bf16 inputs, fp32 accumulation, bf16 or fp32 output. torch.mm lets cuBLAS pick
// one algorithm per shape by its heuristic, tuned for a GPU at full clock; under the power
// limit a step's multiplies run at ~1450 of 1980 MHz and the fastest algorithm is the one that
// spends the least energy per FLOP, which the heuristic's first pick need not be. These ops
// list the heuristic's candidates for a shape (each as its opaque 64-byte cublasLtMatmulAlgo_t
// in an int64 tensor, so Python can time them and keep one) and run a chosen one. Built by
// bench/bench_gemm_algos.py; not part of the server (the README says what it measured).

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/extension.h>

#include <cstring>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace {

#define LT_CHECK(expr)                                                                        \
  do {                                                                                        \
    cublasStatus_t st_ = (expr);                                                              \
    TORCH_CHECK(st_ == CUBLAS_STATUS_SUCCESS, #expr " failed with cuBLAS status ", int(st_)); \
  } while (0)

constexpr int64_t kAlgoWords = sizeof(cublasLtMatmulAlgo_t) / sizeof(int64_t);
static_assert(sizeof(cublasLtMatmulAlgo_t) % sizeof(int64_t) == 0, "algo size");

// The descriptors of one problem: column-major, D[N, M] = op(W)[N, K] * X[K, M] (+ C), i.e.
// row-major out[M, N] = x[M, K] w[N, K]^T with row strides ldx, ldw, ldo.
struct Problem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;

  Problem(int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldw, int64_t ldo, cudaDataType_t out_type) {
    LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    LT_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, n, ldw));
    LT_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, m, ldx));
    LT_CHECK(cublasLtMatrixLayoutCreate(&c, out_type, n, m, ldo));
  }
  ~Problem() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;
};

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int>;

struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 0;
    auto mix = [&h](int64_t v) { h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    mix(std::get<0>(k)); mix(std::get<1>(k)); mix(std::get<2>(k)); mix(std::get<3>(k));
    mix(std::get<4>(k)); mix(std::get<5>(k)); mix(std::get<6>(k)); mix(std::get<7>(k));
    return h;
  }
};

// Descriptors are made once per shape and device (a few microseconds each otherwise).
Problem& problem_for(int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldw, int64_t ldo, cudaDataType_t t,
                     int device) {
  static std::mutex mu;
  static std::unordered_map<Key, std::unique_ptr<Problem>, KeyHash> cache;
  std::lock_guard<std::mutex> g(mu);
  Key key{m, n, k, ldx, ldw, ldo, int(t), device};
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, std::make_unique<Problem>(m, n, k, ldx, ldw, ldo, t)).first;
  return *it->second;
}

void check_operands(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && out.is_cuda(), "lt_gemm: CUDA tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "lt_gemm: bf16 x and w");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat, "lt_gemm: bf16 or fp32 out");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "lt_gemm: 2-D operands");
  TORCH_CHECK(x.size(1) == w.size(1) && out.size(0) == x.size(0) && out.size(1) == w.size(0),
              "lt_gemm: shapes ", x.sizes(), " @ ", w.sizes(), "^T -> ", out.sizes());
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1, "lt_gemm: rows must be contiguous");
}

cudaDataType_t out_type(const at::Tensor& out) {
  return out.scalar_type() == at::kFloat ? CUDA_R_32F : CUDA_R_16BF;
}

}  // namespace

// The heuristic's candidates for out = x w^T (+ out): an int64 tensor [n, kAlgoWords + 2],
// each row an algorithm's bytes, then its workspace bytes and its estimated waves x 1000.
at::Tensor lt_gemm_algos(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out, bool accumulate,
                         int64_t max_algos, int64_t workspace_bytes) {
  check_operands(x, w, out);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  Problem& p = problem_for(m, n, k, x.stride(0), w.stride(0), out.stride(0), out_type(out), x.get_device());
  cublasLtMatmulPreference_t pref = nullptr;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = uint64_t(workspace_bytes);
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  std::vector<cublasLtMatmulHeuristicResult_t> found(size_t(std::max<int64_t>(1, max_algos)));
  int returned = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), p.op, p.a, p.b, p.c,
                                                     p.c, pref, int(found.size()), found.data(), &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  LT_CHECK(st);
  (void)accumulate;  // the candidates do not depend on beta; kept so a caller names the epilogue
  std::vector<int64_t> rows;
  int kept = 0;
  for (int i = 0; i < returned; ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
    int64_t words[kAlgoWords];
    std::memcpy(words, &found[i].algo, sizeof(found[i].algo));
    rows.insert(rows.end(), words, words + kAlgoWords);
    rows.push_back(int64_t(found[i].workspaceSize));
    rows.push_back(int64_t(found[i].wavesCount * 1000.0f));
    ++kept;
  }
  return torch::tensor(rows, torch::kInt64).view({kept, kAlgoWords + 2});
}

// out = x w^T (+ out when accumulate) with the algorithm in `algo` (a row of lt_gemm_algos,
// its first kAlgoWords words) and `workspace` (a byte tensor at least its workspace size).
void lt_gemm_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out, bool accumulate,
                 const at::Tensor& algo, const at::Tensor& workspace) {
  check_operands(x, w, out);
  TORCH_CHECK(algo.scalar_type() == at::kLong && algo.is_cpu() && algo.numel() >= kAlgoWords && algo.is_contiguous(),
              "lt_gemm: algo must be a CPU int64 row from lt_gemm_algos");
  TORCH_CHECK(workspace.is_cuda() && workspace.scalar_type() == at::kByte, "lt_gemm: CUDA uint8 workspace");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  if (m == 0) return;
  Problem& p = problem_for(m, n, k, x.stride(0), w.stride(0), out.stride(0), out_type(out), x.get_device());
  cublasLtMatmulAlgo_t a;
  std::memcpy(&a, algo.data_ptr<int64_t>(), sizeof(a));
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  LT_CHECK(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), p.op, &alpha, w.data_ptr(), p.a, x.data_ptr(),
                          p.b, &beta, out.data_ptr(), p.c, out.data_ptr(), p.c, &a, workspace.data_ptr(),
                          size_t(workspace.numel()), at::cuda::getCurrentCUDAStream()));
}
