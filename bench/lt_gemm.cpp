// cuBLASLt GEMMs with an explicit algorithm: out[M, N] = x[M, K] @ w[N, K]^T (+ out when
// accumulate), bf16 inputs, fp32 accumulation, bf16 or fp32 output. torch.mm lets cuBLAS pick
// one algorithm per shape by its heuristic, tuned for a GPU at full clock; under the power
// limit a step's multiplies run at ~1450 of 1980 MHz and the fastest algorithm is the one that
// spends the least energy per FLOP, which the heuristic's first pick need not be. These ops
// list the heuristic's candidates for a shape (each as its opaque 64-byte cublasLtMatmulAlgo_t
// in an int64 tensor, so Python can time them and keep one) and run a chosen one. The same for
// the FP8 block-scaled recipe torch's F.scaled_mm runs for DeepSeek-style checkpoints (1x128
// activation scales, 128x128 weight scales), whose candidates cuBLASLt's best-fit heuristic
// narrows to one kernel family: lt_block_algos also asks the heuristic per algorithm id and
// tries each id's tiles and stages. Built by bench/bench_gemm_algos.py; not part of the server
// (the README says what it measured).

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/extension.h>

#include <array>
#include <cstring>
#include <vector>
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
// row-major out[M, N] = x[M, K] w[N, K]^T with row strides ldx, ldw, ldo. bf16 operands, or with
// `block` e4m3 ones with the FP8 block-scaled recipe as torch's scaled_gemm sets it: cuBLASLt's A
// is the weight (BLK128x128_32F scales, [Nb] rows of round_up(Kb, 4) floats), B the activations
// (VEC128_32F scales, Kb columns of M floats).
struct Problem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cudaDataType_t out_t;

  Problem(int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldw, int64_t ldo, cudaDataType_t out_type,
          bool block) : out_t(out_type) {
    LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (block) {
      int32_t amode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, bmode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &amode, sizeof(amode)));
      LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bmode, sizeof(bmode)));
    }
    const cudaDataType_t in_t = block ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    LT_CHECK(cublasLtMatrixLayoutCreate(&a, in_t, k, n, ldw));
    LT_CHECK(cublasLtMatrixLayoutCreate(&b, in_t, k, m, ldx));
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

  // The block recipe's scale pointers (the weight's, the activations'), set before each call.
  void set_scales(const at::Tensor& wscale, const at::Tensor& xscale) {
    const void* sa = wscale.data_ptr();
    const void* sb = xscale.data_ptr();
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  }
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
                     int device, bool block = false) {
  static std::mutex mu;
  static std::unordered_map<Key, std::unique_ptr<Problem>, KeyHash> cache;
  std::lock_guard<std::mutex> g(mu);
  Key key{m, n, k, ldx, ldw, ldo, int(t) * 2 + int(block), device};
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, std::make_unique<Problem>(m, n, k, ldx, ldw, ldo, t, block)).first;
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

// ---- FP8 block-scaled: out[M, N] = (xq[M, K] * 1x128 scales) (wq[N, K] * 128x128 scales)^T ----

namespace {

Problem& block_problem_for(const at::Tensor& xq, const at::Tensor& wq, const at::Tensor& out) {
  return problem_for(xq.size(0), wq.size(0), xq.size(1), xq.stride(0), wq.stride(0), out.stride(0), out_type(out),
                     xq.get_device(), true);
}

void check_block(const at::Tensor& xq, const at::Tensor& xscale, const at::Tensor& wq, const at::Tensor& wscale,
                 const at::Tensor& out) {
  TORCH_CHECK(xq.is_cuda() && wq.is_cuda() && out.is_cuda() && xscale.is_cuda() && wscale.is_cuda(),
              "lt_block: CUDA tensors expected");
  TORCH_CHECK(xq.scalar_type() == at::kFloat8_e4m3fn && wq.scalar_type() == at::kFloat8_e4m3fn, "lt_block: e4m3 operands");
  TORCH_CHECK(xscale.scalar_type() == at::kFloat && wscale.scalar_type() == at::kFloat, "lt_block: float32 scales");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat, "lt_block: bf16 or fp32 out");
  TORCH_CHECK(xq.dim() == 2 && wq.dim() == 2 && out.dim() == 2 && xq.size(1) == wq.size(1) &&
              out.size(0) == xq.size(0) && out.size(1) == wq.size(0), "lt_block: shapes");
  TORCH_CHECK(xq.stride(1) == 1 && wq.stride(1) == 1 && out.stride(1) == 1, "lt_block: rows must be contiguous");
}

void push_algo(std::vector<int64_t>& rows, const cublasLtMatmulAlgo_t& algo, size_t ws, float waves, int64_t source) {
  int64_t words[kAlgoWords];
  std::memcpy(words, &algo, sizeof(algo));
  rows.insert(rows.end(), words, words + kAlgoWords);
  rows.push_back(int64_t(ws));
  rows.push_back(int64_t(waves * 1000.0f));
  rows.push_back(source);
}

}  // namespace

