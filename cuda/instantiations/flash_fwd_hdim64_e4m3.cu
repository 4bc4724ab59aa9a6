// Forward kernel, head-dim bucket 64, fp8 (e4m3 inputs, bf16 output). One instantiation per file.
#include "flash_fwd/fp8/launch.h"

template cudaError_t jax_fa3::run_flash_fwd_fp8<64, 192>(const jax_fa3::FlashFwdFp8Params&, cudaStream_t);
