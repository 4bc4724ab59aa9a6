// Host side of one instantiation: TMA descriptors, scalars, grid, shared-memory attribute, launch.
// Included only by cuda/instantiations/flash_fwd_hdim<D>_<dtype>.cu.
#pragma once
#include "common/cute_config.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include <cute/tensor.hpp>

#include "common/cuda_check.h"
#include "common/key_ranges.h"
#include "common/window.h"
#include "flash_fwd/flash_fwd.h"
#include "flash_fwd/fp8_cache.h"
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
  // Row bounds carry their own diagonals, whose windows clamp as the Python rule clamps them;
  // whole rows' diagonal is s_k - s_q (common/window.h).
  const bool bounds = p.row_bounds != nullptr || p.row_lengths != nullptr;
  s.window_left = bounds ? bounded_window(p.window_left, p.s_q, p.s_k)
                         : clamp_window_past_reach(p.window_left, p.s_q, p.s_k);
  s.window_right = bounds ? bounded_window(p.window_right, p.s_q, p.s_k)
                          : clamp_window_past_reach(p.window_right, p.s_q, p.s_k);
  s.lse = p.lse;
  s.key_ranges = p.key_ranges;
  s.key_covers = p.key_covers;
  s.row_bounds = p.row_lengths != nullptr ? p.row_lengths : p.row_bounds;
  s.bounds_are_lengths = p.row_lengths != nullptr;
  s.kv_pages = nullptr;  // set by launch_traits for a paged cache
  s.pages_per_seq = s.blocks_per_page = s.num_pages = 0;
  s.num_splits = 1;  // set by launch_traits for split-KV
  s.split_keys = 0;
  return s;
}

// Keys per split-KV piece (params.h): ceil(key blocks / num_splits) whole blocks of key_block.
inline int split_piece_keys(int s_k, int num_splits, int key_block) {
  const int64_t blocks = (int64_t(s_k) + key_block - 1) / key_block;
  return static_cast<int>((blocks + num_splits - 1) / num_splits * key_block);
}

// make_scalars plus the split-KV pieces (num_splits > 1) and a paged cache's pages, for a kernel
// of `key_block`-key blocks.
inline FlashFwdScalars make_piece_scalars(const FlashFwdParams& p, bool paged, int key_block) {
  FlashFwdScalars scalars = make_scalars(p);
  if (p.num_splits > 1) {
    scalars.num_splits = p.num_splits;
    scalars.split_keys = split_piece_keys(p.s_k, p.num_splits, key_block);
  }
  if (paged) {
    scalars.kv_pages = p.kv_pages;
    scalars.pages_per_seq = p.pages_per_seq;
    scalars.blocks_per_page = p.page_size / key_block;
    scalars.num_pages = p.num_pages;
  }
  return scalars;
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

  // Split-KV and heads-major q / o are for the key-range kernels (the handlers make sure).
  if ((p.num_splits != 1 || p.qo_heads_major) && !Traits::kKeyRanges) return cudaErrorInvalidValue;
  if (p.num_splits < 1) return cudaErrorInvalidValue;
  const FlashFwdScalars scalars = make_piece_scalars(p, paged, Traits::kBlockN);
  const Params params = make_kernel_params<Traits>(
      {}, q, k, make_gmem_tensor(v, s_k_desc, p.d, h_k_desc, b_k_desc), static_cast<Element*>(p.o),
      p.b, p.s_q, s_k_desc, p.h, h_k_desc, p.d, scalars, b_k_desc, p.qo_heads_major);
  int num_sms = 0;
  JAX_FA3_RETURN_IF_CUDA_ERROR(current_device_sm_count(&num_sms));
  return launch_kernel(params, std::min(num_sms, params.scheduler.num_tiles), stream);
}

// A decode step over an e4m3 KV cache (fp8_cache.h): the decode tile with the converter
// warpgroup. The 16-bit K/V descriptors of the parameter block are never used (the producer
// loads the e4m3 blocks through tma_k8 / tma_v8): they describe one row of q.
template <class Traits>
cudaError_t launch_fp8_cache(const FlashFwdParams& p, cudaStream_t stream) {
  using Element = typename Traits::Element;
  using ElementCache = typename Traits::ElementCache;
  if (p.b == 0 || p.s_q == 0 || p.h == 0) return cudaSuccess;
  if (p.d > Traits::kHeadDim || p.d % 16 != 0 || !p.qo_heads_major || p.row_lengths == nullptr ||
      p.num_splits < 1 || p.scale_block < 1 || p.scale_blocks < 1 || p.s_k == 0 ||
      p.k_scales == nullptr || p.v_scales == nullptr) {
    return cudaErrorInvalidValue;  // the handler checked each
  }
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.o)}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return cudaErrorMisalignedAddress;
  }
  const bool paged = p.kv_pages != nullptr;
  if (paged && p.page_size % Traits::kBlockN != 0) return cudaErrorInvalidValue;
  const int s_k_desc = paged ? p.num_pages * p.page_size : p.s_k;
  const int b_k_desc = paged ? 1 : p.b;

  const FlashFwdScalars scalars = make_piece_scalars(p, paged, Traits::kBlockN);
  auto slot_tma = [&](const void* cache) {
    return make_tma_copy(SM90_TMA_LOAD{},
                         make_gmem_tensor(static_cast<const ElementCache*>(cache), s_k_desc, p.d,
                                          p.h_k, b_k_desc),
                         take<0, 2>(typename Traits::SmemLayoutSlot{}),
                         Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{});
  };
  const int64_t num_scales = int64_t(paged ? p.num_pages : p.b) * p.h_k * p.scale_blocks;
  if (num_scales > INT32_MAX) return cudaErrorInvalidValue;  // indexed in int32 (producer.h)
  const Fp8CacheParams<Traits> cache{slot_tma(p.k), slot_tma(p.v), p.k_scales, p.v_scales,
                                     p.scale_block, p.scale_blocks, int(num_scales)};
  const auto* q = static_cast<const Element*>(p.q);
  const KernelParams<Traits> params = make_kernel_params<Traits>(
      {}, q, q, make_gmem_tensor(q, 1, p.d, 1, 1), static_cast<Element*>(p.o), p.b, p.s_q, 1,
      p.h, 1, p.d, scalars, 1, /*qo_heads_major=*/true, cache);
  int num_sms = 0;
  JAX_FA3_RETURN_IF_CUDA_ERROR(current_device_sm_count(&num_sms));
  return launch_kernel(params, std::min(num_sms, params.scheduler.num_tiles), stream);
}

