// FlashAttention-3 backward, head-dim bucket 192, bf16. One instantiation per file (parallel builds).
#include "flash_bwd/launch.cuh"

JAX_FA3_INSTANTIATE_FLASH_BWD(192, bf16, cutlass::bfloat16_t)
