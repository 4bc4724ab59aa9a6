#include "quantize/rotate_quantize.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/float_convert.cuh"
#include "flash_fwd/fp8/flash_fwd_fp8.h"
#include "flash_fwd/fp8/vt_store.h"

namespace jax_fa3 {
namespace {

// Each lane holds 32 consecutive elements of a row, so a row of d spans d / 32 lanes
// (kLanesPerRow). The first five butterfly stages (h < 32) then stay in registers and only the
// stages h = 32, 64, 128 cross lanes: 2 shuffles per element at d=128 instead of 5 with one
// element per lane, and loads / stores are 16-byte vectors.
constexpr int kPerLane = 32;
constexpr float kInvE4m3Max = 1.f / 448.f;  // float32(1/448), as jax_fa3/_fp8_quantize.py multiplies

// Amaxes are taken on bits: for magnitudes (sign bit clear) the unsigned order of the bits is
// the float order, and NaN's bits lie above +inf's, so an integer max propagates NaN like jnp.max
// (fmaxf would drop it): a block with a NaN gets amax NaN, hence scale 1.0, exactly as the XLA
// path computes it. One LOP3 + IMNMX per element instead of a NaN-aware float compare chain.
__device__ __forceinline__ uint32_t magnitude_bits(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}

__device__ __forceinline__ float scale_from_amax(float amax) {
  return amax > 0.f ? fmaxf(amax * kInvE4m3Max, FLT_MIN) : 1.f;
}

// Two fp32 -> packed e4m3x2 (round to nearest even, saturating): lo in bits 0..7.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  return pair;
}

// Where this lane's 32 elements live: row `row_in_warp` of the warp's rows, elements
// [32 * lane_in_row, 32 * lane_in_row + 32) of it. Lanes past the last whole row idle (d = 96,
// 160, 192, 224) but still take part in the shuffles.
// One pass of a CTA covers a 64-token block (quantized straight from registers) at d <= 128:
// 2 warps at d = 32, 4 at d = 64 (8 left half the CTA idle on 64-token blocks: q rotated at 16k
// tokens x 2048 took 79 µs, 52 with 4, H200, 2026-12-02), 8 from d = 96 on. d=256 takes
// two passes (16 warps to cover it in one measured slower: 106 vs 96 µs, H200, 2026-12-01).
template <int kLanesPerRow>
struct LaneMap {
  static constexpr int kWarps = kLanesPerRow <= 2 ? 2 * kLanesPerRow : 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  static constexpr int kRowsPerIter = kWarps * kRowsPerWarp;
  int lane_in_row;
  int row;  // row of the CTA's current group of kRowsPerIter
  bool active;
  __device__ static LaneMap of_thread() {
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int warp = static_cast<int>(threadIdx.x / 32);
    return {lane % kLanesPerRow, warp * kRowsPerWarp + lane / kLanesPerRow,
            lane < kRowsPerWarp * kLanesPerRow};
  }
};

struct Rotation {
  bool enabled;
  int block_pow2;       // d's largest power-of-two factor: the Hadamard block (hadamard.h)
  float scale;          // float32(1/sqrt(block_pow2))
  uint32_t negative;    // bit e: this lane's element e has sign -1
};

// A lane's 32 elements as loaded (16-byte vectors), before conversion: a load can be issued
// early and its registers consumed later.
template <typename T>
struct RawLane {
  static constexpr int kVec = 16 / sizeof(T);
  uint4 vec[kPerLane / kVec];
};

template <typename T>
__device__ __forceinline__ void load_raw(const T* __restrict__ src, RawLane<T>& raw) {
#pragma unroll
  for (int i = 0; i < kPerLane / RawLane<T>::kVec; ++i) {
    raw.vec[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
  }
}

// The same, zeros where `valid` is false, as a select per vector: in the one-pass kernel (two
// blocks' loads in flight) ptxas spills 44 bytes at d = 128 with a branch, none with this.
template <typename T>
__device__ __forceinline__ void load_raw_or_zeros(const T* __restrict__ src, bool valid,
                                                  RawLane<T>& raw) {
#pragma unroll
  for (int i = 0; i < kPerLane / RawLane<T>::kVec; ++i) {
    raw.vec[i] = valid ? __ldg(reinterpret_cast<const uint4*>(src) + i) : make_uint4(0, 0, 0, 0);
  }
}

template <typename T>
__device__ __forceinline__ void raw_to_float(const RawLane<T>& raw, float (&v)[kPerLane]) {
  constexpr int kVec = RawLane<T>::kVec;
#pragma unroll
  for (int i = 0; i < kPerLane / kVec; ++i) {
    const T* elems = reinterpret_cast<const T*>(&raw.vec[i]);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[i * kVec + j] = to_float(elems[j]);
  }
}

// When enabled, H·diag(signs)/sqrt(block_pow2) applied to the row. Stages run in the order of
// jax_fa3.hadamard._hadamard_reference (h = 1, 2, 4, ...) on the same (a + b, a - b) pairs, so the
// float32 results agree with it.
template <int kLanesPerRow>
__device__ __forceinline__ void rotate_row(const Rotation& rot, int lane_in_row,
                                           float (&v)[kPerLane]) {
  if (!rot.enabled) return;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    // Exactly x * -1 where the sign is negative.
    v[e] = __uint_as_float(__float_as_uint(v[e]) ^ ((rot.negative << (31 - e)) & 0x80000000u));
  }
#pragma unroll
  for (int h = 1; h < kPerLane; h <<= 1) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      if ((e & h) == 0) {
        const float a = v[e];
        const float b = v[e + h];
        v[e] = a + b;
        v[e + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < kLanesPerRow; m <<= 1) {
    if (kPerLane * m >= rot.block_pow2) break;
    // lower lane: a + b; upper lane: a - b = other - mine. One FFMA each (the product by ±1 is
    // exact, so the sum rounds exactly as the FADD would).
    const float sign = (lane_in_row & m) != 0 ? -1.f : 1.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      v[e] = fmaf(sign, v[e], __shfl_xor_sync(0xffffffffu, v[e], m));
    }
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) v[e] *= rot.scale;
}

// Loads the lane's 32 elements (zeros where `valid` is false) and rotates them (rotate_row).
// The loads stay behind the branch: a select on `valid` per vector slowed the v passes by 7-14%
// (H200, 2026-12-02).
template <typename T, int kLanesPerRow>
__device__ __forceinline__ void load_row(const T* __restrict__ src, bool valid, const Rotation& rot,
                                         int lane_in_row, float (&v)[kPerLane]) {
  if (valid) {
    RawLane<T> raw;
    load_raw(src, raw);
    raw_to_float(raw, v);
  } else {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] = 0.f;
  }
  rotate_row<kLanesPerRow>(rot, lane_in_row, v);
}

