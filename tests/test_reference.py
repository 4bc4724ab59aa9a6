"""jax_fa3.reference (blocked pure-JAX attention) against the float64 NumPy oracle, on the CPU.

Every case draws fresh random inputs, rounds them to the dtype under test, and hands the *rounded*
values (as float64) to the oracle, so that only the reference's own arithmetic is measured. Errors
are norm-wise relative: ||x - ref|| / ||ref||. Small block sizes make the padding, the masking of
ragged tails and the multi-block online softmax do real work.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa3.reference import attention_backward, attention_forward
from oracle import attention_oracle, attention_oracle_grads, visibility_mask

# Norm-wise relative tolerances for out, dq, dk, dv.
# float64: the reference computes in float64; 1e-10 leaves room for accumulation over ~1000 keys
#          (observed ~5e-16).
# float32: computed in float32 (unit roundoff u = 2^-24 ~ 6e-8); sums over up to ~1000 terms and
#          exp/tanh give errors of ~1e-7..1e-6, so 1e-5.
# bfloat16 / float16: computed in float32, but out and the gradients are *returned* in the dtype,
#          and the backward reads the rounded out (D = rowsum(dO * O)); rounding a result costs at
#          most u, and the D error a little more: bf16 u = 2^-8 ~ 3.9e-3 -> 1e-2 (observed ~2e-3),
#          fp16 u = 2^-11 ~ 4.9e-4 -> 2e-3 (observed ~3e-4).
TOLERANCE = {
    jnp.float64: 1e-10,
    jnp.float32: 1e-5,
    jnp.bfloat16: 1e-2,
    jnp.float16: 2e-3,
}
# The LSE is float32 (float64 for float64 inputs) whatever the input dtype, computed from the
# rounded inputs, so only float32 arithmetic separates it from the oracle.
LSE_TOLERANCE = {jnp.float64: 1e-12}
LSE_TOLERANCE_DEFAULT = 1e-6


@pytest.fixture
def enable_x64():
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def _random_inputs(seed, b, s_q, s_k, h, h_k, d, dtype):
    """q, k, v, dout as arrays of `dtype` (standard normal, rounded to the dtype)."""
    rng = np.random.default_rng(seed)
    shapes = [(b, s_q, h, d), (b, s_k, h_k, d), (b, s_k, h_k, d), (b, s_q, h, d)]
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


def _as_numpy64(*arrays):
    return [np.asarray(a).astype(np.float64) for a in arrays]


def relative_error(actual, expected):
    """||actual - expected|| / ||expected||; the absolute error when expected is exactly 0
    (e.g. dq with a single visible key: the softmax of one score does not depend on it)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = np.linalg.norm(expected)
    return np.linalg.norm(actual - expected) / (scale if scale > 0 else 1.0)


def assert_lse_close(lse, expected, tolerance):
    """+inf exactly where the oracle has an empty row; relative error elsewhere."""
    lse = np.asarray(lse, np.float64)
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(expected))
    finite = np.isfinite(expected)
    assert np.isfinite(lse[finite]).all()
    if finite.any():
        assert relative_error(lse[finite], expected[finite]) < tolerance


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: shapes, semantics and the reference's block sizes."""
    s_q: int
    s_k: int
    b: int = 1
    h: int = 2
    h_k: int = 2
    d: int = 16
    window: tuple = (-1, -1)
    softcap: float = 0.0
    blocks: tuple = (16, 32)

    def semantics(self):
        return dict(softmax_scale=self.d**-0.5, window_left=self.window[0],
                    window_right=self.window[1], softcap=self.softcap)

    def options(self):
        return dict(self.semantics(), block_q=self.blocks[0], block_k=self.blocks[1])


def _run_reference(cases, inputs):
    """Forward and backward of every case, traced into ONE jit-compiled program.

    XLA:CPU compiles dominate this file's runtime (~1 s of CPU for each forward or backward),
    and cases of one shape that differ only in window/softcap share most of a program's
    compiled kernels, so each test below groups same-shaped cases into one program."""
    def run_all(inputs):
        results = []
        for case, (q, k, v, dout) in zip(cases, inputs):
            out, lse = attention_forward(q, k, v, **case.options())
            grads = attention_backward(q, k, v, out, lse, dout, **case.options())
            results.append((out, lse, grads))
        return results
    return jax.jit(run_all)(inputs)


