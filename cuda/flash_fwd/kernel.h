// The persistent, warp-specialized forward kernel: warpgroup 0 produces (TMA), warpgroups 1..2
// consume (wgmma + softmax + epilogue).
#pragma once
#include <cutlass/arch/reg_reconfig.h>

#include "flash_fwd/barriers.h"
#include "flash_fwd/consumer.h"
#include "flash_fwd/fp8/row_sum.h"
#include "flash_fwd/fp8_cache.h"
#include "flash_fwd/kernel_params.h"
#include "flash_fwd/producer.h"

namespace jax_fa3::fwd {

// The e4m3 cache's converter warpgroups (fp8_cache.h); none in the other kernels.
template <class Traits>
__device__ __forceinline__ bool is_converter(int warp_group) {
  if constexpr (Traits::kFp8Cache) {
    return warp_group >= Traits::kConverterWarpGroup;
  } else {
    return false;
  }
}

// __launch_bounds__(threads, 1) caps registers at entry (65536 / 384 -> 168), which setmaxnreg
// needs; the producer then gives registers back and the consumers raise theirs to 240.
template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    flash_fwd_kernel(CUTE_GRID_CONSTANT const KernelParams<Traits> params) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const int warp_group = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    mbar_init(&ss.q_full, 1);
    // Q's buffer is released by every consumer warp after its last S GEMM where the kernel does
    // so (KernelParams::early_q_release), else by consumer thread 0 once the TMA store of O has
    // read it (consumer.h).
    mbar_init(&ss.q_empty, params.early_q_release() ? Traits::kNumConsumerThreads / 32 : 1);
    // One arrival fills a stage: the TMA's (1 + tx), or the e4m3 cache's converter thread 0 for
    // its warpgroup (fp8_cache.h).
#pragma unroll
    for (int s = 0; s < Traits::kStages; ++s) {
      mbar_init(&ss.k_full[s], 1);
      mbar_init(&ss.v_full[s], 1);
      mbar_init(&ss.k_empty[s], Traits::kNumConsumerThreads / 32);
      mbar_init(&ss.v_empty[s], Traits::kNumConsumerThreads / 32);
    }
    if constexpr (Traits::kFp8Cache) {
#pragma unroll
      for (int s = 0; s < Traits::kNumSlots; ++s) {
        mbar_init(&ss.slot_full[s], 2);  // the block's TMA and its scales' cp.asyncs
        mbar_init(&ss.slot_empty[s], 1);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (Traits::kFp8) {
    // The row-sum GEMM's constant B operand: generic-proxy stores, read by wgmma (async proxy)
    // only after the fence and the barrier below.
    TensorRowSum<Traits, true>::fill_selector(ss.row_sum_selector.data(), threadIdx.x,
                                              Traits::kNumThreads);
    cutlass::arch::fence_view_async_shared();
  }
  __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x == 0) run_producer<Traits>(params, ss);
  } else if (is_converter<Traits>(warp_group)) {
    if constexpr (Traits::kFp8Cache) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::kConverterRegs>();  // budget: fp8_cache.h
      run_cache_converter<Traits>(params, ss, threadIdx.x - 128 * Traits::kConverterWarpGroup);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    run_consumer<Traits>(params, ss, threadIdx.x - 128);
  }
}

}  // namespace jax_fa3::fwd
