// The fp8 forward's pre-pass: V (b, s_k, h_k, d) e4m3 -> Vt (b, h_k, d, s_pad) e4m3, keys
// contiguous and permuted inside each group of 32 (fp8/layout.h), zero for keys >= s_k; and the
// k scales k_col (b, h_k, s_pad) f32 the consumer reads without a division: one per 32-key group
// or one per key (fp8_k_col_entry; 1 past s_k: any positive value, the consumer masks those
// keys); and the tail split's tickets cleared.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "flash_fwd/fp8/softmax.h"
#include "flash_fwd/fp8/vt_store.h"

namespace jax_fa3::fwd {

// Entry `slot` (0..s_pad-1) of a (batch, kv-head)'s k_col row. Block sizes that are multiples of
// 32 (k_scale_grouped) only need one scale per 32-key group, so the row holds those, group j at
// slot j (the key 32 j's scale), 1 past the last group up to a whole number of 128-key blocks,
// so the consumer loads a block's four as one float4 (4 * ceil(s_pad / 128) <= s_pad slots).
// Other block sizes: one scale per key, key `slot`. The grouped test needs no bound on `slot`
// beyond key < s_k: the groups of real keys, ceil(s_k / 32), fit in the padded row.
__device__ __forceinline__ float fp8_k_col_entry(const float* __restrict__ k_scale, int64_t bh,
                                                 int slot, int s_k, int block_size,
                                                 int num_k_blocks) {
  if (block_size % kFp8KeyScaleGroup != 0) {
    return fp8_key_column_scale(k_scale, bh, slot, s_k, block_size, num_k_blocks);
  }
  const int key = kFp8KeyScaleGroup * slot;
  return key < s_k ? k_scale[bh * num_k_blocks + key / block_size] : 1.f;
}

// The tail split's tickets (fp8/tail_split.h, merge_if_last_piece) start at 0 in every call: the
// workspace is XLA scratch with whatever a previous op left there. Block 0 of the pre-kernel,
// which runs before the main kernel on the stream, clears them (at most kFp8TailSplitMaxTiles).
__device__ __forceinline__ void zero_tail_tickets(int* tickets, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) tickets[i] = 0;
}

// A tile: 128 keys (four permutation groups) x 128 dims of one (batch, kv head).
constexpr int kVtTileKeys = 128;
constexpr int kVtTileDims = 128;
constexpr int kVtThreads = 128;

