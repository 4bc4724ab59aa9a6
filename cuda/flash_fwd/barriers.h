// Thin wrappers over the synchronization primitives the kernel uses: mbarriers (TMA completion and
// buffer release) and named barriers (consumer warpgroups only). Kept here so the protocol in
// producer.h and consumer.h reads as a protocol.
#pragma once
#include <cstdint>
#include <cutlass/arch/barrier.h>

namespace jax_fa3::fwd {

// Named barrier ids. 0 is __syncthreads(); the producer warpgroup never takes part in these.
enum NamedBarrierId : uint32_t {
  kBarrierConsumers = 1,   // all consumer threads: O staged in smem before the TMA store
  kBarrierWarpGroup1 = 2,  // ping-pong: "warpgroup 1 may issue its GEMMs"
  kBarrierWarpGroup2 = 3,  // ping-pong: "warpgroup 2 may issue its GEMMs"
  kBarrierWarpGroup3 = 4,  // ping-pong with three consumer warpgroups (fp8 192-row tiles)
  kBarrierVMean = 5,       // fp8: the tile's v_mean is staged in shared memory (fp8/v_mean.h)
  kBarrierConverter = 6,   // e4m3 cache: every converter thread stored its part of a block
};

__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

using Mbarrier = cutlass::arch::ClusterTransactionBarrier;

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  Mbarrier::init(bar, arrivals);
}
// Waits until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) { Mbarrier::wait(bar, phase); }
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { Mbarrier::arrive(bar); }
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  Mbarrier::arrive_and_expect_tx(bar, bytes);
}

// A ring position of the K/V pipeline: stage index and the parity of the stage's current phase.
template <int kStages>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

}  // namespace jax_fa3::fwd
