// Memory-bound elementwise kernels of the forward, 16-byte vectors, 8 elements per thread.
//
// silu_mul:   out[t, i] = round(round(silu(gate[t, i])) * up[t, i]),  gate_up = [gate | up]
//             (rounding to the storage type where eager torch rounds, so results match it)
// clamped_swiglu: gpt-oss's expert activation, in float32 and rounded once (ops.clamped_swiglu):
//             g = min(gate[t, i] + b[e, i], limit), u = clamp(up[t, i] + b[e, I + i], -limit, limit),
//             out[t, i] = round((u + 1) * g * sigmoid(alpha * g)), e = expert[t]
// Both take an optional row end on the device (an expert-parallel rank's last row end): rows
// at or past it are neither read nor written (another rank's experts' rows, never read), and
// the host never waits for the count.
// moe_combine: out[t, c] = round(sum_j w[t, j] * (y[pos[t, j], c] (+ bias[expert[pos[t, j]], c])))
//             in float32 (weights unrounded), slot order j = 0..k-1, a slot at pad skipped: the
//             expert layer's weighted sum of each token's k expert rows.
// merge_attn: out = (o1 * e^(l1 - m) + o2 * e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m)),
//             m = max(l1, l2): two partial attentions over disjoint key sets merged by
//             their log-sum-exp (l1, l2 per query row and head, float32).
// No fast-math: expf is the accurate version.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int kVec = 8;  // 16 bytes of 2-byte elements
constexpr int kThreads = 256;

// Conversions of a 2-byte float format held as raw bits (uint16_t storage everywhere, so
// unions and vector moves never touch the CUDA types' constructors).
struct BF16 {
  __device__ __forceinline__ static float to_float(uint16_t v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }
  __device__ __forceinline__ static uint16_t from_float(float v) { return __bfloat16_as_ushort(__float2bfloat16(v)); }
};

struct FP16 {
  __device__ __forceinline__ static float to_float(uint16_t v) { return __half2float(__ushort_as_half(v)); }
  __device__ __forceinline__ static uint16_t from_float(float v) { return __half_as_ushort(__float2half(v)); }
};

union Vec {
  uint4 raw;
  uint16_t x[kVec];
};

// The rows a kernel computes: all, or those before *end (read on the device).
__device__ __forceinline__ int64_t live_rows(int64_t rows, const int32_t* end) {
  if (end == nullptr) return rows;
  const int64_t e = *end;
  return e < 0 ? 0 : (e < rows ? e : rows);
}

// silu(gate) * up, rounded where eager torch rounds.
struct SiluMul {
  template <typename C>
  __device__ __forceinline__ void apply(int64_t, int64_t, int64_t, const Vec& g, const Vec& u, Vec& o) const {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = C::to_float(g.x[j]);
      const float s = C::to_float(C::from_float(x / (1.0f + expf(-x))));
      o.x[j] = C::from_float(s * C::to_float(u.x[j]));
    }
  }
};

// gpt-oss's clamped SwiGLU of gate/up plus the row's expert's bias, in float32, rounded once.
struct ClampedSwiglu {
  const uint16_t* bias;  // [E, 2I]
  int64_t bias_stride;
  const int64_t* expert;  // [T]
  float alpha, limit;

  template <typename C>
  __device__ __forceinline__ void apply(int64_t r, int64_t c, int64_t inter, const Vec& g, const Vec& u,
                                        Vec& o) const {
    const uint16_t* b = bias + expert[r] * bias_stride;  // a few experts' rows: read from cache
    Vec bg, bu;
    bg.raw = *reinterpret_cast<const uint4*>(b + c);
    bu.raw = *reinterpret_cast<const uint4*>(b + inter + c);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      // comparisons, not fminf/fmaxf: a NaN stays NaN, as torch's clamp keeps it
      float x = C::to_float(g.x[j]) + C::to_float(bg.x[j]);
      x = x > limit ? limit : x;
      float y = C::to_float(u.x[j]) + C::to_float(bu.x[j]);
      y = y > limit ? limit : (y < -limit ? -limit : y);
      o.x[j] = C::from_float((y + 1.0f) * x * (1.0f / (1.0f + expf(-(alpha * x)))));
    }
  }
};