// d64 tiles (H100, 2026-12-05, kernel through the public API, 16k tokens, TFLOP/s, every
// candidate in one run; benchmarks/RESULTS.md):
// * 192 x 128 (three consumer warpgroups, intra-warpgroup overlap) from 2049 keys on, causal or
//   not: against the 128 x 160 / 128 x 128 tiles, non-causal 4k 440 -> 480, 16k 477 -> 531;
//   causal 4k 344 -> 377, 16k 443 -> 490. Without the overlap, or with 160- or 192-key blocks,
//   192 rows lost 3-14%.
// * Short causal / windowed problems (at most 2048 keys) keep 128 x 128: 192-row tiles overshoot
//   the diagonal further (1k causal 256 with 128 rows, 239 with 192). 2k was not measured.
// * Short problems without a mask (at most 1024 keys) keep 128 x 160, or 128 x 128 where the
//   160-key blocks' last block wastes more than 5% of s_k beyond what 128-key blocks waste
//   (1024 keys take 1120 with 160): 1k 402 against 401 with 192 rows.
constexpr int kShortMaskedKeys = 2048;
constexpr int kShortUnmaskedKeys = 1024;
inline bool masked(const FlashFwdParams& p) { return p.window_left >= 0 || p.window_right >= 0; }

// Keys computed past s_k by the last block of a row when blocks are `block` keys wide.
constexpr int64_t tail_keys(int64_t s_k, int block) { return (s_k + block - 1) / block * block - s_k; }

constexpr double kTailWasteShare = 0.05;
inline bool wasteful_tail(const FlashFwdParams& p, int wide_block) {
  return double(tail_keys(p.s_k, wide_block) - tail_keys(p.s_k, 128)) > kTailWasteShare * p.s_k;
}

// The decode tile (kernel_traits.h, DecodeKernelTraits: 64 rows, one consumer warpgroup, 3-4
// K/V stages) for a decode step whose kv head has at most 64 query heads and whose split-KV
// pieces are short. H100, d128 GQA 32:4 bf16, kernel per step against the 128-row tile, both
// alternated in one run (2026-12-06, benchmarks/RESULTS.md): b1 32k (pieces of 1024 keys)
// 28.3 -> 27.5 us; b1 128k (4096 keys) level; b8 32k (8192 keys) and b8 128k (32768 keys)
// 1.3% and 1.9% slower. Short pieces gain from the deeper pipeline's start; long ones run at the
// copy rate either way and lose the two warpgroups' ping-pong.
constexpr int kDecodeTileMaxPieceKeys = 2048;
inline bool decode_tile_applies(const FlashFwdParams& p, int key_block) {
  if (!p.qo_heads_major || p.s_q > 64 || p.num_splits < 1) return false;
  return split_piece_keys(p.s_k, p.num_splits, key_block) <= kDecodeTileMaxPieceKeys;
}

template <int kHeadDim, DType kDType>
cudaError_t launch(const FlashFwdParams& p, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  if (p.k_scales != nullptr) {
    if constexpr (kHeadDim <= 128) {
      return launch_fp8_cache<Fp8CacheTraits<kHeadDim, Element>>(p, stream);
    } else {
      return cudaErrorInvalidValue;  // the handler refuses d > 128
    }
  }
  if (p.key_ranges != nullptr || p.row_bounds != nullptr || p.row_lengths != nullptr) {
    if (decode_tile_applies(p, BlockN<kHeadDim>::value)) {
      return launch_traits<DecodeKernelTraits<kHeadDim, Element>>(p, stream);
    }
    return launch_traits<KernelTraits<kHeadDim, Element, true>>(p, stream);
  }
  if constexpr (kHeadDim == 64) {
    const bool short_masked = masked(p) && p.s_k <= kShortMaskedKeys;
    const bool short_unmasked = !masked(p) && p.s_k <= kShortUnmaskedKeys;
    if (short_masked || (short_unmasked && wasteful_tail(p, BlockN<64>::value))) {
      return launch_traits<KernelTraits<64, Element, false, 128>>(p, stream);
    }
    if (!short_unmasked) {
      return launch_traits<KernelTraits<64, Element, false, 128, 192>>(p, stream);
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
