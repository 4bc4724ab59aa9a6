// One lane's consecutive elements, loaded and stored in the widest vector accesses their size
// allows: the elementwise kernels (hadamard, the split-KV merge) read and write rows this way.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector_types.h>  // uint2, uint4

namespace jax_fa3 {

// A lane's kPerLane consecutive elements of a row, moved as one or two vector accesses (2..32
// bytes): the caller keeps rows aligned to the access (hadamard.cu's launch_typed, the split-KV
// merge's 16-byte rows).
template <typename T, int kPerLane>
union LaneVector {
  static constexpr int kBytes = kPerLane * int(sizeof(T));
  static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16 || kBytes == 32);
  using Piece = std::conditional_t<
      kBytes == 2, uint16_t,
      std::conditional_t<kBytes == 4, uint32_t, std::conditional_t<kBytes == 8, uint2, uint4>>>;
  static constexpr int kPieces = kBytes > 16 ? kBytes / 16 : 1;
  Piece piece[kPieces];
  T elem[kPerLane];

  __device__ __forceinline__ void load(const T* src) {
#pragma unroll
    for (int c = 0; c < kPieces; ++c) piece[c] = reinterpret_cast<const Piece*>(src)[c];
  }
  __device__ __forceinline__ void store(T* dst) const {
#pragma unroll
    for (int c = 0; c < kPieces; ++c) reinterpret_cast<Piece*>(dst)[c] = piece[c];
  }
};

}  // namespace jax_fa3
