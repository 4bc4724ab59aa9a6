// Host side of one (head-dim bucket, dtype), 16-bit or fp8: zero the workspace (16-bit: in the
// preprocess), build the TMA descriptors, launch the main kernel, postprocess. Every CUDA call is
// checked.
#pragma once
#include "common/cute_config.h"  // first: before any CuTe header
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "common/cuda_check.h"
#include "flash_bwd/fp8_traits.cuh"
#include "flash_bwd/kernel.cuh"
#include "flash_bwd/params.h"
#include "flash_bwd/postprocess.cuh"
#include "flash_bwd/preprocess.cuh"

namespace jax_fa3::flash_bwd {

// What both launches (16-bit, fp8) share.

// No (query, key) pair (s_q = 0 or s_k = 0): every gradient is zero.
template <typename Traits>
cudaError_t zero_gradients(const FlashBwdParams& p, cudaStream_t stream) {
  using Grad = typename Traits::ElementGrad;
  const size_t q_bytes = size_t(p.b) * p.s_q * p.h * p.d * sizeof(Grad);
  const size_t k_bytes = size_t(p.b) * p.s_k * p.h_k * p.d * sizeof(Grad);
  if (q_bytes) JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dq, 0, q_bytes, stream));
  if (k_bytes) {
    JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dk, 0, k_bytes, stream));
    JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dv, 0, k_bytes, stream));
  }
  return cudaSuccess;
}

// TMA descriptors need 16-byte aligned bases, and the 1-D bulk copies of the row vectors 16-byte
// aligned sources (offsets inside them are multiples of 256 bytes). XLA's buffers are aligned;
// refuse rather than risk a transfer that never completes its mbarrier.
inline bool all_aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* ptr : ptrs) {
    if (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  }
  return true;
}

// Zeroes the deterministic mode's semaphores (one per (b, h, Q block)).
inline cudaError_t zero_semaphores(const FlashBwdParams& p, int num_m_blocks, cudaStream_t stream) {
  if (!p.deterministic) return cudaSuccess;
  return cudaMemsetAsync(p.semaphores, 0, sizeof(int) * size_t(p.b) * p.h * num_m_blocks, stream);
}

// Zeroes the fp32 dQ accumulator and the semaphores (the fp8 backward, which has no preprocess:
// the 16-bit one zeroes the accumulator in its preprocess).
template <typename Traits>
cudaError_t zero_dq_workspace(const FlashBwdParams& p, int num_m_blocks, cudaStream_t stream) {
  JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
      p.dq_accum, 0, sizeof(float) * size_t(p.b) * p.h * num_m_blocks * Traits::kDqChunkFloats,
      stream));
  return zero_semaphores(p, num_m_blocks, stream);
}

// The (seqlen, d, heads, batch) view of a contiguous (b, s, h, d) array.
inline ShapeSDHB shape_sdhb(int s, int d, int h, int b) { return cute::make_shape(s, d, h, b); }
inline StrideSDHB stride_sdhb(int s, int d, int h) {
  return cute::make_stride(int64_t(h) * d, cute::_1{}, int64_t(d), int64_t(s) * h * d);
}

// Every KernelParams field but the TMA descriptors.
template <typename Traits>
void set_kernel_scalars(KernelParams<Traits>& kp, const FlashBwdParams& p, int s_q_pad,
                        int num_m_blocks) {
  kp.shape_q = shape_sdhb(p.s_q, p.d, p.h, p.b);
  kp.shape_k = shape_sdhb(p.s_k, p.d, p.h_k, p.b);
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
}

// The TMA descriptors of both kernels: the Q of S^T (Q, or q8: Traits::ElementQs), dO, K (K, or
// the fp8 kernel's K~) and V, over the shapes set_kernel_scalars stored.
template <typename Traits>
void set_tma_q_do_k_v(KernelParams<Traits>& kp, const FlashBwdParams& p) {
  using namespace cute;
  using Element = typename Traits::Element;
  const StrideSDHB stride_q = stride_sdhb(p.s_q, p.d, p.h);
  const StrideSDHB stride_k = stride_sdhb(p.s_k, p.d, p.h_k);
  auto tile_q = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{};
  auto tile_k = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{};
  kp.tma_q = make_tma_load_sdhb(static_cast<const typename Traits::ElementQs*>(p.q), kp.shape_q,
                                stride_q, typename Traits::SmemLayoutQs{}, tile_q);
  kp.tma_do = make_tma_load_sdhb(static_cast<const Element*>(p.dout), kp.shape_q, stride_q,
                                 typename Traits::SmemLayoutQ{}, tile_q);
  kp.tma_k = make_tma_load_sdhb(static_cast<const Element*>(p.k), kp.shape_k, stride_k,
                                typename Traits::SmemLayoutKV{}, tile_k);
  kp.tma_v = make_tma_load_sdhb(static_cast<const Element*>(p.v), kp.shape_k, stride_k,
                                typename Traits::SmemLayoutKV{}, tile_k);
}

