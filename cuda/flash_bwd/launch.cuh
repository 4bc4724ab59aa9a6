// Host side of one (head-dim bucket, dtype): zero the workspace, preprocess, build the TMA
// descriptors, launch the main kernel, postprocess. Every CUDA call is checked.
#pragma once
#include <cmath>

#include "common/cuda_check.h"
#include "flash_bwd/kernel.cuh"
#include "flash_bwd/params.h"
#include "flash_bwd/postprocess.cuh"
#include "flash_bwd/preprocess.cuh"

namespace jax_fa3::flash_bwd {

template <int kHeadDim, typename Element>
cudaError_t run_flash_bwd(const FlashBwdParams& p, cudaStream_t stream) {
  using namespace cute;
  using Traits = BwdTraits<kHeadDim, Element>;
  if (p.d > kHeadDim || p.d % 8 != 0 || p.h_k <= 0 || p.h % p.h_k != 0) return cudaErrorInvalidValue;
  const size_t q_bytes = size_t(p.b) * p.s_q * p.h * p.d * sizeof(Element);
  const size_t k_bytes = size_t(p.b) * p.s_k * p.h_k * p.d * sizeof(Element);
  if (p.b == 0 || p.h == 0 || p.d == 0) return cudaSuccess;
  if (p.s_q == 0 || p.s_k == 0) {  // no (query, key) pair: every gradient is zero
    if (q_bytes) JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dq, 0, q_bytes, stream));
    if (k_bytes) {
      JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dk, 0, k_bytes, stream));
      JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dv, 0, k_bytes, stream));
    }
    return cudaSuccess;
  }

  // TMA descriptors need 16-byte aligned bases, and the 1-D bulk copies of LSE*log2e / D need
  // 16-byte aligned sources (offsets inside the workspace are multiples of 256 bytes). XLA's
  // buffers are aligned; refuse rather than risk a transfer that never completes its mbarrier.
  for (const void* ptr : {p.q, p.k, p.v, p.dout, static_cast<const void*>(p.lse_log2),
                          static_cast<const void*>(p.dpsum), static_cast<const void*>(p.dq_accum)}) {
    if (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
      return cudaErrorMisalignedAddress;
    }
  }

  const int s_q_pad = static_cast<int>(round_up(p.s_q, Traits::kBlockM));
  const int num_m_blocks = s_q_pad / Traits::kBlockM;
  const int num_n_blocks = (p.s_k + Traits::kBlockN - 1) / Traits::kBlockN;
  // Grid limits: main kernel (n blocks, h_k, b), postprocess (m blocks, h, b).
  if (p.h > 65535 || p.b > 65535) return cudaErrorInvalidValue;

  // 1. Zero the fp32 dQ accumulator (and the semaphores), then D and LSE*log2(e).
  JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
      p.dq_accum, 0, sizeof(float) * size_t(p.b) * p.h * num_m_blocks * Traits::kDqChunkFloats,
      stream));
  if (p.deterministic) {
    JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
        p.semaphores, 0, sizeof(int) * size_t(p.b) * p.h * num_m_blocks, stream));
  }
  {
    const int64_t rows = int64_t(p.b) * p.h * s_q_pad;
    const int lanes = preprocess_lanes_per_row(p.d);
    const int64_t rows_per_block = kPreprocessThreads / lanes;
    const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
    if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
    auto preprocess = lanes == 8    ? flash_bwd_preprocess_kernel<Element, 8>
                      : lanes == 16 ? flash_bwd_preprocess_kernel<Element, 16>
                                    : flash_bwd_preprocess_kernel<Element, 32>;
    preprocess<<<static_cast<unsigned>(blocks), kPreprocessThreads, 0, stream>>>(
        static_cast<const Element*>(p.out), static_cast<const Element*>(p.dout), p.lse,
        p.lse_log2, p.dpsum, p.b, p.s_q, p.h, p.d, s_q_pad);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  }

  // 2. Main kernel.
  KernelParams<Traits> kp{};
  const ShapeSDHB shape_q = make_shape(p.s_q, p.d, p.h, p.b);
  const StrideSDHB stride_q = make_stride(int64_t(p.h) * p.d, _1{}, int64_t(p.d),
                                          int64_t(p.s_q) * p.h * p.d);
  const ShapeSDHB shape_k = make_shape(p.s_k, p.d, p.h_k, p.b);
  const StrideSDHB stride_k = make_stride(int64_t(p.h_k) * p.d, _1{}, int64_t(p.d),
                                          int64_t(p.s_k) * p.h_k * p.d);
  auto tile_q = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{};
  auto tile_k = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{};
  kp.tma_q = make_tma_load_sdhb(static_cast<const Element*>(p.q), shape_q, stride_q,
                                typename Traits::SmemLayoutQ{}, tile_q);
  kp.tma_do = make_tma_load_sdhb(static_cast<const Element*>(p.dout), shape_q, stride_q,
                                 typename Traits::SmemLayoutQ{}, tile_q);
  kp.tma_k = make_tma_load_sdhb(static_cast<const Element*>(p.k), shape_k, stride_k,
                                typename Traits::SmemLayoutKV{}, tile_k);
  kp.tma_v = make_tma_load_sdhb(static_cast<const Element*>(p.v), shape_k, stride_k,
                                typename Traits::SmemLayoutKV{}, tile_k);
  kp.shape_q = shape_q;
  kp.shape_k = shape_k;
  kp.lse_log2 = p.lse_log2;
  kp.dpsum = p.dpsum;
  kp.dq_accum = p.dq_accum;
  kp.semaphores = p.semaphores;
  kp.dk = p.dk;
  kp.dv = p.dv;
  kp.b = p.b;
  kp.s_q = p.s_q;
  kp.s_k = p.s_k;
  kp.h = p.h;
  kp.h_k = p.h_k;
  kp.d = p.d;
  kp.s_q_pad = s_q_pad;
  kp.num_m_blocks = num_m_blocks;
  kp.softmax_scale = p.softmax_scale;
  kp.has_softcap = p.softcap > 0.f;
  constexpr float kLog2e = 1.4426950408889634f;
  kp.score_log2 = kp.has_softcap ? p.softcap * kLog2e : p.softmax_scale * kLog2e;
  kp.tanh_in_scale = kp.has_softcap ? p.softmax_scale / p.softcap : 0.f;
  kp.deterministic = p.deterministic;
  kp.geom = BlockGeometry{Traits::kBlockM, Traits::kBlockN, p.window_left, p.window_right,
                          whole_rows(p.s_q, p.s_k)};
  kp.key_ranges = p.key_ranges;
  kp.key_covers = p.key_covers;
  kp.num_granules = key_range_rows(p.s_q) / kKeyRangeGranule;

  const bool key_ranges = p.key_ranges != nullptr;
  auto kernel = key_ranges ? flash_bwd_kernel<Traits, false, true>
                           : flash_bwd_kernel<Traits, false, false>;
  if constexpr (Traits::kKeyMajor) {
    if (kp.has_softcap) {
      kernel = key_ranges ? flash_bwd_kernel<Traits, true, true>
                          : flash_bwd_kernel<Traits, true, false>;
    }
  }
  constexpr int smem = Traits::kSmemBytes;
  JAX_FA3_RETURN_IF_CUDA_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // Causal and right-windowed CTAs differ in length: launch the longest first where L2 allows
  // (tile_order.h). Otherwise grid y holds the kv heads (h_k <= h <= 65535, checked above).
  kp.order = TileOrder::for_problem(p.window_right, num_n_blocks, p.h, p.s_q, p.d);
  const TileOrder::Dims dims = kp.order.grid(num_n_blocks, p.h_k, p.b);
  const dim3 grid(dims.x, dims.y, dims.z);
  kernel<<<grid, Traits::kNumThreads, smem, stream>>>(kp);
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();

  // 3. dq = dq_accum * softmax_scale in the input dtype.
  flash_bwd_postprocess_kernel<Traits>
      <<<dim3(static_cast<unsigned>(num_m_blocks), static_cast<unsigned>(p.h),
              static_cast<unsigned>(p.b)),
         Traits::kNumMmaThreads, 0, stream>>>(p.dq_accum, static_cast<Element*>(p.dq), p.s_q, p.h,
                                               p.d, num_m_blocks, p.softmax_scale);
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace jax_fa3::flash_bwd

// Defines run_flash_bwd_hdim<D>_<dtype>, the entry point declared in params.h.
#define JAX_FA3_INSTANTIATE_FLASH_BWD(D, DT, ELEMENT)                                       \
  namespace jax_fa3::flash_bwd {                                                           \
  cudaError_t run_flash_bwd_hdim##D##_##DT(const FlashBwdParams& params, cudaStream_t stream) { \
    return run_flash_bwd<D, ELEMENT>(params, stream);                                      \
  }                                                                                        \
  }
