// Host-side checks of the layout facts the backward kernel relies on, for every head-dim bucket
// (CuTe's layout algebra runs on the host; no GPU needed). Exit status 0 when all hold.
//  1. P/dS stores: the byte offsets the kernel takes from its S (key-major: S^T) fragment
//     partition of the swizzled (kBlockM, kBlockN) tile over a null base put each fragment pair
//     (i, i+1) at adjacent, 4-byte aligned addresses (one st.shared.b32), and the two consumer
//     warpgroups' 128 threads cover every element of the tile exactly once.
//  1b. Row-major: element i of the S fragment is on the row of element 2 * ((i >> 1) & 1) (LSE
//     and D are loaded once per row). Key-major: the S^T accumulator element i sits at the same
//     (key, row) as element i of the A fragment of dV += P^T dO and dK += dS^T Q, so P^T and dS^T
//     become RS operands by an element-wise conversion.
//  2. dQ fragment order: the dQ accumulator partition maps (warpgroup, thread, i) one-to-one onto
//     the (kBlockM, d) chunk, pairs (i, i+1) are adjacent columns of one row, and the chunk slot
//     (i / 2) * 256 + 2 t (+ wg * kDqWgFloats) is a bijection too, so the postprocess inverts the
//     consumers' stores exactly.
#include <cstdio>
#include <vector>

#include <cute/tensor.hpp>  // before traits.cuh, as in the kernel TUs

#include "flash_bwd/traits.cuh"

using namespace cute;
using jax_fa3::flash_bwd::BwdTraits;

template <int kHeadDim>
int check_bucket() {
  using Traits = BwdTraits<kHeadDim, cutlass::bfloat16_t>;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kDQ = Traits::kDQ, kDqRows = Traits::kDqRows;
  int errors = 0;
  auto fail = [&](const char* what, int wg, int t, int i) {
    if (errors++ < 10) std::printf("d=%d: %s (wg %d, thread %d, i %d)\n", kHeadDim, what, wg, t, i);
  };

  // 1. P/dS offsets.
  std::vector<int> hits(kBlockM * kBlockN, 0);
  typename Traits::MmaSdP mma_sdp;
  for (int wg = 0; wg < 2; ++wg) {
    for (int t = 0; t < 128; ++t) {
      auto thr = mma_sdp.get_thread_slice(t);
      Tensor off = Traits::pds_store_offsets(thr, wg);
      for (int i = 0; i < size(off); ++i) {
        const auto bytes = reinterpret_cast<uintptr_t>(raw_pointer_cast(&off(i)));
        if (bytes % 2 || bytes / 2 >= uintptr_t(kBlockM * kBlockN)) { fail("P offset out of tile", wg, t, i); continue; }
        hits[bytes / 2]++;
        if (i % 2 == 0) {
          const auto next = reinterpret_cast<uintptr_t>(raw_pointer_cast(&off(i + 1)));
          if (bytes % 4 != 0 || next != bytes + 2) fail("P pair not adjacent / 4-byte aligned", wg, t, i);
        }
      }
    }
  }
  for (int e = 0; e < kBlockM * kBlockN; ++e) {
    if (hits[e] != 1) { fail("P tile element not written exactly once", -1, -1, e); break; }
  }
  // 1b.
  for (int t = 0; t < 128; ++t) {
    auto thr = mma_sdp.get_thread_slice(t);
    Tensor rc = thr.partition_C(make_identity_tensor(typename Traits::TileS{}));
    if constexpr (Traits::kKeyMajor) {
      typename Traits::MmadKV mma_dkv;
      Tensor a = mma_dkv.get_thread_slice(t).partition_A(make_identity_tensor(typename Traits::TileS{}));
      if (size(a) != size(rc)) fail("A fragment size != S^T fragment size", 0, t, 0);
      for (int i = 0; i < size(rc) && i < size(a); ++i) {
        if (get<0>(rc(i)) != get<0>(a(i)) || get<1>(rc(i)) != get<1>(a(i))) {
          fail("S^T accumulator element i != RS A-fragment element i", 0, t, i);
        }
      }
    } else {
      for (int i = 0; i < size(rc); ++i) {
        if (get<0>(rc(i)) != get<0>(rc(2 * ((i >> 1) & 1)))) fail("S row of element i", 0, t, i);
      }
    }
  }

  // 2. dQ fragment order.
  std::vector<int> cell(kBlockM * kHeadDim, 0), slot(Traits::kDqChunkFloats, 0);
  typename Traits::MmadQ mma_dq;
  for (int wg = 0; wg < 2; ++wg) {
    for (int t = 0; t < 128; ++t) {
      auto thr = mma_dq.get_thread_slice(t);
      Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kDqRows>, Int<kDQ>>{}));
      if (size(coord) * 128 != kDqRows * kDQ) fail("dQ fragment size", wg, t, 0);
      for (int i = 0; i < size(coord); ++i) {
        const int r = Traits::dq_row0(wg) + get<0>(coord(i));
        const int c = Traits::dq_col0(wg) + get<1>(coord(i));
        cell[r * kHeadDim + c]++;
        slot[wg * Traits::kDqWgFloats + Traits::dq_slot(i, t)]++;
        if (i % 2 == 0 && (c % 2 != 0 || Traits::dq_row0(wg) + get<0>(coord(i + 1)) != r ||
                           Traits::dq_col0(wg) + get<1>(coord(i + 1)) != c + 1)) {
          fail("dQ pair not (r, c), (r, c + 1) with c even", wg, t, i);
        }
      }
    }
  }
  for (int e = 0; e < kBlockM * kHeadDim; ++e) {
    if (cell[e] != 1) { fail("dQ element not covered exactly once", -1, -1, e); break; }
  }
  for (int e = 0; e < Traits::kDqChunkFloats; ++e) {
    if (slot[e] != 1) { fail("dQ chunk slot not used exactly once", -1, -1, e); break; }
  }
  std::printf("d=%d: %s\n", kHeadDim, errors ? "FAILED" : "ok");
  return errors;
}

int main() {
  const int errors = check_bucket<64>() + check_bucket<96>() + check_bucket<128>() +
                     check_bucket<192>() + check_bucket<256>();
  return errors ? 1 : 0;
}