// The main kernel over (K blocks, h_k, b), then the postprocess over (Q blocks, h, b): dq =
// dq_accum * softmax_scale (fp8: * row_scale per row) in Traits::ElementGrad.
template <typename Traits, typename Kernel, typename Params>
cudaError_t launch_main_and_postprocess(Kernel kernel, const Params& kp, const FlashBwdParams& p,
                                        const float* row_scale, cudaStream_t stream) {
  constexpr int smem = Traits::kSmemBytes;
  JAX_FA3_RETURN_IF_CUDA_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int num_n_blocks = (p.s_k + Traits::kBlockN - 1) / Traits::kBlockN;
  // Causal and right-windowed CTAs differ in length: launch the longest first, in sections of kv
  // heads that fit L2 (tile_order.h). Otherwise grid y holds the kv heads (h_k <= h <= 65535,
  // checked by callers).
  Params params = kp;
  params.order = TileOrder::for_problem(p.window_right, num_n_blocks, p.h, p.h_k, p.b, p.s_q, p.d);
  if (Traits::kDqTransposed && params.order.longest_first()) return cudaErrorInvalidValue;
  const TileOrder::Dims dims = params.order.grid(num_n_blocks, p.h_k, p.b);
  const dim3 grid(dims.x, dims.y, dims.z);
  kernel<<<grid, Traits::kNumThreads, smem, stream>>>(params);
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();

  flash_bwd_postprocess_kernel<Traits>
      <<<dim3(static_cast<unsigned>(kp.num_m_blocks), static_cast<unsigned>(p.h),
              static_cast<unsigned>(p.b)),
         Traits::kNumMmaThreads, 0, stream>>>(
          p.dq_accum, static_cast<typename Traits::ElementGrad*>(p.dq), p.s_q, p.h, p.d,
          kp.num_m_blocks, p.softmax_scale, row_scale);
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  return cudaSuccess;
}

// The 16-bit backward with Q blocks of Traits::kBlockM rows.
template <typename Traits>
cudaError_t run_flash_bwd_traits(const FlashBwdParams& p, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  if (p.d > kHeadDim || p.d % 8 != 0 || p.h_k <= 0 || p.h % p.h_k != 0) return cudaErrorInvalidValue;
  if (p.b == 0 || p.h == 0 || p.d == 0) return cudaSuccess;
  if (p.s_q == 0 || p.s_k == 0) return zero_gradients<Traits>(p, stream);
  if (!all_aligned16({p.q, p.k, p.v, p.dout, p.lse_log2, p.dpsum, p.dq_accum})) {
    return cudaErrorMisalignedAddress;
  }

  const int s_q_pad = static_cast<int>(round_up(p.s_q, Traits::kBlockM));
  const int num_m_blocks = s_q_pad / Traits::kBlockM;
  // Grid limits: main kernel (n blocks, h_k, b), postprocess (m blocks, h, b).
  if (p.h > 65535 || p.b > 65535) return cudaErrorInvalidValue;

  // 1. D and LSE*log2(e), zeroing the fp32 dQ accumulator on the way (the semaphores by a memset).
  JAX_FA3_RETURN_IF_CUDA_ERROR(zero_semaphores(p, num_m_blocks, stream));
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
        p.lse_log2, p.dpsum, p.dq_accum, kHeadDim, p.b, p.s_q, p.h, p.d, s_q_pad);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  }

  // 2. Main kernel, 3. postprocess.
  KernelParams<Traits> kp{};
  set_kernel_scalars(kp, p, s_q_pad, num_m_blocks);
  set_tma_q_do_k_v(kp, p);

  const bool key_ranges = p.key_ranges != nullptr;
  if constexpr (Traits::kDqTransposed) {  // whole rows, no softcap only (wide_q_blocks)
    if (key_ranges || kp.has_softcap) return cudaErrorInvalidValue;
    return launch_main_and_postprocess<Traits>(flash_bwd_kernel<Traits, false, false>, kp, p,
                                               nullptr, stream);
  } else {
    auto kernel = key_ranges ? flash_bwd_kernel<Traits, false, true>
                             : flash_bwd_kernel<Traits, false, false>;
    if constexpr (Traits::kKeyMajor) {
      if (kp.has_softcap) {
        kernel = key_ranges ? flash_bwd_kernel<Traits, true, true>
                            : flash_bwd_kernel<Traits, true, false>;
      }
    }
    return launch_main_and_postprocess<Traits>(kernel, kp, p, nullptr, stream);
  }
}

// The entry point of bucket kHeadDim: the bucket's kernel, or at d = 128 the one with 80-row Q
// blocks where block_m_for_call takes it (its own translation unit).
template <int kHeadDim, typename Element>
cudaError_t run_flash_bwd(const FlashBwdParams& p, cudaStream_t stream) {
  if constexpr (kHeadDim == 128) {
    if (block_m_for_call(p) == kWideBlockM) {
      if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
        return run_flash_bwd_hdim128_rows80_bf16(p, stream);
      } else {
        return run_flash_bwd_hdim128_rows80_fp16(p, stream);
      }
    }
  }
  return run_flash_bwd_traits<BwdTraits<kHeadDim, Element>>(p, stream);
}

