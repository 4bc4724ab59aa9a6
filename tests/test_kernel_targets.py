"""The test suite's own instruments: the kernel-target check (tests/kernel_targets.py) and the
FlashAttention-3 accuracy criterion (tests/fa3_criterion.py). CPU only."""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
import kernel_targets as kt
from fa3_criterion import assert_within_criterion, check_forward, check_grads, naive_attention
from oracle import keys_seen_per_row, oracle_attention

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_known_targets_are_those_the_extension_registers():
  registry = (REPO / "cuda" / "ffi" / "registry.cc").read_text()
  assert set(re.findall(r'\{"(jax_fa3_[a-z0-9_]+)"', registry)) == kt.KNOWN_TARGETS


def test_finds_a_target_in_stablehlo():
  call = lambda x: jax.ffi.ffi_call(kt.FLASH_FWD, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  text = jax.jit(call).lower(jnp.ones(4)).as_text()  # lowering needs no registered handler
  assert kt.kernel_targets(text) == {kt.FLASH_FWD: 1}
  kt.assert_targets(text, kt.FLASH_FWD)
  with pytest.raises(AssertionError, match="pure-JAX fallback"):
    kt.assert_targets(text, {kt.FLASH_FWD, kt.FLASH_BWD})


def test_finds_targets_in_compiled_hlo():
  text = ('%a = bf16[2,8]{1,0} custom-call(%p), custom_call_target="jax_fa3_flash_fwd_fp8", x\n'
          '%b = f32[3]{0} custom-call(%q), custom_call_target="lapack_spotrf_ffi"\n'
          '%c = f32[3]{0} custom-call(%r), custom_call_target="jax_fa3_flash_fwd_fp8"\n')
  assert kt.custom_call_targets(text) == {kt.FLASH_FWD_FP8: 2, "lapack_spotrf_ffi": 1}
  assert kt.kernel_targets(text) == {kt.FLASH_FWD_FP8: 2}
  kt.assert_targets(text, [kt.FLASH_FWD_FP8])
  with pytest.raises(AssertionError, match="jax_fa3_flash_fwd'"):
    kt.assert_targets(text, kt.FLASH_FWD)  # the fp8 target is not the bf16 one


def test_rejects_an_unknown_expected_target():
  with pytest.raises(AssertionError, match="not a jax_fa3 kernel target"):
    kt.assert_targets("", "jax_fa3_flash_fwd_typo")


@pytest.mark.skipif(jax_fa3.kernels_available(), reason="the pure-JAX path runs only off-GPU")
def test_reports_no_kernel_target_for_the_pure_jax_path():
  q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
  grad = jax.grad(lambda q: jax_fa3.flash_attention(q, q, q).astype(jnp.float32).sum())
  text = kt.compiled_text(grad, q)
  assert kt.kernel_targets(text) == {}
  assert kt.describe(text) == "no kernel target"
  with pytest.raises(AssertionError, match="pure-JAX fallback"):
    kt.run_on_kernels(grad, q, expected={kt.FLASH_FWD, kt.FLASH_BWD})


def _rounded(seed, shape, dtype):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_criterion_accepts_the_float32_path_and_rejects_a_bias(dtype):
  """The pure-JAX path in float32, rounded once to the dtype, is more accurate than naive
  attention in the dtype, so it passes; the same output pushed 16 ulps of its magnitude off in one row fails."""
  q, k, v = (_rounded(i, (1, 200, 2, 64), dtype) for i in range(3))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  out, lse = jax_fa3.flash_attention(*f32, causal=True, return_lse=True)
  check_forward(out.astype(dtype), lse, q, k, v, causal=True)
  ref, _ = oracle_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True)
  naive, _ = naive_attention(q, k, v, dtype, causal=True)
  assert np.max(np.abs(naive - ref)) > 0  # the bound is not reduced to its floor
  bad = np.asarray(out, np.float64).copy()
  bad[0, 150] += 16 * float(jnp.finfo(dtype).eps) * np.max(np.abs(ref))
  with pytest.raises(AssertionError, match="exceeds"):
    assert_within_criterion("out", bad, ref, naive, dtype)


def test_criterion_checks_empty_rows_exactly():
  q, k, v = (_rounded(i, (1, 40, 2, 64), jnp.bfloat16) for i in (3, 4, 5))
  k, v = k[:, :10], v[:, :10]  # causal, s_q > s_k: rows 0-29 see no key, row 30 one key
  seen = keys_seen_per_row(40, 10, causal=True)
  assert (seen == 0).sum() == 30 and seen[30] == 1
  out, lse = jax_fa3.flash_attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True,
                                     return_lse=True)
  check_forward(out.astype(jnp.bfloat16), lse, q, k, v, causal=True)
  with pytest.raises(AssertionError, match="exactly 0"):
    check_forward(out.astype(jnp.bfloat16).at[0, 0].set(1e-3), lse, q, k, v, causal=True)
  with pytest.raises(AssertionError, match="LSE"):
    check_forward(out.astype(jnp.bfloat16), lse.at[0, 0, 0].set(0.0), q, k, v, causal=True)


@pytest.mark.parametrize("options", [dict(causal=True), dict(softcap=5.0, softmax_scale=0.3),
                                     dict(window_size=(7, 3))])
def test_criterion_accepts_float32_gradients(options):
  q, k, v, do = (_rounded(i, shape, jnp.bfloat16) for i, shape in
                 enumerate([(1, 90, 4, 64), (1, 70, 2, 64), (1, 70, 2, 64), (1, 90, 4, 64)]))
  loss = lambda q, k, v: jnp.sum(jax_fa3.flash_attention(q, k, v, **options)
                                 * do.astype(jnp.float32))
  grads = jax.grad(loss, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
  check_grads([g.astype(jnp.bfloat16) for g in grads], q, k, v, do, **options)


# The GPU test files that run jax_fa3 kernels through XLA; test_gpu_exp2_fma.py compiles and runs
# a standalone CUDA check (no FFI target to look for).
NO_FFI_TARGET = {"test_gpu_exp2_fma.py"}


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "tests").glob("test_gpu_*.py")))
def test_every_gpu_test_file_checks_kernel_targets(path):
  text = (REPO / "tests" / path).read_text()
  if path in NO_FFI_TARGET:
    assert "jax_fa3." not in text
    return
  assert "from kernel_targets import" in text
  assert "pytestmark = pytest.mark.gpu" in text
