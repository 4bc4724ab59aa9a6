// Host entry point of the forward kernel. Plain C++ (no CuTe), so the FFI handler can include it.
#pragma once
#include <cuda_runtime.h>

#include "common/buckets.h"
#include "flash_fwd/params.h"

namespace jax_fa3 {

// One specialization per cuda/instantiations/flash_fwd_hdim<D>_<dtype>.cu (only those compiled
// in); keyed by our DType so this header needs no CUTLASS types. Dispatch: flash_fwd/dispatch.h.
template <int kHeadDim, DType kDType>
cudaError_t run_flash_fwd(const FlashFwdParams& params, cudaStream_t stream);

}  // namespace jax_fa3