// The fp8 backward (fp8_traits.cuh): no preprocess (the caller computed D and LSE'), TMA
// descriptors for the e4m3 operands too, the postprocess scaling dq per row.
template <int kHeadDim, typename Element>
cudaError_t run_flash_bwd_fp8(const FlashBwdFp8Params& p, cudaStream_t stream) {
  using namespace cute;
  using Traits = BwdTraitsFp8<kHeadDim, Element>;
  using ElementFp8 = typename Traits::ElementFp8;
  if (p.d > kHeadDim || p.d % 16 != 0 || p.h_k <= 0 || p.h % p.h_k != 0 || p.softcap != 0.f ||
      p.key_ranges != nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.b == 0 || p.h == 0 || p.d == 0) return cudaSuccess;
  if (p.s_q == 0 || p.s_k == 0) return zero_gradients<Traits>(p, stream);
  if (!all_aligned16({p.q, p.q_t, p.k8, p.k, p.v, p.dout, p.dout_t, p.lse_log2, p.dpsum,
                      p.q_scale, p.dk_coef, p.dq_accum}) ||
      p.dq_scale == nullptr || p.k_scale == nullptr || p.dv_scale == nullptr) {
    return cudaErrorMisalignedAddress;
  }

  const int s_q_pad = static_cast<int>(round_up(p.s_q, Traits::kBlockM));
  const int num_m_blocks = s_q_pad / Traits::kBlockM;
  const int s_t = static_cast<int>(round_up(p.s_q, 32));  // keys of q8^T, dO8^T
  if (p.h > 65535 || p.b > 65535) return cudaErrorInvalidValue;
  JAX_FA3_RETURN_IF_CUDA_ERROR(zero_dq_workspace<Traits>(p, num_m_blocks, stream));

  Fp8KernelParams<Traits> kp{};
  set_kernel_scalars(kp, p, s_q_pad, num_m_blocks);
  set_tma_q_do_k_v(kp, p);
  // (b, h, d, s_t) seen as (d, s_t, h, b): s_t contiguous.
  kp.shape_t = make_shape(p.d, s_t, p.h, p.b);
  const StrideSDHB stride_t =
      make_stride(int64_t(s_t), _1{}, int64_t(p.d) * s_t, int64_t(p.h) * p.d * s_t);
  auto tile_k = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{};
  auto tile_t = Shape<Int<kHeadDim>, Int<Traits::kBlockM>>{};
  kp.tma_k8 = make_tma_load_sdhb(static_cast<const ElementFp8*>(p.k8), kp.shape_k,
                                 stride_sdhb(p.s_k, p.d, p.h_k), typename Traits::SmemLayoutK8{},
                                 tile_k);
  kp.tma_qt = make_tma_load_sdhb(static_cast<const ElementFp8*>(p.q_t), kp.shape_t, stride_t,
                                 typename Traits::SmemLayoutT8{}, tile_t);
  kp.tma_dot = make_tma_load_sdhb(static_cast<const ElementFp8*>(p.dout_t), kp.shape_t,
                                  stride_t, typename Traits::SmemLayoutT8{}, tile_t);
  kp.q_scale = p.q_scale;
  kp.dk_coef = p.dk_coef;
  kp.k_scale = p.k_scale;
  kp.dv_scale = p.dv_scale;
  return launch_main_and_postprocess<Traits>(flash_bwd_kernel<Traits, false, false>, kp, p,
                                             p.dq_scale, stream);
}

}  // namespace jax_fa3::flash_bwd

// Defines run_flash_bwd_hdim<D>_<dtype>, the entry point declared in params.h.
#define JAX_FA3_INSTANTIATE_FLASH_BWD(D, DT, ELEMENT)                                       \
  namespace jax_fa3::flash_bwd {                                                           \
  cudaError_t run_flash_bwd_hdim##D##_##DT(const FlashBwdParams& params, cudaStream_t stream) { \
    return run_flash_bwd<D, ELEMENT>(params, stream);                                      \
  }                                                                                        \
  }

// Defines run_flash_bwd_hdim128_rows80_<dtype> (params.h).
#define JAX_FA3_INSTANTIATE_FLASH_BWD_ROWS80(DT, ELEMENT)                                  \
  namespace jax_fa3::flash_bwd {                                                          \
  cudaError_t run_flash_bwd_hdim128_rows80_##DT(const FlashBwdParams& params,             \
                                                cudaStream_t stream) {                    \
    return run_flash_bwd_traits<BwdTraits<128, ELEMENT, kWideBlockM>>(params, stream);    \
  }                                                                                       \
  }

// Defines run_flash_bwd_fp8_hdim<D>_<dtype>, the entry point declared in params.h.
#define JAX_FA3_INSTANTIATE_FLASH_BWD_FP8(D, DT, ELEMENT)                                  \
  namespace jax_fa3::flash_bwd {                                                          \
  cudaError_t run_flash_bwd_fp8_hdim##D##_##DT(const FlashBwdFp8Params& params,           \
                                               cudaStream_t stream) {                     \
    return run_flash_bwd_fp8<D, ELEMENT>(params, stream);                                 \
  }                                                                                       \
  }
