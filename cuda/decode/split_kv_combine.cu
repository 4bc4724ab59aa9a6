#include "decode/split_kv_combine.h"

#include <cstdint>

#include "common/cuda_check.h"
#include "common/float_convert.cuh"
#include "common/lane_vector.cuh"

namespace jax_fa3 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / 32;
// A lane's share of an output vector: 8 consecutive elements, one 16-byte access in 16-bit
// types, two in float32. d = 8 * lanes_per_piece, so 1 to 32 lanes cover a piece's vector.
constexpr int kPerLane = 8;
// Pieces a lane loads before it accumulates any (its loads in flight together).
constexpr int kUnroll = 4;

// A piece's lse as its weight sees it: +inf (no key seen) weighs exp(-inf) = 0.
__device__ __forceinline__ float piece_lse(float lse) { return lse == INFINITY ? -INFINITY : lse; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int lanes = 16; lanes > 0; lanes >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, lanes));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int lanes = 16; lanes > 0; lanes >>= 1) v += __shfl_xor_sync(0xffffffffu, v, lanes);
  return v;
}

// A team of team_warps warps merges one output vector (batch row, query row, head); a CTA holds
// kWarpsPerCta / team_warps teams. Inside a warp, lane = slot * lanes_per_piece + chunk: the
// warp's `slots` slots each read one piece at a time, lane `chunk` of a slot its 8 elements.
// Warp `member` of a team reads pieces member * slots + slot + k * slots * team_warps, k = 0, 1,
// ..., kUnroll of them per batch of loads; the first batch is issued before the lse pass, so the
// two wait on memory together. Every warp of the team reduces all n lse itself (n floats, read
// twice, the second time from L1), which costs no synchronisation. The slots' sums are added
// in the warp by shuffles, the team's warps' sums in shared memory by its first warp, which
// writes out and lse.
template <typename T>
__global__ void __launch_bounds__(kThreads) split_kv_combine_kernel(
    const T* __restrict__ out_pieces, const float* __restrict__ lse_pieces, T* __restrict__ out,
    float* __restrict__ lse, int64_t vectors, int64_t rows, int64_t heads, int d, int n,
    int team_warps, int lanes_per_piece) {
  __shared__ float partial[kWarpsPerCta][kPerLane * 32];  // [warp][element * 32 + lane]
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int team = warp / team_warps;
  const int member = warp % team_warps;
  const int slots = 32 / lanes_per_piece;
  const int slot = lane / lanes_per_piece;
  const int chunk = lane % lanes_per_piece;
  const int64_t v = int64_t(blockIdx.x) * (kWarpsPerCta / team_warps) + team;
  const bool active = v < vectors;  // warp-uniform
  const int64_t head = v % heads;
  const int64_t row = v / heads % rows;
  const int64_t batch = v / heads / rows;

  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.f;
  float top = 0.f, total = 0.f;
  if (active) {
    const int64_t lse_stride = heads * rows;  // from one piece to the next
    const float* piece_lses = lse_pieces + (batch * n * heads + head) * rows + row;
    const int64_t out_stride = rows * heads * d;
    const T* piece_outs =
        out_pieces + ((batch * n * rows + row) * heads + head) * d + chunk * kPerLane;
    const int64_t step = int64_t(slots) * team_warps;  // between a slot's consecutive pieces

    LaneVector<T, kPerLane> x[kUnroll];
    float x_lse[kUnroll];
    auto load_batch = [&](int64_t first) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = first + u * step + slot;
        const bool valid = slot < slots && i < n;
        x_lse[u] = valid ? piece_lses[i * lse_stride] : -INFINITY;
        if (valid) x[u].load(piece_outs + i * out_stride);
      }
    };
    int64_t first = int64_t(member) * slots;
    load_batch(first);

    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, piece_lse(piece_lses[i * lse_stride]));
    m = warp_max(m);
    top = m == -INFINITY ? 0.f : m;
    float s = 0.f;
    for (int i = lane; i < n; i += 32) s += __expf(piece_lse(piece_lses[i * lse_stride]) - top);
    total = warp_sum(s);
    // The weights w_p / total (IEEE reciprocal, once: a division per piece would be a call with
    // a slow path, and its spills, in the loop).
    const float scale = total == 0.f ? 0.f : __frcp_rn(total);

    while (true) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float w = __expf(piece_lse(x_lse[u]) - top) * scale;
        if (w != 0.f) {  // skipped: the pieces past n, and those of weight 0
#pragma unroll
          for (int e = 0; e < kPerLane; ++e) acc[e] = fmaf(w, to_float(x[u].elem[e]), acc[e]);
        }
      }
      first += step * kUnroll;
      if (first >= n) break;  // warp-uniform
      load_batch(first);
    }
    // Slot s's sums into slot 0's lanes (same chunk, lanes_per_piece * s lanes below).
    for (int s = 1; s < slots; s <<= 1) {
      const bool adds = slot % (2 * s) == 0 && slot + s < slots;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const float other = __shfl_down_sync(0xffffffffu, acc[e], s * lanes_per_piece);
        if (adds) acc[e] += other;
      }
    }
  }
  if (team_warps > 1) {  // CTA-uniform
    if (active && member > 0 && slot == 0) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) partial[warp][e * 32 + lane] = acc[e];
    }
    __syncthreads();
    if (active && member == 0 && slot == 0) {
      for (int w = 1; w < team_warps; ++w) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[e] += partial[warp + w][e * 32 + lane];
      }
    }
  }
  if (!active || member != 0) return;
  if (slot == 0) {
    LaneVector<T, kPerLane> y;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) y.elem[e] = from_float<T>(acc[e]);
    y.store(out + v * d + chunk * kPerLane);
  }
  if (lane == 0) {
    lse[(batch * heads + head) * rows + row] = total == 0.f ? INFINITY : top + __logf(total);
  }
}

template <typename T>
cudaError_t launch_typed(const SplitKvCombineParams& p, cudaStream_t stream) {
  const int lanes_per_piece = p.d / kPerLane;
  const int slots = 32 / lanes_per_piece;
  // Enough warps per vector that a lane's pieces fit in one batch of loads (at most a CTA).
  int team_warps = 1;
  while (team_warps < kWarpsPerCta && int64_t(slots) * team_warps * kUnroll < p.n) team_warps *= 2;
  const int64_t vectors = p.b * p.rows * p.heads;
  const int64_t per_cta = kWarpsPerCta / team_warps;
  const int64_t ctas = (vectors + per_cta - 1) / per_cta;
  if (ctas > 0x7fffffff) return cudaErrorInvalidValue;
  split_kv_combine_kernel<T><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
      static_cast<const T*>(p.out_pieces), p.lse_pieces, static_cast<T*>(p.out), p.lse, vectors,
      p.rows, p.heads, p.d, p.n, team_warps, lanes_per_piece);
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_split_kv_combine(const SplitKvCombineParams& p, cudaStream_t stream) {
  if (p.n < 1 || p.d < kSplitKvCombineDimMultiple || p.d > kSplitKvCombineMaxDim ||
      p.d % kSplitKvCombineDimMultiple != 0 || p.b < 0 || p.rows < 0 || p.heads < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.b == 0 || p.rows == 0 || p.heads == 0) return cudaSuccess;
  const bool aligned = reinterpret_cast<uintptr_t>(p.out_pieces) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  if (!aligned) return cudaErrorMisalignedAddress;
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_fa3
