"""jax_fa3.reference (blocked pure-JAX attention) against the float64 NumPy oracle, on the CPU.

Every case draws fresh random inputs, rounds them to the dtype under test, and hands the *rounded*
values (as float64) to the oracle, so that only the reference's own arithmetic is measured. Errors
are norm-wise relative: ||x - ref|| / ||ref||. Small block sizes make the padding, the masking of
ragged tails and the multi-block online softmax do real work.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa3.reference import attention_backward, attention_forward
from oracle import attention_oracle, attention_oracle_grads, visibility_mask

# Norm-wise relative tolerances for out, dq, dk, dv.
# float64: the reference computes in float64; 1e-10 leaves room for accumulation over ~1000 keys.
# float32: computed in float32 (unit roundoff u = 2^-24 ~ 6e-8); sums over up to ~1000 terms and
#          exp/tanh give errors around 1e-6, so 1e-5.
# bfloat16 / float16: computed in float32, but out and the gradients are *returned* in the dtype,
#          and the backward reads the rounded out (D = rowsum(dO * O)); both cost a few unit
#          roundoffs: bf16 u = 2^-8 ~ 3.9e-3 -> 2e-2, fp16 u = 2^-11 ~ 4.9e-4 -> 4e-3.
TOLERANCE = {
    jnp.float64: 1e-10,
    jnp.float32: 1e-5,
    jnp.bfloat16: 2e-2,
    jnp.float16: 4e-3,
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


@functools.lru_cache(maxsize=None)
def _jitted(**options):
    """jit-compiled forward and backward with static options (cached across identical cases)."""
    forward = jax.jit(functools.partial(attention_forward, **options))
    backward = jax.jit(functools.partial(attention_backward, **options))
    return forward, backward


def check_against_oracle(*, b=1, s_q, s_k, h=2, h_k=None, d=16, dtype=jnp.float32,
                         window=(-1, -1), softcap=0.0, blocks=(16, 32), seed=0):
    h_k = h if h_k is None else h_k
    q, k, v, dout = _random_inputs(seed, b, s_q, s_k, h, h_k, d, dtype)
    semantics = dict(softmax_scale=d**-0.5, window_left=window[0], window_right=window[1],
                     softcap=softcap)
    forward, backward = _jitted(block_q=blocks[0], block_k=blocks[1], **semantics)

    out, lse = forward(q, k, v)
    grads = backward(q, k, v, out, lse, dout)

    expected_out, expected_lse = attention_oracle(*_as_numpy64(q, k, v), **semantics)
    expected_grads = attention_oracle_grads(*_as_numpy64(q, k, v, dout), **semantics)

    tolerance = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (b, h, s_q)
    assert lse.dtype == (jnp.float64 if dtype == jnp.float64 else jnp.float32)
    for name, value in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert np.isfinite(np.asarray(value, np.float32)).all(), f"{name} has non-finite values"
    assert relative_error(out, expected_out) < tolerance
    assert_lse_close(lse, expected_lse, LSE_TOLERANCE.get(dtype, LSE_TOLERANCE_DEFAULT))
    for name, grad, expected, like in zip(("dq", "dk", "dv"), grads, expected_grads, (q, k, v)):
        assert grad.dtype == dtype and grad.shape == like.shape, name
        error = relative_error(grad, expected)
        assert error < tolerance, f"{name}: relative error {error:.3g} >= {tolerance:.3g}"
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

@pytest.mark.parametrize("s_q, s_k", [
    (1, 1), (17, 17), (129, 129), (1000, 1000), (17, 129), (129, 17), (1, 300), (300, 1),
])
def test_sequence_lengths(s_q, s_k):
    check_against_oracle(s_q=s_q, s_k=s_k)


@pytest.mark.parametrize("h, h_k", [(8, 2), (4, 1), (3, 3)], ids=["gqa8:2", "mqa4:1", "mha"])
def test_grouped_query_heads(h, h_k):
    check_against_oracle(s_q=70, s_k=90, h=h, h_k=h_k, window=(-1, 0))


@pytest.mark.parametrize("s_q, s_k", [(50, 120), (120, 50), (77, 77)])
def test_causal(s_q, s_k):
    expected_lse = check_against_oracle(b=2, s_q=s_q, s_k=s_k, window=(-1, 0))
    if s_q > s_k:  # bottom-right alignment leaves the first s_q - s_k queries with no key
        assert np.isposinf(expected_lse).any()


@pytest.mark.parametrize("window", [(16, 0), (8, 8), (-1, 4), (5, -1), (0, 0)])
@pytest.mark.parametrize("s_q, s_k", [(100, 100), (60, 140), (140, 60)])
def test_sliding_window(window, s_q, s_k):
    check_against_oracle(s_q=s_q, s_k=s_k, window=window)


@pytest.mark.parametrize("softcap", [30.0, 5.0])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0)], ids=["full", "causal"])
def test_softcap(softcap, window):
    check_against_oracle(s_q=90, s_k=110, h=4, h_k=2, window=window, softcap=softcap)


DTYPE_CASES = [
    dict(s_q=129, s_k=129),
    dict(s_q=100, s_k=47, h=4, h_k=2, window=(-1, 0)),  # empty rows
    dict(s_q=64, s_k=200, window=(8, 8), softcap=5.0),
]


@pytest.mark.parametrize("case", DTYPE_CASES, ids=["plain", "causal-gqa", "window-softcap"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
def test_dtypes(dtype, case):
    check_against_oracle(dtype=dtype, d=32, **case)


@pytest.mark.parametrize("case", DTYPE_CASES, ids=["plain", "causal-gqa", "window-softcap"])
def test_float64(enable_x64, case):
    check_against_oracle(dtype=jnp.float64, d=32, **case)


@pytest.mark.parametrize("blocks", [(None, None), (1, 1), (7, 5), (64, 8), (256, 256)])
def test_block_sizes(blocks):
    check_against_oracle(s_q=37, s_k=45, h=4, h_k=2, window=(20, 3), blocks=blocks)


def test_rows_without_keys_have_zero_output_infinite_lse_and_zero_gradient():
    q, k, v, dout = _random_inputs(3, 1, 40, 10, 2, 1, 8, jnp.float32)
    forward, backward = _jitted(block_q=16, block_k=4, softmax_scale=0.3, window_left=-1,
                                window_right=0, softcap=5.0)
    out, lse = forward(q, k, v)
    dq, dk, dv = backward(q, k, v, out, lse, dout)
    empty = slice(0, 30)  # causal with s_q - s_k = 30: queries 0..29 see no key
    assert (np.asarray(out[:, empty]) == 0).all()
    assert np.isposinf(np.asarray(lse[..., empty])).all()
    assert (np.asarray(dq[:, empty]) == 0).all()
    assert all(np.isfinite(np.asarray(x)).all() for x in (out, dq, dk, dv))


# ----------------------------------------------------------------------------------------------
# Transformations
# ----------------------------------------------------------------------------------------------

def test_vmap_over_the_whole_function():
    q, k, v, dout = _random_inputs(4, 3, 33, 40, 4, 2, 8, jnp.float32)  # leading 3: the vmap axis
    q, k, v, dout = (x[:, None] for x in (q, k, v, dout))  # -> (3, 1, s, h, d)
    options = dict(softmax_scale=0.35, window_left=10, window_right=0, block_q=16, block_k=16)
    forward = functools.partial(attention_forward, **options)
    backward = functools.partial(attention_backward, **options)

    out, lse = jax.jit(jax.vmap(forward))(q, k, v)
    grads = jax.jit(jax.vmap(backward))(q, k, v, out, lse, dout)
    for i in range(3):
        out_i, lse_i = forward(q[i], k[i], v[i])
        np.testing.assert_allclose(out[i], out_i, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lse[i], lse_i, rtol=1e-6)
        for grad, grad_i in zip(grads, backward(q[i], k[i], v[i], out_i, lse_i, dout[i])):
            np.testing.assert_allclose(grad[i], grad_i, rtol=1e-5, atol=1e-6)


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

def _temp_bytes(function, *args):
    return jax.jit(function).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _check_bounded_memory(b, s, h, h_k, d, causal, check_values):
    q, k, v, dout = _random_inputs(6, b, s, s, h, h_k, d, jnp.float32)
    options = dict(softmax_scale=d**-0.5, window_right=0 if causal else -1)
    forward = functools.partial(attention_forward, **options)
    backward = functools.partial(attention_backward, **options)

    # A dense score matrix alone would take b * h * s * s * 4 bytes; the blocked code must need a
    # small fraction of that (its largest temporaries are block-sized and dq-sized).
    dense_scores_bytes = b * h * s * s * 4
    out, lse = jax.jit(forward)(q, k, v)
    assert _temp_bytes(forward, q, k, v) < dense_scores_bytes / 8
    assert _temp_bytes(backward, q, k, v, out, lse, dout) < dense_scores_bytes / 8

    grads = jax.jit(backward)(q, k, v, out, lse, dout)
    assert all(np.isfinite(np.asarray(x)).all() for x in (out, lse, *grads))
    if check_values:
        expected_out, expected_lse = attention_oracle(*_as_numpy64(q, k, v), **options)
        assert relative_error(out, expected_out) < 1e-5
        assert relative_error(lse, expected_lse) < 1e-6
        expected_grads = attention_oracle_grads(*_as_numpy64(q, k, v, dout), **options)
        for grad, expected in zip(grads, expected_grads):
            assert relative_error(grad, expected) < 1e-5


def test_bounded_memory_seqlen_4096():
    _check_bounded_memory(b=1, s=4096, h=2, h_k=1, d=16, causal=True, check_values=True)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JAX_FA3_SLOW") != "1", reason="set JAX_FA3_SLOW=1 to run")
def test_bounded_memory_seqlen_16k_full_size():
    _check_bounded_memory(b=1, s=16384, h=16, h_k=16, d=128, causal=False, check_values=False)
