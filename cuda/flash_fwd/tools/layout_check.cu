// Host-only check (no GPU) that the register-layout assumptions of softmax.h / consumer.h hold
// for every bucket: S fragment coordinates, P reused as the RS A operand at the same flat index,
// O fragment coordinates, compact fragments, and the V^T view. Not part of the build; run:
//   nvcc -std=c++17 --expt-relaxed-constexpr -I cuda -isystem <cutlass>/include \
//        cuda/flash_fwd/tools/layout_check.cu -o /tmp/layout_check && /tmp/layout_check
// (about a minute of compile time). Exit status = number of mismatches.
#include "flash_fwd/kernel_traits.h"
#include "flash_fwd/softmax.h"
#include <cstdio>
using namespace cute;
template <int D> int check() {
  using T = jax_fa3::fwd::KernelTraits<D, cutlass::bfloat16_t>;
  typename T::TiledMmaQK mqk; typename T::TiledMmaPV mpv;
  constexpr int M = T::kBlockM, N = T::kBlockN;
  int bad = 0;
  for (int t = 0; t < 256; ++t) {
    auto tq = mqk.get_thread_slice(t);
    Tensor cS = tq.partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    auto fragS = partition_fragment_C(mqk, Shape<Int<M>, Int<N>>{});
    if (size(cS) != size(fragS)) { printf("size mismatch\n"); return 1; }
    // fragment must be compact in the same order as the coordinate tensor's shape
    auto tp = mpv.get_thread_slice(t);
    Tensor cA = tp.partition_A(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    auto pshape = partition_shape_A(mpv, Shape<Int<M>, Int<N>>{});
    auto fragP = make_tensor<cutlass::bfloat16_t>(pshape);
    Tensor cO = tp.partition_C(make_identity_tensor(Shape<Int<M>, Int<D>>{}));
    int tw = t % 128; auto fc = jax_fa3::fwd::FragCoord::of_thread(tw);
    for (int i = 0; i < size(cS); ++i) {
      int r = get<0>(cS(i)), c = get<1>(cS(i));
      int er = 64 * (t / 128) + fc.row0 + 8 * jax_fa3::fwd::frag_row(i);
      int ec = fc.col0 + jax_fa3::fwd::frag_col(i);
      if (r != er || c != ec) { if (bad++ < 5) printf("S t%d i%d got (%d,%d) want (%d,%d)\n", t, i, r, c, er, ec); }
      // A operand coords at same flat index (flat index of a compact fragment == i)
      int ar = get<0>(cA(i)), ac = get<1>(cA(i));
      if (ar != r || ac != c) { if (bad++ < 10) printf("A t%d i%d got (%d,%d) want (%d,%d)\n", t, i, ar, ac, r, c); }
    }
    for (int i = 0; i < size(cO); ++i) {
      int r = get<0>(cO(i)), c = get<1>(cO(i));
      int er = 64 * (t / 128) + fc.row0 + 8 * jax_fa3::fwd::frag_row(i);
      int ec = fc.col0 + jax_fa3::fwd::frag_col(i);
      if (r != er || c != ec) { if (bad++ < 15) printf("O t%d i%d got (%d,%d) want (%d,%d)\n", t, i, r, c, er, ec); }
    }
    if (t == 0 && false) { print("fragS "); print(fragS.layout()); print("\ncA "); print(cA.layout()); print("\nfragP "); print(fragP.layout()); print("\n"); }
  }
  // fragments compact col-major? check strides of fragS == compact
  auto fragS = partition_fragment_C(mqk, Shape<Int<M>, Int<N>>{});
  for (int i = 0; i < size(fragS); ++i) if (fragS.layout()(i) != i) { bad++; printf("fragS not compact at %d\n", i); break; }
  auto fragP = make_tensor<cutlass::bfloat16_t>(partition_shape_A(mpv, Shape<Int<M>, Int<N>>{}));
  for (int i = 0; i < size(fragP); ++i) if (fragP.layout()(i) != i) { bad++; printf("fragP not compact\n"); break; }
  // V^T view: Vt(d, n, s) must address the same element as V(n, d, s)
  auto V = typename T::SmemLayoutV{}; auto Vt = typename T::SmemLayoutVt{};
  for (int s = 0; s < 2; ++s) for (int n = 0; n < N; ++n) for (int d = 0; d < D; ++d)
    if (V(n, d, s) != Vt(d, n, s)) { if (bad++ < 20) printf("Vt mismatch\n"); }
  printf("D=%d N=%d bad=%d smem=%d\n", D, N, bad, T::kSmemBytes);
  return bad;
}
int main() { return check<64>() + check<96>() + check<128>() + check<192>() + check<256>(); }
