// What the forward kernel needs to know about one call: plain data, no CUDA, no XLA, no CuTe.
// Built by the FFI handler, consumed by launch.h (host) and, copied into the kernel parameters,
// by the device code.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace jax_fa3 {

struct FlashFwdParams {
  // q (b, s_q, h, d), k/v (b, s_k, h_k, d), o like q: contiguous row-major, so the row stride is
  // h*d (resp. h_k*d) elements and the head stride d. lse (b, h, s_q) float32.
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  int b, s_q, s_k, h, h_k;
  int d;          // the real head dim (multiple of 8, <= 256); the kernel runs in bucket >= d
  DType dtype;    // bf16 or fp16

  float softmax_scale;  // natural-units scale applied to q·k
  float softcap;        // 0 = off; else s = softcap * tanh(softmax_scale * q·k / softcap)
  int window_left;      // -1 = unbounded
  int window_right;     // -1 = unbounded; causal arrives as 0
  // Per-query key ranges and their 64-row covers (common/key_ranges.h), or nullptr: whole rows
  // under the window above. 16-bit kernels only; the ranges replace the window.
  const int* key_ranges = nullptr;
  const int* key_covers = nullptr;
  // Or per-row bounds (b, 3): (q_len, k_len, diag) (common/key_ranges.h), on the same kernels:
  // each row's range comes from its bounds and the window above, nothing else is read.
  const int* row_bounds = nullptr;
  // Or one cache length per batch row (b,), a decode step's: the bounds (s_q, length,
  // length - 1) (common/key_ranges.h, load_length_row_bounds), with no (b, 3) array to build.
  const int* row_lengths = nullptr;
  // A paged KV cache read in place (key ranges only): k and v are pools (num_pages, page_size,
  // h_k, d), and batch row r's logical key j lives in page kv_pages[r, j / page_size] at row
  // j % page_size; s_k = pages_per_seq * page_size. page_size is a multiple of the kernel's key
  // block (common/buckets.h, forward_key_block), so no K/V block straddles two pages. nullptr:
  // k and v are (b, s_k, h_k, d).
  const int* kv_pages = nullptr;
  int pages_per_seq = 0;
  int page_size = 0;
  int num_pages = 0;
  // Decoding (key-range kernels). qo_heads_major: q and o are laid out (b, h, s_q, d) rather
  // than (b, s_q, h, d); a GQA decode step's q (b, 1, h_k * g, d) is then read in place as g
  // query rows of each of h_k heads (s_q = g, h = h_k), so one tile streams a kv head's K/V
  // for all its query heads. num_splits > 1: split-KV in the kernel: each (row, head) tile is
  // num_splits tiles, piece p visiting the row's keys in
  // [p * split_keys, (p + 1) * split_keys), split_keys = ceil(key blocks / num_splits) * key
  // block; o and lse then hold b * num_splits rows, piece p of batch row r at row
  // r * num_splits + p (merged by the split-KV combine, cuda/decode/).
  bool qo_heads_major = false;
  int num_splits = 1;
  // An e4m3 KV cache (decode steps, d <= 128: flash_fwd/fp8_cache.h): k and v (or their pools)
  // are e4m3, and the key in slot j of batch row r (contiguous) or of page r (paged) of kv head
  // kh is value * k_scales[(r * h_k + kh) * scale_blocks + min(j / scale_block,
  // scale_blocks - 1)] (v likewise): one scale per scale_block slots. nullptr: a 16-bit cache.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  int scale_block = 0;
  int scale_blocks = 0;
};

// The device-side view of the scalars: the scale already folded into the log2 domain.
struct FlashFwdScalars {
  int b, s_q, s_k, h, h_k, d;
  // Without softcap: p = exp2(qk * scale_log2 - max * scale_log2).
  // With softcap: s = softcap * tanh(qk * softcap_pre) first, then scale_log2 = log2(e).
  float scale_log2;
  float softcap_pre;   // softmax_scale / softcap (only read when use_softcap)
  float softcap;       // 0 = off
  int window_left, window_right;
  float* lse;
  const int* key_ranges;  // FlashFwdParams::key_ranges
  const int* key_covers;  // FlashFwdParams::key_covers
  const int* row_bounds;  // FlashFwdParams::row_bounds or row_lengths (then window_* are
                          // bounded_window's)
  int bounds_are_lengths; // row_bounds holds FlashFwdParams::row_lengths
  const int* kv_pages;    // FlashFwdParams::kv_pages
  int pages_per_seq;
  int blocks_per_page;    // page_size / kBlockN
  int num_pages;
  int num_splits;         // FlashFwdParams::num_splits (1: none)
  int split_keys;         // keys per piece, a multiple of kBlockN (0: no split)
};

}  // namespace jax_fa3
