// The gate/up projection and SiLU-mul in one Hopper GEMM, built on CUTLASS's SM90 collective
// mainloop (TMA loads multicast across a thread-block cluster, warp-specialised wgmma, a
// persistent tile scheduler) with an epilogue of our own that pairs gate and up columns.
//
//   out[t, j] = round(round(silu(round(g))) * round(u)),  g = h[t] . gate[j],  u = h[t] . up[j]
//
// (the rounding of the two-pass path: a bf16 GEMM output, then the SiLU-mul kernel, with its
// expf and IEEE division). The weight is the [gate; up] matrix with its rows permuted once
// (``glu_rows``, in Python): within each block of BN rows (one tile's columns), accumulator
// column c = 8i + 2q + s holds gate (s = 0) or up (s = 1) of output column (BN/8) q + i of the
// tile. In the wgmma accumulator layout a thread holds columns 8i + 2q and 8i + 2q + 1 for every
// i, so each thread's gate and up sit in neighbouring registers, and its BN/8 outputs of a row
// are contiguous: 16-byte stores straight from registers, no shared memory.
//
// A plain shared library with a C interface (loaded with ctypes), built with nvcc alone: no
// torch headers, so one build serves any torch. Configurations are compile-time; the launch
// takes the config's index.

#include <cstdint>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"

namespace ts {

using namespace cute;
using Bf16 = cutlass::bfloat16_t;
using StrideOut = cute::Stride<int64_t, cute::Int<1>, int64_t>;

// silu(g) * u with the two-pass path's roundings (g and u arrive as float32 accumulators)
CUTLASS_DEVICE float glu(float g, float u) {
  g = __bfloat162float(__float2bfloat16_rn(g));
  u = __bfloat162float(__float2bfloat16_rn(u));
  float s = g / (1.0f + expf(-g));
  s = __bfloat162float(__float2bfloat16_rn(s));
  return s * u;
}

// The collective epilogue (the interface of CUTLASS's register-to-global epilogues, wrapped in
// its warp-specialised adapter by the kernel type below). The output is [M, N/2], row stride ldd.
template <int BM, int BN>
class GluEpilogue {
 public:
  using ElementC = void;
  using StrideC = StrideOut;
  using ElementD = Bf16;
  using StrideD = StrideOut;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct ThreadEpilogueOp {};  // none: the adapter's type names one
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  struct Arguments {
    Bf16* ptr_D = nullptr;
    int64_t ldd = 0;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    auto n = get<1>(shape);
    return args.ptr_D != nullptr && n % BN == 0 && args.ldd % 8 == 0 && args.ldd >= n / 2 &&
           reinterpret_cast<uintptr_t>(args.ptr_D) % 16 == 0;
  }

  CUTLASS_HOST_DEVICE GluEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : params(p) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char*) {
    constexpr int G = BN / 8;  // 8-column groups of a tile: a thread's outputs per row
    static_assert(G % 8 == 0, "a thread's outputs of a row make whole 16-byte stores");
    // ((2 columns, 2 row halves, G groups), MMA_M, MMA_N): one wgmma atom spans the tile's N
    static_assert(size<0>(FrgLayout{}) == 4 * G && size<2>(FrgLayout{}) == 1,
                  "accumulators are not in the wgmma layout this epilogue pairs");
    int const M = get<0>(problem_shape_mnkl);
    auto m_coord = get<0>(blk_coord_mnkl);
    auto n_coord = get<1>(blk_coord_mnkl);
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor cD = make_identity_tensor(make_shape(Int<BM>{}, Int<BN>{}));
    Tensor tCcD = thr_mma.partition_C(cD);  // (m, c) of each accumulator within the tile
    Bf16* out = params.ptr_D + static_cast<int64_t>(n_coord) * (BN / 2);
    int64_t const row0 = static_cast<int64_t>(m_coord) * BM;
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < size<1>(FrgLayout{}); ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        auto crd = tCcD(make_coord(make_coord(0, r, 0), mm, 0));
        int64_t const row = row0 + get<0>(crd);
        if (row >= M) continue;
        int const q = (get<1>(crd) >> 1) & 3;
        Bf16* dst = out + row * params.ldd + G * q;
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < G / 8; ++v) {
          cutlass::Array<Bf16, 8> pack;
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 8; ++j) {
            int const g = v * 8 + j;
            pack[j] = Bf16(glu(acc(make_coord(make_coord(0, r, g), mm, 0)), acc(make_coord(make_coord(1, r, g), mm, 0))));
          }
          *reinterpret_cast<cutlass::Array<Bf16, 8>*>(dst + v * 8) = pack;
        }
      }
    }
  }

 private:
  Params params;
};

