// Host side of one fp8 instantiation: the V transpose pre-pass, TMA descriptors, launch.
// Included only by cuda/instantiations/flash_fwd_hdim<D>_e4m3*.cu (and the timing tool).
#pragma once
#include "common/cute_config.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include <cute/tensor.hpp>

#include "common/cuda_check.h"
#include "flash_fwd/fp8/flash_fwd_fp8.h"
#include "flash_fwd/fp8/traits.h"
#include "flash_fwd/fp8/vt.h"
#include "flash_fwd/launch.h"
#include "flash_fwd/launch_common.h"

namespace jax_fa3::fwd {

// Vt (d, s_pad, h_k, b) as a (seq-like, d-like) gmem view: mode 0 = d (stride s_pad), mode 1 =
// keys (contiguous). Same stride type as make_gmem_tensor, so the TMA types match KernelParams.
template <class Element>
auto make_vt_gmem_tensor(Element* ptr, int d, int s_pad, int h_k, int b) {
  const int64_t head = int64_t(d) * s_pad;
  return make_tensor(make_gmem_ptr(ptr), GmemShape(d, s_pad, h_k, b),
                     GmemStride(int64_t(s_pad), _1{}, head, head * h_k));
}

template <class Traits>
cudaError_t launch_fp8(const FlashFwdFp8Params& p, cudaStream_t stream) {
  constexpr int kHeadDim = Traits::kHeadDim;
  using Params = KernelParams<Traits>;
  using Element = typename Traits::Element;
  using ElementOut = typename Traits::ElementOut;
  if (p.b == 0 || p.s_q == 0 || p.h == 0) return cudaSuccess;
  if (p.d > kHeadDim || p.d % 16 != 0 || p.block_size < 1 || p.h_k < 1 || p.h % p.h_k != 0) {
    return cudaErrorInvalidValue;
  }
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.o),
                          static_cast<const void*>(p.workspace)}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 && ptr != nullptr) {
      return cudaErrorMisalignedAddress;
    }
  }

  const bool no_keys = p.s_k == 0;
  const int s_pad = static_cast<int>(flash_fwd_fp8_key_pad(p.s_k));
  const int64_t vt_bytes = p.v_transposed ? 0 : int64_t(p.b) * p.h_k * p.d * s_pad;
  const auto* vt = p.v_transposed ? static_cast<const uint8_t*>(p.v)
                                  : static_cast<const uint8_t*>(p.workspace);
  auto* k_col = reinterpret_cast<float*>(static_cast<uint8_t*>(p.workspace) + vt_bytes);
  // The tail split's slots follow the k scales (flash_fwd_fp8_workspace_bytes).
  const bool masked = p.window_left >= 0 || p.window_right >= 0;
  // (Sized for the bucket that runs d in this build; the tools compile one kernel and say which.)
  const int64_t split_slots = fp8_head_dim_bucket(p.d) == kHeadDim
                                  ? fp8_tail_split_slots(p.b, p.s_q, p.s_k, p.h, p.d, masked)
                                  : 0;
  auto* split_partials = k_col + int64_t(p.b) * p.h_k * s_pad;
  int num_sms = 0;
  JAX_FA3_RETURN_IF_CUDA_ERROR(current_device_sm_count(&num_sms));
  // With s_k == 0 no K/V block is ever loaded (every row is empty: O = 0, LSE = +inf), so the K
  // and Vt descriptors over Q's memory with tiny extents are never dereferenced.
  const auto* q = static_cast<const Element*>(p.q);
  const auto* k = no_keys ? q : static_cast<const Element*>(p.k);
  const auto* vt_e = no_keys ? q : reinterpret_cast<const Element*>(vt);
  const int s_k_desc = no_keys ? 1 : p.s_k;
  const int h_k_desc = no_keys ? 1 : p.h_k;
  const int b_desc = no_keys ? 1 : p.b;
  const int s_pad_desc = no_keys ? 16 : s_pad;
  const int d_desc = no_keys ? 1 : p.d;

  FlashFwdParams common = p;
  common.softcap = 0.f;  // no softcap in fp8
  const FlashFwdScalars scalars = make_scalars(common);

  ExtraParams<true> extra;
  extra.q_scale = p.q_scale;
  extra.k_col_scale = k_col;
  extra.v_scale = p.v_scale;
  extra.v_mean = p.v_mean;
  extra.num_q_blocks = static_cast<int>((int64_t(p.s_q) + p.block_size - 1) / p.block_size);
  extra.block_size = p.block_size;
  extra.s_pad = s_pad;
  extra.k_scale_grouped = p.block_size % kFp8KeyScaleGroup == 0;
  extra.early_q_release = fp8_early_q_release(kHeadDim, Traits::kBlockM, p);
  extra.scale_log2 = scalars.scale_log2;  // softmax_scale * log2(e) (no softcap in fp8)
  extra.tail_partials = split_partials;
  extra.out = p.o;

  Params params = make_kernel_params<Traits>(
      extra, q, k, make_vt_gmem_tensor(vt_e, d_desc, s_pad_desc, h_k_desc, b_desc),
      static_cast<ElementOut*>(p.o), p.b, p.s_q, s_k_desc, p.h, h_k_desc, p.d, scalars);

  const int grid = std::min(num_sms, params.scheduler.num_tiles);
  int split = 0;
  if constexpr (Traits::kTailSplit) {
    static_assert(Traits::kBlockM == fp8_default_block_m(kHeadDim), "slot size of the split");
    const int num_kv_blocks = (p.s_k + Traits::kBlockN - 1) / Traits::kBlockN;
    // Two slots per split tile (one per piece).
    split = p.tail_split ? tail_split_tiles(params.scheduler.num_tiles, grid, num_kv_blocks,
                                            int(split_slots / 2))
                         : 0;
    params.scheduler.set_tail_split(split);
  }

  // The pre-kernel (V's transpose and the per-key k scales, or the k scales only) also clears
  // the split tiles' tickets; the main kernel follows it on the stream.
  using SlotLayout = TailSlotLayout<kHeadDim, Traits::kBlockM>;
  int* tail_tickets = split > 0 ? SlotLayout::tickets(split_partials, split) : nullptr;
  const int num_k_blocks = static_cast<int>((int64_t(p.s_k) + p.block_size - 1) / p.block_size);
  if (!no_keys && p.v_transposed) {
    const int64_t num_columns = int64_t(p.b) * p.h_k * s_pad;
    const int64_t column_grid = (num_columns + kKeyColumnThreads - 1) / kKeyColumnThreads;
    if (column_grid > INT32_MAX) return cudaErrorInvalidValue;
    fp8_key_column_scales_kernel<<<static_cast<unsigned>(column_grid), kKeyColumnThreads, 0,
                                   stream>>>(p.k_scale, k_col, p.s_k, s_pad, p.block_size,
                                             num_k_blocks, num_columns, tail_tickets, split);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  } else if (!no_keys) {
    const int num_key_tiles = (s_pad + kVtTileKeys - 1) / kVtTileKeys;
    const int num_dim_tiles = (p.d + kVtTileDims - 1) / kVtTileDims;
    const int num_tiles = num_key_tiles * num_dim_tiles * p.b * p.h_k;
    const int vt_grid = std::min(num_tiles, kVtCtasPerSm * num_sms);
    fp8_transpose_v_kernel<<<vt_grid, kVtThreads, 0, stream>>>(
        static_cast<const uint8_t*>(p.v), p.k_scale, static_cast<uint8_t*>(p.workspace), k_col,
        p.s_k, p.h_k, p.d, s_pad, p.block_size, num_k_blocks, num_key_tiles, num_dim_tiles,
        num_tiles, tail_tickets, split);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  }

  return launch_kernel(params, grid, stream);
}

}  // namespace jax_fa3::fwd

namespace jax_fa3 {
// Explicitly instantiated once per cuda/instantiations/flash_fwd_hdim<D>_e4m3*.cu.
template <int kHeadDim, int kBlockM>
cudaError_t run_flash_fwd_fp8(const FlashFwdFp8Params& params, cudaStream_t stream) {
  return fwd::launch_fp8<fwd::Fp8KernelTraits<kHeadDim, kBlockM>>(params, stream);
}
}  // namespace jax_fa3