// The (batch, head) slice a CTA works on and its token range.
struct Slice {
  int64_t base;      // element offset of (batch, token 0, head, 0)
  int64_t t_begin, t_end;
  int64_t scale_index;
  int64_t head_index;  // batch * h + head
};

// This lane's 32 elements of its (batch, head)'s mean (RotateQuantizeParams::mean), zeros without
// one: x - 0 is x exactly, so the chunk kernels subtract unconditionally.
__device__ __forceinline__ void load_lane_mean(const RotateQuantizeParams& p, const Slice& sl,
                                               int lane_in_row, float (&mean)[kPerLane]) {
  if (p.mean == nullptr) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) mean[e] = 0.f;
    return;
  }
  const float4* src =
      reinterpret_cast<const float4*>(p.mean + sl.head_index * p.d + kPerLane * lane_in_row);
#pragma unroll
  for (int i = 0; i < kPerLane / 4; ++i) {
    const float4 m = __ldg(src + i);
    mean[4 * i] = m.x;
    mean[4 * i + 1] = m.y;
    mean[4 * i + 2] = m.z;
    mean[4 * i + 3] = m.w;
  }
}

// Only tokens of the slice are centred: the zeros that stand in for rows past its end stay zeros
// (they must not enter the amax, and they are the keys-transposed layout's padding).
__device__ __forceinline__ void subtract_mean(bool valid, const float (&mean)[kPerLane],
                                              float (&v)[kPerLane]) {
  if (!valid) return;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) v[e] -= mean[e];
}

__device__ __forceinline__ float lane_amax(float amax, const float (&v)[kPerLane]) {
  uint32_t bits = magnitude_bits(amax);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) bits = max(bits, magnitude_bits(v[e]));
  return __uint_as_float(bits);
}

__device__ __forceinline__ float warp_amax(float amax) {
  uint32_t bits = magnitude_bits(amax);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  }
  return __uint_as_float(bits);
}

