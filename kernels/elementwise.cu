// Memory-bound elementwise kernels of the forward, 16-byte vectors, 8 elements per thread.
//
// silu_mul:   out[t, i] = round(round(silu(gate[t, i])) * up[t, i]),  gate_up = [gate | up]
//             (rounding to the storage type where eager torch rounds, so results match it)
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

template <typename T>
struct Half2Byte;

template <>
struct Half2Byte<__nv_bfloat16> {
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
};

template <>
struct Half2Byte<__half> {
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half(v); }
};

template <typename T>
union Vec {
  uint4 raw;
  T x[kVec];
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
silu_mul_kernel(const T* __restrict__ in, int64_t in_stride, T* __restrict__ out, int64_t rows,
                int64_t inter) {
  using C = Half2Byte<T>;
  const int64_t per_row = inter / kVec;
  const int64_t n = rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row;
    const int64_t c = (i - r * per_row) * kVec;
    const T* row = in + r * in_stride;
    Vec<T> g, u, o;
    g.raw = __ldcs(reinterpret_cast<const uint4*>(row + c));
    u.raw = __ldcs(reinterpret_cast<const uint4*>(row + inter + c));
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = C::to_float(g.x[j]);
      const float s = C::to_float(C::from_float(x / (1.0f + expf(-x))));
      o.x[j] = C::from_float(s * C::to_float(u.x[j]));
    }
    __stcs(reinterpret_cast<uint4*>(out + r * inter + c), o.raw);
  }
}

struct Strides3 {
  int64_t s0, s1;  // [c, H, D] with a contiguous last dim
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
merge_attn_kernel(const T* __restrict__ o1, Strides3 st1, const float* __restrict__ l1,
                  const T* __restrict__ o2, Strides3 st2, const float* __restrict__ l2,
                  int64_t ls0, int64_t ls1, int64_t ls20, int64_t ls21, T* __restrict__ out,
                  Strides3 sto, int64_t c, int heads, int dim) {
  using C = Half2Byte<T>;
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
    Vec<T> x, y, o;
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

}  // namespace

// gate_up [T, 2I] (rows 16-byte aligned), out [T, I] contiguous, same dtype; I % 8 == 0.
void silu_mul_out(const at::Tensor& gate_up, const at::Tensor& out) {
  check_half(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % (2 * kVec) == 0, "silu_mul: gate_up must be [T, 2I], I % 8 == 0");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.stride(0) % kVec == 0, "silu_mul: gate_up row stride must be a multiple of 8");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type() && out.device() == gate_up.device() &&
                  out.dim() == 2 && out.size(0) == rows && out.size(1) == inter && out.is_contiguous() &&
                  aligned16(out),
              "silu_mul: out must be a contiguous, aligned [T, I] tensor of gate_up's dtype");
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(gate_up.get_device()).stream();
  const unsigned grid = grid_for(rows * inter / kVec);
  if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(gate_up.data_ptr()), gate_up.stride(0),
        static_cast<__nv_bfloat16*>(out.data_ptr()), rows, inter);
  } else {
    silu_mul_kernel<__half><<<grid, kThreads, 0, stream>>>(
        static_cast<const __half*>(gate_up.data_ptr()), gate_up.stride(0), static_cast<__half*>(out.data_ptr()),
        rows, inter);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  if (o1.scalar_type() == at::kBFloat16) {
    merge_attn_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(o1.data_ptr()), s1, l1p, static_cast<const __nv_bfloat16*>(o2.data_ptr()),
        s2, l2p, l1.stride(0), l1.stride(1), l2.stride(0), l2.stride(1),
        static_cast<__nv_bfloat16*>(out.data_ptr()), so, c, static_cast<int>(heads), static_cast<int>(dim));
  } else {
    merge_attn_kernel<__half><<<grid, kThreads, 0, stream>>>(
        static_cast<const __half*>(o1.data_ptr()), s1, l1p, static_cast<const __half*>(o2.data_ptr()), s2, l2p,
        l1.stride(0), l1.stride(1), l2.stride(0), l2.stride(1), static_cast<__half*>(out.data_ptr()), so, c,
        static_cast<int>(heads), static_cast<int>(dim));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
