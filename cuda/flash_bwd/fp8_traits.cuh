// Compile-time configuration of the fp8 (e4m3) backward: the key-major 16-bit configuration
// (traits.cuh) with the members the fp8 variant changes, under the same names, so that the
// producer, the dQ writer, the consumer and the postprocess read them through `Traits::` and
// branch on `Traits::kFp8` only where the work itself differs.
//
// Numerics: jax_fa3/_fp8_backward_emulation.py (its docstring defines them). Three GEMMs take
// e4m3 operands, two keep 16-bit ones:
//   S^T  = k8 q8^T          SS, both e4m3 K-major: k8 (keys, d), q8 (rows, d)
//   dP^T = V dO^T           SS, 16-bit, as in the 16-bit kernel
//   dV  += P'^T dO8         RS: P'^T e4m3 from registers, B = dO8^T (d, rows), rows contiguous
//   dQ   = dS' K~           SS, 16-bit: the dS' tile and K~, k8 dequantized by the caller
//   dK  += y^T q8           RS: y^T e4m3 from registers, B = q8^T (d, rows), rows contiguous
// An fp8 wgmma needs both shared-memory operands K-major, and for dV and dK the K dimension is
// the query rows: the caller hands q8 and dO8 a second time transposed, (b, h, d, s_pad) with
// the rows permuted inside each group of 32 (jax_fa3._fp8_quantize.kernel_v_layout), which is
// the order the accumulator's values take as A operand (common/fp8_a_operand.cuh). Those two
// transposed tiles take the place of the 16-bit kernel's transposed views of Q and dO.
#pragma once
#include "common/cute_config.h"  // first: before any CuTe header
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "flash_bwd/traits.cuh"

namespace jax_fa3::flash_bwd {

// The widest K-major GMMA swizzle atom (8 rows) of e4m3 whose row of kBytes bytes it divides.
template <int kBytes>
using SmemAtomE4m3 = std::conditional_t<
    kBytes % 128 == 0, cute::GMMA::Layout_K_SW128_Atom<cutlass::float_e4m3_t>,
    std::conditional_t<kBytes % 64 == 0, cute::GMMA::Layout_K_SW64_Atom<cutlass::float_e4m3_t>,
                       cute::GMMA::Layout_K_SW32_Atom<cutlass::float_e4m3_t>>>;

template <int kHeadDim_, typename Element_>
struct BwdTraitsFp8 : BwdTraits<kHeadDim_, Element_> {
  using Base = BwdTraits<kHeadDim_, Element_>;
  using typename Base::Element;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kStages;
  static_assert(Base::kKeyMajor, "the fp8 backward runs the key-major arrangement (d <= 128)");
  static constexpr bool kFp8 = true;
  using ElementFp8 = cutlass::float_e4m3_t;
  // dq, dk, dv leave in float32: dk and dv are scaled per key and per (batch, kv head) and dq per
  // row on the way out, then rotated back and rounded to the inputs' type by the caller, as the
  // emulation does.
  using ElementGrad = float;

  // Shared memory (bytes): K~ and V 2*2*kBlockN*d, k8 kBlockN*d, per stage q8 + dO + q8^T +
  // dO8^T 5*kBlockM*d and the four row vectors 16*kBlockM, the dS' tile 2*kBlockM*kBlockN, sdq
  // kDqStages*4*kBlockM*d, + 1 KB alignment slack:
  //   d64 : 32K + 8K + 2*(40K + 2K) + 32K + 2*32K (sdq) + 1K = 221 KB
  //   d128: 64K + 16K + 2*(40K + 1K) + 16K + 1*32K (sdq) + 1K = 211 KB; a second sdq buffer
  //         (243 KB) does not fit
  static constexpr int kDqStages = kHeadDim <= 64 ? 2 : 1;

