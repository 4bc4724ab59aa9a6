// Host entry point of the forward kernel. Plain C++ (no CuTe), so the FFI handler can include it.
#pragma once
#include <cuda_runtime.h>

#include "flash_fwd/params.h"

namespace jax_fa3 {

// Head-dim buckets: a head dim d runs in the smallest bucket >= d (TMA zero-fills the padding).
constexpr int kFlashFwdBuckets[] = {64, 96, 128, 192, 256};

inline int flash_fwd_bucket(int d) {
  for (int bucket : kFlashFwdBuckets) {
    if (d <= bucket) return bucket;
  }
  return -1;
}

// One specialization per cuda/instantiations/flash_fwd_hdim<D>_<dtype>.cu (only those compiled
// in); keyed by our DType so this header needs no CUTLASS types. Dispatch: flash_fwd/dispatch.h.
template <int kHeadDim, DType kDType>
cudaError_t run_flash_fwd(const FlashFwdParams& params, cudaStream_t stream);

}  // namespace jax_fa3
