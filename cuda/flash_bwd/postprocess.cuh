// Backward postprocess: dq = dq_accum * softmax_scale in the input dtype. dq_accum holds, per
// (batch, head, Q block), one chunk in the main kernel's fragment order (Traits::kDqWgFloats);
// this kernel undoes it with the same TiledMMA partition the consumers used, so the two cannot
// disagree. One CTA of 256 threads per chunk: thread (wg, t) reads the vectors accumulator thread t
// of consumer warpgroup wg held (coalesced: a warp reads 256 or 512 contiguous bytes per vector)
// and puts them, scaled and converted, at their (row, column) of a shared tile; the tile then
// leaves in 16-byte row pieces. Written straight from fragment order, a warp's store covered 8 rows
// x 16 bytes, half of each 32-byte sector, with 4-byte stores: the kernel ran at about a quarter
// of copy bandwidth. The fp8 kernel's dq is float32 and scaled per row instead: dq = dq_accum *
// row_scale (b, h, s_q) (the caller's softmax_scale / (2^8 r) of each row).
#pragma once
#include <cstdint>

#include <cute/tensor.hpp>

#include "flash_bwd/traits.cuh"

namespace jax_fa3::flash_bwd {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNumMmaThreads)
    flash_bwd_postprocess_kernel(const float* __restrict__ dq_accum,
                                 typename Traits::ElementGrad* __restrict__ dq, int s_q, int h,
                                 int d, int num_m_blocks, float scale,
                                 const float* __restrict__ row_scale = nullptr) {
  using namespace cute;
  using ElementGrad = typename Traits::ElementGrad;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  const int m = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;

  typename Traits::MmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor coord = thr_dq.partition_C(make_identity_tensor(typename Traits::DqTile{}));

  // 16-byte pieces: 8 16-bit or 4 float elements. Rows padded by one piece: the 8 rows x 4
  // column pairs of one fragment store spread over the banks (16-bit: 32 different banks).
  constexpr int kPieceElems = 16 / int(sizeof(ElementGrad));
  constexpr int kRowElems = kHeadDim + kPieceElems;
  __shared__ alignas(16) ElementGrad tile[kBlockM * kRowElems];

  const float* part =
      dq_accum + q_block_index(batch, h, head, num_m_blocks, m) * int64_t(Traits::kDqChunkFloats) +
      wg * Traits::kDqWgFloats;
  constexpr int kVec = Traits::kDqVec;
  CUTE_UNROLL
  for (int i = 0; i < size(coord); i += kVec) {
    float v[kVec];
    if constexpr (kVec == 4) {
      *reinterpret_cast<float4*>(v) = *reinterpret_cast<const float4*>(part + Traits::dq_slot(i, tid));
    } else {
      *reinterpret_cast<float2*>(v) = *reinterpret_cast<const float2*>(part + Traits::dq_slot(i, tid));
    }
    CUTE_UNROLL
    for (int j = 0; j < kVec; j += 2) {
      const int row = Traits::dq_row(coord(i + j), wg);
      const int col = Traits::dq_col(coord(i + j), wg);  // even, unless transposed
      ElementGrad* at = &tile[row * kRowElems + col];
      if constexpr (Traits::kDqTransposed) {  // the pair is (row, col), (row + 1, col)
        at[0] = ElementGrad(v[j] * scale);
        at[kRowElems] = ElementGrad(v[j + 1] * scale);
      } else if constexpr (Traits::kFp8) {
        const int q_row = m * kBlockM + row;
        const float rs =
            q_row < s_q ? __ldg(row_scale + (int64_t(batch) * h + head) * s_q + q_row) : 0.f;
        *reinterpret_cast<float2*>(at) = make_float2(v[j] * rs, v[j + 1] * rs);
      } else {
        const ElementGrad lo(v[j] * scale), hi(v[j + 1] * scale);
        *reinterpret_cast<uint32_t*>(at) = uint32_t(lo.raw()) | (uint32_t(hi.raw()) << 16);
      }
    }
  }
  __syncthreads();

  // d is a multiple of 8, so a piece is wholly inside or outside it.
  constexpr int kPiecesPerRow = kHeadDim / kPieceElems;
  CUTE_UNROLL
  for (int piece = threadIdx.x; piece < kBlockM * kPiecesPerRow; piece += Traits::kNumMmaThreads) {
    const int r = piece / kPiecesPerRow;
    const int col = (piece % kPiecesPerRow) * kPieceElems;
    const int row = m * kBlockM + r;
    if (row < s_q && col < d) {
      *reinterpret_cast<uint4*>(dq + ((int64_t(batch) * s_q + row) * h + head) * d + col) =
          *reinterpret_cast<const uint4*>(&tile[r * kRowElems + col]);
    }
  }
}

}  // namespace jax_fa3::flash_bwd