// x * (1 / scale) with the reciprocal correctly rounded (__frcp_rn is exact IEEE even under
// --use_fast_math): the quantization jax_fa3/_fp8_quantize.py defines. A direct x / scale would round
// differently on ~1e-4 of the elements (near-ties at e4m3 precision). 32 bytes per lane.
__device__ __forceinline__ void store_quantized(const float (&v)[kPerLane], float inv_scale,
                                                uint8_t* dst) {
  uint32_t packed[kPerLane / 4];
#pragma unroll
  for (int i = 0; i < kPerLane / 4; ++i) {
    packed[i] = e4m3x2(v[4 * i] * inv_scale, v[4 * i + 1] * inv_scale) |
                (e4m3x2(v[4 * i + 2] * inv_scale, v[4 * i + 3] * inv_scale) << 16);
  }
  uint4* out = reinterpret_cast<uint4*>(dst);  // global memory, or the shared staging tile
  out[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  out[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// kCentred: subtract RotateQuantizeParams::mean (the chunk kernels; the block kernel, held to 85
// registers, has no room for a lane's 32 means and never gets one).
template <typename T, int kLanesPerRow, bool kCentred>
__device__ __forceinline__ float rows_amax(const RotateQuantizeParams& p, const Slice& sl,
                                           const Rotation& rot) {
  using Map = LaneMap<kLanesPerRow>;
  const Map map = Map::of_thread();
  const T* x = static_cast<const T*>(p.x) + sl.base + kPerLane * map.lane_in_row;
  const int64_t row_stride = p.h * p.d;
  [[maybe_unused]] float mean[kPerLane];
  if constexpr (kCentred) load_lane_mean(p, sl, map.lane_in_row, mean);
  float amax = 0.f;
  for (int64_t t0 = sl.t_begin; t0 < sl.t_end; t0 += Map::kRowsPerIter) {
    const int64_t t = t0 + map.row;
    const bool valid = map.active && t < sl.t_end;
    float v[kPerLane];
    load_row<T, kLanesPerRow>(x + t * row_stride, valid, rot, map.lane_in_row, v);
    if constexpr (kCentred) subtract_mean(valid, mean, v);
    amax = lane_amax(amax, v);
  }
  return warp_amax(amax);
}

template <typename T, int kLanesPerRow, bool kCentred>
__device__ __forceinline__ void quantize_rows(const RotateQuantizeParams& p, const Slice& sl,
                                              const Rotation& rot, float scale) {
  using Map = LaneMap<kLanesPerRow>;
  const Map map = Map::of_thread();
  const T* x = static_cast<const T*>(p.x) + sl.base + kPerLane * map.lane_in_row;
  uint8_t* values = static_cast<uint8_t*>(p.values) + sl.base + kPerLane * map.lane_in_row;
  const int64_t row_stride = p.h * p.d;
  const float inv_scale = __frcp_rn(scale);
  [[maybe_unused]] float mean[kPerLane];
  if constexpr (kCentred) load_lane_mean(p, sl, map.lane_in_row, mean);
  for (int64_t t0 = sl.t_begin; t0 < sl.t_end; t0 += Map::kRowsPerIter) {
    const int64_t t = t0 + map.row;
    const bool valid = map.active && t < sl.t_end;
    float v[kPerLane];
    load_row<T, kLanesPerRow>(x + t * row_stride, valid, rot, map.lane_in_row, v);
    if constexpr (kCentred) subtract_mean(valid, mean, v);
    if (valid) store_quantized(v, inv_scale, values + t * row_stride);
  }
}

__device__ __forceinline__ Rotation make_rotation(const RotateQuantizeParams& p,
                                                  int lane_in_row, int block_pow2, float scale) {
  Rotation rot{p.signs != nullptr, block_pow2, scale, 0u};
  if (rot.enabled) {
    for (int e = 0; e < kPerLane; ++e) {
      rot.negative |= uint32_t(p.signs[kPerLane * lane_in_row + e] < 0.f) << e;
    }
  }
  return rot;
}

// kSlot: reductions that follow each other without a barrier between them use distinct slots.
template <int kWarps, int kSlot = 0>
__device__ __forceinline__ float cta_amax(float warp_amax_value) {
  __shared__ float amax_of_warp[kWarps];
  if (threadIdx.x % 32 == 0) amax_of_warp[threadIdx.x / 32] = warp_amax_value;
  __syncthreads();
  uint32_t bits = magnitude_bits(amax_of_warp[0]);
#pragma unroll
  for (int w = 1; w < kWarps; ++w) bits = max(bits, magnitude_bits(amax_of_warp[w]));
  return __uint_as_float(bits);
}

// Slice of CTA `cta` when each block is cut into `chunks` pieces of `chunk_tokens`.
__device__ __forceinline__ Slice slice_of(const RotateQuantizeParams& p, int64_t n_blocks,
                                          int64_t chunks, int64_t chunk_tokens, int64_t cta) {
  const int64_t chunk = cta % chunks;
  const int64_t scale_index = cta / chunks;  // (batch * h + head) * n_blocks + block
  const int64_t block = scale_index % n_blocks;
  const int64_t head = (scale_index / n_blocks) % p.h;
  const int64_t batch = scale_index / (n_blocks * p.h);
  const int64_t block_end = min((block + 1) * int64_t(p.block_size), p.s);
  const int64_t t_begin = block * p.block_size + chunk * chunk_tokens;
  return {(batch * p.s * p.h + head) * p.d, t_begin, min(t_begin + chunk_tokens, block_end),
          scale_index, batch * p.h + head};
}

// Blocks of <= kRotateQuantizeMaxCtaBlock tokens that two passes of a CTA do not cover (the staged
// kernel below takes 64-token blocks at d >= 160): one CTA per (batch, head, block), the block read
// twice (the second time from L2). A short last block is loaded once and quantized from registers.
// Three CTAs per SM (at most 85 registers: 20 bytes spilled at d = 128 and 256, up to 44 at d = 96,
// 160-224, none at d = 32, 64; tests/test_sass.py pins them), where 92 registers allowed two: the
// pass waits on memory, and 24 warps hide more of it than 16. q rotated at 16k tokens, H200
// (2026-12-02, benchmarks/RESULTS.md): 52 vs 64 µs at d = 128, 79 vs 88 at d = 256.
template <typename T, int kLanesPerRow>
__global__ void __launch_bounds__(LaneMap<kLanesPerRow>::kThreads, 3)
rotate_quantize_block_kernel(RotateQuantizeParams p, int64_t n_blocks, int block_pow2,
                             float rotation_scale) {
  using Map = LaneMap<kLanesPerRow>;
  const Map map = Map::of_thread();
  const Slice sl = slice_of(p, n_blocks, 1, p.block_size, blockIdx.x);
  const Rotation rot = make_rotation(p, map.lane_in_row, block_pow2, rotation_scale);
  if (sl.t_end - sl.t_begin <= Map::kRowsPerIter) {
    const int64_t offset = sl.base + (sl.t_begin + map.row) * p.h * p.d + kPerLane * map.lane_in_row;
    const bool valid = map.active && sl.t_begin + map.row < sl.t_end;
    float v[kPerLane];
    load_row<T, kLanesPerRow>(static_cast<const T*>(p.x) + offset, valid, rot, map.lane_in_row, v);
    const float scale = scale_from_amax(cta_amax<Map::kWarps>(warp_amax(lane_amax(0.f, v))));
    if (threadIdx.x == 0) p.scales[sl.scale_index] = scale;
    if (valid) store_quantized(v, __frcp_rn(scale), static_cast<uint8_t*>(p.values) + offset);
    return;
  }
  const float scale =
      scale_from_amax(cta_amax<Map::kWarps>(rows_amax<T, kLanesPerRow, false>(p, sl, rot)));
  if (threadIdx.x == 0) p.scales[sl.scale_index] = scale;
  quantize_rows<T, kLanesPerRow, false>(p, sl, rot, scale);
}

// Blocks that two passes of a CTA cover (64-token blocks at d = 160-256, 32-40 rows a pass): each
// pass's rows are loaded and rotated once and staged as float32 in shared memory until the block's
// amax is known, where the block kernel loads and rotates them twice: the rotation's shuffle stages
// bounded it at d = 256. q rotated, 2 x 8k tokens x 2048, H100 (2026-12-07, benchmarks/RESULTS.md):
// 60.0 µs against the block kernel's 79.2 (47.0 at d = 128, one pass, for the same bytes). A thread
// reads back only its own rows, so the slots are thread-major float4s: a warp's accesses cover 512
// consecutive bytes, no bank conflicts. 16-bit inputs issue both passes' loads before the first
// rotation (their raw registers fit; float32's would spill). 64 KB a CTA, three CTAs an SM.
constexpr int kStagedPasses = 2;

template <int kLanesPerRow>
constexpr int staged_block_smem_bytes() {
  return kStagedPasses * LaneMap<kLanesPerRow>::kThreads * kPerLane * int(sizeof(float));
}

template <typename T, int kLanesPerRow>
__global__ void __launch_bounds__(LaneMap<kLanesPerRow>::kThreads, 3)
rotate_quantize_staged_block_kernel(RotateQuantizeParams p, int64_t n_blocks, int block_pow2,
                                    float rotation_scale) {
  using Map = LaneMap<kLanesPerRow>;
  constexpr int kEarlyLoads = sizeof(T) == 2 ? kStagedPasses : 1;
  extern __shared__ float4 staged[];  // [pass][float4 of the lane][thread]
  const Map map = Map::of_thread();
  const Slice sl = slice_of(p, n_blocks, 1, p.block_size, blockIdx.x);
  const Rotation rot = make_rotation(p, map.lane_in_row, block_pow2, rotation_scale);
  const T* x = static_cast<const T*>(p.x) + sl.base + kPerLane * map.lane_in_row;
  const int64_t row_stride = p.h * p.d;
  // Evaluated again after the barrier rather than kept across it (kept, bf16 spilled at d = 160,
  // 192).
  auto token_of = [&](int pass) { return sl.t_begin + pass * Map::kRowsPerIter + map.row; };
  auto slot_of = [&](int pass) {
    return staged + pass * (kPerLane / 4) * Map::kThreads + threadIdx.x;
  };
  int64_t token[kStagedPasses];
  bool valid[kStagedPasses];
#pragma unroll
  for (int pass = 0; pass < kStagedPasses; ++pass) {
    token[pass] = token_of(pass);
    valid[pass] = map.active && token[pass] < sl.t_end;
  }
  RawLane<T> raw[kEarlyLoads];
#pragma unroll
  for (int pass = 0; pass < kEarlyLoads; ++pass) {
    load_raw_or_zeros(x + token[pass] * row_stride, valid[pass], raw[pass]);
  }
  float amax = 0.f;
#pragma unroll
  for (int pass = 0; pass < kStagedPasses; ++pass) {
    float v[kPerLane];
    if constexpr (kEarlyLoads == kStagedPasses) {
      raw_to_float(raw[pass], v);
      rotate_row<kLanesPerRow>(rot, map.lane_in_row, v);
    } else {
      load_row<T, kLanesPerRow>(x + token[pass] * row_stride, valid[pass], rot, map.lane_in_row,
                                v);
    }
    amax = lane_amax(amax, v);
    float4* slot = slot_of(pass);
#pragma unroll
    for (int i = 0; i < kPerLane / 4; ++i) {
      slot[i * Map::kThreads] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    }
  }
  const float scale = scale_from_amax(cta_amax<Map::kWarps>(warp_amax(amax)));
  if (threadIdx.x == 0) p.scales[sl.scale_index] = scale;
  const float inv_scale = __frcp_rn(scale);
  uint8_t* values = static_cast<uint8_t*>(p.values) + sl.base + kPerLane * map.lane_in_row;
#pragma unroll
  for (int pass = 0; pass < kStagedPasses; ++pass) {
    const int64_t t = token_of(pass);
    if (!map.active || t >= sl.t_end) continue;
    const float4* slot = slot_of(pass);
    float v[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane / 4; ++i) {
      const float4 f = slot[i * Map::kThreads];
      v[4 * i] = f.x;
      v[4 * i + 1] = f.y;
      v[4 * i + 2] = f.z;
      v[4 * i + 3] = f.w;
    }
    store_quantized(v, inv_scale, values + t * row_stride);
  }
}

// Blocks that one pass of a CTA covers (64 tokens at d <= 128), kBlocksPerCta consecutive ones
// per CTA: the loads of all of them are issued first, so that twice the bytes are in flight per
// SM while the first block is rotated, reduced and stored (the pass waits on memory). 80
// registers, no spill, three CTAs per SM. q rotated at 16k tokens, H200 (2026-12-02,
// benchmarks/RESULTS.md), bit for bit the output of one block per CTA: d = 128 46 vs 52 µs, d = 96
// 39 vs 46.5, d = 64 24 vs 28.
template <typename T, int kLanesPerRow, int kBlocksPerCta>
__global__ void __launch_bounds__(LaneMap<kLanesPerRow>::kThreads, 3)
rotate_quantize_one_pass_kernel(RotateQuantizeParams p, int64_t n_blocks, int64_t slices,
                                int block_pow2, float rotation_scale) {
  using Map = LaneMap<kLanesPerRow>;
  const Map map = Map::of_thread();
  const Rotation rot = make_rotation(p, map.lane_in_row, block_pow2, rotation_scale);
  const int64_t first = int64_t(blockIdx.x) * kBlocksPerCta;
  RawLane<T> raw[kBlocksPerCta];
  int64_t offset[kBlocksPerCta];
  bool valid[kBlocksPerCta];
#pragma unroll
  for (int i = 0; i < kBlocksPerCta; ++i) {
    const Slice sl = slice_of(p, n_blocks, 1, p.block_size, min(first + i, slices - 1));
    offset[i] = sl.base + (sl.t_begin + map.row) * p.h * p.d + kPerLane * map.lane_in_row;
    valid[i] = first + i < slices && map.active && sl.t_begin + map.row < sl.t_end;
    load_raw_or_zeros(static_cast<const T*>(p.x) + offset[i], valid[i], raw[i]);
  }
  auto finish = [&](auto slot) {
    constexpr int i = decltype(slot)::value;
    if (first + i >= slices) return;
    float v[kPerLane];
    raw_to_float(raw[i], v);
    rotate_row<kLanesPerRow>(rot, map.lane_in_row, v);
    const float scale = scale_from_amax(cta_amax<Map::kWarps, i>(warp_amax(lane_amax(0.f, v))));
    if (threadIdx.x == 0) p.scales[first + i] = scale;
    if (valid[i]) store_quantized(v, __frcp_rn(scale), static_cast<uint8_t*>(p.values) + offset[i]);
  };
  finish(std::integral_constant<int, 0>{});
  if constexpr (kBlocksPerCta > 1) finish(std::integral_constant<int, 1>{});
  static_assert(kBlocksPerCta <= 2);
}

// Larger blocks, pass 1: the amax of each chunk, merged per block with an atomic max on the bits
// (|x| >= 0 orders like its bits as unsigned; NaN's bits are above +inf's, so NaN still wins).
// p.scales holds the amax bits until rotate_quantize_scale_kernel turns them into scales.
template <typename T, int kLanesPerRow>
__global__ void __launch_bounds__(LaneMap<kLanesPerRow>::kThreads)
rotate_quantize_chunk_amax_kernel(RotateQuantizeParams p, int64_t n_blocks, int64_t chunks,
                                  int block_pow2, float rotation_scale) {
  const Slice sl = slice_of(p, n_blocks, chunks, kRotateQuantizeChunkTokens, blockIdx.x);
  const Rotation rot = make_rotation(p, LaneMap<kLanesPerRow>::of_thread().lane_in_row,
                                     block_pow2, rotation_scale);
  const float amax =
      cta_amax<LaneMap<kLanesPerRow>::kWarps>(rows_amax<T, kLanesPerRow, true>(p, sl, rot));
  if (threadIdx.x == 0 && sl.t_begin < sl.t_end) {
    atomicMax(reinterpret_cast<unsigned int*>(p.scales) + sl.scale_index, __float_as_uint(amax));
  }
}

// Centring in the pass (RotateQuantizeParams::mean_out; no rotation), step 1: each chunk's column
// sums, maxima and minima into its slot of p.partials, (3, d) floats. A thread folds
// kStatsColumns columns of every kRows-th token of the chunk in 24 registers, then the rows meet
// in shared memory and are folded in row order (the pass stays deterministic). Why so few columns
// a thread: holding a lane's 32 columns (the rotation's layout) needs 145-214 registers, fits one
// CTA per SM and took 148 µs at 8k tokens (d = 128, H200, 2026-12-03), where XLA's mean and the
// amax pass took 109; eight columns keep eight CTAs per SM with their loads in flight.
constexpr int kStatsColumns = 8;
constexpr int kStatsThreads = 256;

template <typename T>
__device__ __forceinline__ void load_columns(const T* __restrict__ src,
                                             float (&v)[kStatsColumns]) {
  constexpr int kVec = 16 / sizeof(T);
#pragma unroll
  for (int i = 0; i < kStatsColumns / kVec; ++i) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src) + i);
    const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[i * kVec + j] = to_float(elems[j]);
  }
}

