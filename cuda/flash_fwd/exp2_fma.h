// exp2 computed on the FMA/ALU pipes, for a share of the softmax's exponentials.
//
// Why: per 64-row tile the softmax issues one MUFU.EX2 per score, and Hopper's MUFU retires 16
// per clock per SM. Where the tile's GEMMs are short (fp8 at d64: 64x128x64 QK and PV, 256 tensor
// core clocks against 512 MUFU clocks per warpgroup tile) the exp2 pass sets the pace, and moving
// every k-th exponential to a polynomial on the FMA pipe (9 issue slots each) shortens it. Where
// the loop is not MUFU-bound the extra issue slots cost more than they save (measured: traits).
//
// Method: x = j + f with j = round(x) (the 1.5 * 2^23 add puts j in the low mantissa bits of t)
// and f in [-0.5, 0.5]; 2^f by a cubic fitted for relative error (max 1.0e-4 over the range, far
// below bf16's 3.9e-3 rounding of P and e4m3's 6%); 2^j built in the exponent field by one
// integer multiply-add on t's bits, then one FMUL.
//
// Edge cases: x is clamped to >= -127, where j = -127 makes 2^j's bits 0: the result is +0.0
// exactly at and below -127 (masked scores are -inf, and a fully masked row must still sum to 0
// for finalize's "empty row" test), and below the normal range the FMUL flushes to 0 (FTZ), as
// MUFU.EX2 does. The clamp is max.NaN and NaN * 2^j is NaN, so a NaN score stays NaN as through
// MUFU.EX2 (adding j to p's bits instead would turn the GPU's NaN 0x7fffffff into a finite value).
#pragma once
#include <cstdint>

namespace jax_fa3::fwd {

__device__ __forceinline__ float exp2_fma(float x) {
  constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23
  float clamped;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(clamped) : "f"(x), "f"(-127.f));
  // __fadd_rn: neither contracted nor reassociated, so t - magic is exactly round(x).
  const float t = __fadd_rn(clamped, kRoundMagic);
  const float f = __fsub_rn(clamped, __fsub_rn(t, kRoundMagic));
  float p = fmaf(0.05500892922282219f, f, 0.2422109693288803f);
  p = fmaf(p, f, 0.6932829022407532f);
  p = fmaf(p, f, 1.f);
  // t's bits are 0x4b400000 + j; shifted by 23 only j survives: (j + 127) << 23 is 2^j.
  const float two_j = __uint_as_float((__float_as_uint(t) + 127u) << 23);
  return p * two_j;
}

// The softmax's exponential of element i (a compile-time index in the unrolled loops): every
// kFmaPeriod-th on the FMA pipe (exp2_fma), the rest on MUFU; kFmaPeriod 0 keeps all on MUFU.
template <int kFmaPeriod>
__device__ __forceinline__ float softmax_exp2(float x, int i) {
  if constexpr (kFmaPeriod > 0) {
    if (i % kFmaPeriod == kFmaPeriod - 1) return exp2_fma(x);
  }
  return exp2f(x);
}

}  // namespace jax_fa3::fwd
