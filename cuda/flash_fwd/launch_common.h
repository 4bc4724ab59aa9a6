// Host side shared by the 16-bit (launch.h) and fp8 (fp8/launch.h) launches: the kernel
// parameters with their TMA descriptors, the SM count, and the launch itself.
#pragma once
#include "common/cute_config.h"
#include <cuda_runtime.h>
#include <cute/tensor.hpp>

#include "common/cuda_check.h"
#include "flash_fwd/kernel.h"
#include "flash_fwd/kernel_params.h"

namespace jax_fa3::fwd {

// Where one call's tensors are, as its TMA descriptors see them: Q and O (b, s_q, h, d), or
// (b, h, s_q, d) with qo_heads_major, O with b * scalars.num_splits batch rows (split-KV), K
// (b, s_k, h_k, d), and V's global view, which the caller builds (16-bit: like K; fp8: the
// transposed Vt). s_k and h_k are those of the descriptors (1 for a call without keys, whose K/V
// blocks are never loaded); kv_batch is K's batch extent (b unless given: a paged cache's pool
// is one batch).
template <class Traits, class GmemV>
KernelParams<Traits> make_kernel_params(const ExtraParams<Traits::kFp8>& extra,
                                        const typename Traits::Element* q,
                                        const typename Traits::Element* k, GmemV const& v,
                                        typename Traits::ElementOut* o, int b, int s_q, int s_k,
                                        int h, int h_k, int d, const FlashFwdScalars& scalars,
                                        int kv_batch = -1, bool qo_heads_major = false,
                                        const Fp8CacheParams<Traits>& cache = {}) {
  using Params = KernelParams<Traits>;
  auto qo_tensor = [&](auto* ptr, int batch) {
    return qo_heads_major ? make_heads_major_gmem_tensor(ptr, s_q, d, h, batch)
                          : make_gmem_tensor(ptr, s_q, d, h, batch);
  };
  return Params{
      extra,
      cache,
      make_tma_copy(SM90_TMA_LOAD{}, qo_tensor(q, b),
                    typename Traits::SmemLayoutQ{}, typename Params::TileQ{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, make_gmem_tensor(k, s_k, d, h_k, kv_batch < 0 ? b : kv_batch),
                    take<0, 2>(typename Traits::SmemLayoutK{}), typename Params::TileKV{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename Traits::SmemLayoutV{}),
                    typename Params::TileV{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, qo_tensor(o, b * scalars.num_splits),
                    typename Traits::SmemLayoutO{}, typename Params::TileQ{}, _1{}),
      scalars,
      TileScheduler(s_q, Traits::kBlockM, h, b,
                    scalars.window_left >= 0 || scalars.window_right >= 0,
                    scalars.num_splits)};
}

// The current device's SM count: the persistent grid's upper bound.
inline cudaError_t current_device_sm_count(int* num_sms) {
  int device = 0;
  JAX_FA3_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
  return cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
}

// The kernel on `grid` persistent CTAs, with its shared memory.
template <class Traits>
cudaError_t launch_kernel(KernelParams<Traits> params, int grid, cudaStream_t stream) {
  params.scheduler.set_grid(grid);
  auto* kernel = &flash_fwd_kernel<Traits>;
  JAX_FA3_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes));
  kernel<<<grid, Traits::kNumThreads, Traits::kSmemBytes, stream>>>(params);
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace jax_fa3::fwd