template <typename T, int kDim>
__global__ void __launch_bounds__(kStatsThreads)
rotate_quantize_chunk_stats_kernel(RotateQuantizeParams p, int64_t chunks) {
  constexpr int kThreadsPerRow = kDim / kStatsColumns;
  constexpr int kRows = kStatsThreads / kThreadsPerRow;  // tokens a step; the rest idle (d = 96..)
  __shared__ float stats_of_row[3][kRows][kDim];
  const int column0 = kStatsColumns * (static_cast<int>(threadIdx.x) % kThreadsPerRow);
  const int row = static_cast<int>(threadIdx.x) / kThreadsPerRow;
  const Slice sl = slice_of(p, 1, chunks, kRotateQuantizeChunkTokens, blockIdx.x);
  if (row < kRows) {
    const T* x = static_cast<const T*>(p.x) + sl.base + column0;
    const int64_t row_stride = p.h * p.d;
    float sum[kStatsColumns], hi[kStatsColumns], lo[kStatsColumns];
#pragma unroll
    for (int e = 0; e < kStatsColumns; ++e) {
      sum[e] = 0.f;
      hi[e] = -INFINITY;
      lo[e] = INFINITY;
    }
#pragma unroll 4
    for (int64_t t = sl.t_begin + row; t < sl.t_end; t += kRows) {
      float v[kStatsColumns];
      load_columns<T>(x + t * row_stride, v);
#pragma unroll
      for (int e = 0; e < kStatsColumns; ++e) {
        sum[e] += v[e];
        hi[e] = fmaxf(hi[e], v[e]);
        lo[e] = fminf(lo[e], v[e]);
      }
    }
#pragma unroll
    for (int e = 0; e < kStatsColumns; ++e) {
      stats_of_row[0][row][column0 + e] = sum[e];
      stats_of_row[1][row][column0 + e] = hi[e];
      stats_of_row[2][row][column0 + e] = lo[e];
    }
  }
  __syncthreads();
  float* slot = p.partials + int64_t(blockIdx.x) * 3 * kDim;
  for (int col = static_cast<int>(threadIdx.x); col < kDim; col += kStatsThreads) {
    float total = stats_of_row[0][0][col], h = stats_of_row[1][0][col], l = stats_of_row[2][0][col];
    for (int r = 1; r < kRows; ++r) {
      total += stats_of_row[0][r][col];
      h = fmaxf(h, stats_of_row[1][r][col]);
      l = fminf(l, stats_of_row[2][r][col]);
    }
    slot[col] = total;
    slot[kDim + col] = h;
    slot[2 * kDim + col] = l;
  }
}

