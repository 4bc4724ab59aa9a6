// Issuing one warpgroup GEMM (a batch of wgmma over the K extent) with CuTe's SM90 atoms.
#pragma once
#include "common/cute_config.h"
#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

namespace jax_fa3::fwd {

using namespace cute;

// The k-steps [kBegin, kEnd) of C (+)= A * B for this thread's warpgroup, as one commit group.
// kZeroInit: the first k-step overwrites C.
// kWait >= 0: wait until at most kWait wgmma batches of this warpgroup are in flight on return;
// kWait < 0: return right after the commit (the caller waits later, e.g. to overlap softmax).
// The operand fences stop the compiler from moving register reads/writes of A (RS form) and C
// across the asynchronous wgmma.
// kARegisters: A is a register fragment (RS form) rather than shared-memory descriptors.
// A GEMM can be issued in pieces between other work (consumer.h, Traits::kPipelinedPv).
template <int kBegin, int kEnd, bool kZeroInit, int kWait, bool kARegisters, class TiledMma,
          class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm_ksteps(TiledMma& mma, TA const& a, TB const& b,
                                                      TC& c) {
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = kBegin; k < kEnd; ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
}

// The whole K extent of A and B (see warpgroup_gemm_ksteps).
template <bool kZeroInit, int kWait, bool kARegisters = false, class TiledMma, class TA, class TB,
          class TC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  constexpr int kSteps = decltype(size<2>(a))::value;
  warpgroup_gemm_ksteps<0, kSteps, kZeroInit, kWait, kARegisters>(mma, a, b, c);
}

}  // namespace jax_fa3::fwd
