// Host-side checks (CuTe's layout algebra on the host; no GPU) of the layout facts the fp8
// backward kernel (cuda/flash_bwd/fp8_traits.cuh) relies on, for every fp8 head-dim bucket.
// Exit status 0 when all hold.
//  1. The e4m3 S^T accumulator (k32 wgmma) has the 16-bit one's layout: the kernel reads the
//     (key, row) of its elements, and writes dS' to the dS tile, through the 16-bit partition.
//  2. Element i of a thread's S^T accumulator lies on key row frag_row(i) of the thread's two
//     (element 2r on row r: the key coefficients), and the dK / dV accumulators hold the same two
//     key rows (the dK operand's per-key rescale and the final per-key dK factor).
//  3. P'^T and y^T packed in place (common/fp8_a_operand.cuh): A slot (register a, byte e) of
//     k32 step s of dV += P'^T dO8 / dK += y^T q8 holds the S^T value 16 s + fp8_p_source(a, e)
//     of the same key, whose row is 32 s + fp8_key_of_slot(k % 32) for the slot's K coordinate
//     k: the row that q8^T and dO8^T (jax_fa3._fp8_quantize.kernel_v_layout) store at slot k.
//  4. End to end on integers: A (packed from S^T) times B^T (rows permuted per 32) equals S^T
//     times B.
// It also prints the dK operand's constants (tests/test_cuda_layouts.py compares them with the
// emulation's) and each bucket's shared memory.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cute/tensor.hpp>  // before the traits, as in the kernel TUs

#include "common/accumulator_fragment.cuh"
#include "flash_bwd/fp8_dk_operand.cuh"
#include "flash_bwd/fp8_traits.cuh"
#include "flash_fwd/fp8/layout.h"

using namespace cute;
using jax_fa3::frag_row;
using jax_fa3::fp8::fp8_key_of_slot;
using jax_fa3::fp8::fp8_p_source;

template <int kHeadDim>
int check_bucket() {
  using Traits = jax_fa3::flash_bwd::BwdTraitsFp8<kHeadDim, cutlass::bfloat16_t>;
  constexpr int kBlockM = Traits::kBlockM;
  int errors = 0;
  auto fail = [&](const char* what, int t, int i) {
    if (errors++ < 10) std::printf("d=%d fp8: %s (thread %d, i %d)\n", kHeadDim, what, t, i);
  };

  // Random S^T (64 keys x kBlockM rows) and B (kBlockM rows x d) for 4.
  std::srand(kHeadDim);
  std::vector<long> S(64 * kBlockM), B(kBlockM * kHeadDim), A(64 * kBlockM, -1);
  for (auto& x : S) x = std::rand() % 17 - 8;
  for (auto& x : B) x = std::rand() % 17 - 8;

  typename Traits::MmaS mma_s;
  typename Traits::MmaSdP mma_sdp;
  typename Traits::MmadKV mma_dkv;
  for (int t = 0; t < 128; ++t) {
    auto tile = Shape<_64, Int<kBlockM>>{};
    Tensor c8 = mma_s.get_thread_slice(t).partition_C(make_identity_tensor(tile));
    Tensor c16 = mma_sdp.get_thread_slice(t).partition_C(make_identity_tensor(tile));
    Tensor a = mma_dkv.get_thread_slice(t).partition_A(make_identity_tensor(tile));
    Tensor ckv = mma_dkv.get_thread_slice(t).partition_C(
        make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
    if (size(c8) != size(c16) || size(a) != size(c8) || size(c8) % 16 != 0) {
      fail("fragment sizes differ", t, int(size(c8)));
      break;
    }
    for (int i = 0; i < size(c8); ++i) {
      // 1.
      if (get<0>(c8(i)) != get<0>(c16(i)) || get<1>(c8(i)) != get<1>(c16(i))) {
        fail("e4m3 S^T accumulator != 16-bit layout", t, i);
      }
      // 2.
      if (get<0>(c16(i)) != get<0>(c16(2 * frag_row(i)))) fail("S^T key row != frag_row", t, i);
    }
    if (get<0>(c16(2)) != get<0>(c16(0)) + 8) fail("S^T key rows not r, r + 8", t, 0);
    for (int i = 0; i < size(ckv); ++i) {
      if (get<0>(ckv(i)) != get<0>(c16(2 * frag_row(i)))) fail("dK row != S^T key row", t, i);
    }
    // 3.
    for (int step = 0; step < size(c8) / 16; ++step) {
      for (int ra = 0; ra < 4; ++ra) {
        for (int e = 0; e < 4; ++e) {
          const int ip = 16 * step + 4 * ra + e;           // A slot (register ra, byte e)
          const int is = 16 * step + fp8_p_source(ra, e);  // S^T value packed there
          const int key = get<0>(a(ip)), k = get<1>(a(ip));
          if (get<0>(c16(is)) != key) fail("A slot key != S^T value key", t, ip);
          if (get<1>(c16(is)) != 32 * (k / 32) + fp8_key_of_slot(k % 32)) {
            fail("A slot row != permuted B row", t, ip);
          }
          if (A[key * kBlockM + k] != -1) fail("A slot written twice", t, ip);
          A[key * kBlockM + k] = S[get<0>(c16(is)) * kBlockM + get<1>(c16(is))];
        }
      }
    }
  }
  // 4. sum_k A[key, k] B[row(k), n] == sum_row S^T[key, row] B[row, n].
  for (int key = 0; key < 64 && errors == 0; ++key) {
    for (int n = 0; n < kHeadDim; ++n) {
      long lhs = 0, rhs = 0;
      for (int k = 0; k < kBlockM; ++k) {
        const int row = 32 * (k / 32) + fp8_key_of_slot(k % 32);
        lhs += A[key * kBlockM + k] * B[row * kHeadDim + n];
        rhs += S[key * kBlockM + k] * B[k * kHeadDim + n];
      }
      if (lhs != rhs) { fail("A * B^T != S^T * B", key, n); break; }
    }
  }
  std::printf("d=%d fp8 (tile %dx%d, smem %d bytes): %s\n", kHeadDim, kBlockM, Traits::kBlockN,
              Traits::kSmemBytes, errors ? "FAILED" : "ok");
  return errors;
}

int main() {
  std::printf("dk_prescale: %.9g\n", double(jax_fa3::flash_bwd::kFp8DkPrescale));
  std::printf("dk_lazy_margin: %.9g\n", double(jax_fa3::flash_bwd::kFp8DkLazyMargin));
  std::printf("dk_min_running_max: %.9g\n", double(jax_fa3::flash_bwd::kFp8DkMinRunningMax));
  const int errors = check_bucket<64>() + check_bucket<128>();
  return errors ? 1 : 0;
}