// Candidates for the block-scaled product: rows [n, kAlgoWords + 3] (the algorithm's bytes, its
// workspace, waves x 1000, and where it came from: -1 the best-fit heuristic, else the algorithm
// id whose own heuristic (search limited to it) or tile x stages sweep gave it; duplicates
// removed). Tried only to `max_algos` per source.
at::Tensor lt_block_algos(const at::Tensor& xq, const at::Tensor& xscale, const at::Tensor& wq,
                          const at::Tensor& wscale, const at::Tensor& out, int64_t max_algos, int64_t workspace_bytes,
                          bool sweep) {
  check_block(xq, xscale, wq, wscale, out);
  c10::cuda::CUDAGuard guard(xq.device());
  Problem& p = block_problem_for(xq, wq, out);
  p.set_scales(wscale, xscale);
  cublasLtHandle_t h = at::cuda::getCurrentCUDABlasLtHandle();
  std::vector<int64_t> rows;
  std::vector<std::array<int64_t, kAlgoWords>> seen;
  auto fresh = [&seen](const cublasLtMatmulAlgo_t& algo) {
    std::array<int64_t, kAlgoWords> w;
    std::memcpy(w.data(), &algo, sizeof(algo));
    for (auto& s : seen)
      if (s == w) return false;
    seen.push_back(w);
    return true;
  };
  const size_t nmax = size_t(std::max<int64_t>(1, max_algos));
  auto heuristic = [&](uint32_t mode, const cublasLtMatmulAlgo_t* init, int64_t source) {
    cublasLtMatmulPreference_t pref = nullptr;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = uint64_t(workspace_bytes);
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &mode, sizeof(mode)));
    std::vector<cublasLtMatmulHeuristicResult_t> found(nmax);
    if (init)
      for (auto& f : found) f.algo = *init;
    int returned = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, p.op, p.a, p.b, p.c, p.c, pref, int(found.size()),
                                                       found.data(), &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS) return;
    for (int i = 0; i < returned; ++i)
      if (found[i].state == CUBLAS_STATUS_SUCCESS && fresh(found[i].algo))
        push_algo(rows, found[i].algo, found[i].workspaceSize, found[i].wavesCount, source);
  };
  heuristic(CUBLASLT_SEARCH_BEST_FIT, nullptr, -1);
  if (sweep) {
    int ids[256];
    int nids = 0;
    if (cublasLtMatmulAlgoGetIds(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, p.out_t, p.out_t,
                                 256, ids, &nids) != CUBLAS_STATUS_SUCCESS)
      nids = 0;
    for (int i = 0; i < nids; ++i) {
      cublasLtMatmulAlgo_t algo;
      if (cublasLtMatmulAlgoInit(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, p.out_t, p.out_t,
                                 ids[i], &algo) != CUBLAS_STATUS_SUCCESS)
        continue;
      heuristic(CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID, &algo, ids[i]);
      auto cap_list = [&algo](cublasLtMatmulAlgoCapAttributes_t attr, uint32_t undefined) {
        size_t bytes = 0;
        std::vector<uint32_t> v;
        if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) == CUBLAS_STATUS_SUCCESS && bytes) {
          v.resize(bytes / sizeof(uint32_t));
          if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), bytes, &bytes) != CUBLAS_STATUS_SUCCESS) v.clear();
        }
        if (v.empty()) v.push_back(undefined);
        return v;
      };
      size_t kept = 0;
      for (uint32_t tile : cap_list(CUBLASLT_ALGO_CAP_TILE_IDS, CUBLASLT_MATMUL_TILE_UNDEFINED)) {
        for (uint32_t stages : cap_list(CUBLASLT_ALGO_CAP_STAGES_IDS, CUBLASLT_MATMUL_STAGES_UNDEFINED)) {
          if (kept >= nmax) break;
          cublasLtMatmulAlgo_t a2 = algo;
          cublasLtMatmulAlgoConfigSetAttribute(&a2, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
          cublasLtMatmulAlgoConfigSetAttribute(&a2, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages));
          cublasLtMatmulHeuristicResult_t r = {};
          if (cublasLtMatmulAlgoCheck(h, p.op, p.a, p.b, p.c, p.c, &a2, &r) != CUBLAS_STATUS_SUCCESS) continue;
          if (r.workspaceSize > size_t(workspace_bytes) || !fresh(a2)) continue;
          push_algo(rows, a2, r.workspaceSize, r.wavesCount, ids[i]);
          ++kept;
        }
      }
    }
  }
  const int64_t n = int64_t(rows.size()) / (kAlgoWords + 3);
  return torch::tensor(rows, torch::kInt64).view({n, kAlgoWords + 3});
}

// The block-scaled product with a chosen candidate (a row of lt_block_algos).
void lt_block_out(const at::Tensor& xq, const at::Tensor& xscale, const at::Tensor& wq, const at::Tensor& wscale,
                  const at::Tensor& out, const at::Tensor& algo, const at::Tensor& workspace) {
  check_block(xq, xscale, wq, wscale, out);
  TORCH_CHECK(algo.scalar_type() == at::kLong && algo.is_cpu() && algo.numel() >= kAlgoWords && algo.is_contiguous(),
              "lt_block: algo must be a CPU int64 row from lt_block_algos");
  TORCH_CHECK(workspace.is_cuda() && workspace.scalar_type() == at::kByte, "lt_block: CUDA uint8 workspace");
  c10::cuda::CUDAGuard guard(xq.device());
  if (xq.size(0) == 0) return;
  Problem& p = block_problem_for(xq, wq, out);
  p.set_scales(wscale, xscale);
  cublasLtMatmulAlgo_t a;
  std::memcpy(&a, algo.data_ptr<int64_t>(), sizeof(a));
  const float alpha = 1.0f, beta = 0.0f;
  LT_CHECK(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), p.op, &alpha, wq.data_ptr(), p.a, xq.data_ptr(),
                          p.b, &beta, out.data_ptr(), p.c, out.data_ptr(), p.c, &a, workspace.data_ptr(),
                          size_t(workspace.numel()), at::cuda::getCurrentCUDAStream()));
}
