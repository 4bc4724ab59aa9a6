// The softmax row sums of the fp8 kernel on the tensor cores: each k32 step of P that goes to the
// PV GEMM also goes, in the same commit group, to a 64x8x32 GEMM against a constant 0/1 selector
// tile (8 x kBlockN e4m3) in shared memory. That takes the 64 FADDs per thread and block out of
// the exp2 pass (the loop's issue slots, MUFU and tensor pipe are each about half busy,
// benchmarks/RESULTS.md) for 4 small wgmma per block. The sum is of P as quantized to e4m3, the
// very weights that multiply V.
// Precision: the fp8 wgmma adds into its fp32 accumulator with about 13 mantissa bits, each
// product aligned to the larger exponent and truncated (SageAttention2's "FP22"). On the H200 an
// all-ones selector carried through 8k keys came back up to 17% low, and even within one
// 128-key block a flat row lost 1.1% (2026-12-03). Hence:
// - the selector's columns 2j and 2j + 1 take the keys of k-step j only, so each column gets
//   its products from one wgmma and the other three add zeros; thread t of a quad holds columns
//   2t and 2t + 1, the sum of k-step t, and finalize()'s quad sum adds the steps up;
// - the accumulator holds one block (zeroed by the block's first k-step) and is folded into fp32
//   registers when O is rescaled.
#pragma once
#include "common/cute_config.h"
#include <cute/tensor.hpp>

#include "flash_fwd/softmax.h"
#include "flash_fwd/wgmma.h"

namespace jax_fa3::fwd {

using namespace cute;

// kEnabled false (16-bit types): nothing; OnlineSoftmax keeps its own row sums.
template <class Traits, bool kEnabled>
struct TensorRowSum {
  __device__ __forceinline__ TensorRowSum(typename Traits::SharedStorage&, int) {}
  __device__ __forceinline__ void clear() {}
  // O += P V over P's k-steps [kBegin, kEnd) (see warpgroup_gemm_ksteps).
  template <int kBegin, int kEnd, class MmaPV, class FragP, class FragV, class FragO>
  __device__ __forceinline__ void pv_ksteps(MmaPV& mma_pv, FragP const& tOrP, FragV const& tOrV,
                                            FragO& tOrO) {
    warpgroup_gemm_ksteps<kBegin, kEnd, /*zero_init=*/false, /*wait=*/-1, /*a_regs=*/true>(
        mma_pv, tOrP, tOrV, tOrO);
  }
  __device__ __forceinline__ void rescale(const float (&)[2]) {}
  template <class Softmax>
  __device__ __forceinline__ void hand_over(Softmax&) const {}
};

template <class Traits>
struct TensorRowSum<Traits, true> {
  using Mma = typename Traits::TiledMmaRowSum;
  using Element = typename Traits::Element;
  // Thread t of a quad holds columns 2t and 2t + 1: one k-step (of 32 keys) per thread.
  static_assert(Traits::kBlockN == 128, "the selector gives each thread of a quad one k-step");

  __host__ __device__ static auto selector(Element* smem) {
    return make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutRowSumSelector{});
  }
  // Columns 2j and 2j + 1 of the (n, key slot k) selector are 1 on k-step j's keys, 0 elsewhere.
  // Generic-proxy stores: the caller fences them for the async proxy before the first barrier.
  __device__ static void fill_selector(Element* smem, int thread, int num_threads) {
    Tensor sel = selector(smem);
    for (int i = thread; i < 8 * Traits::kBlockN; i += num_threads) {
      const int n = i % 8, k = i / 8;
      sel(n, k) = Element(n / 2 == k / 32 ? 1.f : 0.f);
    }
  }

  using FragSelector = decltype(Mma{}.get_thread_slice(0).partition_fragment_B(
      selector(static_cast<Element*>(nullptr))));
  using FragSum = decltype(partition_fragment_C(Mma{}, Shape<Int<Traits::kBlockM>, _8>{}));

  Mma mma;
  FragSelector sel;  // smem descriptors (MMA, 1, K)
  FragSum block;     // this block's sums of the thread's k-step (row r: elements 2r, 2r + 1, equal)
  float earlier[2];  // the earlier blocks' sums of the thread's k-step, rescaled as O

  __device__ __forceinline__ TensorRowSum(typename Traits::SharedStorage& ss, int thread_idx)
      : sel(mma.get_thread_slice(thread_idx)
                .partition_fragment_B(selector(ss.row_sum_selector.data()))) {}

  __device__ __forceinline__ void clear() {
    cute::clear(block);
    earlier[0] = earlier[1] = 0.f;
  }
  // O += P V and block += P x selector over P's k-steps [kBegin, kEnd), in one commit group, so
  // that the caller's warpgroup_wait counts stay those of the PV GEMM alone (the intra-warpgroup
  // overlap waits for S with PV still in flight).
  template <int kBegin, int kEnd, class MmaPV, class FragP, class FragV, class FragO>
  __device__ __forceinline__ void pv_ksteps(MmaPV& mma_pv, FragP const& tOrP, FragV const& tOrV,
                                            FragO& tOrO) {
    warpgroup_fence_operand(const_cast<FragP&>(tOrP));
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(block);
    warpgroup_arrive();
    mma_pv.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = kBegin; k < kEnd; ++k) {
      cute::gemm(mma_pv, tOrP(_, _, k), tOrV(_, _, k), tOrO);
      mma.accumulate_ = k == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
      cute::gemm(mma, tOrP(_, _, k), sel(_, _, k), block);
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(block);
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(const_cast<FragP&>(tOrP));
  }
  // With O, once per block, when every issued k-step is done (consumer.h): the last block's
  // sums join the earlier ones.
  __device__ __forceinline__ void rescale(const float (&correction)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      earlier[r] = (earlier[r] + block(2 * r)) * correction[r];
    }
  }
  template <class Softmax>
  __device__ __forceinline__ void hand_over(Softmax& softmax) const {
    const float mine[2] = {earlier[0] + block(0), earlier[1] + block(2)};
    softmax.set_row_sums(mine);
  }
};

}  // namespace jax_fa3::fwd
