"""FlashAttention-3's accuracy criterion for the bf16/fp16 kernels, against tests/oracle.py.

The kernel's error against the float64 oracle (on the same dtype-rounded inputs) may be at most
C times the error of naive attention computed in the same dtype, plus a floor:

    max|kernel - oracle| <= C * max|naive - oracle| + floor.

C = 2 and the floor are FlashAttention-3's own test criterion (its `rtol = 2` and `fwd_atol =
2 * max|(ref + 0.3 - 0.3) - ref|`, two roundings of the reference's magnitude in the dtype); the
bound scales with the dtype and the problem by construction, so it needs no GPU measurement to
justify it. "Naive" is the textbook computation with every operation's result rounded to the
dtype, as a framework's bf16/fp16 ops do: S = QK^T, the scale, the soft cap, P = softmax(S),
O = PV; its backward dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = dS K, dK = dS^T Q.
Matrix products accumulate in float32 (tensor cores do) and round once.

Rows that see no key are checked exactly: output 0 and LSE +inf (the oracle's convention).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from oracle import (_expand_kv_heads, _sum_over_head_groups, oracle_attention,
                    oracle_attention_grads, resolve_options, visibility_mask)

C = 2.0  # FlashAttention-3's multiple of the naive same-dtype error
_LOW = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def low_dtype(dtype):
  """The NumPy type that rounds to `dtype` (bfloat16 or float16)."""
  return _LOW[np.dtype(dtype).name]


def eps(dtype) -> float:
  return float(ml_dtypes.finfo(low_dtype(dtype)).eps)


def _round(x, dtype):
  return np.asarray(x, np.float32).astype(low_dtype(dtype)).astype(np.float32)


def _naive_probabilities(q, k, dtype, options):
  """P rounded to dtype (zero where masked or the row is empty), the float32 LSE of the rounded
  scores, and tanh of the capped scores (None without a cap)."""
  s_q, s_k = q.shape[1], k.shape[1]
  s = _round(np.einsum("bqhd,bkhd->bhqk", q, k, optimize=True), dtype)
  s = _round(s * np.float32(options["softmax_scale"]), dtype)
  tanh = None
  if options["softcap"] > 0:
    cap = np.float32(options["softcap"])
    tanh = _round(np.tanh(_round(s / cap, dtype)), dtype)
    s = _round(cap * tanh, dtype)
  visible = visibility_mask(s_q, s_k, options["window_left"], options["window_right"])
  s = np.where(visible, s, -np.inf).astype(np.float32)
  row_max = s.max(-1, keepdims=True)
  empty = np.isneginf(row_max)
  e = np.exp(s - np.where(empty, 0, row_max))
  total = e.sum(-1, keepdims=True)
  p = _round(e / np.where(empty, 1, total), dtype)
  with np.errstate(divide="ignore"):
    lse = np.where(empty, np.inf, row_max + np.log(total))[..., 0]
  return p, lse, tanh


def naive_attention(q, k, v, dtype, **api_options):
  """Naive attention in `dtype` (see the module docstring): out float32 (values of dtype), lse."""
  options = resolve_options(q.shape[-1], **api_options)
  q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
  h = q.shape[2]
  k, v = _expand_kv_heads(k, h), _expand_kv_heads(v, h)
  p, lse, _ = _naive_probabilities(q, k, dtype, options)
  return _round(np.einsum("bhqk,bkhd->bqhd", p, v, optimize=True), dtype), lse


def naive_attention_grads(q, k, v, dout, dtype, **api_options):
  """Gradients of sum(out * dout) by naive backprop in `dtype`: dq, dk, dv float32."""
  options = resolve_options(q.shape[-1], **api_options)
  q, k, v, dout = (np.asarray(x, np.float32) for x in (q, k, v, dout))
  h, h_k = q.shape[2], k.shape[2]
  k_full, v_full = _expand_kv_heads(k, h), _expand_kv_heads(v, h)
  p, _, tanh = _naive_probabilities(q, k_full, dtype, options)
  dv = _round(np.einsum("bhqk,bqhd->bkhd", p, dout, optimize=True), dtype)
  dp = _round(np.einsum("bqhd,bkhd->bhqk", dout, v_full, optimize=True), dtype)
  ds = _round(p * (dp - (p * dp).sum(-1, keepdims=True)), dtype)
  if tanh is not None:
    ds = _round(ds * _round(1 - tanh * tanh, dtype), dtype)
  ds = _round(ds * np.float32(options["softmax_scale"]), dtype)
  dq = _round(np.einsum("bhqk,bkhd->bqhd", ds, k_full, optimize=True), dtype)
  dk = _round(np.einsum("bhqk,bqhd->bkhd", ds, q, optimize=True), dtype)
  return dq, _round(_sum_over_head_groups(dk, h_k), dtype), _round(_sum_over_head_groups(dv, h_k),
                                                                      dtype)


def _max_abs(x):
  return float(np.max(np.abs(x))) if np.size(x) else 0.0


def assert_within_criterion(name, got, ref, naive, dtype, c=C):
  """max|got - ref| <= c * max|naive - ref| + eps(dtype) * (max|ref| + 0.3)."""
  got, ref, naive = (np.asarray(x, np.float64) for x in (got, ref, naive))
  assert got.shape == ref.shape, (name, got.shape, ref.shape)
  assert np.all(np.isfinite(got)), f"{name}: non-finite values (unwritten or NaN)"
  err, naive_err = _max_abs(got - ref), _max_abs(naive - ref)
  floor = eps(dtype) * (_max_abs(ref) + 0.3)
  bound = c * naive_err + floor
  assert err <= bound, (f"{name}: max error {err:.3g} vs the float64 oracle exceeds "
                        f"{c} x naive {np.dtype(dtype).name} error {naive_err:.3g} + floor "
                        f"{floor:.3g}")
  return err, naive_err


def check_forward(out, lse, q, k, v, **api_options):
  """Checks a kernel's (out, lse) at dtype-rounded q, k, v against the oracle by the criterion;
  rows that see no key must be exactly 0 with LSE +inf."""
  dtype = q.dtype
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  ref_out, ref_lse = oracle_attention(q64, k64, v64, **api_options)
  naive_out, naive_lse = naive_attention(q64, k64, v64, dtype, **api_options)
  out = np.asarray(out, np.float64)
  lse = np.asarray(lse, np.float64)
  empty = np.isposinf(ref_lse)  # (b, h, s_q)
  np.testing.assert_array_equal(np.isposinf(lse), empty, err_msg="LSE +inf exactly on empty rows")
  empty_rows = np.swapaxes(empty, 1, 2)  # (b, s_q, h)
  assert np.all(out[empty_rows] == 0), "rows that see no key must output exactly 0"
  assert_within_criterion("out", out, ref_out, naive_out, dtype)
  finite = ~empty
  if finite.any():
    assert_within_criterion("lse", lse[finite], ref_lse[finite], naive_lse[finite], dtype)


def check_output(out, q, k, v, **api_options):
  """check_forward for a call that returns no LSE: empty rows exactly 0, the rest by the
  criterion."""
  dtype = q.dtype
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  ref_out, ref_lse = oracle_attention(q64, k64, v64, **api_options)
  naive_out, _ = naive_attention(q64, k64, v64, dtype, **api_options)
  out = np.asarray(out, np.float64)
  assert np.all(out[np.swapaxes(np.isposinf(ref_lse), 1, 2)] == 0), "empty rows must output 0"
  return assert_within_criterion("out", out, ref_out, naive_out, dtype)


def check_grads(grads, q, k, v, dout, **api_options):
  """Checks a kernel's (dq, dk, dv) against the oracle's gradients of sum(out * dout)."""
  dtype = q.dtype
  arrays = [np.asarray(x, np.float64) for x in (q, k, v, dout)]
  refs = oracle_attention_grads(*arrays, **api_options)
  naives = naive_attention_grads(*arrays, dtype, **api_options)
  for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
    assert got.dtype == dtype, (name, got.dtype)
    assert_within_criterion(name, got, ref, naive, dtype)
