// Backward postprocess: dq = dq_accum * softmax_scale converted to the input dtype. dq_accum is
// (b, h, s_q, d) fp32, dq is (b, s_q, h, d). Four elements per thread (d is a multiple of 8).
#pragma once
#include <cstdint>

#include <cutlass/numeric_types.h>

namespace jax_fa3::flash_bwd {

template <typename Element>
__global__ void __launch_bounds__(256)
    flash_bwd_postprocess_kernel(const float* __restrict__ dq_accum, Element* __restrict__ dq,
                                 int b, int s_q, int h, int d, float scale) {
  const int d4 = d / 4;
  const int64_t total = int64_t(b) * s_q * h * d4;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(idx % d4) * 4;
    int64_t rest = idx / d4;  // (b, s_q, h) flattened
    const int hh = static_cast<int>(rest % h);
    rest /= h;
    const int i = static_cast<int>(rest % s_q);
    const int64_t bb = rest / s_q;
    const float4 v =
        *reinterpret_cast<const float4*>(dq_accum + ((bb * h + hh) * s_q + i) * d + c);
    const Element e0(v.x * scale), e1(v.y * scale), e2(v.z * scale), e3(v.w * scale);
    uint2 packed;
    packed.x = uint32_t(e0.raw()) | (uint32_t(e1.raw()) << 16);
    packed.y = uint32_t(e2.raw()) | (uint32_t(e3.raw()) << 16);
    *reinterpret_cast<uint2*>(dq + idx * 4) = packed;
  }
}

}  // namespace jax_fa3::flash_bwd
