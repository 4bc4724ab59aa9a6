// Small PTX helpers of the backward kernel: named barriers, bulk (non-tensor) async copies that
// complete on an mbarrier, tanh. (The forward has its own; deduplicate later.)
#pragma once
#include <cstdint>

#include <cute/arch/util.hpp>

namespace jax_fa3::flash_bwd {

// Named barrier ids used by the consumer warpgroups (0 is __syncthreads).
enum class NamedBarrier : uint32_t {
  kPdSReady = 1,   // both warpgroups wrote their half of P and dS (after fence.proxy.async)
  kPdSFree = 2,    // both warpgroups' wgmmas that read P and dS of the previous block finished
  kDeterministic = 3,  // dQ semaphore acquired / all dQ atomics of this block issued
};

__device__ __forceinline__ void named_barrier_sync(NamedBarrier id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(num_threads) : "memory");
}

// 1-D bulk copy global -> shared completing `bytes` of transaction on `bar` (16-byte aligned,
// bytes a multiple of 16).
__device__ __forceinline__ void bulk_copy_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                              uint64_t* bar) {
  const uint32_t dst = cute::cast_smem_ptr_to_uint(smem_dst);
  const uint32_t mbar = cute::cast_smem_ptr_to_uint(bar);
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "l"(gmem_src), "r"(bytes), "r"(mbar)
      : "memory");
}

// tanh(x) = 1 - 2 / (exp(2x) + 1) with ex2.approx (rel. error ~2^-22) and a fast divide: absolute
// error ~1e-7, so softcap * tanh stays accurate for large caps (tanh.approx.f32 is only ~2^-11).
__device__ __forceinline__ float tanh_fast(float x) {
  const float e = exp2f(x * 2.8853900817779268f);  // exp(2x); overflows to +inf -> tanh = 1
  return 1.f - __fdividef(2.f, e + 1.f);
}

__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

}  // namespace jax_fa3::flash_bwd
