// The kernel's parameter block: TMA descriptors (built on the host in launch.h, passed by value as
// a __grid_constant__ so the descriptors live in parameter space as TMA requires), the scalars and
// the tile scheduler.
#pragma once
#include "common/cute_config.h"
#include <type_traits>
#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>

#include "flash_fwd/params.h"
#include "flash_fwd/tile_scheduler.h"

namespace jax_fa3::fwd {

using namespace cute;

// Global tensors are seen as (seq, d, head, batch): d contiguous, so a (kBlock, kHeadDim) box at
// (block, 0, head, batch) is one tile. The real d (<= bucket) is the tensor's extent, so the
// bucket-wide box reads zeros past it and the store clips at it; likewise for seq tails.
using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;

template <class Element>
auto make_gmem_tensor(Element* ptr, int seq, int d, int heads, int batch) {
  const int64_t row = int64_t(heads) * d;
  return make_tensor(make_gmem_ptr(ptr), GmemShape(seq, d, heads, batch),
                     GmemStride(row, _1{}, int64_t(d), row * seq));
}

// The same view of an array laid out (batch, heads, seq, d) (FlashFwdParams::qo_heads_major).
template <class Element>
auto make_heads_major_gmem_tensor(Element* ptr, int seq, int d, int heads, int batch) {
  const int64_t head = int64_t(seq) * d;
  return make_tensor(make_gmem_ptr(ptr), GmemShape(seq, d, heads, batch),
                     GmemStride(int64_t(d), _1{}, head, head * heads));
}

// Extra parameters of the fp8 kernel (scales, transposed V), an empty base otherwise (so the
// bf16/fp16 parameter block keeps its layout: empty-base optimization).
template <bool kFp8> struct ExtraParams {};
template <> struct ExtraParams<true> {
  const float* q_scale;      // (b, h, num_q_blocks): the per-row-block q descale
  const float* k_col_scale;  // (b, h_k, s_pad): k scales per 32-key group or per key (fp8/vt.h)
  const float* v_scale;      // (b, h_k)
  const float* v_mean;       // (b, h_k, d): added back to O's non-empty rows (fp8/v_mean.h)
  int num_q_blocks;          // ceil(s_q / block_size)
  int block_size;            // tokens per q/k scale
  int s_pad;                 // keys of Vt / k_col_scale rows (s_k rounded up to 32)
  int k_scale_grouped;       // block_size % 32 == 0: one k scale per 32-key group (fp8/softmax.h)
  int early_q_release;       // Q's buffer released after a tile's last S GEMM (fp8/flash_fwd_fp8.h)
  float scale_log2;          // softmax_scale * log2(e)
  float* tail_partials;      // split tiles' pieces (fp8/tail_split.h; scheduler.num_split_tiles)
  // O (b, s_q, h, d) bf16: the tail merge writes split tiles directly. With v_mean the struct is
  // 72 bytes and the TMA descriptors after it start at the next 64-byte boundary; a field that
  // pushed them past it made ptxas spill 8 bytes in the 128-row d128 kernel, whose spills are
  // pinned in tests/test_sass.py.
  void* out;
};

// V's tile: (kBlockN keys, d) for bf16/fp16; the fp8 kernel loads V^T tiles (d, kBlockN keys)
// from the transposed copy, keys contiguous (K-major for the PV GEMM).
template <class Traits>
using TileVOf = std::conditional_t<Traits::kFp8, Shape<Int<Traits::kHeadDim>, Int<Traits::kBlockN>>,
                                   Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>>;

// Extra parameters of the decode kernel over an e4m3 KV cache (fp8_cache.h), an empty base
// otherwise: the TMA descriptors of the e4m3 K and V (or their pools) and their scales, one per
// `scale_block` slots of a page (paged) or batch row, per kv head: (pages or b, h_k,
// scale_blocks).
template <class Traits, bool = Traits::kFp8Cache> struct Fp8CacheParams {};
template <class Traits> struct Fp8CacheParams<Traits, true> {
  using ElementCache = typename Traits::ElementCache;
  using TmaSlot = decltype(make_tma_copy(
      SM90_TMA_LOAD{},
      std::declval<decltype(make_gmem_tensor(static_cast<ElementCache const*>(nullptr), 1, 1, 1, 1))>(),
      take<0, 2>(typename Traits::SmemLayoutSlot{}),
      Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{}));
  TmaSlot tma_k8;
  TmaSlot tma_v8;
  const float* k_scales;  // flat (pages or batch rows, kv heads, scale_blocks)
  const float* v_scales;
  int scale_block;   // slots per scale
  int scale_blocks;  // scales per (page or batch row, kv head): ceil(page or row length / scale_block)
  int num_scales;    // of each of k and v: (pages or batch rows) * kv heads * scale_blocks
};

template <class Traits>
struct KernelParams : ExtraParams<Traits::kFp8>, Fp8CacheParams<Traits> {
  // Whether Q's buffer is released after each tile's last S GEMM (the next tile's Q then loads
  // under this tile's tail) instead of after the TMA store of O: fixed per traits for 16-bit
  // (Traits::kEarlyQRelease: O has its own buffer), chosen per call for fp8, whose O always has
  // its own buffer (fp8/flash_fwd_fp8.h, fp8_early_q_release).
  __device__ __forceinline__ bool early_q_release() const {
    if constexpr (Traits::kFp8) {
      return Traits::kEarlyQReleasePerCall && this->ExtraParams<true>::early_q_release != 0;
    } else {
      return Traits::kEarlyQRelease;
    }
  }

  using Element = typename Traits::Element;
  using ElementOut = typename Traits::ElementOut;
  using TileQ = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
  using TileKV = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;
  using TileV = TileVOf<Traits>;
  using GmemIn = decltype(make_gmem_tensor(static_cast<Element const*>(nullptr), 1, 1, 1, 1));
  using GmemOut = decltype(make_gmem_tensor(static_cast<ElementOut*>(nullptr), 1, 1, 1, 1));

  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GmemIn>(),
                                      typename Traits::SmemLayoutQ{}, TileQ{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GmemIn>(),
                                       take<0, 2>(typename Traits::SmemLayoutK{}), TileKV{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GmemIn>(),
                                      take<0, 2>(typename Traits::SmemLayoutV{}), TileV{}, _1{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, std::declval<GmemOut>(),
                                      typename Traits::SmemLayoutO{}, TileQ{}, _1{}));

  TmaQ tma_q;
  TmaKV tma_k;
  TmaV tma_v;
  TmaO tma_o;
  FlashFwdScalars s;
  TileScheduler scheduler;
};

}  // namespace jax_fa3::fwd
