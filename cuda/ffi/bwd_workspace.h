// The backward handlers' workspace: it arrives as an extra (discarded) uint8 result that XLA
// allocates with the call's other temporaries (XLA's FFI ScratchAllocator returned nothing on the
// H200, JAX 0.11.2, 2026-11-30); this checks its size and points the kernel's parameters into it.
#pragma once
#include "ffi/ffi_common.h"
#include "flash_bwd/params.h"

namespace jax_fa3::ffi_util {

// ws: the kernel's layout (flash_bwd/params.h); dq: the dq result, which holds LSE*log2(e) and D
// when ws.row_stats_in_dq; size_fn: the extension function Python sizes the buffer with.
inline ffi::Error carve_bwd_workspace(const char* op, const char* size_fn,
                                      const flash_bwd::WorkspaceLayout& ws,
                                      ffi::AnyBuffer& workspace, void* dq,
                                      flash_bwd::FlashBwdParams& p) {
  if (workspace.size_bytes() < ws.total) {
    return invalid(op, ": workspace must have at least ", ws.total, " bytes (see ", size_fn,
                   "), got ", workspace.size_bytes());
  }
  char* base = static_cast<char*>(workspace.untyped_data());
  char* row_stats = ws.row_stats_in_dq ? static_cast<char*>(dq) : base;
  p.dq_accum = reinterpret_cast<float*>(base + ws.dq_accum);
  if (ws.has_row_stats) {
    p.lse_log2 = reinterpret_cast<float*>(row_stats + ws.lse_log2);
    p.dpsum = reinterpret_cast<float*>(row_stats + ws.dpsum);
  }
  p.semaphores = p.deterministic ? reinterpret_cast<int*>(base + ws.semaphores) : nullptr;
  return ffi::Error::Success();
}

}  // namespace jax_fa3::ffi_util