// out[t] = act(gate_up[t]) for the rows before the end: 8 columns of gate and up per thread.
template <typename C, typename Act>
__global__ void __launch_bounds__(kThreads)
gated_act_kernel(const uint16_t* __restrict__ in, int64_t in_stride, uint16_t* __restrict__ out, int64_t rows,
                 int64_t inter, const int32_t* __restrict__ end, const Act act) {
  const int64_t per_row = inter / kVec;
  const int64_t n = live_rows(rows, end) * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row;
    const int64_t c = (i - r * per_row) * kVec;
    const uint16_t* row = in + r * in_stride;
    Vec g, u, o;
    g.raw = __ldcs(reinterpret_cast<const uint4*>(row + c));
    u.raw = __ldcs(reinterpret_cast<const uint4*>(row + inter + c));
    act.template apply<C>(r, c, inter, g, u, o);
    __stcs(reinterpret_cast<uint4*>(out + r * inter + c), o.raw);
  }
}

struct Strides3 {
  int64_t s0, s1;  // [c, H, D] with a contiguous last dim
};

template <typename C>
__global__ void __launch_bounds__(kThreads)
merge_attn_kernel(const uint16_t* __restrict__ o1, Strides3 st1, const float* __restrict__ l1,
                  const uint16_t* __restrict__ o2, Strides3 st2, const float* __restrict__ l2,
                  int64_t ls0, int64_t ls1, int64_t ls20, int64_t ls21, uint16_t* __restrict__ out,
                  Strides3 sto, int64_t c, int heads, int dim) {
  const int per_head = dim / kVec;
  const int64_t n = c * heads * per_head;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / (static_cast<int64_t>(heads) * per_head);
    const int64_t rem = i - t * heads * per_head;
    const int h = static_cast<int>(rem / per_head);
    const int d = static_cast<int>(rem - static_cast<int64_t>(h) * per_head) * kVec;
    const float a = l1[h * ls0 + t * ls1];
    const float b = l2[h * ls20 + t * ls21];
    const float m = fmaxf(a, b);
    float w1 = 0.f, w2 = 0.f;
    if (m != -INFINITY) {
      w1 = expf(a - m);
      w2 = expf(b - m);
      const float inv = 1.0f / (w1 + w2);
      w1 *= inv;
      w2 *= inv;
    }
    Vec x, y, o;
    x.raw = *reinterpret_cast<const uint4*>(o1 + t * st1.s0 + h * st1.s1 + d);
    y.raw = *reinterpret_cast<const uint4*>(o2 + t * st2.s0 + h * st2.s1 + d);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      o.x[j] = C::from_float(C::to_float(x.x[j]) * w1 + C::to_float(y.x[j]) * w2);
    }
    *reinterpret_cast<uint4*>(out + t * sto.s0 + h * sto.s1 + d) = o.raw;
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 * 16 ? blocks : 65536 * 16);
}

bool aligned16(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15u) == 0; }

void check_half(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf),
              what, " must be a CUDA bfloat16/float16 tensor");
  TORCH_CHECK(t.stride(-1) == 1 && aligned16(t), what, " must have a contiguous, 16-byte aligned last dim");
}

// An activation's input gate_up [T, 2I] (rows 16-byte aligned; I % 8 == 0) and its output out
// [T, I] (contiguous, aligned, gate_up's dtype).
void check_activation(const at::Tensor& gate_up, const at::Tensor& out, const char* what) {
  check_half(gate_up, what);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % (2 * kVec) == 0, what, ": gate_up must be [T, 2I], I % 8 == 0");
  TORCH_CHECK(gate_up.stride(0) % kVec == 0, what, ": gate_up row stride must be a multiple of 8");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type() && out.device() == gate_up.device() && out.dim() == 2 &&
                  out.size(0) == gate_up.size(0) && out.size(1) == gate_up.size(1) / 2 && out.is_contiguous() &&
                  aligned16(out),
              what, ": out must be a contiguous, aligned [T, I] tensor of gate_up's dtype");
}

