// Small PTX helpers of the backward kernel: named barriers, bulk (non-tensor) async copies that
// complete on an mbarrier, tanh. (The forward has its own; deduplicate later.)
#pragma once
#include <cstdint>

#include <cute/arch/util.hpp>

namespace jax_fa3::flash_bwd {

// Named barrier ids used by the consumer warpgroups (0 is __syncthreads).
enum class NamedBarrier : uint32_t {
  kPdSReady = 1,   // both warpgroups wrote their half of P and dS (after fence.proxy.async)
  // One per writer, kPdSFree + wg (pds_free_barrier): the other warpgroup's wgmmas that read P
  // and dS of the previous block finished, so warpgroup wg may overwrite them. (Kernels short of
  // registers sync both warpgroups on kPdSFree instead: a rendezvous, same guarantee.)
  kPdSFree = 2,
  kDeterministic = 4,  // dQ semaphore acquired / all dQ atomics of this block issued
  // dQ through shared memory (consumers + the dQ-writer warp, kMma + 32 threads), one pair per
  // sdq buffer b at kDqFull + 2 b, kDqEmpty + 2 b (dq_barrier):
  kDqFull = 5,     // consumers wrote this block's dQ partial into sdq (after fence.proxy.async)
  kDqEmpty = 6,    // the writer's bulk reduce finished reading sdq: it may be overwritten
};

// "Warpgroup wg may overwrite the P / dS tiles": one-way, not a rendezvous. The other warpgroup
// arrives on it (bar.arrive) at the start of each Q block after its first (its wgmmas reading the
// previous block's tiles completed in that block), and wg syncs on it right before its stores,
// by when the arrival has happened in the common case. A two-way barrier there (both sync) held
// the warpgroups in step twice per Q block, kPdSReady being the other. Arrivals cannot run ahead:
// the other warpgroup's next arrival follows its next kPdSReady, which needs wg's stores, i.e.
// wg's sync. Both sides skip the first block, so counts match.
__device__ __forceinline__ NamedBarrier pds_free_barrier(int wg) {
  return static_cast<NamedBarrier>(static_cast<uint32_t>(NamedBarrier::kPdSFree) + wg);
}

// The named barrier `id` (kDqFull or kDqEmpty) of sdq buffer b. A run-time barrier id makes
// ptxas reserve all 16 barriers, harmless at one CTA per SM.
__device__ __forceinline__ NamedBarrier dq_barrier(NamedBarrier id, int b) {
  return static_cast<NamedBarrier>(static_cast<uint32_t>(id) + 2 * b);
}

__device__ __forceinline__ void named_barrier_sync(NamedBarrier id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(num_threads) : "memory");
}

// Signals a named barrier without waiting (producer side of a producer/consumer pair).
__device__ __forceinline__ void named_barrier_arrive(NamedBarrier id, uint32_t num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(num_threads) : "memory");
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

// A shared-memory (lo, hi) pair read where it is used: the volatile load is not hoisted, so a
// masked loop holds one pair at a time instead of all its columns' pairs (the key-range mask of
// the d = 64 softcap backward spilled with plain loads).
__device__ __forceinline__ int2 ld_shared_pair_at_use(uint32_t smem_addr) {
  int2 v;
  asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(smem_addr));
  return v;
}

__device__ __forceinline__ void st_shared_b32(uint32_t smem_addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_addr), "r"(v) : "memory");
}

// Four 8 x 8 blocks of 16-bit pairs: register r[j] is this thread's pair (row lane / 4, columns
// 2 (lane % 4), +1) of block j, and lane 8 j + i gives the address of block j's stored row i
// (8 elements, 16 bytes): the block's row i, or with kTrans its column i.
template <bool kTrans>
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1,
                                            uint32_t r2, uint32_t r3) {
  if constexpr (kTrans) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                     smem_addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                     smem_addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  }
}

__device__ __forceinline__ void st_shared_f32x4(uint32_t smem_addr, float x, float y, float z,
                                                float w) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr), "f"(x), "f"(y), "f"(z),
               "f"(w)
               : "memory");
}

// Four floats added to global memory with no value returned (REDG). atomicAdd(float4*) became
// ATOMG with a discarded result in the d = 256 consumer, which waits for the L2's reply.
__device__ __forceinline__ void red_global_add_f32x4(float* gmem_dst, float a, float b, float c,
                                                     float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(gmem_dst), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
}

// gmem[i] += smem[i] for `bytes / 4` floats, issued by one thread as one asynchronous bulk
// operation (TMA unit). Each element's add is atomic, so CTAs may reduce into the same block
// concurrently. 16-byte aligned addresses, bytes a multiple of 16. Completion: bulk_commit +
// bulk_wait_read (smem may be reused) or bulk_wait (writes done).
__device__ __forceinline__ void bulk_reduce_add_s2g(float* gmem_dst, const float* smem_src,
                                                    uint32_t bytes) {
  const uint32_t src = cute::cast_smem_ptr_to_uint(smem_src);
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                   gmem_dst),
               "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until at most kPending committed bulk groups still read their shared-memory source.
template <int kPending = 0>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

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
