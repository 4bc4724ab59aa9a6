// The fp8 P/V layout fact: how the transposed V copy permutes keys so that P (the fp32 S
// accumulator) becomes the A operand of the fp8 PV wgmma without any register shuffle.
// Plain C++ (host and device): used by the transpose pre-pass, the P conversion and the host-side
// layout test (tests/cuda/check_fp8_layouts.cu).
//
// Register fragments (PTX ISA, "Matrix fragments for wgmma", per warpgroup thread t, lane l =
// t % 32, warp w = t / 32, r = 16w + l/4 the thread's first row, q = l % 4):
//   fp32 accumulator of S (m64nNk*), for every 8-column chunk j, four values
//     idx = v0 + 2*v1 + 4*j  ->  (row r + 8*v1, column 8j + 2q + v0)
//   e4m3 A operand of m64nNk32 (four 32-bit registers, 4 bytes each), register a, byte e:
//     (row r + 8*(a%2), k 16*(a/2) + 4q + e)
// For one k32 step (S columns 32s..32s+31 = chunks 4s..4s+3, flat S values 16s..16s+15) the
// thread holds, per row, S columns {2q, 2q+1, 8+2q, 9+2q, 16+2q, 17+2q, 24+2q, 25+2q} but the A
// operand wants k {4q..4q+3, 16+4q..16+4q+3}: different sets, which FA3 fixes with byte permutes
// and warp shuffles. We instead pack P in place — register a of step s gets the four values
//   S flat 16s + fp8_p_source(a, e), e = 0..3  (rows match: a%2 = v1)
// i.e. A slot k = 16h + 4q + e (h = a/2) holds S column fp8_key_of_slot(k) = 16h + 8*(e/2) + 2q +
// e%2, and compensate on the other operand: the transposed copy of V stores at key slot k (within
// each group of 32 keys) the V row of key fp8_key_of_slot(k). Then
//   sum_k A[row, k] * Vt[k, n] = sum_k P[row, key(k)] * V[key(k), n] = (P V)[row, n]
// because fp8_key_of_slot is a bijection of 0..31. The S GEMM, the masks and the per-key scales
// are unaffected (they work on the unpermuted S columns).
#pragma once

namespace jax_fa3::fp8 {

// Key (0..31, within a group of 32) whose score sits in A-operand slot k (0..31) of a k32 step.
__host__ __device__ constexpr int fp8_key_of_slot(int k) {
  const int h = k / 16, q = (k % 16) / 4, e = k % 4;
  return 16 * h + 8 * (e / 2) + 2 * q + (e % 2);
}

// Flat index (0..15, within one k32 step's 16 S values) packed into byte e of A register a.
__host__ __device__ constexpr int fp8_p_source(int a, int e) {
  return 8 * (a / 2) + 2 * (a % 2) + 4 * (e / 2) + (e % 2);
}

// Keys of the transposed V rows are padded to a multiple of this (whole permutation groups; also
// keeps TMA's 16-byte global stride rule).
constexpr int kFp8KeyPad = 32;

}  // namespace jax_fa3::fp8
