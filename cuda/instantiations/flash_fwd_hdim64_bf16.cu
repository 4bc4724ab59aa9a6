// Forward kernel, head-dim bucket 64, bf16. One instantiation per file keeps compile units small.
#include "flash_fwd/launch.h"

template cudaError_t jax_fa3::run_flash_fwd<64, jax_fa3::DType::kBFloat16>(
    const jax_fa3::FlashFwdParams&, cudaStream_t);