def check_against_oracle(cases, dtype=jnp.float32, seed=0):
    """Reference forward (out, lse) and backward (dq, dk, dv) vs the oracle, for each case."""
    inputs = [_random_inputs(seed + index, c.b, c.s_q, c.s_k, c.h, c.h_k, c.d, dtype)
              for index, c in enumerate(cases)]
    results = _run_reference(cases, inputs)
    return [_compare_with_oracle(case, dtype, case_inputs, *result)
            for case, case_inputs, result in zip(cases, inputs, results)]


def _compare_with_oracle(case, dtype, inputs, out, lse, grads):
    q, k, v, dout = inputs
    expected_out, expected_lse = attention_oracle(*_as_numpy64(q, k, v), **case.semantics())
    expected_grads = attention_oracle_grads(*_as_numpy64(q, k, v, dout), **case.semantics())

    tolerance = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == q.shape, case
    assert lse.shape == (case.b, case.h, case.s_q), case
    assert lse.dtype == (jnp.float64 if dtype == jnp.float64 else jnp.float32), case
    for name, value in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert np.isfinite(np.asarray(value, np.float32)).all(), f"{case}: {name} not finite"
    error = relative_error(out, expected_out)
    assert error < tolerance, f"{case}: out relative error {error:.3g} >= {tolerance:.3g}"
    assert_lse_close(lse, expected_lse, LSE_TOLERANCE.get(dtype, LSE_TOLERANCE_DEFAULT))
    # Rows that see no key: exactly 0 (not merely small) in out and dq.
    empty_rows = np.isposinf(expected_lse).transpose(0, 2, 1)  # (b, s_q, h)
    assert (np.asarray(out)[empty_rows] == 0).all(), f"{case}: out on empty rows"
    assert (np.asarray(grads[0])[empty_rows] == 0).all(), f"{case}: dq on empty rows"
    for name, grad, expected, like in zip(("dq", "dk", "dv"), grads, expected_grads, (q, k, v)):
        assert grad.dtype == dtype and grad.shape == like.shape, f"{case}: {name}"
        error = relative_error(grad, expected)
        assert error < tolerance, f"{case}: {name} relative error {error:.3g} >= {tolerance:.3g}"
    return expected_lse


# ----------------------------------------------------------------------------------------------
# The oracle itself
# ----------------------------------------------------------------------------------------------

