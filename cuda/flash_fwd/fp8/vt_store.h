// The store half of the transposed V layout (fp8/layout.h), shared by its two writers: the fp8
// forward's pre-pass (fp8/vt.h, from e4m3 V) and the keys-transposed mode of the rotate + quantize
// pass (quantize/rotate_quantize.cu, straight from bf16/fp16/fp32 V). Both stage whole keys in
// shared memory as 32-bit words (4 dims of one key) and then store per dim.
#pragma once
#include <cstdint>

#include "flash_fwd/fp8/layout.h"

namespace jax_fa3::fwd {

// One thread's share of a Vt store: the 32 key slots of one permutation group for 4 consecutive
// dims. `group_keys` points at the group's first key in the staging tile (`row_words` words per
// key), `word` selects the 4 dims; dim j's 32 slots go to dst + j * dim_stride as one 32-byte run,
// a whole sector (dst 16-byte aligned). Slot c holds key fp8_key_of_slot(c); word w of a dim's
// run holds slots 4w..4w+3 (byte e = slot 4w + e), so 4x4 byte transposes by byte permutes turn
// four gathered keys into one word of each of the four dims.
// When `word` runs over consecutive lanes of a warp and row_words >= 32, each gather touches 32
// consecutive words of one key: no bank conflicts.
__device__ __forceinline__ void fp8_store_vt_group(const uint32_t* group_keys, int row_words,
                                                   int word, uint8_t* dst, int64_t dim_stride) {
  uint32_t runs[4][8];  // [dim within the word][word of the 32-byte run]
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    const uint32_t k0 = group_keys[fp8::fp8_key_of_slot(4 * w + 0) * row_words + word];
    const uint32_t k1 = group_keys[fp8::fp8_key_of_slot(4 * w + 1) * row_words + word];
    const uint32_t k2 = group_keys[fp8::fp8_key_of_slot(4 * w + 2) * row_words + word];
    const uint32_t k3 = group_keys[fp8::fp8_key_of_slot(4 * w + 3) * row_words + word];
    const uint32_t lo01 = __byte_perm(k0, k1, 0x5140);  // k0.b0 k1.b0 k0.b1 k1.b1
    const uint32_t lo23 = __byte_perm(k2, k3, 0x5140);
    const uint32_t hi01 = __byte_perm(k0, k1, 0x7362);  // k0.b2 k1.b2 k0.b3 k1.b3
    const uint32_t hi23 = __byte_perm(k2, k3, 0x7362);
    runs[0][w] = __byte_perm(lo01, lo23, 0x5410);  // byte 0 of k0..k3
    runs[1][w] = __byte_perm(lo01, lo23, 0x7632);
    runs[2][w] = __byte_perm(hi01, hi23, 0x5410);
    runs[3][w] = __byte_perm(hi01, hi23, 0x7632);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    auto* run = reinterpret_cast<uint4*>(dst + j * dim_stride);
    run[0] = make_uint4(runs[j][0], runs[j][1], runs[j][2], runs[j][3]);
    run[1] = make_uint4(runs[j][4], runs[j][5], runs[j][6], runs[j][7]);
  }
}

// The per-key k scale the consumer reads (k_col): k_scale of the key's block, any positive value
// for the padding keys past s_k (the consumer masks them).
__device__ __forceinline__ float fp8_key_column_scale(const float* __restrict__ k_scale, int64_t bh,
                                                      int key, int s_k, int block_size,
                                                      int num_k_blocks) {
  return key < s_k ? k_scale[bh * num_k_blocks + key / block_size] : 1.f;
}

}  // namespace jax_fa3::fwd