// The optional row end: one int32 on gate_up's device; nullptr when absent.
const int32_t* row_end(const c10::optional<at::Tensor>& end, const at::Tensor& gate_up, const char* what) {
  if (!end.has_value()) return nullptr;
  TORCH_CHECK(end->device() == gate_up.device() && end->scalar_type() == at::kInt && end->numel() == 1, what,
              ": end must be one int32 on gate_up's device");
  return end->data_ptr<int32_t>();
}

// The launch of an activation (checked by check_activation): every row, or those before end.
template <typename Act>
void launch_gated_act(const at::Tensor& gate_up, const at::Tensor& out, const int32_t* end, const Act& act) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(gate_up.get_device()).stream();
  // the grid covers every row (the end is not known here); threads past the end exit at once
  const unsigned grid = grid_for(rows * inter / kVec);
  const auto* ip = static_cast<const uint16_t*>(gate_up.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  if (gate_up.scalar_type() == at::kBFloat16) {
    gated_act_kernel<BF16><<<grid, kThreads, 0, stream>>>(ip, gate_up.stride(0), op, rows, inter, end, act);
  } else {
    gated_act_kernel<FP16><<<grid, kThreads, 0, stream>>>(ip, gate_up.stride(0), op, rows, inter, end, act);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// gate_up [T, 2I] (rows 16-byte aligned), out [T, I] contiguous, same dtype; I % 8 == 0;
// end: rows at or past it are left unwritten.
void silu_mul_out(const at::Tensor& gate_up, const at::Tensor& out, const c10::optional<at::Tensor>& end) {
  check_activation(gate_up, out, "silu_mul");
  launch_gated_act(gate_up, out, row_end(end, gate_up, "silu_mul"), SiluMul{});
}

// gate_up [T, 2I] as silu_mul's; bias [E, 2I] contiguous, gate_up's dtype; expert [T] int64
// (each in [0, E)); out [T, I] contiguous; rows at or past end are left unwritten.
void clamped_swiglu_out(const at::Tensor& gate_up, const at::Tensor& bias, const at::Tensor& expert, double alpha,
                        double limit, const at::Tensor& out, const c10::optional<at::Tensor>& end) {
  check_activation(gate_up, out, "clamped_swiglu");
  const int64_t inter = gate_up.size(1) / 2;
  TORCH_CHECK(bias.scalar_type() == gate_up.scalar_type() && bias.device() == gate_up.device() && bias.dim() == 2 &&
                  bias.size(1) == 2 * inter && bias.is_contiguous() && aligned16(bias),
              "clamped_swiglu: bias must be a contiguous, aligned [E, 2I] tensor of gate_up's dtype");
  TORCH_CHECK(expert.scalar_type() == at::kLong && expert.device() == gate_up.device() && expert.dim() == 1 &&
                  expert.size(0) == gate_up.size(0) && expert.is_contiguous(),
              "clamped_swiglu: expert must be a contiguous int64 [T] on gate_up's device");
  const ClampedSwiglu act{static_cast<const uint16_t*>(bias.data_ptr()), bias.stride(0), expert.data_ptr<int64_t>(),
                          static_cast<float>(alpha), static_cast<float>(limit)};
  launch_gated_act(gate_up, out, row_end(end, gate_up, "clamped_swiglu"), act);
}

// o1, o2, out: [c, H, D] (last dim contiguous, other strides multiples of 8, same dtype);
// l1, l2: [H, c] float32 (any strides). D % 8 == 0.
void merge_attn_out(const at::Tensor& o1, const at::Tensor& l1, const at::Tensor& o2, const at::Tensor& l2,
                    const at::Tensor& out) {
  check_half(o1, "merge_attn: o1");
  check_half(o2, "merge_attn: o2");
  check_half(out, "merge_attn: out");
  TORCH_CHECK(o1.dim() == 3 && o1.sizes() == o2.sizes() && o1.sizes() == out.sizes(),
              "merge_attn: o1, o2, out must be [c, H, D] of one shape");
  TORCH_CHECK(o1.scalar_type() == o2.scalar_type() && o1.scalar_type() == out.scalar_type(),
              "merge_attn: o1, o2, out must share a dtype");
  const int64_t c = o1.size(0), heads = o1.size(1), dim = o1.size(2);
  TORCH_CHECK(dim % kVec == 0, "merge_attn: head dim must be a multiple of 8");
  for (const at::Tensor* t : {&o1, &o2, &out}) {
    TORCH_CHECK(t->stride(0) % kVec == 0 && t->stride(1) % kVec == 0, "merge_attn: strides must be multiples of 8");
  }
  for (const at::Tensor* t : {&l1, &l2}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == heads &&
                    t->size(1) == c,
                "merge_attn: l1, l2 must be [H, c] float32 CUDA tensors");
  }
  if (c == 0) return;
  const c10::cuda::CUDAGuard guard(o1.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(o1.get_device()).stream();
  const unsigned grid = grid_for(c * heads * dim / kVec);
  const Strides3 s1{o1.stride(0), o1.stride(1)}, s2{o2.stride(0), o2.stride(1)}, so{out.stride(0), out.stride(1)};
  const auto* l1p = l1.data_ptr<float>();
  const auto* l2p = l2.data_ptr<float>();
  const auto* p1 = static_cast<const uint16_t*>(o1.data_ptr());
  const auto* p2 = static_cast<const uint16_t*>(o2.data_ptr());
  auto* po = static_cast<uint16_t*>(out.data_ptr());
  if (o1.scalar_type() == at::kBFloat16) {
    merge_attn_kernel<BF16><<<grid, kThreads, 0, stream>>>(p1, s1, l1p, p2, s2, l2p, l1.stride(0), l1.stride(1),
                                                           l2.stride(0), l2.stride(1), po, so, c,
                                                           static_cast<int>(heads), static_cast<int>(dim));
  } else {
    merge_attn_kernel<FP16><<<grid, kThreads, 0, stream>>>(p1, s1, l1p, p2, s2, l2p, l1.stride(0), l1.stride(1),
                                                           l2.stride(0), l2.stride(1), po, so, c,
                                                           static_cast<int>(heads), static_cast<int>(dim));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------
// qkv_rope: split the fused QKV projection, per-head RMSNorm of q and k (when weights are
// given, Qwen3), rotary on q and k, and the write of k and v into the paged KV pool.
//
// A group of L = D/8 lanes holds one head, 8 elements (16 bytes) a lane: lane s of the group
// holds elements [8s, 8s + 8), so the rotary partner (i +- D/2) is lane s ^ L/2 of the same
// group. A group takes U neighbouring heads of one token (U divides the heads), issues all
// their loads first, and reads the token's slot and rotary row once for them. Shuffles name
// the group's own lanes only, so a group may leave early while its warp's other group
// goes on. Rounding follows the eager torch code: normed = round(x * rsqrt(mean(x^2) + eps));
// w = round(weight * normed); out = round(x1*cos - x2*sin | x2*cos + x1*sin) from the
// rounded values. Indices are 32-bit: the host checks T * heads * L < 2^31.
namespace {

template <typename C, int D, int U>
__global__ void __launch_bounds__(kThreads)
qkv_rope_kernel(const uint16_t* __restrict__ qkv, int64_t qkv_stride, const float* __restrict__ cs,
                int64_t cs_stride, const uint16_t* __restrict__ q_w, const uint16_t* __restrict__ k_w, float eps,
                uint16_t* __restrict__ q_out, uint16_t* __restrict__ k_out, uint16_t* __restrict__ v_out,
                uint16_t* __restrict__ k_cache, uint16_t* __restrict__ v_cache, const int64_t* __restrict__ slots,
                int ntok, int hq, int hkv) {
  constexpr int E = kVec;
  constexpr int L = D / E;  // lanes per head: 8, 16 or 32
  constexpr int kHalf = D / 2;
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int sub = tid & (L - 1);
  const int heads = hq + 2 * hkv;
  const int per_token = heads / U;  // groups per token
  const int group = tid / L;
  const int t = group / per_token;
  if (t >= ntok) return;
  const int h0 = (group - t * per_token) * U;
  const unsigned lane = threadIdx.x & 31u;
  const unsigned mask = L == 32 ? 0xffffffffu : ((1u << L) - 1u) << (lane & ~static_cast<unsigned>(L - 1));
  const uint16_t* src = qkv + t * qkv_stride + h0 * D + sub * E;
  Vec in[U];
#pragma unroll
  for (int u = 0; u < U; ++u) in[u].raw = *reinterpret_cast<const uint4*>(src + u * D);
  const int64_t slot = slots != nullptr ? slots[t] : -1;
  const bool low = sub < L / 2;
  const float* crow = cs + t * cs_stride + (sub % (L / 2)) * E;  // this lane's frequencies
  float cosv[E], sinv[E];
  if (h0 < hq + hkv) {  // some q or k head among the group's
#pragma unroll
    for (int j = 0; j < E; ++j) {
      cosv[j] = crow[j];
      sinv[j] = crow[kHalf + j];
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int h = h0 + u;
    if (h >= hq + hkv) {  // v: copy, and into the pool
      const int64_t off = static_cast<int64_t>(h - hq - hkv) * D + sub * E;
      *reinterpret_cast<uint4*>(v_out + static_cast<int64_t>(t) * hkv * D + off) = in[u].raw;
      if (slot >= 0) *reinterpret_cast<uint4*>(v_cache + slot * hkv * D + off) = in[u].raw;
      continue;
    }
    const bool is_q = h < hq;
    float x[E];
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = C::to_float(in[u].x[j]);
    if (q_w != nullptr) {
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < E; ++j) ss += x[j] * x[j];
#pragma unroll
      for (int off = L / 2; off > 0; off >>= 1) ss += __shfl_xor_sync(mask, ss, off);
      const float r = rsqrtf(ss / static_cast<float>(D) + eps);
      const Vec wv = *reinterpret_cast<const Vec*>((is_q ? q_w : k_w) + sub * E);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float n = C::to_float(C::from_float(x[j] * r));
        x[j] = C::to_float(C::from_float(C::to_float(wv.x[j]) * n));
      }
    }
    float other[E];
#pragma unroll
    for (int j = 0; j < E; ++j) other[j] = __shfl_xor_sync(mask, x[j], L / 2);
    Vec out;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      // Each product rounded on its own, as eager torch does (no FMA contraction).
      const float a = __fmul_rn(x[j], cosv[j]), b = __fmul_rn(other[j], sinv[j]);
      out.x[j] = C::from_float(low ? __fsub_rn(a, b) : __fadd_rn(a, b));
    }
    if (is_q) {
      *reinterpret_cast<uint4*>(q_out + (static_cast<int64_t>(t) * hq + h) * D + sub * E) = out.raw;
    } else {
      const int64_t off = static_cast<int64_t>(h - hq) * D + sub * E;
      *reinterpret_cast<uint4*>(k_out + static_cast<int64_t>(t) * hkv * D + off) = out.raw;
      if (slot >= 0) *reinterpret_cast<uint4*>(k_cache + slot * hkv * D + off) = out.raw;
    }
  }
}

template <typename C, int D>
void launch_qkv_d(int items_per_group, const uint16_t* qkv, int64_t qkv_stride, const float* cs, int64_t cs_stride,
                  const uint16_t* q_w, const uint16_t* k_w, float eps, uint16_t* q, uint16_t* k, uint16_t* v,
                  uint16_t* kc, uint16_t* vc, const int64_t* slots, int64_t ntok, int hq, int hkv,
                  cudaStream_t stream) {
  const int heads = hq + 2 * hkv;
  int u = 8;  // the most heads a group takes: at most items_per_group, and a divisor of the heads
  while (u > 1 && (u > items_per_group || heads % u != 0)) u /= 2;
  const int64_t threads = ntok * (heads / u) * (D / kVec);
  TORCH_CHECK(threads < (int64_t{1} << 31), "qkv_rope: too many tokens for one launch");
  const unsigned grid = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  const int n = static_cast<int>(ntok);
#define TS_QKV(U)                                                                                                  \
  qkv_rope_kernel<C, D, U><<<grid, kThreads, 0, stream>>>(qkv, qkv_stride, cs, cs_stride, q_w, k_w, eps, q, k, v, kc, \
                                                          vc, slots, n, hq, hkv)
  switch (u) {
    case 1: TS_QKV(1); break;
    case 2: TS_QKV(2); break;
    case 4: TS_QKV(4); break;
    default: TS_QKV(8); break;
  }
#undef TS_QKV
}

template <typename C>
void launch_qkv(const at::Tensor& qkv, const at::Tensor& cs, const at::Tensor* q_w, const at::Tensor* k_w,
                double eps, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* kc,
                const at::Tensor* vc, const at::Tensor* slots, int hq, int hkv, int d, int items_per_group,
                cudaStream_t stream) {
  auto p = [](const at::Tensor* t) { return t == nullptr ? nullptr : static_cast<uint16_t*>(t->data_ptr()); };
  const int64_t* sp = slots == nullptr ? nullptr : slots->data_ptr<int64_t>();
  const auto* x = static_cast<const uint16_t*>(qkv.data_ptr());
  const int64_t ntok = qkv.size(0);
  const float e = static_cast<float>(eps);
#define TS_QKV_D(D)                                                                                                \
  launch_qkv_d<C, D>(items_per_group, x, qkv.stride(0), cs.data_ptr<float>(), cs.stride(0), p(q_w), p(k_w), e, p(&q), \
                     p(&k), p(&v), p(kc), p(vc), sp, ntok, hq, hkv, stream)
  if (d == 64) {
    TS_QKV_D(64);
  } else if (d == 128) {
    TS_QKV_D(128);
  } else {
    TS_QKV_D(256);
  }
#undef TS_QKV_D
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// qkv [T, (hq + 2 hkv) d] (last dim contiguous); cs [T, d] float32 (cos | sin halves);
// q_w, k_w: [d] or undefined; q [T, hq, d], k, v [T, hkv, d] contiguous outputs;
// k_cache, v_cache: [S, hkv, d] contiguous or undefined; slots [T] int64 (-1: no write).
void qkv_rope_out(const at::Tensor& qkv, const at::Tensor& cs, const c10::optional<at::Tensor>& q_w,
                  const c10::optional<at::Tensor>& k_w, double eps, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const c10::optional<at::Tensor>& k_cache,
                  const c10::optional<at::Tensor>& v_cache, const c10::optional<at::Tensor>& slots,
                  int64_t items_per_group) {
  TORCH_CHECK(qkv.is_cuda() && (qkv.scalar_type() == at::kBFloat16 || qkv.scalar_type() == at::kHalf) &&
                  qkv.dim() == 2 && qkv.stride(1) == 1,
              "qkv_rope: qkv must be a [T, n] CUDA bf16/fp16 tensor with a contiguous last dim");
  auto aligned16 = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  TORCH_CHECK(aligned16(qkv) && qkv.stride(0) % kVec == 0, "qkv_rope: qkv's rows must be 16-byte aligned");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.is_contiguous() && k.is_contiguous() &&
                  v.is_contiguous(),
              "qkv_rope: q, k, v must be contiguous [T, H, d]");
  const int64_t ntok = qkv.size(0);
  const int hq = static_cast<int>(q.size(1)), hkv = static_cast<int>(k.size(1)), d = static_cast<int>(q.size(2));
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "qkv_rope: head dim must be 64, 128 or 256");
  TORCH_CHECK(qkv.size(1) == static_cast<int64_t>(hq + 2 * hkv) * d && q.size(0) == ntok && k.size(0) == ntok &&
                  v.size(0) == ntok && v.size(1) == hkv && k.size(2) == d && v.size(2) == d,
              "qkv_rope: shapes do not match");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type() && t->device() == qkv.device(), "qkv_rope: q/k/v dtype/device");
    TORCH_CHECK(aligned16(*t), "qkv_rope: q, k, v must be 16-byte aligned");
  }
  TORCH_CHECK(cs.is_cuda() && cs.scalar_type() == at::kFloat && cs.dim() == 2 && cs.size(0) == ntok &&
                  cs.size(1) == d && cs.stride(1) == 1,
              "qkv_rope: cs must be [T, d] float32 with a contiguous last dim");
  TORCH_CHECK(q_w.has_value() == k_w.has_value(), "qkv_rope: give both norm weights or neither");
  if (q_w.has_value()) {
    for (const at::Tensor* t : {&*q_w, &*k_w}) {
      TORCH_CHECK(t->numel() == d && t->is_contiguous() && t->scalar_type() == qkv.scalar_type() &&
                      t->device() == qkv.device(),
                  "qkv_rope: norm weights must be contiguous [d] of qkv's dtype");
      TORCH_CHECK(aligned16(*t), "qkv_rope: norm weights must be 16-byte aligned");
    }
  }
  const bool cache = slots.has_value();
  TORCH_CHECK(cache == k_cache.has_value() && cache == v_cache.has_value(), "qkv_rope: cache args go together");
  if (cache) {
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->numel() == ntok && slots->is_contiguous() &&
                    slots->device() == qkv.device(),
                "qkv_rope: slots must be [T] int64 on the device");
    for (const at::Tensor* t : {&*k_cache, &*v_cache}) {
      TORCH_CHECK(t->dim() == 3 && t->size(1) == hkv && t->size(2) == d && t->is_contiguous() &&
                      t->scalar_type() == qkv.scalar_type() && t->device() == qkv.device(),
                  "qkv_rope: caches must be contiguous [S, hkv, d] of qkv's dtype");
      TORCH_CHECK(aligned16(*t), "qkv_rope: caches must be 16-byte aligned");
    }
  }
  TORCH_CHECK(items_per_group == 1 || items_per_group == 2 || items_per_group == 4 || items_per_group == 8,
              "qkv_rope: items_per_group must be 1, 2, 4 or 8");
  const int ipg = static_cast<int>(items_per_group);
  if (ntok == 0) return;
  const c10::cuda::CUDAGuard guard(qkv.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(qkv.get_device()).stream();
  const at::Tensor* qw = q_w.has_value() ? &*q_w : nullptr;
  const at::Tensor* kw = k_w.has_value() ? &*k_w : nullptr;
  const at::Tensor* kc = cache ? &*k_cache : nullptr;
  const at::Tensor* vc = cache ? &*v_cache : nullptr;
  const at::Tensor* sl = cache ? &*slots : nullptr;
  if (qkv.scalar_type() == at::kBFloat16) {
    launch_qkv<BF16>(qkv, cs, qw, kw, eps, q, k, v, kc, vc, sl, hq, hkv, d, ipg, stream);
  } else {
    launch_qkv<FP16>(qkv, cs, qw, kw, eps, q, k, v, kc, vc, sl, hq, hkv, d, ipg, stream);
  }
}

