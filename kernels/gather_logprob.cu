// gather_logprob: per row, log_softmax(logits)[candidates] in one pass over the vocab.
//
// out[r, j] = logits[r, c] - logsumexp(logits[r, :])   (log-prob mode)
//           = logits[r, c]                             (logits mode: no pass at all)
// with c = cand[r, j] (or cand[j] when shared); c < 0 -> -inf, c >= V -> NaN (ids are
// validated upstream; the kernel only guarantees it never reads out of bounds).
//
// Accuracy: every thread keeps an online (max m, sum s) pair in float32, rescaling s when
// m grows; pairs merge by warp shuffles. The output is computed as (x - m) - log(s), never
// x - (m + log s): at |logits| ~ 1e4 the sum m + log s would round at ulp(1e4) ~ 1e-3.
// No fast-math: exp2f/logf are the accurate (<= 2 ulp) versions.
//
// Partial mode (vocab-parallel scoring, one vocab shard of ids [vocab_start, vocab_start + V)):
// out[r, j] = logits[r, c - vocab_start] when c is in the shard, else 0 (padding too: the
// shards' outputs are summed), and the row's (max m, sum exp(x - m) s) are written to
// stats_m / stats_s for the cross-shard merge (zeros in logits mode, where no pass is made).
//
// Memory: the row is streamed once with 16-byte loads (scalar head/tail where the row
// pointer is not 16-byte aligned), then K scattered loads for the candidates (L2 hits).

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kUnroll = 4;           // 16-byte loads in flight per thread per iteration
constexpr int kWarpRowsPerBlock = 8;  // small-V kernel: one warp per row, 8 rows per block

// Element formats: storage type, elements per 16-byte vector, conversion to float.
struct F32 {
  using Storage = float;
  static constexpr int kVec = 4;
  __device__ __forceinline__ static float to_float(float v) { return v; }
  __device__ __forceinline__ static void unpack(const uint4& v, float* x) {
    x[0] = __uint_as_float(v.x);
    x[1] = __uint_as_float(v.y);
    x[2] = __uint_as_float(v.z);
    x[3] = __uint_as_float(v.w);
  }
};

struct BF16 {
  using Storage = uint16_t;
  static constexpr int kVec = 8;
  // bf16 is the top half of a float32: widening is a shift, exact.
  __device__ __forceinline__ static float to_float(uint16_t v) {
    return __uint_as_float(static_cast<uint32_t>(v) << 16);
  }
  __device__ __forceinline__ static void unpack_word(uint32_t w, float* x) {
    x[0] = __uint_as_float(w << 16);          // low half = lower address = first element
    x[1] = __uint_as_float(w & 0xffff0000u);
  }
  __device__ __forceinline__ static void unpack(const uint4& v, float* x) {
    unpack_word(v.x, x);
    unpack_word(v.y, x + 2);
    unpack_word(v.z, x + 4);
    unpack_word(v.w, x + 6);
  }
};

struct F16 {
  using Storage = uint16_t;
  static constexpr int kVec = 8;
  __device__ __forceinline__ static float to_float(uint16_t v) {
    return __half2float(__ushort_as_half(v));
  }
  __device__ __forceinline__ static void unpack_word(uint32_t w, float* x) {
    x[0] = to_float(static_cast<uint16_t>(w & 0xffffu));
    x[1] = to_float(static_cast<uint16_t>(w >> 16));
  }
  __device__ __forceinline__ static void unpack(const uint4& v, float* x) {
    unpack_word(v.x, x);
    unpack_word(v.y, x + 2);
    unpack_word(v.z, x + 4);
    unpack_word(v.w, x + 6);
  }
};

// Fold n values into the running (m, s): one rescale per chunk, one exp per element.
template <int N>
__device__ __forceinline__ void online_update(const float* x, float& m, float& s) {
  float cm = x[0];
#pragma unroll
  for (int i = 1; i < N; ++i) cm = fmaxf(cm, x[i]);
  if (cm > m) {
    s *= exp2f((m - cm) * kLog2e);  // m == -inf -> exp2f(-inf) == 0, s stays 0
    m = cm;
  }
  // While m is -inf every value seen is -inf and contributes 0 (and -inf - -inf is NaN).
  if (m != -INFINITY) {
    float cs = 0.f;  // chunk sum first: shorter accumulation chain into s
#pragma unroll
    for (int i = 0; i < N; ++i) cs += exp2f((x[i] - m) * kLog2e);
    s += cs;
  }
}

