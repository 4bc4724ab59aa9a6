"""Decoding over an e4m3 KV cache read in place (jax_fa3_flash_fwd_decode_fp8_cache,
_paged_decode_fp8_cache: cuda/flash_fwd/fp8_cache.h) through `flash_attention_with_kvcache`.

Main check, tolerance-free: the converter writes exactly `(value.astype(float32) *
scale).astype(q.dtype)` into the 16-bit tile and the consumer is the 16-bit decode kernel's, so
out must be bit for bit the 16-bit decode kernel's over the dequantized cache (contiguous and
paged, GQA, split or not, ragged lengths with 0, 1 and the capacity, outputs poisoned first).
Then against the float64 oracle of the dequantized cache (bf16 tolerance), a cache whose tail
block is partial and scale blocks that do not divide the key block, and the handler's refusals.
"""
import os

os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from jax_fa3 import _local_attention
from ffi_probe import ffi_error_message
from kernel_build import skip_unless_compiled
from kernel_targets import (FLASH_FWD_DECODE, FLASH_FWD_DECODE_FP8_CACHE, FLASH_FWD_PAGED_DECODE,
                            FLASH_FWD_PAGED_DECODE_FP8_CACHE, compiled_text, kernel_targets,
                            run_on_kernels)
from oracle import attention_oracle
from paged_cache import shuffled_pages

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _masked_kernels(monkeypatch):
  monkeypatch.setenv(_local_attention.MASKED_KERNELS_ENV, "1")


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
  return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)).astype(dtype)


def _bits(x):
  return np.asarray(x).view(np.uint16)


def _fp8_and_dequantized(cache, block, dtype):
  pair = jax_fa3.quantize_fp8(cache, block_size=block)
  return pair, jax_fa3.dequantize_fp8(*pair, block_size=block, dtype=dtype)


# (d, capacity, page size or None, scale block, splits): d = 128's key block is 128 keys, d = 64's
# 160; pages of whole key blocks are read in place; scale blocks of 48 and 7 do not divide them
# (a key block's scales start mid-run), one of 1 gives every key row its own scale (a key block
# spans the kernel's whole box of scales).
_CASES = [(128, 1024, None, 64, 1), (128, 1024, None, 64, 3), (128, 1000, None, 48, 0),
          (128, 1024, 256, 64, 1), (128, 1024, 256, 64, 4), (64, 960, None, 64, 2),
          (64, 960, 320, 32, 1), (96, 864, None, 64, 1), (112, 640, None, 16, 2),
          (128, 1024, 256, 7, 2), (128, 900, None, 1, 1), (64, 960, 320, 7, 0)]


@pytest.mark.parametrize("d,capacity,page,block,splits", _CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_e4m3_cache_is_the_16bit_kernel_over_its_dequantized_values(d, capacity, page, block,
                                                                     splits, dtype):
  b, h, h_k = 3, 16, 2
  q = _normal(1, (b, 1, h, d), dtype)
  skip_unless_compiled(q)
  k_cache, v_cache = _normal(2, (b, capacity, h_k, d), scale=3.0), _normal(3, (b, capacity, h_k, d))
  options = dict(num_splits=splits)
  if page is not None:
    (k_cache, table), (v_cache, _) = (shuffled_pages(k_cache, page, 4),
                                      shuffled_pages(v_cache, page, 4))
    options["page_table"] = table
  (k8, k_deq), (v8, v_deq) = (_fp8_and_dequantized(x, block, dtype) for x in (k_cache, v_cache))
  lengths = jnp.asarray([1, capacity, capacity // 2 + 7], jnp.int32)
  fp8_call = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, block_size=block, **options))
  target = FLASH_FWD_PAGED_DECODE_FP8_CACHE if page else FLASH_FWD_DECODE_FP8_CACHE
  got = run_on_kernels(fp8_call, q, k8, v8, expected={target})
  bf16_call = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, **options))
  want = run_on_kernels(bf16_call, q, k_deq, v_deq,
                        expected={FLASH_FWD_PAGED_DECODE if page else FLASH_FWD_DECODE})
  np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("h,options", [(8, dict(softcap=30.0)),
                                       (4, dict(window_size=(300, 0))),  # MHA: a left window
                                       (8, dict(softmax_scale=0.05, num_splits=5))])
