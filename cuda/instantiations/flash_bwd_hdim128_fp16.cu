// FlashAttention-3 backward, head-dim bucket 128, fp16. One instantiation per file (parallel builds).
#include "flash_bwd/launch.cuh"

JAX_FA3_INSTANTIATE_FLASH_BWD(128, fp16, cutlass::half_t)
