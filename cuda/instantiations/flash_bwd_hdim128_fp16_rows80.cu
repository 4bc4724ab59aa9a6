// FlashAttention-3 backward, head-dim bucket 128, fp16, 80-row Q blocks (params.h wide_q_blocks).
#include "flash_bwd/launch.cuh"

JAX_FA3_INSTANTIATE_FLASH_BWD_ROWS80(fp16, cutlass::half_t)