// Merge another thread's (om, os) into (m, s).
__device__ __forceinline__ void merge(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  if (nm == -INFINITY) return;  // both empty: s == os == 0
  s = s * exp2f((m - nm) * kLog2e) + os * exp2f((om - nm) * kLog2e);
  m = nm;
}

__device__ __forceinline__ void warp_merge(float& m, float& s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float om = __shfl_xor_sync(kFullMask, m, off);
    const float os = __shfl_xor_sync(kFullMask, s, off);
    merge(m, s, om, os);
  }
}

// This thread's (m, s) over its share of row[0, V): threads tid, tid + nthreads, ...
template <typename E>
__device__ __forceinline__ void thread_stats(const typename E::Storage* row, int V, int tid,
                                             int nthreads, float& m, float& s) {
  using S = typename E::Storage;
  constexpr int kVec = E::kVec;
  // Scalar head up to the first 16-byte boundary (rows with a stride need not be aligned).
  const int misalign = static_cast<int>(reinterpret_cast<uintptr_t>(row) & 15u);
  const int head = min(V, static_cast<int>(((16 - misalign) & 15) / sizeof(S)));
  if (tid < head) {
    const float x = E::to_float(__ldg(row + tid));
    online_update<1>(&x, m, s);
  }
  const int nvec = (V - head) / kVec;
  const uint4* vrow = reinterpret_cast<const uint4*>(row + head);
  int i = tid;
  // Main loop: kUnroll independent 16-byte streaming loads in flight, then one update.
  for (; i + (kUnroll - 1) * nthreads < nvec; i += kUnroll * nthreads) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = __ldcs(vrow + i + u * nthreads);
    float x[kUnroll * kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) E::unpack(raw[u], x + u * kVec);
    online_update<kUnroll * kVec>(x, m, s);
  }
  for (; i < nvec; i += nthreads) {
    const uint4 raw = __ldcs(vrow + i);
    float x[kVec];
    E::unpack(raw, x);
    online_update<kVec>(x, m, s);
  }
  // Scalar tail: fewer than kVec (<= 8 <= nthreads) elements.
  const int t = head + nvec * kVec + tid;
  if (t < V) {
    const float x = E::to_float(__ldg(row + t));
    online_update<1>(&x, m, s);
  }
}

// Write out_row[0, K) from the row statistics (m, lse = log s); partial: the shard's logits.
template <typename E, typename Idx>
__device__ __forceinline__ void gather_row(const typename E::Storage* row, int V,
                                           const Idx* cand_row, int K, float* out_row,
                                           int tid, int nthreads, float m, float lse,
                                           bool logits_mode, bool partial, int64_t vocab_start) {
  for (int j = tid; j < K; j += nthreads) {
    const int64_t c = static_cast<int64_t>(cand_row[j]);
    float v;
    if (partial) {
      const int64_t local = c - vocab_start;
      // Padding and ids of other shards contribute nothing to the sum over shards.
      v = (c < 0 || local < 0 || local >= V) ? 0.f : E::to_float(__ldg(row + local));
    } else if (c < 0) {
      v = -INFINITY;  // padding
    } else if (c >= V) {
      v = NAN;  // invalid id: visible, never an out-of-bounds read
    } else {
      const float x = E::to_float(__ldg(row + c));
      v = logits_mode ? x : (x - m) - lse;
    }
    out_row[j] = v;
  }
}

// One block of kThreads per row.
template <typename E, typename Idx, int kThreads>
__global__ void __launch_bounds__(kThreads)
    gather_logprob_block_kernel(const typename E::Storage* __restrict__ logits,
                                int64_t row_stride, int V, const Idx* __restrict__ cand,
                                int64_t cand_stride, int K, float* __restrict__ out,
                                bool logits_mode, int64_t vocab_start,
                                float* __restrict__ stats_m, float* __restrict__ stats_s) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float sm_m[kWarps];
  __shared__ float sm_s[kWarps];
  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x;
  const typename E::Storage* row = logits + r * row_stride;
  float m = 0.f;
  float lse = 0.f;
  if (!logits_mode) {
    float s = 0.f;
    m = -INFINITY;
    thread_stats<E>(row, V, tid, kThreads, m, s);
    warp_merge(m, s);
    const int warp = tid / 32;
    const int lane = tid % 32;
    if (lane == 0) {
      sm_m[warp] = m;
      sm_s[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
      m = lane < kWarps ? sm_m[lane] : -INFINITY;
      s = lane < kWarps ? sm_s[lane] : 0.f;
      warp_merge(m, s);
      if (lane == 0) {
        sm_m[0] = m;
        sm_s[0] = s;
      }
    }
    __syncthreads();
    m = sm_m[0];
    lse = logf(sm_s[0]);
    if (stats_m != nullptr && tid == 0) {
      stats_m[r] = m;
      stats_s[r] = sm_s[0];
    }
  } else if (stats_m != nullptr && tid == 0) {
    stats_m[r] = 0.f;
    stats_s[r] = 0.f;
  }
  gather_row<E, Idx>(row, V, cand + r * cand_stride, K, out + r * K, tid, kThreads, m, lse,
                     logits_mode, stats_m != nullptr, vocab_start);
}