// Step 2, one CTA of d threads per (batch, head): thread c folds column c's chunk stats in chunk
// order into the mean (sum / s, as jax_fa3._fp8_quantize.mean_over_keys) and the column's largest |x - mean|,
// max(max - mean, mean - min); the CTA's largest is the head's amax. A NaN anywhere in the head
// makes the sum, the mean and so the amax NaN (scale 1.0), as on the XLA path (fmaxf, fminf drop
// NaN, the sum does not). The stats of kChunksInFlight chunks are loaded before any is folded:
// one chunk at a time the kernel was a chain of L2 round trips, 9.9 us for 32 chunks at d128 (2 x
// 8k tokens, 16 heads, H100, 2026-12-07, benchmarks/RESULTS.md) for a few KB a head; 7.3 us batched.
__global__ void rotate_quantize_centre_kernel(const float* partials, float* mean_out,
                                              float* scales, int64_t chunks, int64_t s, int d) {
  constexpr int kChunksInFlight = 8;
  __shared__ uint32_t amax_of_warp[kRotateQuantizeMaxDim / 32];
  const int64_t head = blockIdx.x;
  const int col = static_cast<int>(threadIdx.x);
  const float* stats = partials + head * chunks * 3 * d;
  float sum = 0.f, hi = -INFINITY, lo = INFINITY;
  for (int64_t c0 = 0; c0 < chunks; c0 += kChunksInFlight) {
    float add[kChunksInFlight], top[kChunksInFlight], bottom[kChunksInFlight];
#pragma unroll
    for (int i = 0; i < kChunksInFlight; ++i) {
      const int64_t c = min(c0 + i, chunks - 1);  // past the last chunk: folded as no-ops below
      add[i] = stats[(3 * c) * d + col];
      top[i] = stats[(3 * c + 1) * d + col];
      bottom[i] = stats[(3 * c + 2) * d + col];
    }
#pragma unroll
    for (int i = 0; i < kChunksInFlight; ++i) {
      if (c0 + i < chunks) {
        sum += add[i];
        hi = fmaxf(hi, top[i]);
        lo = fminf(lo, bottom[i]);
      }
    }
  }
  const float mean = __fdiv_rn(sum, static_cast<float>(s));
  mean_out[head * d + col] = mean;
  const float column_amax = __uint_as_float(
      max(magnitude_bits(__fsub_rn(hi, mean)), magnitude_bits(__fsub_rn(mean, lo))));
  uint32_t bits = __float_as_uint(warp_amax(column_amax));
  if (col % 32 == 0) amax_of_warp[col / 32] = bits;
  __syncthreads();
  if (col == 0) {
    for (int w = 1; w < d / 32; ++w) bits = max(bits, amax_of_warp[w]);
    scales[head] = scale_from_amax(__uint_as_float(bits));
  }
}

