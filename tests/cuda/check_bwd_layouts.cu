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
//     (i / 4) * 512 + 4 t + i % 4 (+ wg * kDqWgFloats) is a bijection too, so the postprocess inverts the
//     consumers' stores exactly.
#include <cstdio>
#include <vector>

#include "common/cute_config.h"  // first, as in the kernel TUs
#include <cute/tensor.hpp>

#include "flash_bwd/traits.cuh"

using namespace cute;
using jax_fa3::flash_bwd::BwdTraits;

// 1c. Key-major: the stmatrix stores of the dS^T fragments. For every thread and x4 number x,
// block q takes the S^T fragment pair (v, v + 1), v = ds_stmatrix_value(x, q), which must sit at
// (key 16 w + 8 (q % 2) + lane / 4, rows 8 j + 2 (lane % 4) and + 1), j = 2 x + q / 2 (the pair
// stmatrix expects of that lane); the lane's row address ds_stmatrix_at(ds_stmatrix_offset, x)
// must be that of block q's stored row lane % 8 with its 8 elements after it: (key 16 w +
// 8 (q % 2) + lane % 8, rows 8 j ...) in the row-contiguous tile (plain stmatrix), (row 8 j +
// lane % 8, keys 16 w + 8 (q % 2) ...) in the key-contiguous one (80-row blocks, .trans); and
// the stores cover the (kBlockM, kBlockN) tile exactly once.
template <typename Traits, typename Fail>
void check_ds_stmatrix(Fail&& fail) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  Tensor tile = make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                            typename Traits::SmemLayoutPdS{});
  auto offset = [&](int row, int key) {
    return reinterpret_cast<uintptr_t>(raw_pointer_cast(&tile(row, key)));
  };
  std::vector<int> hits(kBlockM * kBlockN, 0);
  typename Traits::MmaSdP mma_sdp;
  for (int wg = 0; wg < 2; ++wg) {
    for (int t = 0; t < 128; ++t) {
      Tensor rc = mma_sdp.get_thread_slice(t).partition_C(
          make_identity_tensor(typename Traits::TileS{}));
      const int lane = t % 32, w = t / 32;
      for (int x = 0; x < kBlockM / 16; ++x) {
        for (int q = 0; q < 4; ++q) {
          const int v = Traits::ds_stmatrix_value(x, q), j = 2 * x + q / 2;
          const int key = 16 * w + 8 * (q % 2) + lane / 4, row = 8 * j + 2 * (lane % 4);
          if (get<0>(rc(v)) != key || get<1>(rc(v)) != row || get<0>(rc(v + 1)) != key ||
              get<1>(rc(v + 1)) != row + 1) {
            fail("stmatrix block's fragment pair", wg, t, v);
          }
        }
        const int q = lane / 8, j = 2 * x + q / 2, key0 = wg * 64 + 16 * w + 8 * (q % 2);
        const uintptr_t at =
            Traits::ds_stmatrix_at(Traits::ds_stmatrix_offset(wg, t), x);
        for (int k = 0; k < 8; ++k) {
          const int row = Traits::kDqTransposed ? 8 * j + lane % 8 : 8 * j + k;
          const int key = Traits::kDqTransposed ? key0 + k : key0 + lane % 8;
          if (offset(row, key) != at + 2 * k) fail("stmatrix row address", wg, t, x);
          const uintptr_t e = offset(row, key) / 2;
          if (e < uintptr_t(kBlockM * kBlockN)) hits[e]++;
        }
      }
    }
  }
  for (int e = 0; e < kBlockM * kBlockN; ++e) {
    if (hits[e] != 1) { fail("dS tile element not written exactly once", -1, -1, e); break; }
  }
}

template <typename Traits>
int check_traits() {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  int errors = 0;
  auto fail = [&](const char* what, int wg, int t, int i) {
    if (errors++ < 10) {
      std::printf("d=%d, %d rows: %s (wg %d, thread %d, i %d)\n", kHeadDim, kBlockM, what, wg, t, i);
    }
  };

  // 1. P/dS pair-store offsets (row-major, fp8 key-major; 1c: the 16-bit key-major stmatrix stores).
  std::vector<int> hits(kBlockM * kBlockN, 0);
  typename Traits::MmaSdP mma_sdp;
  if constexpr (Traits::kKeyMajor) check_ds_stmatrix<Traits>(fail);
  if constexpr (Traits::kDqTransposed) {
    hits.assign(kBlockM * kBlockN, 1);
  } else for (int wg = 0; wg < 2; ++wg) {
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
      Tensor coord = thr.partition_C(make_identity_tensor(typename Traits::DqTile{}));
      if (size(coord) * 128 != Traits::kDqWgFloats) fail("dQ fragment size", wg, t, 0);
      for (int i = 0; i < size(coord); ++i) {
        const int r = Traits::dq_row(coord(i), wg);
        const int c = Traits::dq_col(coord(i), wg);
        if (r < 0 || r >= kBlockM || c < 0 || c >= kHeadDim) { fail("dQ cell outside", wg, t, i); continue; }
        cell[r * kHeadDim + c]++;
        slot[wg * Traits::kDqWgFloats + Traits::dq_slot(i, t)]++;
        // The postprocess stores pairs: (r, c), (r, c + 1) with c even; transposed (r, c),
        // (r + 1, c).
        const int r1 = Traits::dq_row(coord(i + 1 - i % 2), wg);
        const int c1 = Traits::dq_col(coord(i + 1 - i % 2), wg);
        const bool pair_ok = Traits::kDqTransposed ? (r1 == r + 1 && c1 == c)
                                                   : (c % 2 == 0 && r1 == r && c1 == c + 1);
        if (i % 2 == 0 && !pair_ok) fail("dQ pair not adjacent as the postprocess stores it", wg, t, i);
      }
    }
  }
  for (int e = 0; e < kBlockM * kHeadDim; ++e) {
    if (cell[e] != 1) { fail("dQ element not covered exactly once", -1, -1, e); break; }
  }
  for (int e = 0; e < Traits::kDqChunkFloats; ++e) {
    if (slot[e] != 1) { fail("dQ chunk slot not used exactly once", -1, -1, e); break; }
  }
  std::printf("d=%d, %d rows: %s\n", kHeadDim, kBlockM, errors ? "FAILED" : "ok");
  return errors;
}

template <int kHeadDim>
int check_bucket() {
  return check_traits<BwdTraits<kHeadDim, cutlass::bfloat16_t>>();
}

int main() {
  const int errors =
      check_bucket<64>() + check_bucket<96>() + check_bucket<128>() + check_bucket<192>() +
      check_bucket<256>() +
      check_traits<BwdTraits<128, cutlass::bfloat16_t, jax_fa3::flash_bwd::kWideBlockM>>();
  return errors ? 1 : 0;
}
