// float32 accumulator values -> the e4m3 A operand (registers) of an fp8 RS wgmma m64nNk32 whose
// K is the accumulator's N. Shared by the fp8 forward (P of O += P V) and the fp8 backward (P'^T
// of dV += P'^T dO8, the dK operand y^T of dK += y^T q8).
//
// The values are packed in place order, not moved between threads: register a of k32 step s takes
// the accumulator values 16 s + fp8_p_source(a, e), e = 0..3 (flash_fwd/fp8/layout.h), so A slot k
// of every 32 holds accumulator column fp8_key_of_slot(k). The GEMM's B operand compensates: it
// stores at K slot k the row of column fp8_key_of_slot(k) (the fp8 forward's Vt, the fp8
// backward's transposed q8 and dO8, laid out by jax_fa3._fp8_quantize.kernel_v_layout).
#pragma once
#include <cstdint>

#include <cute/tensor.hpp>

#include "flash_fwd/fp8/layout.h"

namespace jax_fa3::fp8 {

// Two fp32 -> packed e4m3x2 (round to nearest even, saturating to +-448, NaN stays NaN): lo in
// bits 0..7, hi in 8..15.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// tA (the e4m3 A fragment: 16 values per k32 step, register-major) <- value(i) for the flat
// accumulator indices i of k32 steps [kStepBegin, kStepEnd). value: int -> float, called once per
// index, so it may compute the value (a product, a select) instead of reading a stored one.
template <int kStepBegin, int kStepEnd, class Value, class FragA>
__device__ __forceinline__ void pack_e4m3_a_operand(Value&& value, FragA& tA) {
  cute::Tensor a32 = cute::recast<uint32_t>(tA);
#pragma unroll
  for (int step = kStepBegin; step < kStepEnd; ++step) {
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int base = 16 * step;
      const uint32_t lo = cvt_e4m3x2(value(base + fp8_p_source(a, 0)),
                                     value(base + fp8_p_source(a, 1)));
      const uint32_t hi = cvt_e4m3x2(value(base + fp8_p_source(a, 2)),
                                     value(base + fp8_p_source(a, 3)));
      a32(4 * step + a) = lo | (hi << 16);
    }
  }
}

}  // namespace jax_fa3::fp8
