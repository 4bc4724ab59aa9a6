// Optional per-warpgroup timeline of the forward main loop (clock64 stamps), for
// cuda/flash_fwd/tools/fwd_timeline.cu only: compiled in with -DJAX_FA3_FWD_TRACE, empty
// otherwise. Thread 0 of each consumer warpgroup of the first kTraceCtas CTAs stamps kTraceEvents
// points per K/V block; `step` counts the warpgroup's blocks across its tiles.
#pragma once
#include <cstdint>

namespace jax_fa3::fwd {

enum TraceEvent : int {
  kTraceStart = 0,     // top of a steady-state block
  kTraceKvReady,       // K(n) and V(n+1) have landed
  kTraceTurn,          // this warpgroup's ping-pong turn began
  kTraceIssued,        // both GEMMs issued, turn passed on
  kTraceScoresReady,   // S(n) complete
  kTraceMaxDone,       // fp8: row maxima of S(n) reduced (the exp2 pass starts)
  kTraceSoftmaxDone,   // P(n) in fp32, row stats updated
  kTracePvDone,        // O += P(n+1) V(n+1) complete
  kTraceEnd,           // O rescaled, P(n) converted
  kTraceEvents
};

#ifdef JAX_FA3_FWD_TRACE
constexpr int kTraceCtas = 8;
constexpr int kTraceWarpGroups = 3;  // consumer warpgroups: 2, or 3 (fp8 d64)
constexpr int kTraceSteps = 512;
__device__ long long g_fwd_trace[kTraceCtas][kTraceWarpGroups][kTraceSteps][kTraceEvents];
__device__ __forceinline__ void trace_stamp(int wg, int step, int event) {
  if (blockIdx.x < kTraceCtas && threadIdx.x % 128 == 0 && step < kTraceSteps) {
    g_fwd_trace[blockIdx.x][wg][step][event] = clock64();
  }
}
#else
__device__ __forceinline__ void trace_stamp(int, int, int) {}
#endif

}  // namespace jax_fa3::fwd
