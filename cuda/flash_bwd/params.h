// FlashAttention-3 backward (sm_90a): the parameters one call needs, the workspace layout, and the
// per-(head-dim bucket, dtype) entry points. Plain C++: included by the FFI handler (host compiler)
// and by the CUDA instantiations. Knows nothing about XLA.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/buckets.h"

namespace jax_fa3::flash_bwd {

// Tile height over queries (rows per Q block) of a head-dim bucket: 128 at d = 64, where the
// S^T / dP^T GEMMs then have N = 128 (less shared-memory traffic per FLOP) and the accumulators
// still fit; 64 elsewhere. The workspace layout below depends on it.
constexpr int block_m_for_bucket(int bucket) { return bucket <= 64 ? 128 : 64; }

// 80-row Q blocks at d = 128 (FlashAttention-3's choice there): S^T / dP^T with N = 80 read
// (64 + 80) / (64 * 80) shared-memory bytes per FLOP instead of (64 + 64) / (64 * 64), and each
// Q block's fixed work (barriers, the dQ hand-off, LSE and D) is spread over 25% more rows. dQ
// is then computed transposed (traits.cuh). Taken for unmasked calls only (no causal mask or
// window: their diagonal blocks would waste more of a taller tile; no key ranges, whose covers are
// 64-row granules; no softcap, one more kernel for a rare case) of at least 1024 queries (the
// padding to whole blocks costs < 2%), and not for MQA (one kv head: a few long CTAs).
constexpr int kWideBlockM = 80;
inline bool wide_q_blocks(int bucket, int64_t s_q, int64_t h_k, int window_left, int window_right,
                          float softcap, bool key_ranges) {
  return bucket == 128 && s_q >= 1024 && h_k > 1 && window_left < 0 && window_right < 0 &&
         softcap == 0.f && !key_ranges;
}

struct FlashBwdParams {
  // Inputs, contiguous: q/out/dout (b, s_q, h, d); k/v (b, s_k, h_k, d); lse (b, h, s_q) fp32.
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* dout;
  const float* lse;
  // Outputs: dq like q, dk like k, dv like v.
  void* dq;
  void* dk;
  void* dv;
  // Workspace (see workspace_layout): all carved from one scratch allocation.
  float* dq_accum;    // (b, h, ceil(s_q / block_m), block_m * bucket) fp32 chunks, zeroed per call
  float* lse_log2;    // (b, h, s_q_pad) fp32: lse * log2(e); +inf for padded rows
  float* dpsum;       // (b, h, s_q_pad) fp32: D = rowsum(dO * O); 0 for padded rows
                      // (both in the dq result's memory when they fit: WorkspaceLayout)
  int* semaphores;    // (b, h, ceil(s_q / block_m)) int32, zeroed; deterministic mode only
  int b, s_q, s_k, h, h_k, d;
  float softmax_scale;
  float softcap;        // 0 = off
  int window_left;      // -1 = unbounded
  int window_right;     // -1 = unbounded (causal: 0)
  bool deterministic;
  DType dtype;
  // Per-query key ranges and their 64-row covers (common/key_ranges.h), or nullptr: whole rows
  // under the window above. The ranges replace the window.
  const int* key_ranges = nullptr;
  const int* key_covers = nullptr;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Byte offsets of the workspace pieces inside one allocation (each 256-byte aligned).
struct WorkspaceLayout {
  size_t dq_accum, lse_log2, dpsum, semaphores, total;
  // LSE*log2(e) and D sit at offsets lse_log2 and dpsum of the dq result instead, when they fit
  // in its bytes (4 s_q_pad <= s_q d for 16-bit dq): only the postprocess writes dq, after the
  // main kernel's last read of them, and a training step's peak memory holds 2 b h s_q_pad
  // floats less (2 MiB at d = 128, 16k tokens, 16 heads).
  bool row_stats_in_dq;
  bool has_row_stats;  // false: the kernel takes LSE*log2(e) and D as inputs (fp8)
};

// dQ is accumulated per Q block in chunks of block_m rows x the head-dim bucket d_pad (padded
// rows and columns included: the main kernel adds whole chunks; see BwdTraits::kDqWgFloats).
// row_stats: LSE*log2(e) and D have a place here (the 16-bit kernel's preprocess writes them;
// the fp8 kernel takes them as inputs).
inline WorkspaceLayout dq_workspace_layout(int64_t b, int64_t h, int64_t s_q, int64_t d,
                                           int64_t d_pad, int64_t block_m, bool deterministic,
                                           bool row_stats) {
  const int64_t s_q_pad = round_up(s_q, block_m);
  WorkspaceLayout w{};
  w.has_row_stats = row_stats;
  const size_t row_stats_bytes = round_up(4 * b * h * s_q_pad, 256);
  // Both rows of statistics in the dq result's 2 b s_q h d bytes (16-bit dq).
  w.row_stats_in_dq = row_stats && 2 * row_stats_bytes <= size_t(2 * b * s_q * h * d);
  size_t off = 0;
  w.dq_accum = off;
  off += round_up(4 * b * h * s_q_pad * d_pad, 256);
  if (w.row_stats_in_dq) {
    w.lse_log2 = 0;
    w.dpsum = row_stats_bytes;
  } else if (row_stats) {
    w.lse_log2 = off;
    off += row_stats_bytes;
    w.dpsum = off;
    off += row_stats_bytes;
  }
  w.semaphores = off;
  if (deterministic) off += round_up(4 * b * h * (s_q_pad / block_m), 256);
  w.total = off;
  return w;
}

// The 16-bit kernel's workspace for Q blocks of block_m rows (the launch's choice: the bucket's
// default or kWideBlockM).
inline WorkspaceLayout workspace_layout(int64_t b, int64_t h, int64_t s_q, int64_t d,
                                        int64_t block_m, bool deterministic) {
  const int bucket = head_dim_bucket(static_cast<int>(d));
  return dq_workspace_layout(b, h, s_q, d, bucket > 0 ? bucket : d, block_m, deterministic, true);
}

// Rows per Q block of a 16-bit call at head dim d without the 80-row choice (a d no bucket
// covers sizes as its own bucket, as dq_workspace_layout pads it).
inline int default_block_m(int64_t d) {
  const int bucket = head_dim_bucket(static_cast<int>(d));
  return block_m_for_bucket(bucket > 0 ? bucket : static_cast<int>(d));
}

// Rows per Q block of a 16-bit call (what run_flash_bwd launches).
inline int block_m_for_call(const FlashBwdParams& p) {
  return wide_q_blocks(head_dim_bucket(p.d), p.s_q, p.h_k, p.window_left, p.window_right,
                       p.softcap, p.key_ranges != nullptr)
             ? kWideBlockM
             : default_block_m(p.d);
}

// The bytes a 16-bit call's workspace may need, whichever Q-block height the call takes (the
// caller sizes the buffer without the masks and scalars that decide it).
inline size_t workspace_bytes_any_block_m(int64_t b, int64_t h, int64_t s_q, int64_t d,
                                          bool deterministic) {
  const size_t usual = workspace_layout(b, h, s_q, d, default_block_m(d), deterministic).total;
  if (head_dim_bucket(static_cast<int>(d)) != 128) return usual;
  const size_t wide = workspace_layout(b, h, s_q, d, kWideBlockM, deterministic).total;
  return wide > usual ? wide : usual;
}

// ---------------------------------------------------------------------------------------------
// The fp8 (e4m3) backward (fp8_traits.cuh; numerics: jax_fa3/_fp8_backward_emulation.py).

// Head-dim buckets of the fp8 backward (the key-major arrangement only), and the compiled one
// that runs d, or 0: d a multiple of 16 (the e4m3 rows TMA reads are multiples of 16 bytes).
// The fp8 kernels follow the head-dim list only (kernels.cmake), for both 16-bit types.
constexpr int kFp8BwdHeadDimBuckets[] = {64, 128};
inline int fp8_bwd_head_dim_bucket(int d) {
  if (d <= 0 || d % 16 != 0) return 0;
#ifdef JAX_FA3_HAS_HDIM64
  if (d <= 64) return 64;
#endif
#ifdef JAX_FA3_HAS_HDIM128
  if (d <= 128) return 128;
#endif
  return 0;
}

// The 16-bit call's fields in these roles: q = q8 (b, s_q, h, d) e4m3; k = K~ (b, s_k, h_k, d),
// k8 dequantized in the 16-bit type `dtype` (dQ's B); v, dout 16-bit; lse_log2 and dpsum are
// inputs, (b, h, s_q_pad) with s_q_pad = s_q rounded up to block_m_for_bucket: LSE' * log2(e)
// (LSE - ln(2^8 r), +inf where r = 0 and in the padding) and D (- dlse; 0 in the padding); dq,
// dk, dv float32. out, lse, softcap and the key ranges are not read. Then its own:
struct FlashBwdFp8Params : FlashBwdParams {
  const void* k8;         // (b, s_k, h_k, d) e4m3: S^T's A
  // q8 and dO8 transposed, (b, h, d, s_t) e4m3 with s_t = s_q rounded up to 32, zero past s_q and
  // the rows permuted inside each group of 32 (jax_fa3._fp8_quantize.kernel_v_layout): the B
  // operands of dK and dV.
  const void* q_t;
  const void* dout_t;
  const float* q_scale;   // (b, h, s_q_pad): each row's q8 scale, 0 in the padding
  const float* dk_coef;   // (b, h, s_q_pad): w = q scale / (2^8 r), 0 in the padding
  const float* dq_scale;  // (b, h, s_q): softmax_scale / (2^8 r), 0 where r = 0
  const float* k_scale;   // (b, h_k, s_k): each key's k8 scale
  const float* dv_scale;  // (b, h_k): s_max / 2^8
};

// The fp8 kernel's workspace: the dQ accumulator and the deterministic semaphores.
inline WorkspaceLayout fp8_workspace_layout(int64_t b, int64_t h, int64_t s_q, int64_t d,
                                            bool deterministic) {
  const int bucket = fp8_bwd_head_dim_bucket(static_cast<int>(d));
  const int64_t d_pad = bucket > 0 ? bucket : d;
  return dq_workspace_layout(b, h, s_q, d, d_pad, block_m_for_bucket(static_cast<int>(d_pad)),
                             deterministic, false);
}

// One per compiled (bucket, 16-bit dtype); defined in
// cuda/instantiations/flash_bwd_hdim<D>_e4m3_<dtype>.cu.
#define JAX_FA3_DECLARE_FLASH_BWD_FP8(D, DT)                                             \
  cudaError_t run_flash_bwd_fp8_hdim##D##_##DT(const FlashBwdFp8Params& params,          \
                                               cudaStream_t stream);
JAX_FA3_DECLARE_FLASH_BWD_FP8(64, bf16)
JAX_FA3_DECLARE_FLASH_BWD_FP8(64, fp16)
JAX_FA3_DECLARE_FLASH_BWD_FP8(128, bf16)
JAX_FA3_DECLARE_FLASH_BWD_FP8(128, fp16)
#undef JAX_FA3_DECLARE_FLASH_BWD_FP8

// One per compiled (bucket, dtype); defined in cuda/instantiations/flash_bwd_hdim<D>_<dtype>.cu.
#define JAX_FA3_DECLARE_FLASH_BWD(D, DT) \
  cudaError_t run_flash_bwd_hdim##D##_##DT(const FlashBwdParams& params, cudaStream_t stream);
JAX_FA3_DECLARE_FLASH_BWD(64, bf16)
JAX_FA3_DECLARE_FLASH_BWD(96, bf16)
JAX_FA3_DECLARE_FLASH_BWD(128, bf16)
JAX_FA3_DECLARE_FLASH_BWD(192, bf16)
JAX_FA3_DECLARE_FLASH_BWD(256, bf16)
JAX_FA3_DECLARE_FLASH_BWD(64, fp16)
JAX_FA3_DECLARE_FLASH_BWD(96, fp16)
JAX_FA3_DECLARE_FLASH_BWD(128, fp16)
JAX_FA3_DECLARE_FLASH_BWD(192, fp16)
JAX_FA3_DECLARE_FLASH_BWD(256, fp16)
// The d = 128 kernel with 80-row Q blocks (wide_q_blocks), called by the d = 128 entry points;
// defined in cuda/instantiations/flash_bwd_hdim128_<dtype>_rows80.cu.
JAX_FA3_DECLARE_FLASH_BWD(128_rows80, bf16)
JAX_FA3_DECLARE_FLASH_BWD(128_rows80, fp16)
#undef JAX_FA3_DECLARE_FLASH_BWD

}  // namespace jax_fa3::flash_bwd
