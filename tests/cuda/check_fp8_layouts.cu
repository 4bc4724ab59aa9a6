// Host-side checks (CuTe's layout algebra on the host; no GPU) of the fp8 forward's P/V layout
// fact (cuda/flash_fwd/fp8/layout.h), for every fp8 head-dim bucket. Exit status 0 when all hold.
//  1. fp8_key_of_slot is a bijection of 0..31 (so the permuted Vt has every key once).
//  2. For every consumer thread (both warpgroups), every k32 step s, A register a and byte e: the
//     S accumulator value the kernel packs there (flat 16s + fp8_p_source(a, e), see
//     convert_p_fp8) lies in the same row as A slot (16s + 4a + e) of the PV GEMM, and its column
//     is 32s + fp8_key_of_slot(k % 32) where k is the slot's K coordinate — the key whose V row
//     the transpose pre-pass stores at Vt slot k.
//  3. The S fragment coordinates agree with FragCoord / frag_row / frag_col (masks, descale).
//  4. End to end on integers: A (built from S by the kernel's packing) times Vt (V rows permuted as
//     fp8/vt.h stores them) equals S times V for a random S and V.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cute/tensor.hpp>  // before the traits, as in the kernel TUs

#include "flash_fwd/fp8/layout.h"
#include "flash_fwd/fp8/traits.h"
#include "flash_fwd/softmax.h"

using namespace cute;
using jax_fa3::fp8::fp8_key_of_slot;
using jax_fa3::fp8::fp8_p_source;

template <int kHeadDim, int kRows = jax_fa3::fp8_default_block_m(kHeadDim)>
int check_bucket() {
  using Traits = jax_fa3::fwd::Fp8KernelTraits<kHeadDim, kRows>;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  int errors = 0;
  auto fail = [&](const char* what, int t, int i) {
    if (errors++ < 10) std::printf("d=%d: %s (thread %d, i %d)\n", kHeadDim, what, t, i);
  };

  // 1. Bijection.
  std::vector<int> seen(32, 0);
  for (int k = 0; k < 32; ++k) {
    const int key = fp8_key_of_slot(k);
    if (key < 0 || key >= 32) fail("key_of_slot out of range", -1, k);
    else seen[key]++;
  }
  for (int k = 0; k < 32; ++k) {
    if (seen[k] != 1) fail("key_of_slot not a bijection", -1, k);
  }

  // Random S (kBlockM x kBlockN) and V (kBlockN x kHeadDim) for 4.
  std::srand(kHeadDim);
  std::vector<long> S(kBlockM * kBlockN), V(kBlockN * kHeadDim), A(kBlockM * kBlockN, -1);
  for (auto& x : S) x = std::rand() % 17 - 8;
  for (auto& x : V) x = std::rand() % 17 - 8;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  for (int t = 0; t < Traits::kNumConsumerThreads; ++t) {
    auto thr_qk = mma_qk.get_thread_slice(t);
    auto thr_pv = mma_pv.get_thread_slice(t);
    Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cP = thr_pv.partition_A(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    if (size(cS) != size(cP) || size(cS) % 16 != 0) {
      fail("S and P fragments differ in size", t, int(size(cS)));
      break;
    }
    const auto fc = jax_fa3::fwd::FragCoord::of_thread(t % 128);
    for (int i = 0; i < size(cS); ++i) {
      // 3. FragCoord (rows within the warpgroup's 64) and frag_row / frag_col.
      const int row = 64 * (t / 128) + fc.row0 + 8 * jax_fa3::fwd::frag_row(i);
      const int col = fc.col0 + jax_fa3::fwd::frag_col(i);
      if (get<0>(cS(i)) != row || get<1>(cS(i)) != col) fail("S fragment != FragCoord", t, i);
    }
    for (int step = 0; step < size(cS) / 16; ++step) {
      for (int a = 0; a < 4; ++a) {
        for (int e = 0; e < 4; ++e) {
          const int ip = 16 * step + 4 * a + e;             // A slot (register a, byte e)
          const int is = 16 * step + fp8_p_source(a, e);    // S value packed there
          const int m = get<0>(cP(ip)), k = get<1>(cP(ip));
          // 2. Same row; column = the key the permuted Vt holds at slot k.
          if (get<0>(cS(is)) != m) fail("P slot row != S value row", t, ip);
          if (get<1>(cS(is)) != 32 * (k / 32) + fp8_key_of_slot(k % 32)) {
            fail("P slot key != permuted Vt key", t, ip);
          }
          // The PTX A layout (register a, byte e) -> (r + 8*(a%2), 16*(a/2) + 4q + e).
          const int lane = t % 32, r = 64 * (t / 128) + 16 * ((t % 128) / 32) + lane / 4;
          if (m != r + 8 * (a % 2) || k != 32 * step + 16 * (a / 2) + 4 * (lane % 4) + e) {
            fail("CuTe A layout != PTX e4m3 A fragment", t, ip);
          }
          if (A[m * kBlockN + k] != -1) fail("A slot written twice", t, ip);
          A[m * kBlockN + k] = S[get<0>(cS(is)) * kBlockN + get<1>(cS(is))];
        }
      }
    }
  }
  // 4. A * Vt == S * V, Vt[slot k] = V[32*(k/32) + key_of_slot(k % 32)] (fp8/vt.h).
  for (int m = 0; m < kBlockM && errors == 0; ++m) {
    for (int n = 0; n < kHeadDim; ++n) {
      long lhs = 0, rhs = 0;
      for (int k = 0; k < kBlockN; ++k) {
        const int key = 32 * (k / 32) + fp8_key_of_slot(k % 32);
        lhs += A[m * kBlockN + k] * V[key * kHeadDim + n];
        rhs += S[m * kBlockN + k] * V[k * kHeadDim + n];
      }
      if (lhs != rhs) { fail("A * Vt != S * V", m, n); break; }
    }
  }
  std::printf("d=%d (tile %dx%d): %s\n", kHeadDim, kBlockM, kBlockN, errors ? "FAILED" : "ok");
  return errors;
}

int main() {
  // The table itself, for tests/test_cuda_layouts.py to compare with jax_fa3._fp8_quantize.KEY_OF_SLOT (the
  // Python copy the XLA fallback of the keys-transposed quantization uses).
  std::printf("key_of_slot:");
  for (int k = 0; k < 32; ++k) std::printf(" %d", fp8_key_of_slot(k));
  std::printf("\n");
  int errors = 0;
  errors += check_bucket<64>();
  errors += check_bucket<128>();
  errors += check_bucket<128, 128>();  // d128's second kernel (fp8/flash_fwd_fp8.h, fp8_block_m)
  errors += check_bucket<256>();
  return errors ? 1 : 0;
}