// ---------------------------------------------------------------------------------------
// moe_combine: a thread holds 8 columns of one token and walks the token's k slots; the
// threads of a warp take neighbouring columns of one token, so each slot's row is read in
// whole 16-byte vectors, coalesced. Float32 weights and accumulator, one rounding.
namespace {
template <typename C>
__global__ void __launch_bounds__(kThreads)
moe_combine_kernel(const uint16_t* __restrict__ y, int64_t y_stride, const int64_t* __restrict__ pos,
                   const float* __restrict__ w, int k, int64_t pad, const uint16_t* __restrict__ bias,
                   const int64_t* __restrict__ expert, uint16_t* __restrict__ out, int64_t out_stride,
                   int64_t tokens, int64_t hidden) {
  const int64_t per_row = hidden / kVec;
  const int64_t n = tokens * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_row;
    const int64_t c = (i - t * per_row) * kVec;
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int j = 0; j < k; ++j) {
      const int64_t p = __ldg(pos + t * k + j);
      if (p == pad) continue;
      const float wj = __ldg(w + t * k + j);
      Vec v;
      v.raw = __ldcs(reinterpret_cast<const uint4*>(y + p * y_stride + c));
      if (bias != nullptr) {
        Vec b;
        b.raw = __ldg(reinterpret_cast<const uint4*>(bias + __ldg(expert + p) * hidden + c));
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += wj * (C::to_float(v.x[e]) + C::to_float(b.x[e]));
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += wj * C::to_float(v.x[e]);
      }
    }
    Vec o;
#pragma unroll
    for (int e = 0; e < kVec; ++e) o.x[e] = C::from_float(acc[e]);
    *reinterpret_cast<uint4*>(out + t * out_stride + c) = o.raw;
  }
}
}  // namespace