// Small V: one warp per row, kWarpRowsPerBlock rows per block, no shared memory.
template <typename E, typename Idx>
__global__ void __launch_bounds__(32 * kWarpRowsPerBlock)
    gather_logprob_warp_kernel(const typename E::Storage* __restrict__ logits, int64_t rows,
                               int64_t row_stride, int V, const Idx* __restrict__ cand,
                               int64_t cand_stride, int K, float* __restrict__ out,
                               bool logits_mode, int64_t vocab_start,
                               float* __restrict__ stats_m, float* __restrict__ stats_s) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;  // whole warp leaves together: no block-level sync below
  const int lane = threadIdx.x % 32;
  const typename E::Storage* row = logits + r * row_stride;
  float m = 0.f;
  float lse = 0.f;
  if (!logits_mode) {
    float s = 0.f;
    m = -INFINITY;
    thread_stats<E>(row, V, lane, 32, m, s);
    warp_merge(m, s);  // every lane holds the row's (m, s) after the butterfly
    lse = logf(s);
    if (stats_m != nullptr && lane == 0) {
      stats_m[r] = m;
      stats_s[r] = s;
    }
  } else if (stats_m != nullptr && lane == 0) {
    stats_m[r] = 0.f;
    stats_s[r] = 0.f;
  }
  gather_row<E, Idx>(row, V, cand + r * cand_stride, K, out + r * K, lane, 32, m, lse,
                     logits_mode, stats_m != nullptr, vocab_start);
}

template <typename E, typename Idx>
void launch(const at::Tensor& logits, const at::Tensor& cand, const at::Tensor& out,
            bool logits_mode, int64_t vocab_start, float* stats_m, float* stats_s,
            cudaStream_t stream) {
  using S = typename E::Storage;
  const int64_t rows = logits.size(0);
  const int V = static_cast<int>(logits.size(1));
  const int K = static_cast<int>(cand.size(-1));
  const int64_t row_stride = logits.stride(0);
  const int64_t cand_stride = cand.dim() == 2 ? cand.stride(0) : 0;  // shared [K]: stride 0
  const auto* lp = static_cast<const S*>(logits.data_ptr());
  const auto* cp = static_cast<const Idx*>(cand.data_ptr());
  auto* op = static_cast<float*>(out.data_ptr());
  // Thresholds: enough 16-byte loads per thread to keep several in flight, few idle lanes.
  if (V <= 4096) {
    const auto blocks = static_cast<unsigned>((rows + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock);
    gather_logprob_warp_kernel<E, Idx><<<blocks, 32 * kWarpRowsPerBlock, 0, stream>>>(
        lp, rows, row_stride, V, cp, cand_stride, K, op, logits_mode, vocab_start, stats_m, stats_s);
  } else if (V <= 32768) {
    gather_logprob_block_kernel<E, Idx, 256><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
        lp, row_stride, V, cp, cand_stride, K, op, logits_mode, vocab_start, stats_m, stats_s);
  } else {
    gather_logprob_block_kernel<E, Idx, 512><<<static_cast<unsigned>(rows), 512, 0, stream>>>(
        lp, row_stride, V, cp, cand_stride, K, op, logits_mode, vocab_start, stats_m, stats_s);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename E>
void dispatch_index(const at::Tensor& logits, const at::Tensor& cand, const at::Tensor& out,
                    bool logits_mode, int64_t vocab_start, float* stats_m, float* stats_s,
                    cudaStream_t stream) {
  if (cand.scalar_type() == at::kInt) {
    launch<E, int32_t>(logits, cand, out, logits_mode, vocab_start, stats_m, stats_s, stream);
  } else {
    launch<E, int64_t>(logits, cand, out, logits_mode, vocab_start, stats_m, stats_s, stream);
  }
}

}  // namespace

// logits [R, V] float32/bfloat16/float16 (last dim contiguous, any row stride);
// cand [K] or [R, K] int32/int64 (last dim contiguous); out [R, K] float32 contiguous.
static void check_inputs(const at::Tensor& logits, const at::Tensor& cand, const at::Tensor& out) {
  TORCH_CHECK(logits.is_cuda(), "gather_logprobs: logits must be a CUDA tensor");
  TORCH_CHECK(logits.dim() == 2, "gather_logprobs: logits must be [R, V], got ", logits.sizes());
  const int64_t rows = logits.size(0);
  const int64_t V = logits.size(1);
  TORCH_CHECK(V >= 1 && V <= std::numeric_limits<int32_t>::max() / 2,
              "gather_logprobs: vocab size out of range: ", V);
  TORCH_CHECK(V == 1 || logits.stride(1) == 1,
              "gather_logprobs: logits last dim must be contiguous, strides ", logits.strides());
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), "gather_logprobs: too many rows: ", rows);
  TORCH_CHECK(cand.device() == logits.device(), "gather_logprobs: cand on ", cand.device(),
              ", logits on ", logits.device());
  TORCH_CHECK(cand.scalar_type() == at::kInt || cand.scalar_type() == at::kLong,
              "gather_logprobs: cand must be int32 or int64, got ", cand.scalar_type());
  TORCH_CHECK(cand.dim() == 1 || (cand.dim() == 2 && cand.size(0) == rows),
              "gather_logprobs: cand must be [K] or [R, K] with R = ", rows, ", got ", cand.sizes());
  const int64_t K = cand.size(-1);
  TORCH_CHECK(K <= std::numeric_limits<int32_t>::max(), "gather_logprobs: K too large: ", K);
  TORCH_CHECK(K <= 1 || cand.stride(-1) == 1, "gather_logprobs: cand last dim must be contiguous");
  TORCH_CHECK(out.device() == logits.device() && out.scalar_type() == at::kFloat &&
                  out.dim() == 2 && out.size(0) == rows && out.size(1) == K && out.is_contiguous(),
              "gather_logprobs: out must be a contiguous [", rows, ", ", K,
              "] float32 tensor on the logits device");
}