def test_e4m3_cache_with_softcap_windows_and_scales(h, options):
  # The same bit-for-bit check with the decode kernel's other options: softcap, a left window
  # (decoded only without GQA), another softmax scale with an odd split.
  b, capacity, h_k, d, block = 2, 1536, 4, 128, 64
  q = _normal(40, (b, 1, h, d), jnp.bfloat16)
  skip_unless_compiled(q)
  (k8, k_deq), (v8, v_deq) = (_fp8_and_dequantized(_normal(s, (b, capacity, h_k, d)), block,
                                                   jnp.bfloat16) for s in (41, 42))
  lengths = jnp.asarray([1536, 777], jnp.int32)
  call = lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, causal=True, **options)
  got = run_on_kernels(jax.jit(call), q, k8, v8, expected={FLASH_FWD_DECODE_FP8_CACHE})
  want = run_on_kernels(jax.jit(call), q, k_deq, v_deq, expected={FLASH_FWD_DECODE})
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_e4m3_cache_matches_the_float64_oracle():
  # GQA 8:1, causal, a row of length 0 (out 0, lse +inf), the split's merge, return_lse.
  b, capacity, h, h_k, d, block = 4, 2048, 16, 2, 128, 64
  q = _normal(10, (b, 1, h, d), jnp.bfloat16)
  skip_unless_compiled(q)
  # The oracle attends over what the kernel does: the values times their scales in bf16.
  (k8, k_deq), (v8, v_deq) = (_fp8_and_dequantized(_normal(s, (b, capacity, h_k, d)), block,
                                                   jnp.bfloat16) for s in (11, 12))
  lengths = np.array([0, 1, 2048, 1300], np.int32)
  call = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=jnp.asarray(lengths), causal=True, return_lse=True, num_splits=4,
      block_size=block))
  out, lse = run_on_kernels(call, q, k8, v8, expected={FLASH_FWD_DECODE_FP8_CACHE})
  out, lse = np.asarray(out, np.float64), np.asarray(lse)
  for r, n in enumerate(lengths):
    if n == 0:
      np.testing.assert_array_equal(out[r], 0.0)
      assert np.all(np.isposinf(lse[r]))
      continue
    want_out, want_lse = attention_oracle(np.asarray(q[r:r + 1], np.float64),
                                          np.asarray(k_deq[r:r + 1, :n], np.float64),
                                          np.asarray(v_deq[r:r + 1, :n], np.float64),
                                          softmax_scale=d**-0.5)
    np.testing.assert_allclose(out[r:r + 1], want_out, atol=1e-2 * np.abs(want_out).max(),
                               rtol=0, err_msg=f"row {r}")
    np.testing.assert_allclose(lse[r:r + 1], want_lse, atol=2e-3, rtol=0, err_msg=f"row {r}")


def test_appending_to_an_e4m3_cache_then_attending_in_place():
  # A decode step that appends its token (the cache donated) reads the updated blocks in place.
  b, capacity, h, h_k, d, block = 2, 512, 8, 2, 128, 64
  q = _normal(20, (b, 1, h, d), jnp.bfloat16)
  skip_unless_compiled(q)
  k8, v8 = (jax_fa3.quantize_fp8(_normal(s, (b, capacity, h_k, d)), block_size=block)
            for s in (21, 22))
  k_new, v_new = _normal(23, (b, 1, h_k, d), jnp.bfloat16), _normal(24, (b, 1, h_k, d), jnp.bfloat16)
  lengths = jnp.asarray([100, 383], jnp.int32)
  step = jax.jit(lambda q, kc, vc, k, v: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, k, v, cache_seqlens=lengths, block_size=block))
  assert FLASH_FWD_DECODE_FP8_CACHE in kernel_targets(compiled_text(step, q, k8, v8, k_new, v_new))
  out, k8_new, v8_new = step(q, k8, v8, k_new, v_new)
  deq = lambda pair: jax_fa3.dequantize_fp8(*pair, block_size=block, dtype=jnp.bfloat16)
  want = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths + 1))(q, deq(k8_new), deq(v8_new))
  np.testing.assert_array_equal(_bits(out), _bits(want))