// y [M, H] (rows 16-byte aligned, H % 8 == 0), pos [T, k] int64 and w [T, k] float32
// (contiguous), out [T, H] (rows aligned, y's dtype); pad: the row no slot reads (-1: none);
// bias [E, H] contiguous (y's dtype) with expert [M] int64, or neither.
void moe_combine_out(const at::Tensor& y, const at::Tensor& pos, const at::Tensor& w, int64_t pad,
                     const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& expert,
                     const at::Tensor& out) {
  check_half(y, "moe_combine: y");
  check_half(out, "moe_combine: out");
  TORCH_CHECK(y.dim() == 2 && out.dim() == 2 && y.size(1) == out.size(1) && y.size(1) % kVec == 0 &&
                  y.stride(0) % kVec == 0 && out.stride(0) % kVec == 0 && out.scalar_type() == y.scalar_type() &&
                  out.device() == y.device(),
              "moe_combine: y [M, H] and out [T, H] of one dtype, H and row strides multiples of 8");
  const int64_t tokens = out.size(0), hidden = y.size(1);
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 2 && pos.size(0) == tokens && pos.is_contiguous() &&
                  pos.device() == y.device(),
              "moe_combine: pos must be a contiguous int64 [T, k] on y's device");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.sizes() == pos.sizes() && w.is_contiguous() && w.device() == y.device(),
              "moe_combine: w must be a contiguous float32 [T, k] on y's device");
  TORCH_CHECK(bias.has_value() == expert.has_value(), "moe_combine: bias and expert go together");
  const uint16_t* bp = nullptr;
  const int64_t* ep = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == y.scalar_type() && bias->dim() == 2 && bias->size(1) == hidden &&
                    bias->is_contiguous() && aligned16(*bias) && bias->device() == y.device(),
                "moe_combine: bias must be a contiguous, aligned [E, H] tensor of y's dtype");
    TORCH_CHECK(expert->scalar_type() == at::kLong && expert->dim() == 1 && expert->size(0) == y.size(0) &&
                    expert->is_contiguous() && expert->device() == y.device(),
                "moe_combine: expert must be a contiguous int64 [M] on y's device");
    bp = static_cast<const uint16_t*>(bias->data_ptr());
    ep = expert->data_ptr<int64_t>();
  }
  if (tokens == 0) return;
  const int k = static_cast<int>(pos.size(1));
  const c10::cuda::CUDAGuard guard(y.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(y.get_device()).stream();
  const unsigned grid = grid_for(tokens * hidden / kVec);
  const auto* yp = static_cast<const uint16_t*>(y.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  if (y.scalar_type() == at::kBFloat16) {
    moe_combine_kernel<BF16><<<grid, kThreads, 0, stream>>>(yp, y.stride(0), pos.data_ptr<int64_t>(),
                                                            w.data_ptr<float>(), k, pad, bp, ep, op, out.stride(0),
                                                            tokens, hidden);
  } else {
    moe_combine_kernel<FP16><<<grid, kThreads, 0, stream>>>(yp, y.stride(0), pos.data_ptr<int64_t>(),
                                                            w.data_ptr<float>(), k, pad, bp, ep, op, out.stride(0),
                                                            tokens, hidden);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