__global__ void rotate_quantize_scale_kernel(float* scales, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) scales[i] = scale_from_amax(scales[i]);
}

// Larger blocks, pass 2: quantize each chunk with its block's scale.
template <typename T, int kLanesPerRow>
__global__ void __launch_bounds__(LaneMap<kLanesPerRow>::kThreads)
rotate_quantize_chunk_kernel(RotateQuantizeParams p, int64_t n_blocks, int64_t chunks,
                             int block_pow2, float rotation_scale) {
  const Slice sl = slice_of(p, n_blocks, chunks, kRotateQuantizeChunkTokens, blockIdx.x);
  const Rotation rot = make_rotation(p, LaneMap<kLanesPerRow>::of_thread().lane_in_row,
                                     block_pow2, rotation_scale);
  quantize_rows<T, kLanesPerRow, true>(p, sl, rot, p.scales[sl.scale_index]);
}

// Larger blocks, pass 2, keys-transposed values (RotateQuantizeParams::keys_transposed): the
// chunk's 128 tokens are quantized into a shared-memory tile (a token's d bytes as d / 4 words,
// zeros past s), then stored per dim as fp8_store_vt_group lays them out, one 32-key group of 4
// dims per thread: one 32-byte sector per dim. d <= 256: the tile is at most 32 KB.
template <typename T, int kLanesPerRow>
__global__ void __launch_bounds__(LaneMap<kLanesPerRow>::kThreads)
rotate_quantize_chunk_keys_transposed_kernel(RotateQuantizeParams p, int64_t n_blocks,
                                             int64_t chunks, int block_pow2, float rotation_scale) {
  using Map = LaneMap<kLanesPerRow>;
  constexpr int kTokens = static_cast<int>(kRotateQuantizeChunkTokens);
  constexpr int kRowWords = kPerLane * kLanesPerRow / 4;  // the launch picks kLanesPerRow = d / 32
  __shared__ __align__(16) uint32_t tile[kTokens][kRowWords];
  const Map map = Map::of_thread();
  const Slice sl = slice_of(p, n_blocks, chunks, kRotateQuantizeChunkTokens, blockIdx.x);
  const Rotation rot = make_rotation(p, map.lane_in_row, block_pow2, rotation_scale);
  const T* x = static_cast<const T*>(p.x) + sl.base + kPerLane * map.lane_in_row;
  const int64_t row_stride = p.h * p.d;
  const float inv_scale = __frcp_rn(p.scales[sl.scale_index]);
  float mean[kPerLane];
  load_lane_mean(p, sl, map.lane_in_row, mean);
  for (int r0 = 0; r0 < kTokens; r0 += Map::kRowsPerIter) {
    const int r = r0 + map.row;
    const bool valid = map.active && sl.t_begin + r < sl.t_end;
    float v[kPerLane];
    load_row<T, kLanesPerRow>(x + (sl.t_begin + r) * row_stride, valid, rot, map.lane_in_row, v);
    subtract_mean(valid, mean, v);
    if (map.active && r < kTokens) {
      store_quantized(v, inv_scale, reinterpret_cast<uint8_t*>(&tile[r][8 * map.lane_in_row]));
    }
  }
  __syncthreads();
  const int64_t s_pad = flash_fwd_fp8_key_pad(p.s);
  // One block per head: scale_index = batch * h + head.
  uint8_t* head_values = static_cast<uint8_t*>(p.values) + sl.scale_index * p.d * s_pad;
  for (int job = static_cast<int>(threadIdx.x); job < (kTokens / 32) * kRowWords;
       job += Map::kThreads) {
    const int group = job / kRowWords;
    const int word = job % kRowWords;
    const int64_t key0 = sl.t_begin + 32 * group;
    if (key0 < s_pad) {
      fwd::fp8_store_vt_group(&tile[32 * group][0], kRowWords, word,
                              head_values + int64_t(4 * word) * s_pad + key0, s_pad);
    }
  }
}