// Persistent: grid min(#tiles, kVtCtasPerSm * #SMs), 128 threads; CTA i walks the 128-key x
// 128-dim tiles i, i + gridDim.x, ... (key tile fastest, then dim tile, then batch * h_k).
// d % 16 == 0 (16-byte rows). Loads: 16-byte chunks of whole 128-byte key rows (streaming: V is
// read once here and never again by the forward), kept in registers and issued one tile ahead,
// so that each CTA's reads of tile i + 1 are in flight while it stores tile i. Stores: each
// thread owns one group of 32 key slots for four dims, gathers them as 32-bit words (4 dims of
// one key) from shared memory and transposes 4x4 bytes with byte permutes, so it writes one full
// 32-byte sector per dim. Both shared-memory phases touch 32 consecutive words per warp
// instruction: no bank conflicts.
// Pre-pass alone, d128, b*s = 16k tokens, h = 16 (32 MB in, 32 MB out; H200, 2026-12-02,
// benchmarks/RESULTS.md): one tile per CTA (grid = #tiles, ~1.2 waves) 40-41 us; persistent with
// 4 / 8 / 16 CTAs per SM 36-37 / 35-37 / 35-36 us. Kernel alone with it (8 per SM): +0.4-0.9%.
constexpr int kVtCtasPerSm = 8;
// static: every fp8 instantiation TU (one per head-dim bucket) includes this header and launches
// its own copy; with external linkage the library's link failed on duplicate definitions.
static __global__ void __launch_bounds__(kVtThreads)
    fp8_transpose_v_kernel(const uint8_t* __restrict__ v, const float* __restrict__ k_scale,
                           uint8_t* __restrict__ vt, float* __restrict__ k_col, int s_k, int h_k,
                           int d, int s_pad, int block_size, int num_k_blocks, int num_key_tiles,
                           int num_dim_tiles, int num_tiles, int* __restrict__ tail_tickets,
                           int num_tail_tickets) {
  constexpr int kChunksPerKey = kVtTileDims / 16;
  constexpr int kLoadsPerThread = kVtTileKeys * kChunksPerKey / kVtThreads;
  __shared__ __align__(16) uint32_t tile[kVtTileKeys][kVtTileDims / 4];
  const int t = threadIdx.x;
  if (blockIdx.x == 0) zero_tail_tickets(tail_tickets, num_tail_tickets);
  const int chunk = t % kChunksPerKey;
  struct Coord {
    int bh, key0, d0;
  };
  auto coord_of = [&](int i) {
    const int rest = i / num_key_tiles;
    return Coord{rest / num_dim_tiles, (i % num_key_tiles) * kVtTileKeys,
                 (rest % num_dim_tiles) * kVtTileDims};
  };
  // The tile row (key) of this thread's r-th 16-byte chunk, in the load and in the smem staging.
  auto key_of_chunk = [&](int r) { return t / kChunksPerKey + r * (kVtThreads / kChunksPerKey); };
  // Zeros outside [0, s_k) x [0, d).
  auto load = [&](const Coord& c, uint4 (&val)[kLoadsPerThread]) {
    const int b = c.bh / h_k, hk = c.bh % h_k;
#pragma unroll
    for (int r = 0; r < kLoadsPerThread; ++r) {
      const int key = key_of_chunk(r);
      const int dd = 16 * chunk;
      val[r] = make_uint4(0, 0, 0, 0);
      if (c.key0 + key < s_k && c.d0 + dd < d) {
        const int64_t off = ((int64_t(b) * s_k + c.key0 + key) * h_k + hk) * d + c.d0 + dd;
        val[r] = __ldcs(reinterpret_cast<const uint4*>(v + off));
      }
    }
  };

  uint4 staged[kLoadsPerThread];
  int i = blockIdx.x;
  if (i < num_tiles) load(coord_of(i), staged);
  for (; i < num_tiles; i += gridDim.x) {
    const Coord c = coord_of(i);
    __syncthreads();  // the previous tile's gathers are done with `tile`
#pragma unroll
    for (int r = 0; r < kLoadsPerThread; ++r) {
      *reinterpret_cast<uint4*>(&tile[key_of_chunk(r)][4 * chunk]) = staged[r];
    }
    __syncthreads();
    if (i + gridDim.x < num_tiles) load(coord_of(i + gridDim.x), staged);

    // Thread t stores the 32 key slots of group t / 32 for dims d0 + 4 (t % 32) .. + 3.
    const int group = t / 32;
    const int quad = t % 32;
    const int dim = c.d0 + 4 * quad;
    if (dim < d && c.key0 + 32 * group < s_pad) {
      fp8_store_vt_group(&tile[32 * group][0], kVtTileDims / 4, quad,
                         vt + (int64_t(c.bh) * d + dim) * s_pad + c.key0 + 32 * group, s_pad);
    }
    if (c.d0 == 0 && t < kVtTileKeys) {
      const int slot = c.key0 + t;
      if (slot < s_pad) {
        k_col[int64_t(c.bh) * s_pad + slot] =
            fp8_k_col_entry(k_scale, c.bh, slot, s_k, block_size, num_k_blocks);
      }
    }
  }
}

// When V arrives already transposed (the rotate + quantize pass's keys-transposed output), only
// k_col is written: one thread per (batch * kv head, key slot).
constexpr int kKeyColumnThreads = 256;
static __global__ void __launch_bounds__(kKeyColumnThreads)
    fp8_key_column_scales_kernel(const float* __restrict__ k_scale, float* __restrict__ k_col,
                                 int s_k, int s_pad, int block_size, int num_k_blocks,
                                 int64_t num_columns, int* __restrict__ tail_tickets,
                                 int num_tail_tickets) {
  if (blockIdx.x == 0) zero_tail_tickets(tail_tickets, num_tail_tickets);
  const int64_t i = int64_t(blockIdx.x) * kKeyColumnThreads + threadIdx.x;
  if (i < num_columns) {
    k_col[i] = fp8_k_col_entry(k_scale, i / s_pad, static_cast<int>(i % s_pad), s_k, block_size,
                               num_k_blocks);
  }
}

}  // namespace jax_fa3::fwd
