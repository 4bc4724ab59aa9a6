// Host side of one instantiation: TMA descriptors, scalars, grid, shared-memory attribute, launch.
// Included only by cuda/instantiations/flash_fwd_hdim<D>_<dtype>.cu.
#pragma once
#include "flash_fwd/cute_config.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include <cute/tensor.hpp>

#include "common/cuda_check.h"
#include "common/window.h"
#include "flash_fwd/flash_fwd.h"
#include "flash_fwd/kernel_traits.h"
#include "flash_fwd/launch_common.h"

namespace jax_fa3::fwd {

template <DType kDType> struct ElementOf;
template <> struct ElementOf<DType::kBFloat16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<DType::kFloat16> { using type = cutlass::half_t; };

inline FlashFwdScalars make_scalars(const FlashFwdParams& p) {
  constexpr float kLog2e = 1.4426950408889634f;
  FlashFwdScalars s;
  s.b = p.b;
  s.s_q = p.s_q;
  s.s_k = p.s_k;
  s.h = p.h;
  s.h_k = p.h_k;
  s.d = p.d;
  s.softcap = p.softcap > 0.f ? p.softcap : 0.f;
  s.softcap_pre = p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f;
  // With softcap the scale is applied inside tanh; the capped score is in natural units.
  s.scale_log2 = p.softcap > 0.f ? kLog2e : p.softmax_scale * kLog2e;
  s.window_left = clamp_window_past_reach(p.window_left, p.s_q, p.s_k);
  s.window_right = clamp_window_past_reach(p.window_right, p.s_q, p.s_k);
  s.lse = p.lse;
  s.key_ranges = p.key_ranges;
  s.key_covers = p.key_covers;
  s.kv_pages = nullptr;  // set by launch_traits for a paged cache
  s.pages_per_seq = s.blocks_per_page = s.num_pages = 0;
  return s;
}

template <class Traits>
cudaError_t launch_traits(const FlashFwdParams& p, cudaStream_t stream) {
  using Element = typename Traits::Element;
  using Params = KernelParams<Traits>;
  if (p.b == 0 || p.s_q == 0 || p.h == 0) return cudaSuccess;
  if (p.d > Traits::kHeadDim || p.d % 8 != 0) return cudaErrorInvalidValue;
  // TMA descriptors need 16-byte aligned base addresses (CuTe asserts otherwise); XLA's buffers are.
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.o)}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 && !(ptr == p.k && p.s_k == 0) &&
        !(ptr == p.v && p.s_k == 0)) {
      return cudaErrorMisalignedAddress;
    }
  }

  // TMA needs non-empty extents; with s_k == 0 no K/V block is ever loaded (every row is empty:
  // O = 0, LSE = +inf), so K/V descriptors over Q's memory with one row are never dereferenced.
  const bool no_keys = p.s_k == 0;
  const auto* q = static_cast<const Element*>(p.q);
  const auto* k = no_keys ? q : static_cast<const Element*>(p.k);
  const auto* v = no_keys ? q : static_cast<const Element*>(p.v);
  // A paged cache's descriptors span its pools: one batch of num_pages * page_size rows.
  const bool paged = p.kv_pages != nullptr && !no_keys;
  if (paged && (!Traits::kKeyRanges || p.page_size % Traits::kBlockN != 0)) {
    return cudaErrorInvalidValue;  // the handler checked both
  }
  const int s_k_desc = no_keys ? 1 : (paged ? p.num_pages * p.page_size : p.s_k);
  const int h_k_desc = no_keys ? 1 : p.h_k;
  const int b_k_desc = paged ? 1 : p.b;

  FlashFwdScalars scalars = make_scalars(p);
  if (paged) {
    scalars.kv_pages = p.kv_pages;
    scalars.pages_per_seq = p.pages_per_seq;
    scalars.blocks_per_page = p.page_size / Traits::kBlockN;
    scalars.num_pages = p.num_pages;
  }
  const Params params = make_kernel_params<Traits>(
      {}, q, k, make_gmem_tensor(v, s_k_desc, p.d, h_k_desc, b_k_desc), static_cast<Element*>(p.o),
      p.b, p.s_q, s_k_desc, p.h, h_k_desc, p.d, scalars, b_k_desc);
  int num_sms = 0;
  JAX_FA3_RETURN_IF_CUDA_ERROR(current_device_sm_count(&num_sms));
  return launch_kernel(params, std::min(num_sms, params.scheduler.num_tiles), stream);
}

// d64 causal / windowed problems of at most kShortMaskedKeys keys run 128 x 128 tiles: with 160-key
// blocks a Q tile's last block overshoots the diagonal by 80 keys on average, 20% of the work at
// 1k causal (11% with 128). Measured faster with 128-key blocks up to 8k too (H100, 2026-12-05:
// +3.0% at 4k, +2.3% at 8k); 16k keeps the 160-key blocks (not measured with 128).
constexpr int kShortMaskedKeys = 8192;
inline bool short_masked(const FlashFwdParams& p) {
  return (p.window_left >= 0 || p.window_right >= 0) && p.s_k <= kShortMaskedKeys;
}

// Keys computed past s_k by the last block of a row when blocks are `block` keys wide.
constexpr int64_t tail_keys(int64_t s_k, int block) { return (s_k + block - 1) / block * block - s_k; }

// Without a mask, d64's 160-key blocks also lose where their last block is mostly past s_k:
// 1024 keys take 1120 (9% of the work wasted), 512 take 640, where 128-key blocks waste none.
// Past kTailWasteShare of the keys more waste than 128-key blocks would have, they take over.
constexpr double kTailWasteShare = 0.05;
inline bool wasteful_tail(const FlashFwdParams& p, int wide_block) {
  return double(tail_keys(p.s_k, wide_block) - tail_keys(p.s_k, 128)) > kTailWasteShare * p.s_k;
}

template <int kHeadDim, DType kDType>
cudaError_t launch(const FlashFwdParams& p, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  if (p.key_ranges != nullptr) {
    return launch_traits<KernelTraits<kHeadDim, Element, true>>(p, stream);
  }
  if constexpr (kHeadDim == 64) {
    if (short_masked(p) || wasteful_tail(p, BlockN<64>::value)) {
      return launch_traits<KernelTraits<64, Element, false, 128>>(p, stream);
    }
  }
  return launch_traits<KernelTraits<kHeadDim, Element, false>>(p, stream);
}

}  // namespace jax_fa3::fwd

namespace jax_fa3 {
// Defined here, explicitly instantiated once per cuda/instantiations/flash_fwd_hdim<D>_<dtype>.cu.
template <int kHeadDim, DType kDType>
cudaError_t run_flash_fwd(const FlashFwdParams& params, cudaStream_t stream) {
  return fwd::launch<kHeadDim, kDType>(params, stream);
}
}  // namespace jax_fa3
