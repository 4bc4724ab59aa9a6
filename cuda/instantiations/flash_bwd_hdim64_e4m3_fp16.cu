// FlashAttention-3 fp8 (e4m3) backward, head-dim bucket 64, fp16 dO / V / K~. One instantiation per file
// (parallel builds).
#include "flash_bwd/launch.cuh"

JAX_FA3_INSTANTIATE_FLASH_BWD_FP8(64, fp16, cutlass::half_t)
