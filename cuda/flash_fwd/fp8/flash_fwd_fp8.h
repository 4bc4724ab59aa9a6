// Host entry point of the fp8 (e4m3) forward kernel. Plain C++ (no CuTe): the FFI handler
// includes it. Numerics: jax_fa3/_fp8_emulation.py (module docstring); design: cuda/flash_fwd/README.md.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flash_fwd/params.h"

namespace jax_fa3 {

// The 16-bit call's fields (params.h: q, k, v, o, lse, the sizes, softmax_scale and the window;
// dtype and softcap are not read) and the fp8 call's own.
struct FlashFwdFp8Params : FlashFwdParams {
  // q8 (b, s_q, h, d), k8 (b, s_k, h_k, d) e4m3, contiguous; v8 (b, s_k, h_k, d) e4m3, or with
  // v_transposed already in the kernel's layout Vt (b, h_k, d, s_pad) (fp8/vt.h: keys permuted
  // per 32, zero past s_k; the rotate + quantize pass writes it); o (b, s_q, h, d) bf16;
  // lse (b, h, s_q) f32; q_scale (b, h, ceil(s_q / block_size)), k_scale (b, h_k,
  // ceil(s_k / block_size)), v_scale (b, h_k) f32; v_mean (b, h_k, d) f32: what V was centred by
  // before its quantization (added back to every row that sees a key: fp8/v_mean.h).
  const float* q_scale;
  const float* k_scale;
  const float* v_scale;
  const float* v_mean;
  void* workspace;  // flash_fwd_fp8_workspace_bytes(...) bytes, 16-byte aligned
  bool v_transposed;
  int block_size;
  // Split the last round's tiles over two CTAs each where the workspace has room
  // (fp8/tail_split.h). Off only to time the kernel without it (tools/fwd_timeline.cu).
  bool tail_split = true;
};

// Keys of the transposed V copy: s_k rounded up to whole 32-key permutation groups. Also called
// on the device by its other writer, the rotate + quantize pass's keys-transposed mode.
#ifdef __CUDACC__
__host__ __device__
#endif
inline int64_t flash_fwd_fp8_key_pad(int64_t s_k) { return (s_k + 31) / 32 * 32; }

// Head-dim buckets with an fp8 kernel (a head dim runs in the smallest compiled one >= d).
constexpr int kFp8HeadDimBuckets[] = {64, 128, 256};

inline bool fp8_kernel_compiled(int bucket) {
  switch (bucket) {
#ifdef JAX_FA3_HAS_HDIM64
    case 64: return true;
#endif
#ifdef JAX_FA3_HAS_HDIM128
    case 128: return true;
#endif
#ifdef JAX_FA3_HAS_HDIM256
    case 256: return true;
#endif
    default: return false;
  }
}

// The compiled fp8 bucket that runs head dim d, or 0 if none.
inline int fp8_head_dim_bucket(int d) {
  if (d <= 0 || d % 16 != 0) return 0;
  for (int bucket : kFp8HeadDimBuckets) {
    if (d <= bucket && fp8_kernel_compiled(bucket)) return bucket;
  }
  return 0;
}

// Rows per tile (kBlockM) of each bucket's fp8 kernels (fp8/traits.h says why): 192 = three
// consumer warpgroups with the PV GEMM pipelined under the exp2 pass, 128 = two. d128 has both
// and picks per call (fp8_block_m).
constexpr int fp8_default_block_m(int bucket) { return bucket == 256 ? 128 : 192; }

// d128 causal: 192-row tiles only from this many query rows. Kernel alone, causal, 192 vs 128
// rows (H200, 2026-12-01, benchmarks/RESULTS.md): 2k 437-448 vs 466-475, 4k
// 595 vs 620, 8k 717-735 vs 696-709, 16k 807 vs 781. In short causal calls the diagonal blocks
// (masked, partly wasted) are a larger share of the work, and more so with taller tiles.
constexpr int kFp8D128TallCausalMinSeqlen = 8192;

// The kBlockM of the fp8 kernel that runs p in `bucket`. d128: 192 rows without a mask (+2% at
// 2k, +3-4% at 8k) and for long causal calls; 128 rows (intra-warpgroup overlap) for short causal
// and for sliding-window calls (not measured with 192 rows: kept on the kernel they had).
inline int fp8_block_m(int bucket, const FlashFwdFp8Params& p) {
  if (bucket != 128) return fp8_default_block_m(bucket);
  const bool unmasked = p.window_left < 0 && p.window_right < 0;
  const bool causal = p.window_left < 0 && p.window_right == 0;
  return unmasked || (causal && p.s_q >= kFp8D128TallCausalMinSeqlen) ? 192 : 128;
}

// Whether the kernel releases Q's buffer after each tile's last S GEMM, so that the next tile's Q
// loads under this tile's last softmax, PV GEMM and epilogue, instead of after the TMA store of O.
// Kernel alone, d128 192-row tiles, non-causal, b*s = 16k, h = 16, same run (H200, 2026-12-02,
// benchmarks/RESULTS.md): 2k 713-714 vs 689-690 TFLOP/s, 4k 791-799 vs 786-787, but 8k 840 vs
// 846-847 and causal 8k 746-750 vs 747. On d128 / d64 with 128-row tiles and ping-pong turns
// (H200, 2026-12-01): 8k 771 vs 803, causal 2k 463 vs 466; those keep it off.
// Only the kernels that may do so read the per-call flag: in the others a run-time check alone
// changed ptxas's schedule (fp8 d64 470 vs 530 TFLOP/s kernel alone at 8k, same run, H200,
// 2026-12-02).
constexpr int kFp8EarlyQReleaseMaxSeqlenK = 4096;
constexpr bool fp8_may_release_q_early(int bucket, int block_m) {
  return bucket == 128 && block_m == 192;
}
inline bool fp8_early_q_release(int bucket, int block_m, const FlashFwdFp8Params& p) {
  return fp8_may_release_q_early(bucket, block_m) && p.s_k <= kFp8EarlyQReleaseMaxSeqlenK;
}

// Keys per K/V block of every fp8 kernel (fp8/traits.h).
constexpr int kFp8BlockN = 128;

// Tail split (fp8/tail_split.h): at most this many tiles of a last round are split, half of an
// H100's or H200's 132 SMs (a split needs two CTAs per tile); and at most a third of the call's
// tiles (a split round follows at least one full round of as many CTAs as twice its tiles).
constexpr int kFp8TailSplitMaxTiles = 66;

// Workspace slots the tail split may use for a call (two per split tile, one per piece): 0 with
// a mask (tiles then differ in cost and run in pairs, tile_scheduler.h), without an fp8 kernel
// for d, or with a single K/V block per tile.
inline int64_t fp8_tail_split_slots(int64_t b, int64_t s_q, int64_t s_k, int64_t h, int64_t d,
                                    bool masked) {
  const int bucket = fp8_head_dim_bucket(static_cast<int>(d));
  if (masked || bucket == 0 || s_k <= kFp8BlockN) return 0;
  const int64_t block_m = fp8_default_block_m(bucket);  // unmasked d128 runs 192 rows too
  const int64_t tiles = (s_q + block_m - 1) / block_m * h * b;
  return 2 * (tiles / 3 < kFp8TailSplitMaxTiles ? tiles / 3 : kFp8TailSplitMaxTiles);
}

// One slot: the partial O of a piece in fp32 (the consumer fragments, block_m x bucket) and four
// floats of row statistics per consumer thread (2 * block_m threads): fp8/tail_split.h,
// TailSlotLayout.
inline int64_t fp8_tail_split_slot_bytes(int bucket) {
  return int64_t(fp8_default_block_m(bucket)) * (4 * bucket + 32);
}

// The split tiles' tickets (one int each, fp8/tail_split.h), padded to 16 bytes.
inline int64_t fp8_tail_split_ticket_bytes(int64_t slots) { return (slots / 2 * 4 + 15) / 16 * 16; }

// Workspace, in this order: Vt (b, h_k, d, s_pad) e4m3 unless V arrives transposed; the per-key
// k scales (b, h_k, s_pad) f32; the tail split's slots, then its tickets. Every part is a
// multiple of 16 bytes.
// Python asks for it through jax_fa3_flash_fwd_fp8_workspace_bytes (tests/test_fp8.py pins it).
inline size_t flash_fwd_fp8_workspace_bytes(int64_t b, int64_t s_q, int64_t s_k, int64_t h,
                                            int64_t h_k, int64_t d, bool masked,
                                            bool v_transposed) {
  const int64_t s_pad = flash_fwd_fp8_key_pad(s_k);
  const int64_t slots = fp8_tail_split_slots(b, s_q, s_k, h, d, masked);
  const int64_t split_bytes =
      slots == 0 ? 0
                 : slots * fp8_tail_split_slot_bytes(fp8_head_dim_bucket(int(d))) +
                       fp8_tail_split_ticket_bytes(slots);
  return static_cast<size_t>(b * h_k * s_pad * ((v_transposed ? 0 : d) + 4) + split_bytes);
}

// One specialization per cuda/instantiations/flash_fwd_hdim<D>_e4m3*.cu. The extern declarations
// keep every other translation unit that sees the template's definition (fp8/launch.h) from
// instantiating all buckets through launch_flash_fwd_fp8 below: each instantiation file then
// compiles its own kernel only.
template <int kHeadDim, int kBlockM>
cudaError_t run_flash_fwd_fp8(const FlashFwdFp8Params& params, cudaStream_t stream);
extern template cudaError_t run_flash_fwd_fp8<64, 192>(const FlashFwdFp8Params&, cudaStream_t);
extern template cudaError_t run_flash_fwd_fp8<128, 128>(const FlashFwdFp8Params&, cudaStream_t);
extern template cudaError_t run_flash_fwd_fp8<128, 192>(const FlashFwdFp8Params&, cudaStream_t);
extern template cudaError_t run_flash_fwd_fp8<256, 128>(const FlashFwdFp8Params&, cudaStream_t);

// cudaErrorNotSupported when no fp8 kernel runs p.d (callers check fp8_head_dim_bucket first).
inline cudaError_t launch_flash_fwd_fp8(const FlashFwdFp8Params& p, cudaStream_t stream) {
  switch (fp8_head_dim_bucket(p.d)) {
#ifdef JAX_FA3_HAS_HDIM64
    case 64: return run_flash_fwd_fp8<64, 192>(p, stream);
#endif
#ifdef JAX_FA3_HAS_HDIM128
    case 128:
      return fp8_block_m(128, p) == 192 ? run_flash_fwd_fp8<128, 192>(p, stream)
                                        : run_flash_fwd_fp8<128, 128>(p, stream);
#endif
#ifdef JAX_FA3_HAS_HDIM256
    case 256: return run_flash_fwd_fp8<256, 128>(p, stream);
#endif
    default: return cudaErrorNotSupported;
  }
}

}  // namespace jax_fa3
