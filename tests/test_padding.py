"""Padded and packed batches: flash_attention's query_seq_lengths / key_value_seq_lengths and
q_segment_ids / kv_segment_ids against the float64 oracle, gradients, jit/vmap/sharding, the
Flax entry points, and the errors.

Float32 inputs, whose softmax and accumulation run in float32: the oracle is float64, so 1e-5
relative (as tests/test_api.py) bounds float32 rounding over these short rows.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_fa3
import jax_fa3.flax as fx
from cpu_mesh import CPUS, make_mesh
from jax_fa3.flax.nnx_layers import _FLAX_HAS_GQA
from oracle import attention_oracle, attention_oracle_grads, padding_mask

B, S_Q, S_K, H, H_K, D = 4, 37, 45, 4, 2, 16
# Row 0 full, row 1 all padding (no query), row 2 one query and one key, row 3 ragged.
Q_LENGTHS = np.array([S_Q, 0, 1, 20], np.int32)
KV_LENGTHS = np.array([S_K, 10, 1, 31], np.int32)


def _inputs(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  make = lambda s, h: jnp.asarray(rng.standard_normal((B, s, h, D)), dtype)
  return make(S_Q, H), make(S_K, H_K), make(S_K, H_K), make(S_Q, H)


def _segments(seed, length, rows=B):
  """Sorted random segment ids per row (packed documents), with length-1 segments among them."""
  rng = np.random.default_rng(seed)
  ids = np.sort(rng.integers(0, 6, (rows, length)), axis=1)
  ids[:, -1] = 99  # a segment of one token at the end of every row
  return ids.astype(np.int32)


def _rel(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


CASES = {
    "lengths": dict(query_seq_lengths=Q_LENGTHS, key_value_seq_lengths=KV_LENGTHS),
    "kv_lengths_only": dict(key_value_seq_lengths=KV_LENGTHS),
    "segments": dict(q_segment_ids=_segments(1, S_Q), kv_segment_ids=_segments(1, S_K)),
    "segments_and_lengths": dict(query_seq_lengths=Q_LENGTHS, key_value_seq_lengths=KV_LENGTHS,
                                 q_segment_ids=_segments(2, S_Q), kv_segment_ids=_segments(2, S_K)),
}


def _mask(padding):
  return padding_mask(S_Q, S_K, padding.get("query_seq_lengths"),
                      padding.get("key_value_seq_lengths"), padding.get("q_segment_ids"),
                      padding.get("kv_segment_ids"))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2))])
def test_forward_and_gradients_match_oracle(case, causal, window):
  q, k, v, dout = _inputs()
  padding = {name: jnp.asarray(x) for name, x in CASES[case].items()}
  options = dict(causal=causal, window_size=window)
  out, lse = jax.jit(lambda q, k, v: jax_fa3.flash_attention(q, k, v, return_lse=True, **options,
                                                             **padding))(q, k, v)
  oracle_options = dict(softmax_scale=D**-0.5, window_left=window[0],
                        window_right=0 if causal else window[1], mask=_mask(CASES[case]))
  as64 = [np.asarray(x, np.float64) for x in (q, k, v, dout)]
  ref_out, ref_lse = attention_oracle(*as64[:3], **oracle_options)
  assert _rel(out, ref_out) < 1e-5
  finite = np.isfinite(ref_lse)
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)  # +inf on empty rows
  np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)

  loss = lambda q, k, v: jnp.sum(jax_fa3.flash_attention(q, k, v, **options, **padding) * dout)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  ref_grads = attention_oracle_grads(*as64, **oracle_options)
  for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
    assert _rel(g, r) < 1e-5, name
  if "query_seq_lengths" in padding:  # padding: zero output and zero gradients, exactly
    q_pad = np.arange(S_Q)[None, :] >= Q_LENGTHS[:, None]
    assert np.all(np.asarray(out)[q_pad] == 0) and np.all(np.asarray(grads[0])[q_pad] == 0)
    k_pad = np.arange(S_K)[None, :] >= KV_LENGTHS[:, None]
    assert np.all(np.asarray(grads[1])[k_pad] == 0) and np.all(np.asarray(grads[2])[k_pad] == 0)


def test_full_lengths_equal_no_padding():
  q, k, v, _ = _inputs(3)
  full = jax_fa3.flash_attention(q, k, v, causal=True,
                                 query_seq_lengths=jnp.full((B,), S_Q, jnp.int32),
                                 key_value_seq_lengths=jnp.full((B,), S_K, jnp.int32))
  np.testing.assert_allclose(np.asarray(full), np.asarray(jax_fa3.flash_attention(q, k, v,
                                                                                  causal=True)),
                             rtol=1e-6, atol=1e-6)


def test_check_grads_float64():
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 9, 2, 8)), jnp.float64) for _ in range(3))
  padding = dict(query_seq_lengths=jnp.array([9, 5], jnp.int32),
                 key_value_seq_lengths=jnp.array([7, 9], jnp.int32),
                 q_segment_ids=jnp.array([[0] * 4 + [1] * 5, [0] * 9], jnp.int32),
                 kv_segment_ids=jnp.array([[0] * 4 + [1] * 5, [0] * 9], jnp.int32))
  fn = lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=True, **padding)
  check_grads(fn, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_vmap_equals_batch():
  q, k, v, _ = _inputs(5)
  padding = {name: jnp.asarray(x) for name, x in CASES["segments_and_lengths"].items()}
  whole = jax_fa3.flash_attention(q, k, v, causal=True, **padding)
  split = lambda x: x.reshape((2, B // 2) + x.shape[1:])
  mapped = jax.vmap(lambda q, k, v, a, b, c, d: jax_fa3.flash_attention(
      q, k, v, causal=True, query_seq_lengths=a, key_value_seq_lengths=b, q_segment_ids=c,
      kv_segment_ids=d))(*(split(x) for x in (q, k, v)), *(split(padding[n]) for n in (
          "query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids")))
  np.testing.assert_allclose(np.asarray(mapped).reshape(whole.shape), np.asarray(whole),
                             rtol=1e-6, atol=1e-6)


def test_traced_lengths_are_clamped():
  # Under jit the values are unknown: out-of-range lengths are clamped to [0, seqlen].
  q, k, v, _ = _inputs(6)
  fn = jax.jit(lambda q, k, v, lq, lk: jax_fa3.flash_attention(
      q, k, v, query_seq_lengths=lq, key_value_seq_lengths=lk))
  got = fn(q, k, v, jnp.array([-3, 1000, 5, 2], jnp.int32), jnp.array([99, 3, -1, 45], jnp.int32))
  want = fn(q, k, v, jnp.array([0, S_Q, 5, 2], jnp.int32), jnp.array([S_K, 3, 0, 45], jnp.int32))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.skipif(len(CPUS) < 8, reason="needs 8 CPU devices (XLA_FLAGS="
                    "--xla_force_host_platform_device_count=8 before JAX starts)")
@pytest.mark.parametrize("kind,spec", [("auto", P("data", None, "model")),
                                       ("explicit", P("data", None, "model")),
                                       ("auto", P("data", "model"))])
def test_sharded_jit_equals_one_device(kind, spec):
  # Batch and heads run locally; a split sequence (last case) is gathered, queries included.
  mesh = make_mesh((4, 2), ("data", "model"), kind)
  q, k, v, dout = _inputs(7)
  padding = [jnp.asarray(CASES["segments_and_lengths"][n]) for n in (
      "query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids")]
  q, k, v, dout = (x[:, :32] for x in (q, k, v, dout))  # seqlens divisible by the mesh
  padding = [jnp.minimum(padding[0], 32), jnp.minimum(padding[1], 32), padding[2][:, :32],
             padding[3][:, :32]]

  def fwd_bwd(q, k, v, dout, lq, lk, sq, sk):
    attend = lambda q, k, v: jax_fa3.flash_attention(
        q, k, v, causal=True, query_seq_lengths=lq, key_value_seq_lengths=lk, q_segment_ids=sq,
        kv_segment_ids=sk)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out,) + vjp(dout)

  args = (q, k, v, dout, *padding)
  want = jax.device_get(jax.jit(fwd_bwd)(*jax.device_put(args, CPUS[0])))
  rank = lambda x: P(*tuple(spec)[:x.ndim])
  placed = [jax.device_put(x, NamedSharding(mesh, rank(x))) for x in args]
  got = jax.jit(fwd_bwd)(*placed)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- Flax


def test_attention_fn_takes_padding_with_batch_dims():
  q, k, v, _ = _inputs(8)
  lengths = jnp.asarray(KV_LENGTHS)
  want = jax_fa3.flash_attention(q, k, v, key_value_seq_lengths=lengths)
  split = lambda x: x.reshape((2, 2) + x.shape[1:])
  got = fx.dot_product_attention(split(q), split(k), split(v),
                                 key_value_seq_lengths=lengths.reshape(2, 2))
  np.testing.assert_allclose(np.asarray(got).reshape(want.shape), np.asarray(want), rtol=1e-6,
                             atol=1e-6)


def test_linen_layer_packed_rows_equal_separate_rows():
  # Two documents packed in one row with segment ids attend as the two rows would alone.
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((1, 24, 32)), jnp.float32)
  layer = fx.linen.MultiHeadDotProductAttention(num_heads=2, causal=True)
  variables = layer.init(jax.random.key(0), x)
  segments = jnp.asarray([[0] * 10 + [1] * 14], jnp.int32)
  packed = layer.apply(variables, x, q_segment_ids=segments, kv_segment_ids=segments)
  first, second = layer.apply(variables, x[:, :10]), layer.apply(variables, x[:, 10:])
  np.testing.assert_allclose(np.asarray(packed),
                             np.asarray(jnp.concatenate([first, second], axis=1)),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not _FLAX_HAS_GQA, reason="jax_fa3.flax.MultiHeadAttention needs flax >= "
                    "0.12.6 (GQA in nnx.MultiHeadAttention)")
def test_nnx_layer_packed_rows_equal_separate_rows():
  from flax import nnx  # noqa: PLC0415
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((1, 24, 32)), jnp.float32)
  model = fx.MultiHeadAttention(2, 32, causal=True, decode=False, rngs=nnx.Rngs(0))
  segments = jnp.asarray([[0] * 10 + [1] * 14], jnp.int32)
  call = nnx.jit(lambda m, x, s: m(x, q_segment_ids=s, kv_segment_ids=s))
  packed = call(model, x, segments)
  first, second = model(x[:, :10]), model(x[:, 10:])
  np.testing.assert_allclose(np.asarray(packed),
                             np.asarray(jnp.concatenate([first, second], axis=1)),
                             rtol=1e-5, atol=1e-5)
  # The padding belongs to that call only.
  np.testing.assert_allclose(np.asarray(model(x)), np.asarray(nnx.jit(lambda m, x: m(x))(model, x)),
                             rtol=1e-6, atol=1e-6)
  assert not np.allclose(np.asarray(model(x)), np.asarray(packed), atol=1e-3)


# ----------------------------------------------------------------------------- errors

_Q, _K, _V, _ = _inputs(10)


@pytest.mark.parametrize("padding,error,message", [
    (dict(query_seq_lengths=np.full((B,), 3.0, np.float32)), TypeError,
     "query_seq_lengths must have an integer dtype"),
    (dict(key_value_seq_lengths=np.ones((B, 1), np.int32)), ValueError,
     r"key_value_seq_lengths must have shape \(4,\) \(batch,\)"),
    (dict(key_value_seq_lengths=[3, 3, 3, 3]), TypeError,
     "key_value_seq_lengths must be a JAX or NumPy integer array"),
    (dict(query_seq_lengths=np.array([1, 2, 3, S_Q + 1], np.int32)), ValueError,
     r"query_seq_lengths must lie in \[0, 37\]"),
    (dict(key_value_seq_lengths=np.array([-1, 2, 3, 4], np.int32)), ValueError,
     r"key_value_seq_lengths must lie in \[0, 45\]"),
    (dict(q_segment_ids=np.zeros((B, S_Q), np.int32)), ValueError,
     "give q_segment_ids and kv_segment_ids together"),
    (dict(q_segment_ids=np.zeros((B, S_Q), np.int32), kv_segment_ids=np.zeros((B, S_Q), np.int32)),
     ValueError, r"kv_segment_ids must have shape \(4, 45\)"),
    (dict(q_segment_ids=np.zeros((B, S_Q), bool), kv_segment_ids=np.zeros((B, S_K), bool)),
     TypeError, "q_segment_ids must have an integer dtype"),
])
def test_bad_padding_raises_clear_errors(padding, error, message):
  with pytest.raises(error, match=message):
    jax_fa3.flash_attention(_Q, _K, _V, **padding)


def test_flax_padding_errors():
  q, k, v = _Q, _K, _V
  with pytest.raises(ValueError, match=r"query_seq_lengths must have shape \(2, 2\)"):
    fx.dot_product_attention(q.reshape((2, 2) + q.shape[1:]), k.reshape((2, 2) + k.shape[1:]),
                             v.reshape((2, 2) + v.shape[1:]), query_seq_lengths=jnp.ones((4,),
                                                                                         jnp.int32))
  with pytest.raises(ValueError, match="fp8=True takes no key_value_seq_lengths"):
    fx.dot_product_attention(q, k, v, fp8=True, key_value_seq_lengths=jnp.ones((B,), jnp.int32))
  with pytest.raises(ValueError, match="key_value_seq_lengths="):  # the mask refusal's hint
    fx.dot_product_attention(q, k, v, mask=jnp.ones((B, 1, S_Q, S_K), bool))


# ----------------------------------------------------------------------------- varlen

# Sequence lengths (q, k): a long one, an empty query, a single token, no keys, cross lengths.
VARLEN_Q = [23, 0, 1, 5, 9]
VARLEN_K = [23, 4, 1, 0, 17]


def _varlen_inputs(seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  tq, tk = sum(VARLEN_Q), sum(VARLEN_K)
  make = lambda t, h: jnp.asarray(rng.standard_normal((t, h, D)), dtype)
  cu = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  return make(tq, H), make(tk, H_K), make(tk, H_K), make(tq, H), cu(VARLEN_Q), cu(VARLEN_K)


def _check_each_sequence(out, lse, grads, arrays, cu_q, cu_k, oracle_options):
  """Packed varlen results against the oracle on each sequence alone (1e-5: float32 inputs)."""
  q, k, v, dout = arrays
  for r in range(len(cu_q) - 1):
    qs, ks = slice(int(cu_q[r]), int(cu_q[r + 1])), slice(int(cu_k[r]), int(cu_k[r + 1]))
    if qs.start == qs.stop:
      continue
    if ks.start == ks.stop:  # no key: out 0, lse +inf, no gradient
      assert np.all(np.asarray(out)[qs] == 0) and np.all(np.isinf(np.asarray(lse)[:, qs]))
      assert np.all(np.asarray(grads[0])[qs] == 0)
      continue
    one = lambda x, s: np.asarray(x, np.float64)[None, s]
    ref_out, ref_lse = attention_oracle(one(q, qs), one(k, ks), one(v, ks), **oracle_options)
    np.testing.assert_allclose(np.asarray(out)[qs], ref_out[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[:, qs], ref_lse[0], rtol=1e-5, atol=1e-5)
    ref_grads = attention_oracle_grads(one(q, qs), one(k, ks), one(v, ks), one(dout, qs),
                                       **oracle_options)
    for g, rg, s in zip(grads, ref_grads, (qs, ks, ks)):
      np.testing.assert_allclose(np.asarray(g)[s], rg[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1))])
def test_varlen_matches_oracle_per_sequence(causal, window):
  q, k, v, dout, cu_q, cu_k = _varlen_inputs(12)
  options = dict(causal=causal, window_size=window)
  fn = jax.jit(lambda q, k, v: jax_fa3.flash_attention_varlen(
      q, k, v, cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), return_lse=True, **options))
  out, lse = fn(q, k, v)
  loss = lambda q, k, v: jnp.sum(jax_fa3.flash_attention_varlen(
      q, k, v, cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), **options) * dout)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert out.shape == q.shape and lse.shape == (H, q.shape[0])
  oracle_options = dict(softmax_scale=D**-0.5, window_left=window[0],
                        window_right=0 if causal else window[1])
  _check_each_sequence(out, lse, grads, (q, k, v, dout), cu_q, cu_k, oracle_options)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0))])
@pytest.mark.parametrize("lens_q,lens_k", [([23, 0, 1, 64, 9], [23, 0, 1, 64, 9]),
                                           (VARLEN_Q, VARLEN_K)])
def test_varlen_packed_route_matches_the_oracle_per_sequence(causal, window, lens_q, lens_k,
                                                             monkeypatch):
  # Where the kernels' key-range variants run, varlen attends the packed arrays as one row
  # (sequence indices as segment ids, one diagonal per query); forced here, the same masks run on
  # the pure-JAX path. Every sequence must match the oracle alone, gradients included, for
  # self-attention and for query and key sequences of different lengths.
  from jax_fa3 import _local_attention, varlen  # noqa: PLC0415
  monkeypatch.setattr(_local_attention, "masked_kernels_would_run", lambda q: True)
  routed = []
  packed = varlen._packed_attention
  monkeypatch.setattr(varlen, "_packed_attention",
                      lambda *a, **kw: routed.append(1) or packed(*a, **kw))
  rng = np.random.default_rng(14)
  tq, tk = sum(lens_q), sum(lens_k)
  q, dout = (jnp.asarray(rng.standard_normal((tq, H, D)), jnp.float32) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((tk, H_K, D)), jnp.float32) for _ in range(2))
  cu = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  cu_q, cu_k = cu(lens_q), cu(lens_k)
  options = dict(causal=causal, window_size=window)
  call = lambda q, k, v: jax_fa3.flash_attention_varlen(
      q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **options)
  out, lse = jax.jit(call)(q, k, v)
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(call(q, k, v)[0] * dout),
                           argnums=(0, 1, 2)))(q, k, v)
  assert routed, "the packed route did not run"
  oracle_options = dict(softmax_scale=D**-0.5, window_left=window[0],
                        window_right=0 if causal else window[1])
  _check_each_sequence(out, lse, grads, (q, k, v, dout), cu_q, cu_k, oracle_options)


def test_varlen_check_grads_float64():
  q, k, v, _, cu_q, cu_k = _varlen_inputs(13, jnp.float64)
  fn = lambda q, k, v: jax_fa3.flash_attention_varlen(q, k, v, cu_q, cu_k, 23, 23, causal=True)
  check_grads(fn, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("change,error,message", [
    (dict(cu_seqlens_q=np.array([0, 3, 2, 6], np.int32)), ValueError, "must be non-decreasing"),
    (dict(cu_seqlens_q=np.array([1, 3, 4, 6], np.int32)), ValueError, "must start at 0 and end"),
    (dict(cu_seqlens_k=np.array([0, 3, 4], np.int32)), ValueError, "must start at 0 and end"),
    (dict(cu_seqlens_q=np.array([0, 3, 4, 6], np.float32)), TypeError, "integer dtype"),
    (dict(max_seqlen_q=2), ValueError, r"max_seqlen_q \(2\) is below the longest sequence"),
    (dict(max_seqlen_k=4.0), TypeError, "max_seqlen_k must be a Python int"),
    (dict(cu_seqlens_k=np.array([0, 8], np.int32), max_seqlen_k=8), ValueError,
     "the same number of sequences"),
])
def test_varlen_bad_inputs(change, error, message):
  rng = np.random.default_rng(14)
  args = dict(q=jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32),
              k=jnp.asarray(rng.standard_normal((8, 2, 8)), jnp.float32),
              v=jnp.asarray(rng.standard_normal((8, 2, 8)), jnp.float32),
              cu_seqlens_q=np.array([0, 3, 4, 6], np.int32),
              cu_seqlens_k=np.array([0, 2, 5, 8], np.int32), max_seqlen_q=3, max_seqlen_k=3)
  args.update(change)
  with pytest.raises(error, match=message):
    jax_fa3.flash_attention_varlen(**args)
