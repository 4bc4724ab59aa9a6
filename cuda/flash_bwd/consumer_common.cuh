// What both consumer mainloops do the same way: hand one Q block's dQ partial to global memory,
// and store dK / dV from registers at the end.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <type_traits>

#include "common/accumulator_fragment.cuh"
#include "flash_bwd/kernel_params.cuh"

namespace jax_fa3::flash_bwd {

// This warpgroup's dQ partial (accumulator tdQrdQ, its wgmmas complete) of query head qh, Q block
// m, in fragment order (Traits::dq_slot: this thread's vectors are 128 vectors apart). `stage`
// is the Q/dO stage of the block (the CTA's it-th: it % kStages); the sdq buffer is
// it % kDqStages, the same number when there are two, taken from it to hold no extra register.
template <typename Traits, bool kKeyRanges, typename Frag>
__device__ __forceinline__ void store_dq_partial(KernelParams<Traits> const& p,
                                                 typename Traits::SharedStorage& ss,
                                                 Frag const& tdQrdQ, int wg, int tid, int ctid,
                                                 const BlockGeometry& geom, int bidb, int qh,
                                                 int m, int n_block, int stage) {
  using namespace cute;
  constexpr uint32_t kMma = Traits::kNumMmaThreads;
  if constexpr (Traits::kDqViaSmem) {
    // The writer warp adds the chunk to global memory (and orders the deterministic mode).
    static_assert(Traits::kDqStages == 1 || Traits::kDqStages == Traits::kStages);
    const int buf = Traits::kDqStages == 1 ? 0 : stage;
    named_barrier_sync(dq_barrier(NamedBarrier::kDqEmpty, buf), kMma + 32);
    // 32-bit shared-window address: a generic 64-bit pointer here cost a register spill.
    static_assert(Traits::kDqVec == 4);
    const uint32_t sdq = cute::cast_smem_ptr_to_uint(ss.dq + buf * Traits::kDqChunkFloats +
                                                     wg * Traits::kDqWgFloats);
    CUTE_UNROLL
    for (int i = 0; i < size(tdQrdQ); i += 4) {
      st_shared_f32x4(sdq + Traits::dq_slot(i, tid) * 4, tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2),
                      tdQrdQ(i + 3));
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> bulk reduce
    named_barrier_arrive(dq_barrier(NamedBarrier::kDqFull, buf), kMma + 32);
  } else {
    // d = 256: add from registers. Padded rows and columns hold exact zeros (dS is 0 past
    // s_q, K is zero-filled past d), so the whole chunk is added without masks.
    int* sem = nullptr;
    if (p.deterministic) {  // K blocks add in increasing order
      if (ctid == 0) sem = wait_dq_turn<kKeyRanges>(p, geom, bidb, qh, m, n_block);
      named_barrier_sync(NamedBarrier::kDeterministic, kMma);
    }
    static_assert(Traits::kDqVec == 4);
    float* gdq = dq_chunk(p, bidb, qh, m) + wg * Traits::kDqWgFloats;
    CUTE_UNROLL
    for (int i = 0; i < size(tdQrdQ); i += 4) {
      red_global_add_f32x4(gdq + Traits::dq_slot(i, tid), tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2),
                           tdQrdQ(i + 3));
    }
    if (p.deterministic) {
      named_barrier_sync(NamedBarrier::kDeterministic, kMma);
      if (ctid == 0) {
        __threadfence();
        atomicAdd(sem, 1);
      }
    }
  }
}

// dK = sum dS^T Q and dV = sum P^T dO of this warpgroup's (64 keys, kDKV columns) slice: key
// rows from row0, d columns from col0; masked pair stores. dK's accumulator row frag_row(i)
// (a thread holds two key rows) is multiplied by dk_scale(frag_row(i)): softmax_scale in the
// 16-bit kernel, the key's M / 2^6 * softmax_scale in the fp8 one (fp8_dk_operand.cuh), whose
// dV is multiplied by dv_scale and which writes float32.
template <typename Traits, typename Frag, typename Coord, typename DkScale>
__device__ __forceinline__ void store_dk_dv(KernelParams<Traits> const& p, Frag const& tdKrdK,
                                            Frag const& tdVrdV, Coord const& tdKVcdKV, int row0,
                                            int col0, int hk, int bidb, DkScale&& dk_scale,
                                            float dv_scale = 1.f) {
  using namespace cute;
  using Element = typename Traits::Element;
  using Out = typename Traits::ElementGrad;
  using Pair = std::conditional_t<Traits::kFp8, float2, uint32_t>;
  const int64_t kv_row_stride = int64_t(p.h_k) * p.d;
  const int64_t kv_base = int64_t(bidb) * p.s_k * kv_row_stride + int64_t(hk) * p.d;
  Pair* dk = reinterpret_cast<Pair*>(static_cast<Out*>(p.dk) + kv_base);
  Pair* dv = reinterpret_cast<Pair*>(static_cast<Out*>(p.dv) + kv_base);
  CUTE_UNROLL
  for (int i = 0; i < size(tdKrdK); i += 2) {
    const int j = row0 + get<0>(tdKVcdKV(i));
    const int c = col0 + get<1>(tdKVcdKV(i));
    if (j < p.s_k && c < p.d) {
      const int64_t idx = (int64_t(j) * kv_row_stride + c) / 2;
      const float sk = dk_scale(frag_row(i));
      if constexpr (Traits::kFp8) {
        dk[idx] = make_float2(tdKrdK(i) * sk, tdKrdK(i + 1) * sk);
        dv[idx] = make_float2(tdVrdV(i) * dv_scale, tdVrdV(i + 1) * dv_scale);
      } else {
        dk[idx] = pack2<Element>(tdKrdK(i) * sk, tdKrdK(i + 1) * sk);
        dv[idx] = pack2<Element>(tdVrdV(i), tdVrdV(i + 1));
      }
    }
  }
}

}  // namespace jax_fa3::flash_bwd