def test_visibility_mask_conventions():
    square = visibility_mask(4, 4, -1, 0)
    np.testing.assert_array_equal(square, np.tril(np.ones((4, 4), bool)))
    # Bottom-right alignment: with more keys than queries, the last query sees every key ...
    wide = visibility_mask(2, 5, -1, 0)
    np.testing.assert_array_equal(wide, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    # ... and with more queries than keys, the first queries see nothing.
    tall = visibility_mask(4, 2, -1, 0)
    np.testing.assert_array_equal(tall, [[0, 0], [0, 0], [1, 0], [1, 1]])
    band = visibility_mask(5, 5, 1, 1)
    np.testing.assert_array_equal(band, np.abs(np.subtract.outer(range(5), range(5))) <= 1)
    assert visibility_mask(3, 7, -1, -1).all()


def test_oracle_empty_rows_give_zero_output_and_infinite_lse():
    q, k, v, _ = _as_numpy64(*_random_inputs(1, 1, 6, 3, 2, 1, 4, jnp.float64))
    out, lse = attention_oracle(q, k, v, softmax_scale=0.5, window_right=0)
    empty = ~visibility_mask(6, 3, -1, 0).any(axis=1)  # the first three queries
    assert empty.sum() == 3
    assert (out[:, empty] == 0).all() and np.isposinf(lse[..., empty]).all()
    assert np.isfinite(lse[..., ~empty]).all()


def test_oracle_gradients_match_finite_differences():
    """The analytic oracle backward (GQA, window, softcap) against central differences."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 5, 4, 3))
    k = rng.standard_normal((1, 7, 2, 3))
    v = rng.standard_normal((1, 7, 2, 3))
    dout = rng.standard_normal((1, 5, 4, 3))
    semantics = dict(softmax_scale=0.9, window_left=3, window_right=1, softcap=2.0)

    def loss(q, k, v):
        return np.sum(attention_oracle(q, k, v, **semantics)[0] * dout)

    analytic = attention_oracle_grads(q, k, v, dout, **semantics)
    inputs = [q, k, v]
    step = 1e-6
    for index, grad in enumerate(analytic):
        numeric = np.zeros_like(grad)
        for position in np.ndindex(grad.shape):
            plus = [x.copy() for x in inputs]
            minus = [x.copy() for x in inputs]
            plus[index][position] += step
            minus[index][position] -= step
            numeric[position] = (loss(*plus) - loss(*minus)) / (2 * step)
        assert relative_error(grad, numeric) < 1e-7


# ----------------------------------------------------------------------------------------------
# Reference vs oracle
# ----------------------------------------------------------------------------------------------

def test_sequence_lengths():
    shapes = [(1, 1), (17, 17), (1000, 1000), (17, 129), (129, 17)]
    check_against_oracle([Case(s_q, s_k) for s_q, s_k in shapes])


def test_grouped_query_heads():
    check_against_oracle([Case(70, 90, h=8, h_k=2, window=(-1, 0)),  # GQA 8:2
                          Case(70, 90, h=4, h_k=1, window=(8, 8))])  # MQA 4:1


# Masking and soft-capping cases share one shape per program (see _run_reference); h=4, h_k=2
# keeps GQA in play.
MASK_SHAPES = {"square": (100, 100), "more-keys": (60, 140), "more-queries": (140, 60)}


@pytest.mark.parametrize("shape", MASK_SHAPES.values(), ids=MASK_SHAPES.keys())
def test_causal_windows_and_softcap(shape):
    """Causal (window_right = 0), sliding windows and softcap; with s_q > s_k, causal leaves the
    first rows without any key."""
    # (0, 0) would leave one key per row, where dq and dk vanish analytically and only roundoff
    # remains to compare: test_single_key_window covers it; (0, 2) keeps a zero left bound.
    windows = [(-1, 0), (16, 0), (8, 8), (-1, 4), (5, -1), (0, 2)]
    cases = [Case(*shape, b=2, h=4, h_k=2, window=window) for window in windows]
    cases += [Case(*shape, b=2, h=4, h_k=2, window=(-1, -1), softcap=30.0),
              Case(*shape, b=2, h=4, h_k=2, window=(-1, 0), softcap=5.0)]
    expected_lses = check_against_oracle(cases)
    if shape[0] > shape[1]:
        assert np.isposinf(expected_lses[0]).any()  # causal really produced empty rows


def test_single_key_window():
    """window (0, 0): every query sees exactly its aligned key, so out = v there, lse = that
    score, dv = dout summed over the query-head group, and dq = dk = 0 up to roundoff."""
    case = Case(24, 40, h=4, h_k=2, d=8, window=(0, 0), softcap=5.0)
    q, k, v, dout = inputs = _random_inputs(7, case.b, case.s_q, case.s_k, case.h, case.h_k,
                                            case.d, jnp.float32)
    [(out, lse, (dq, dk, dv))] = _run_reference([case], [inputs])
    q, k, v, dout = _as_numpy64(q, k, v, dout)
    aligned = np.arange(case.s_q) + case.s_k - case.s_q
    group = case.h // case.h_k
    k_seen = np.repeat(k[:, aligned], group, axis=2)  # (b, s_q, h, d)
    v_seen = np.repeat(v[:, aligned], group, axis=2)
    score = case.softcap * np.tanh(case.d**-0.5 * (q * k_seen).sum(-1) / case.softcap)
    np.testing.assert_allclose(out, v_seen, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, score.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)
    expected_dv = np.zeros_like(v)
    expected_dv[:, aligned] = dout.reshape(*dout.shape[:2], case.h_k, group, case.d).sum(3)
    np.testing.assert_allclose(dv, expected_dv, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dq, 0, atol=1e-5)
    np.testing.assert_allclose(dk, 0, atol=1e-5)


# One shape per dtype program; float32 is what every other test uses.
DTYPE_CASES = [
    Case(100, 47, h=4, h_k=2, d=32, window=(-1, 0)),  # causal with empty rows, GQA
    Case(100, 47, h=4, h_k=2, d=32, window=(8, 8), softcap=5.0),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_half_precision_dtypes(dtype):
    check_against_oracle(DTYPE_CASES, dtype)


def test_float64(enable_x64):
    check_against_oracle(DTYPE_CASES, jnp.float64)


def test_block_sizes():
    """Results do not depend on blocking: defaults (one block here) and 1x1 (every other test
    uses 16x32 blocks with ragged tails; the 4096 test uses the 512x512 defaults)."""
    check_against_oracle([Case(19, 23, h=4, h_k=2, window=(6, 2), blocks=blocks)
                          for blocks in [(None, None), (1, 1)]])


# ----------------------------------------------------------------------------------------------
# Transformations
# ----------------------------------------------------------------------------------------------

def test_vmap_over_the_whole_function():
    case = Case(33, 40, h=4, h_k=2, d=8, window=(10, 0), blocks=(16, 16))
    stack = 3  # the vmapped axis, in front of the batch axis
    per_slice = [_random_inputs(4 + i, case.b, case.s_q, case.s_k, case.h, case.h_k, case.d,
                                jnp.float32) for i in range(stack)]
    stacked = [jnp.stack(arrays) for arrays in zip(*per_slice)]

    def forward_and_backward(q, k, v, dout):
        out, lse = attention_forward(q, k, v, **case.options())
        return out, lse, attention_backward(q, k, v, out, lse, dout, **case.options())

    out, lse, grads = jax.jit(jax.vmap(forward_and_backward))(*stacked)
    for i, inputs in enumerate(per_slice):
        _compare_with_oracle(case, jnp.float32, inputs, out[i], lse[i], [g[i] for g in grads])


def test_inside_custom_vjp_under_jit_and_grad():
    options = dict(softmax_scale=0.25, window_left=-1, window_right=0, softcap=30.0,
                   block_q=16, block_k=32)

    @jax.custom_vjp
    def attention(q, k, v):
        return attention_forward(q, k, v, **options)[0]

    def attention_fwd(q, k, v):
        out, lse = attention_forward(q, k, v, **options)
        return out, (q, k, v, out, lse)

    def attention_bwd(residuals, dout):
        return attention_backward(*residuals, dout, **options)

    attention.defvjp(attention_fwd, attention_bwd)

    q, k, v, dout = _random_inputs(5, 2, 45, 60, 4, 1, 16, jnp.float32)
    loss = lambda q, k, v: jnp.sum(attention(q, k, v) * dout)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    semantics = {key: options[key] for key in ("softmax_scale", "window_left", "window_right",
                                               "softcap")}
    expected = attention_oracle_grads(*_as_numpy64(q, k, v, dout), **semantics)
    for grad, reference in zip(grads, expected):
        assert relative_error(grad, reference) < 1e-5


# ----------------------------------------------------------------------------------------------
# Memory stays bounded for long sequences
# ----------------------------------------------------------------------------------------------

def _check_bounded_memory(b, s, h, h_k, d, causal, check_values):
    q, k, v, dout = _random_inputs(6, b, s, s, h, h_k, d, jnp.float32)
    options = dict(softmax_scale=d**-0.5, window_right=0 if causal else -1)
    forward = functools.partial(attention_forward, **options)
    backward = functools.partial(attention_backward, **options)

    # A dense score matrix alone would take b * h * s * s * 4 bytes; the blocked code must need a
    # small fraction of that (its largest temporaries are block-sized and dq-sized).
    dense_scores_bytes = b * h * s * s * 4
    compiled_forward = jax.jit(forward).lower(q, k, v).compile()
    assert compiled_forward.memory_analysis().temp_size_in_bytes < dense_scores_bytes / 8
    out, lse = compiled_forward(q, k, v)
    compiled_backward = jax.jit(backward).lower(q, k, v, out, lse, dout).compile()
    assert compiled_backward.memory_analysis().temp_size_in_bytes < dense_scores_bytes / 8
    grads = compiled_backward(q, k, v, out, lse, dout)
    assert all(np.isfinite(np.asarray(x)).all() for x in (out, lse, *grads))
    # The last rows alone are cheap to check at any length: with bottom-right alignment, a tail of
    # the queries against all keys sees exactly what it sees in the full problem.
    tail = min(s, 8)
    tail_out, tail_lse = attention_oracle(*_as_numpy64(q[:, -tail:], k, v), **options)
    assert relative_error(out[:, -tail:], tail_out) < 1e-5
    assert relative_error(lse[..., -tail:], tail_lse) < 1e-6
    if check_values:
        expected_out, expected_lse = attention_oracle(*_as_numpy64(q, k, v), **options)
        assert relative_error(out, expected_out) < 1e-5
        assert relative_error(lse, expected_lse) < 1e-6
        expected_grads = attention_oracle_grads(*_as_numpy64(q, k, v, dout), **options)
        for grad, expected in zip(grads, expected_grads):
            assert relative_error(grad, expected) < 1e-5


def test_bounded_memory_seqlen_4096():
    _check_bounded_memory(b=1, s=4096, h=1, h_k=1, d=16, causal=True, check_values=True)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JAX_FA3_SLOW") != "1", reason="set JAX_FA3_SLOW=1 to run")
def test_bounded_memory_seqlen_16k_full_size():
    _check_bounded_memory(b=1, s=16384, h=16, h_k=16, d=128, causal=False, check_values=False)