  // q8 (kBlockM, d) and k8 (kBlockN, d): d contiguous. The transposed tiles (d, kBlockM): rows
  // contiguous. No warpgroup takes a d-slice of these (dK and dV span all of d in each), so any
  // swizzle width that divides a row works.
  using ElementQs = ElementFp8;
  using SmemLayoutQs = decltype(cute::tile_to_shape(
      SmemAtomE4m3<kHeadDim>{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK8 = decltype(cute::tile_to_shape(
      SmemAtomE4m3<kHeadDim>{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutT8 = decltype(cute::tile_to_shape(
      SmemAtomE4m3<kBlockM>{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}));

  // S^T = k8 q8^T per warpgroup (64 keys x kBlockM rows, k32 steps over d).
  using MmaS = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
      ElementFp8, ElementFp8, float,
      cute::Shape<cute::_64, cute::Int<kBlockM>, cute::Int<kHeadDim>>, cute::GMMA::Major::K,
      cute::GMMA::Major::K>()));
  // dV += P'^T dO8, dK += y^T q8: A (64 keys x kBlockM rows) e4m3 from registers, B the
  // transposed tile (d x rows), K-major.
  using MmadKV = decltype(cute::make_tiled_mma(cute::GMMA::rs_op_selector<
      ElementFp8, ElementFp8, float,
      cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockM>>, cute::GMMA::Major::K,
      cute::GMMA::Major::K>()));

  // q8 and k8 come through the (seqlen, d, heads, batch) view of their (b, s, h, d) arrays; the
  // transposed tiles through the same view type over (b, h, d, s_pad): (d, s_pad, h, b) with
  // strides (s_pad, 1, d s_pad, h d s_pad).
  using TmaQs = decltype(make_tma_load_sdhb(
      static_cast<ElementFp8 const*>(nullptr), ShapeSDHB{}, StrideSDHB{}, SmemLayoutQs{},
      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using TmaK8 = decltype(make_tma_load_sdhb(
      static_cast<ElementFp8 const*>(nullptr), ShapeSDHB{}, StrideSDHB{}, SmemLayoutK8{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using TmaT8 = decltype(make_tma_load_sdhb(
      static_cast<ElementFp8 const*>(nullptr), ShapeSDHB{}, StrideSDHB{}, SmemLayoutT8{},
      cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}));

  static constexpr int kSizeQs = cute::cosize_v<SmemLayoutQs>;  // bytes too (1-byte elements)
  static constexpr int kSizeK8 = cute::cosize_v<SmemLayoutK8>;
  static constexpr int kSizeT8 = cute::cosize_v<SmemLayoutT8>;
  static constexpr uint32_t kBytesKVLoad = 2 * Base::kBytesKV + kSizeK8;  // K~, V, k8
  // q8, dO, q8^T, dO8^T; LSE', D, the q scale and the dK coefficient of each row.
  static constexpr uint32_t kBytesStage =
      kSizeQs + Base::kBytesQ + 2 * kSizeT8 + 4 * Base::kBytesRow;

  // The 16-bit members keep their names and roles where both kernels have them: k holds K~ (the
  // B of dQ), q holds q8 (the B of S^T), dout the 16-bit dO (the B of dP^T).
  struct SharedStorage {
    alignas(1024) Element k[Base::kSizeKV];
    alignas(1024) Element v[Base::kSizeKV];
    alignas(1024) ElementFp8 k8[kSizeK8];
    alignas(1024) ElementFp8 q[kStages * kSizeQs];
    alignas(1024) Element dout[kStages * Base::kSizeQ];
    alignas(1024) ElementFp8 qt[kStages * kSizeT8];     // q8^T
    alignas(1024) ElementFp8 doutt[kStages * kSizeT8];  // dO8^T
    alignas(1024) Element ds[Base::kSizePdS];
    alignas(128) float dq[kDqStages * Base::kDqChunkFloats];  // dQ partials
    alignas(16) float lse_log2[kStages][kBlockM];  // LSE' * log2(e): 2^8 r folded in
    alignas(16) float dpsum[kStages][kBlockM];     // D (- dlse)
    alignas(16) float q_scale[kStages][kBlockM];   // the row's q8 scale
    alignas(16) float dk_coef[kStages][kBlockM];   // w = q scale / (2^8 r) of the dK operand
    alignas(8) uint64_t bar_kv;
    uint64_t bar_full[kStages];
    uint64_t bar_empty[kStages];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + base alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "fp8 backward tile does not fit shared memory");
};

}  // namespace jax_fa3::flash_bwd
