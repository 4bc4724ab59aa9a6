// The fp8 forward's pre-pass: V (b, s_k, h_k, d) e4m3 -> Vt (b, h_k, d, s_pad) e4m3, keys
// contiguous and permuted inside each group of 32 (fp8_layout.h), zero for keys >= s_k; and the
// per-key k scale k_col (b, h_k, s_pad) f32 = k_scale[b, h_k, key / block_size] (1 past s_k: any
// positive value, the consumer masks those keys), so the consumer loads one float per column or
// per 32-key group without a division.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "flash_fwd/fp8_layout.h"

namespace jax_fa3::fwd {

constexpr int kVtTileKeys = 64;
constexpr int kVtTileDims = 64;
constexpr int kVtThreads = 256;

// grid (ceil(s_pad / 64), ceil(d / 64), b * h_k), 256 threads. d % 16 == 0 (16-byte rows).
// static: every fp8 instantiation TU (one per head-dim bucket) includes this header and launches
// its own copy; with external linkage the library's link failed on duplicate definitions.
static __global__ void __launch_bounds__(kVtThreads)
    fp8_transpose_v_kernel(const uint8_t* __restrict__ v, const float* __restrict__ k_scale,
                           uint8_t* __restrict__ vt, float* __restrict__ k_col, int s_k, int h_k,
                           int d, int s_pad, int block_size, int num_k_blocks) {
  __shared__ __align__(16) uint8_t tile[kVtTileKeys][kVtTileDims + 16];
  const int bh = blockIdx.z;  // batch * h_k + kv head
  const int b = bh / h_k, hk = bh % h_k;
  const int key0 = blockIdx.x * kVtTileKeys;
  const int d0 = blockIdx.y * kVtTileDims;
  const int t = threadIdx.x;

  // Load 64 keys x 64 dims, 16 bytes per thread (zeros outside [0, s_k) x [0, d)).
  {
    const int key = key0 + t / 4;
    const int dd = 16 * (t % 4);
    uint4 val = make_uint4(0, 0, 0, 0);
    if (key < s_k && d0 + dd < d) {
      const int64_t off = ((int64_t(b) * s_k + key) * h_k + hk) * d + d0 + dd;
      val = *reinterpret_cast<const uint4*>(v + off);
    }
    *reinterpret_cast<uint4*>(&tile[t / 4][dd]) = val;
  }
  __syncthreads();
  // Store 64 dims x 64 key slots, 16 slots per thread: slot c holds key 32*(c/32) + key_of_slot.
  {
    const int dd = t / 4;
    const int c0 = 16 * (t % 4);
    if (d0 + dd < d && key0 + c0 < s_pad) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t word = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = c0 + 4 * i + e;
          const int key = 32 * (c / 32) + fp8::fp8_key_of_slot(c % 32);
          word |= uint32_t(tile[key][dd]) << (8 * e);
        }
        w[i] = word;
      }
      const int64_t off = (int64_t(bh) * d + d0 + dd) * s_pad + key0 + c0;
      *reinterpret_cast<uint4*>(vt + off) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  if (blockIdx.y == 0 && t < kVtTileKeys) {
    const int key = key0 + t;
    if (key < s_pad) {
      k_col[int64_t(bh) * s_pad + key] =
          key < s_k ? k_scale[int64_t(bh) * num_k_blocks + key / block_size] : 1.f;
    }
  }
}

}  // namespace jax_fa3::fwd
