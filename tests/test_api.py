"""Public API: validation, differentiation (custom_vjp), jit/vmap/grad composition on any backend."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_fa3
from oracle import attention_oracle, oracle_attention_grads


def _qkv(seed, b=2, s_q=33, s_k=47, h=4, h_k=2, d=16, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  make = lambda s, hh: jnp.asarray(rng.standard_normal((b, s, hh, d)), dtype)
  return make(s_q, h), make(s_k, h_k), make(s_k, h_k)


def _rel(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(x - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("causal,window,softcap", [
    (False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (8, 3), 0.0), (True, (-1, -1), 20.0)])
def test_matches_oracle(causal, window, softcap):
  q, k, v = _qkv(0)
  out, lse = jax_fa3.flash_attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                     return_lse=True)
  right = 0 if causal else window[1]
  ref_out, ref_lse = attention_oracle(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                      softmax_scale=1 / np.sqrt(16), window_left=window[0],
                                      window_right=right, softcap=softcap)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (2, 4, 33) and lse.dtype == jnp.float32
  assert _rel(out, ref_out) < 1e-5
  finite = np.isfinite(ref_lse)
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_default_scale_and_custom_scale():
  q, k, v = _qkv(1)
  a = jax_fa3.flash_attention(q, k, v)
  b = jax_fa3.flash_attention(q, k, v, softmax_scale=1 / np.sqrt(16))
  c = jax_fa3.flash_attention(q, k, v, softmax_scale=0.05)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _rel(c, a) > 1e-3


@pytest.mark.parametrize("causal,window,softcap", [
    (False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (5, 2), 0.0), (False, (-1, -1), 3.0)])
def test_check_grads_float64(causal, window, softcap):
  q, k, v = _qkv(2, b=1, s_q=9, s_k=13, h=2, h_k=1, d=8, dtype=jnp.float64)
  f = functools.partial(jax_fa3.flash_attention, causal=causal, window_size=window, softcap=softcap)
  check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_check_grads_float32():
  q, k, v = _qkv(3, b=1, s_q=7, s_k=11, h=2, h_k=2, d=8, dtype=jnp.float32)
  f = functools.partial(jax_fa3.flash_attention, causal=True)
  # float32 finite differences: eps=1e-2 keeps truncation (O(eps^2) ~ 1e-4 for these O(1)
  # curvatures) and rounding (2^-24 / eps ~ 6e-6 per evaluation) below 1e-3, which passes.
  check_grads(f, (q, k, v), order=1, modes=("rev",), eps=1e-2, atol=1e-3, rtol=1e-3)


def test_check_grads_through_lse():
  q, k, v = _qkv(4, b=1, s_q=6, s_k=10, h=2, h_k=1, d=8, dtype=jnp.float64)
  def f(q, k, v):
    out, lse = jax_fa3.flash_attention(q, k, v, return_lse=True, window_size=(4, 4))
    return out * 0.5, jnp.sin(lse)
  check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_jit_vmap_grad_compose():
  q, k, v = _qkv(5, b=2, s_q=12, s_k=12, h=2, h_k=2, d=8)
  loss = lambda q, k, v: jnp.sum(jax_fa3.flash_attention(q, k, v, causal=True) ** 2)
  g_direct = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  g_jit = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(g_direct, g_jit):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  # vmap over a new leading axis equals the per-slice result (and composes with grad).
  stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
  vg = jax.vmap(jax.grad(loss))(*stacked)
  np.testing.assert_allclose(np.asarray(vg[0]), np.asarray(jax.grad(loss)(q, k, v)), rtol=1e-5,
                             atol=1e-6)
  outs = jax.jit(jax.vmap(lambda q, k, v: jax_fa3.flash_attention(q, k, v)))(*stacked)
  np.testing.assert_allclose(np.asarray(outs[1]),
                             np.asarray(jax_fa3.flash_attention(*(s[1] for s in stacked))),
                             rtol=1e-5, atol=1e-6)


def test_empty_rows_are_zero_with_infinite_lse():
  q, k, v = _qkv(6, b=1, s_q=8, s_k=4, h=1, h_k=1, d=8)
  out, lse = jax_fa3.flash_attention(q, k, v, causal=True, return_lse=True)
  # bottom-right alignment: query i sees keys j <= i - 4, so rows 0..3 see nothing.
  np.testing.assert_array_equal(np.asarray(out[:, :4]), 0)
  assert np.all(np.isposinf(np.asarray(lse[..., :4])))
  g = jax.grad(lambda q: jnp.sum(jax_fa3.flash_attention(q, k, v, causal=True)))(q)
  # Rows that see no key do not depend on q: exactly zero gradient there, none NaN elsewhere.
  np.testing.assert_array_equal(np.asarray(g[:, :4]), 0)
  dq_ref, _, _ = oracle_attention_grads(q, k, v, np.ones(q.shape), causal=True)
  np.testing.assert_allclose(np.asarray(g), dq_ref, rtol=1e-5, atol=1e-6)


BAD = [
    (dict(q=np.zeros((2, 3, 4))), ValueError, "q must have rank 4"),
    (dict(q="not an array"), TypeError, "q must be a JAX or NumPy array"),
    (dict(q=np.ones((1, 4, 2, 16), np.int32)), TypeError, "q must have a floating dtype"),
    (dict(k=np.ones((1, 5, 2, 16), np.float16)), TypeError, "share one dtype"),
    (dict(k=np.ones((2, 5, 2, 16), np.float32), v=np.ones((2, 5, 2, 16), np.float32)), ValueError,
     "batch size of q"),
    (dict(v=np.ones((1, 6, 2, 16), np.float32)), ValueError, "k and v must have the same shape"),
    (dict(q=np.ones((1, 4, 3, 16), np.float32)), ValueError, "multiple of the number of heads"),
    (dict(q=np.ones((1, 4, 2, 12), np.float32), k=np.ones((1, 5, 2, 12), np.float32),
          v=np.ones((1, 5, 2, 12), np.float32)), ValueError, "head_dim must be a multiple of 8"),
    (dict(q=np.ones((1, 4, 2, 264), np.float32), k=np.ones((1, 5, 2, 264), np.float32),
          v=np.ones((1, 5, 2, 264), np.float32)), ValueError, "between 8 and 256"),
    (dict(k=np.ones((1, 5, 2, 8), np.float32), v=np.ones((1, 5, 2, 8), np.float32)), ValueError,
     "head_dim of q"),
    (dict(window_size=(-2, 0)), ValueError, "window_size left must be -1"),
    (dict(window_size=(3,)), TypeError, "window_size must be a pair"),
    (dict(window_size=(1.5, 2)), TypeError, "window_size left must be an int"),
    (dict(causal=True, window_size=(4, 2)), ValueError, "causal=True means window_size right = 0"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale must be finite and > 0"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    (dict(softmax_scale="big"), TypeError, "softmax_scale must be a Python float"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(q=np.ones((1, 0, 2, 16), np.float32)), ValueError, "q must have seqlen >= 1"),
]


@pytest.mark.parametrize("override,error,message", BAD)
def test_bad_inputs_raise_clear_errors(override, error, message):
  args = dict(q=np.ones((1, 4, 2, 16), np.float32), k=np.ones((1, 5, 2, 16), np.float32),
              v=np.ones((1, 5, 2, 16), np.float32))
  kwargs = {}
  for key, value in override.items():
    (args if key in args else kwargs)[key] = value
  with pytest.raises(error, match=message):
    jax_fa3.flash_attention(args["q"], args["k"], args["v"], **kwargs)


def test_backend_is_reported():
  assert isinstance(jax_fa3.kernels_available(), bool)
  if jax_fa3.kernels_available():
    assert jax_fa3.kernels_unavailable_reason() is None
  else:
    assert jax_fa3.kernels_unavailable_reason()


@pytest.mark.parametrize("b,h,s_q,d,deterministic,expected", [
    # dq chunks 4·b·h·s_q_pad·bucket [+ semaphores]; LSE·log2e and D, 2·4·b·h·s_q_pad bytes,
    # live in the dq result when both fit in its 2·b·s_q·h·d bytes, else in the workspace. At d = 128
    # the size covers 80-row Q blocks too (s_q_pad a multiple of 80 then: 16400 for 16384).
    (1, 16, 16384, 128, False, 4 * 16 * 16400 * 128),
    (1, 16, 16384, 64, False, 4 * 16 * 16384 * 64),
    (2, 3, 65, 40, False, 4 * 2 * 3 * 128 * 64),       # s_q_pad 128, bucket 64: 512 <= 2600
    (2, 3, 65, 40, True, 4 * 2 * 3 * 128 * 64 + 256),  # 12 semaphores -> 256 B
    (1, 2, 1, 64, False, 4 * 2 * 128 * 64 + 2 * 1024),  # 512 > 64: in the workspace
])
def test_backward_workspace_formula(b, h, s_q, d, deterministic, expected):
  # The size lives in C++ only (cuda/flash_bwd/params.h); this pins it to the documented
  # formula (cuda/flash_bwd/README.md) wherever the extension is built, GPU or not.
  from jax_fa3 import _ffi  # noqa: PLC0415
  if _ffi._extension()[0] is None:
    pytest.skip(f"CUDA extension not built: {_ffi._extension()[1]}")
  assert _ffi.flash_bwd_workspace_bytes(b, h, s_q, d, deterministic) == expected


def test_main_job_runs_every_peer_and_says_which_path(capsys):
  """`python -m jax_fa3` (the README's main job): without a Hopper GPU it runs the pure-JAX path
  and says so; every peer, the fp8 call included, reports an error and a time."""
  from jax_fa3.__main__ import main  # noqa: PLC0415
  main([])
  out = capsys.readouterr().out
  if jax_fa3.kernels_available():
    pytest.skip("kernels built: the GPU run of the main job is a benchmark, not a test")
  assert "pure-JAX reference path" in out and "No GPU" in out
  rows = [line for line in out.splitlines() if line.strip().startswith(("True", "False"))]
  assert len(rows) == 2 * 2 * 3, out  # causal x shapes x peers
  assert {line.split("|")[1].split()[0] for line in rows} == {"jax_fa3", "xla", "jax_fa3_fp8"}
  assert not any("failed" in line for line in rows), out
  for line in rows:
    err = float(line.split("|")[1].split()[1])
    assert err < (0.1 if "fp8" in line else 1e-2), line


# The kernels' int32 size limits, raised as ValueError before tracing (cuda/ffi/attention_dims.h
# states the same bounds for the handlers).
@pytest.mark.parametrize("q_shape,k_shape,message", [
    ((1, 2**29 + 1, 1, 64), (1, 16, 1, 64), "seqlen_q and seqlen_k must be at most 2\\^29"),
    ((1, 16, 1, 64), (1, 2**29 + 1, 1, 64), "seqlen_q and seqlen_k must be at most 2\\^29"),
    ((2**14, 65536, 64, 64), (2**14, 16, 64, 64), "ceil\\(seqlen_q / 64\\) \\* heads \\* batch"),
])
def test_kernel_size_limits_name_the_bound(q_shape, k_shape, message):
  from jax_fa3 import _ffi  # noqa: PLC0415
  with pytest.raises(ValueError, match=message):
    _ffi.check_kernel_sizes(q_shape, k_shape)


@pytest.mark.parametrize("q_shape,k_shape", [
    ((1, 2**29, 1, 64), (1, 2**29, 1, 64)),           # the longest sequences allowed
    ((2**13, 65536, 64, 64), (2**13, 65536, 64, 64)),  # exactly 2^29 query tiles
])
def test_kernel_size_limits_accept_the_bound(q_shape, k_shape):
  from jax_fa3 import _ffi  # noqa: PLC0415
  _ffi.check_kernel_sizes(q_shape, k_shape)