template <class Tile, class Cluster, class Schedule>
struct Glu {
  static constexpr int BM = size<0>(Tile{});
  static constexpr int BN = size<1>(Tile{});
  using Epi = GluEpilogue<BM, BN>;
  using CollectiveEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epi>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor, 8, Bf16,
      cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments args(const void* a, const void* b, void* d, int m, int n, int k, int64_t ldd,
                                       int sms, int swizzle, int raster) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, make_shape(m, k, 1));
    StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1));
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {m, n, k, 1},
                                  {static_cast<Bf16 const*>(a), sa, static_cast<Bf16 const*>(b), sb},
                                  {static_cast<Bf16*>(d), ldd}};
    args.hw_info.sm_count = sms;
    args.scheduler.max_swizzle_size = swizzle;
    using Raster = typename Gemm::GemmKernel::TileScheduler::RasterOrderOptions;
    args.scheduler.raster_order = raster == 1 ? Raster::AlongM : raster == 2 ? Raster::AlongN : Raster::Heuristic;
    return args;
  }

  static int workspace(int m, int n, int k, int64_t ldd, int sms, int swizzle, int raster, size_t* bytes) {
    auto a = args(nullptr, nullptr, nullptr, m, n, k, ldd, sms, swizzle, raster);
    *bytes = Gemm::get_workspace_size(a);
    return 0;
  }

  static int run(const void* a, const void* b, void* d, int m, int n, int k, int64_t ldd, int sms, int swizzle,
                 int raster, void* ws, cudaStream_t stream) {
    Gemm gemm;
    auto arg = args(a, b, d, m, n, k, ldd, sms, swizzle, raster);
    cutlass::Status s = gemm.can_implement(arg);
    if (s != cutlass::Status::kSuccess) return 100 + static_cast<int>(s);
    s = gemm.initialize(arg, ws, stream);
    if (s != cutlass::Status::kSuccess) return 200 + static_cast<int>(s);
    s = gemm.run(stream);
    if (s != cutlass::Status::kSuccess) return 300 + static_cast<int>(s);
    return cudaGetLastError() == cudaSuccess ? 0 : 400;
  }
};

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;

// The configurations (index: tile M x N x K, cluster, schedule). Keep in step with
// teacher_server/ops/glu_gemm.py's CONFIGS.
using Glu0 = Glu<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop>;
using Glu1 = Glu<Shape<_128, _256, _64>, Shape<_1, _2, _1>, Coop>;
using Glu2 = Glu<Shape<_128, _256, _64>, Shape<_1, _1, _1>, Coop>;
using Glu3 = Glu<Shape<_64, _256, _64>, Shape<_2, _1, _1>, Ping>;
using Glu4 = Glu<Shape<_256, _128, _64>, Shape<_2, _1, _1>, Coop>;
#define TS_GLU_CONFIGS(X) X(0, Glu0) X(1, Glu1) X(2, Glu2) X(3, Glu3) X(4, Glu4)

}  // namespace ts

extern "C" {

// The tile width BN of a config (the period of the weight's row permutation), 0 if unknown.
int ts_glu_tile_n(int config) {
  switch (config) {
#define X(i, T) \
  case i:       \
    return ts::T::BN;
    TS_GLU_CONFIGS(X)
#undef X
    default:
      return 0;
  }
}

// Workspace bytes of a launch (the persistent scheduler's); nonzero return: unknown config.
int ts_glu_workspace(int config, int m, int n, int k, int64_t ldd, int sms, int swizzle, int raster, size_t* bytes) {
  switch (config) {
#define X(i, T) \
  case i:       \
    return ts::T::workspace(m, n, k, ldd, sms, swizzle, raster, bytes);
    TS_GLU_CONFIGS(X)
#undef X
    default:
      return 1;
  }
}

// a [m, k] and b [n, k] (the permuted [gate; up], n = 2I) bf16 row-major; d [m, n/2] with row
// stride ldd. 0 on success; else a code naming the failing stage (100s: can_implement, 200s:
// initialize, 300s: run, 400: a launch error, 1: unknown config).
int ts_glu_gemm(int config, const void* a, const void* b, void* d, int m, int n, int k, int64_t ldd, int sms,
                int swizzle, int raster, void* workspace, void* stream) {
  switch (config) {
#define X(i, T) \
  case i:       \
    return ts::T::run(a, b, d, m, n, k, ldd, sms, swizzle, raster, workspace, static_cast<cudaStream_t>(stream));
    TS_GLU_CONFIGS(X)
#undef X
    default:
      return 1;
  }
}
}