// Run the kernel for one dtype of logits; stats_m == nullptr: full mode.
static void run(const at::Tensor& logits, const at::Tensor& cand, const at::Tensor& out, bool logits_mode,
                int64_t vocab_start, float* stats_m, float* stats_s) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(logits.get_device()).stream();
  switch (logits.scalar_type()) {
    case at::kFloat:
      dispatch_index<F32>(logits, cand, out, logits_mode, vocab_start, stats_m, stats_s, stream);
      break;
    case at::kBFloat16:
      dispatch_index<BF16>(logits, cand, out, logits_mode, vocab_start, stats_m, stats_s, stream);
      break;
    case at::kHalf:
      dispatch_index<F16>(logits, cand, out, logits_mode, vocab_start, stats_m, stats_s, stream);
      break;
    default:
      TORCH_CHECK(false, "gather_logprobs: logits must be float32, bfloat16 or float16, got ",
                  logits.scalar_type());
  }
}

// logits [R, V] float32/bfloat16/float16 (last dim contiguous, any row stride);
// cand [K] or [R, K] int32/int64 (last dim contiguous); out [R, K] float32 contiguous.
void gather_logprobs_out(const at::Tensor& logits, const at::Tensor& cand, const at::Tensor& out,
                         bool logits_mode) {
  check_inputs(logits, cand, out);
  if (logits.size(0) == 0 || cand.size(-1) == 0) return;
  run(logits, cand, out, logits_mode, 0, nullptr, nullptr);
}

// Partial mode for one vocab shard (ids [vocab_start, vocab_start + V)): as above, plus
// stats_m / stats_s [R] float32 contiguous: the rows' max and sum exp(x - max).
void gather_logprobs_partial_out(const at::Tensor& logits, const at::Tensor& cand, const at::Tensor& out,
                                 const at::Tensor& stats_m, const at::Tensor& stats_s, int64_t vocab_start,
                                 bool logits_mode) {
  check_inputs(logits, cand, out);
  const int64_t rows = logits.size(0);
  for (const at::Tensor* t : {&stats_m, &stats_s}) {
    TORCH_CHECK(t->device() == logits.device() && t->scalar_type() == at::kFloat && t->dim() == 1 &&
                    t->size(0) == rows && t->is_contiguous(),
                "gather_logprobs_partial: stats must be contiguous [", rows,
                "] float32 tensors on the logits device");
  }
  TORCH_CHECK(vocab_start >= 0, "gather_logprobs_partial: vocab_start must be >= 0, got ", vocab_start);
  if (rows == 0) return;  // K == 0 still writes the stats
  run(logits, cand, out, logits_mode, vocab_start, stats_m.data_ptr<float>(), stats_s.data_ptr<float>());
}