def test_large_head_dims_dequantize_instead():
  # d = 256 has no e4m3 decode kernel: the cache is dequantized onto the 16-bit decode target.
  b, capacity, h, h_k, d = 2, 512, 4, 2, 256
  q = _normal(30, (b, 1, h, d), jnp.bfloat16)
  skip_unless_compiled(q)
  k8, v8 = (jax_fa3.quantize_fp8(_normal(s, (b, capacity, h_k, d))) for s in (31, 32))
  call = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=jnp.asarray([512, 3], jnp.int32)))
  found = kernel_targets(compiled_text(call, q, k8, v8))
  assert FLASH_FWD_DECODE in found and FLASH_FWD_DECODE_FP8_CACHE not in found, found


def test_fp8_cache_handler_rejects_bad_calls_via_ffi_error():
  # Caches that are not e4m3, scales of the wrong shape, d beyond 128, a scale block of 0 and a
  # page size the kernel cannot read, each refused by name.
  contiguous = """
    q = jnp.ones((2, 1, 8, {d}), jnp.bfloat16)
    k = jnp.ones((2, 256, 2, {d}), {cache_dtype})
    s = jnp.ones((2, 2, {scale_blocks}), jnp.float32)
    call = jax.ffi.ffi_call("jax_fa3_flash_fwd_decode_fp8_cache", (
        jax.ShapeDtypeStruct((2, 1, 8, {d}), q.dtype), jax.ShapeDtypeStruct((2, 1, 8), jnp.float32)))
    result = lambda: call(q, k, k, s, s, jnp.full((2,), 100, jnp.int32),
                          softmax_scale=np.float32(0.125), softcap=np.float32(0),
                          window_left=np.int32(-1), window_right=np.int32(0),
                          num_splits=np.int32(1), scale_block=np.int32({block}))
  """
  for fields, expected in [
      (dict(d=128, cache_dtype="jnp.bfloat16", scale_blocks=4, block=64), "k must be"),
      (dict(d=128, cache_dtype="jnp.float8_e4m3fn", scale_blocks=3, block=64), "k_scales"),
      (dict(d=256, cache_dtype="jnp.float8_e4m3fn", scale_blocks=4, block=64), "head dim"),
      (dict(d=128, cache_dtype="jnp.float8_e4m3fn", scale_blocks=4, block=0), "scale_block")]:
    message = ffi_error_message(contiguous.format(**fields))
    assert expected in message, message
  message = ffi_error_message("""
    q = jnp.ones((2, 1, 8, 128), jnp.bfloat16)
    pool = jnp.ones((6, 64, 2, 128), jnp.float8_e4m3fn)
    s = jnp.ones((6, 2, 1), jnp.float32)
    call = jax.ffi.ffi_call("jax_fa3_flash_fwd_paged_decode_fp8_cache", (
        jax.ShapeDtypeStruct((2, 1, 8, 128), q.dtype), jax.ShapeDtypeStruct((2, 1, 8), jnp.float32)))
    result = lambda: call(q, pool, pool, s, s, jnp.full((2,), 100, jnp.int32),
                          jnp.zeros((2, 3), jnp.int32), softmax_scale=np.float32(0.125),
                          softcap=np.float32(0), window_left=np.int32(-1),
                          window_right=np.int32(0), num_splits=np.int32(1),
                          scale_block=np.int32(64))
  """)
  assert "page_size must be a multiple of 128" in message, message
