// Forward kernel, head-dim bucket 128, fp8 (e4m3 inputs, bf16 output), 128-row tiles (causal
// below 8k rows, sliding windows: fp8/flash_fwd_fp8.h, fp8_block_m). One instantiation per file.
#include "flash_fwd/fp8/launch.h"

template cudaError_t jax_fa3::run_flash_fwd_fp8<128, 128>(const jax_fa3::FlashFwdFp8Params&,
                                                           cudaStream_t);