template <typename T, int kLanesPerRow>
cudaError_t launch_shape(const RotateQuantizeParams& p, int64_t n_blocks, cudaStream_t stream) {
  const int block_pow2 = p.d & (-p.d);
  // float32(1/sqrt(block_pow2)) correctly rounded, the constant the pure-JAX transform uses.
  const float rotation_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block_pow2)));
  const int64_t slices = p.b * p.h * n_blocks;
  const bool chunked = rotate_quantize_chunked(p);
  const int64_t chunks = rotate_quantize_chunks(p);
  if (chunks == 1 && !chunked && p.block_size <= LaneMap<kLanesPerRow>::kRowsPerIter) {
    // 16-bit inputs: two blocks per CTA (two float32 rows of raw loads would spill).
    constexpr int kBlocksPerCta = sizeof(T) == 2 ? 2 : 1;
    const int64_t ctas = (slices + kBlocksPerCta - 1) / kBlocksPerCta;
    if (ctas > 0x7fffffff) return cudaErrorInvalidValue;
    rotate_quantize_one_pass_kernel<T, kLanesPerRow, kBlocksPerCta>
        <<<static_cast<unsigned>(ctas), LaneMap<kLanesPerRow>::kThreads, 0, stream>>>(
            p, n_blocks, slices, block_pow2, rotation_scale);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
    return cudaSuccess;
  }
  if (chunks == 1 && !chunked) {
    if (slices > 0x7fffffff) return cudaErrorInvalidValue;
    // The staged kernel at d >= 160, where 64-token blocks take two passes (measured at d = 256;
    // tested on a GPU at d = 160, 192, 224, 256).
    if constexpr (kLanesPerRow >= 5) {
      constexpr int64_t kStagedRows = kStagedPasses * LaneMap<kLanesPerRow>::kRowsPerIter;
      if (std::min<int64_t>(p.block_size, p.s) <= kStagedRows) {
        constexpr int kSmem = staged_block_smem_bytes<kLanesPerRow>();
        JAX_FA3_RETURN_IF_CUDA_ERROR(
            cudaFuncSetAttribute(rotate_quantize_staged_block_kernel<T, kLanesPerRow>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
        rotate_quantize_staged_block_kernel<T, kLanesPerRow>
            <<<static_cast<unsigned>(slices), LaneMap<kLanesPerRow>::kThreads, kSmem, stream>>>(
                p, n_blocks, block_pow2, rotation_scale);
        JAX_FA3_RETURN_IF_LAUNCH_ERROR();
        return cudaSuccess;
      }
    }
    rotate_quantize_block_kernel<T, kLanesPerRow><<<static_cast<unsigned>(slices), LaneMap<kLanesPerRow>::kThreads, 0, stream>>>(
        p, n_blocks, block_pow2, rotation_scale);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
    return cudaSuccess;
  }
  const int64_t ctas = slices * chunks;
  if (ctas > 0x7fffffff) return cudaErrorInvalidValue;
  constexpr int kThreads = LaneMap<kLanesPerRow>::kThreads;
  RotateQuantizeParams second = p;  // what the quantizing pass subtracts
  if (p.mean_out != nullptr) {
    // The mean and the scale from per-chunk column stats (one block per head: slices = b * h).
    rotate_quantize_chunk_stats_kernel<T, kPerLane * kLanesPerRow>
        <<<static_cast<unsigned>(ctas), kStatsThreads, 0, stream>>>(p, chunks);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
    rotate_quantize_centre_kernel<<<static_cast<unsigned>(slices), p.d, 0, stream>>>(
        p.partials, p.mean_out, p.scales, chunks, p.s, p.d);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
    second.mean = p.mean_out;
  } else {
    JAX_FA3_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.scales, 0, sizeof(float) * slices, stream));
    rotate_quantize_chunk_amax_kernel<T, kLanesPerRow>
        <<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(p, n_blocks, chunks, block_pow2,
                                                               rotation_scale);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
    rotate_quantize_scale_kernel<<<static_cast<unsigned>((slices + 255) / 256), 256, 0, stream>>>(
        p.scales, slices);
    JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  }
  if (p.keys_transposed) {
    rotate_quantize_chunk_keys_transposed_kernel<T, kLanesPerRow>
        <<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(second, n_blocks, chunks,
                                                               block_pow2, rotation_scale);
  } else {
    rotate_quantize_chunk_kernel<T, kLanesPerRow>
        <<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(second, n_blocks, chunks,
                                                               block_pow2, rotation_scale);
  }
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_typed(const RotateQuantizeParams& p, int64_t n_blocks, cudaStream_t stream) {
  switch (p.d / kPerLane) {
    case 1: return launch_shape<T, 1>(p, n_blocks, stream);
    case 2: return launch_shape<T, 2>(p, n_blocks, stream);
    case 3: return launch_shape<T, 3>(p, n_blocks, stream);
    case 4: return launch_shape<T, 4>(p, n_blocks, stream);
    case 5: return launch_shape<T, 5>(p, n_blocks, stream);
    case 6: return launch_shape<T, 6>(p, n_blocks, stream);
    case 7: return launch_shape<T, 7>(p, n_blocks, stream);
    case 8: return launch_shape<T, 8>(p, n_blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_rotate_quantize(const RotateQuantizeParams& p, cudaStream_t stream) {
  if (!rotate_quantize_supports_dim(p.d) || p.block_size < 1 || p.b < 0 || p.s < 0 || p.h < 0 ||
      (p.keys_transposed && p.block_size < p.s) ||
      (p.mean_out != nullptr && (p.block_size < p.s || p.mean != nullptr ||
                                 p.partials == nullptr || p.signs != nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (p.b == 0 || p.s == 0 || p.h == 0) return cudaSuccess;
  const int64_t n_blocks = (p.s + p.block_size - 1) / p.block_size;
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, n_blocks, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, n_blocks, stream);
    case DType::kFloat16: return launch_typed<__half>(p, n_blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_fa3
