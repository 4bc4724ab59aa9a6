// FlashAttention-3 backward, head-dim bucket 128, bf16, 80-row Q blocks (params.h wide_q_blocks).
#include "flash_bwd/launch.cuh"

JAX_FA3_INSTANTIATE_FLASH_BWD_ROWS80(bf16, cutlass::bfloat16_t)
