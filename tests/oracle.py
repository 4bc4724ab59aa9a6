"""Float64 NumPy dense attention: the test oracle.

Deliberately naive (the whole s_q x s_k score matrix, no blocking, no online softmax) and
independent of jax_fa3, so that it can only agree with the library by being right. The semantics
are exactly those of docs/CONTRACTS.md:

- layout q (b, s_q, h, d), k and v (b, s_k, h_k, d); query head i uses kv head i // (h // h_k);
- scores s = softmax_scale * q.k, soft-capped as softcap * tanh(s / softcap) when softcap > 0;
- query i sees key j iff i + s_k - s_q - window_left <= j <= i + s_k - s_q + window_right
  (bottom-right alignment, -1 meaning unbounded; causal is window_right = 0);
- a row that sees no key has output 0 and LSE +inf;
- `mask` (b, s_q, s_k) bool, optional: further pairs made invisible per batch row (sequence
  lengths, segment ids: `padding_mask`).
"""

import numpy as np

# optimize=True lets np.einsum hand the contractions to BLAS: ~5x faster at s = 4096.


def visibility_mask(s_q, s_k, window_left=-1, window_right=-1):
    """Boolean (s_q, s_k): True where query i may attend to key j."""
    query = np.arange(s_q)[:, None]
    key = np.arange(s_k)[None, :]
    diagonal = query + (s_k - s_q)  # the key each query is aligned with (bottom-right)
    visible = np.ones((s_q, s_k), dtype=bool)
    if window_left >= 0:
        visible &= key >= diagonal - window_left
    if window_right >= 0:
        visible &= key <= diagonal + window_right
    return visible


def _expand_kv_heads(x, num_q_heads):
    """(b, s_k, h_k, d) -> (b, s_k, h, d), repeating each kv head for its query-head group."""
    return np.repeat(x, num_q_heads // x.shape[2], axis=2)


def _sum_over_head_groups(x, num_kv_heads):
    """(b, s_k, h, d) -> (b, s_k, h_k, d): the adjoint of _expand_kv_heads."""
    b, s, h, d = x.shape
    return x.reshape(b, s, num_kv_heads, h // num_kv_heads, d).sum(axis=3)


def _scores(q, k, softmax_scale, softcap):
    """Returns (capped scores, tanh of the uncapped scores / softcap or None), both (b, h, s_q, s_k)."""
    raw = softmax_scale * np.einsum("bqhd,bkhd->bhqk", q, k, optimize=True)
    if softcap > 0:
        tanh = np.tanh(raw / softcap)
        return softcap * tanh, tanh
    return raw, None


def padding_mask(s_q, s_k, q_lengths=None, kv_lengths=None, q_segment_ids=None,
                 kv_segment_ids=None):
    """(b, s_q, s_k) bool: query i of row r may see key j of row r only if i < q_lengths[r],
    j < kv_lengths[r] and q_segment_ids[r, i] == kv_segment_ids[r, j] (each given piece)."""
    given = [x for x in (q_lengths, kv_lengths, q_segment_ids, kv_segment_ids) if x is not None]
    b = np.asarray(given[0]).shape[0]
    mask = np.ones((b, s_q, s_k), dtype=bool)
    if q_lengths is not None:
        mask &= (np.arange(s_q)[None, :] < np.asarray(q_lengths)[:, None])[:, :, None]
    if kv_lengths is not None:
        mask &= (np.arange(s_k)[None, :] < np.asarray(kv_lengths)[:, None])[:, None, :]
    if q_segment_ids is not None:
        mask &= np.asarray(q_segment_ids)[:, :, None] == np.asarray(kv_segment_ids)[:, None, :]
    return mask


def _probabilities(q, k, softmax_scale, window_left, window_right, softcap, mask=None):
    """(P, lse, tanh): P (b, h, s_q, s_k) with zero rows where nothing is visible, lse (b, h, s_q)."""
    s_q, s_k = q.shape[1], k.shape[1]
    scores, tanh = _scores(q, k, softmax_scale, softcap)
    visible = visibility_mask(s_q, s_k, window_left, window_right)
    if mask is not None:
        visible = visible[None, None] & np.asarray(mask, dtype=bool)[:, None]
    # In-place passes from here on: at s = 4096 each full-size temporary costs ~0.3 s.
    probs = np.where(visible, scores, -np.inf)
    row_max = probs.max(axis=-1, keepdims=True)
    empty_row = np.isneginf(row_max)
    np.subtract(probs, np.where(empty_row, 0.0, row_max), out=probs)  # -inf stays -inf
    np.exp(probs, out=probs)  # masked entries (and so whole empty rows) become exactly 0
    row_sum = probs.sum(axis=-1, keepdims=True)
    np.divide(probs, np.where(empty_row, 1.0, row_sum), out=probs)
    with np.errstate(divide="ignore"):
        lse = np.where(empty_row, np.inf, row_max + np.log(row_sum))[..., 0]
    return probs, lse, tanh


def _as_float64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def attention_oracle(q, k, v, *, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                     mask=None):
    """Dense float64 attention. Returns out (b, s_q, h, d) and lse (b, h, s_q), both float64."""
    q, k, v = _as_float64(q, k, v)
    h = q.shape[2]
    k, v = _expand_kv_heads(k, h), _expand_kv_heads(v, h)
    probs, lse, _ = _probabilities(q, k, softmax_scale, window_left, window_right, softcap, mask)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v, optimize=True)
    return out, lse


def attention_oracle_grads(q, k, v, dout, *, softmax_scale, window_left=-1, window_right=-1,
                           softcap=0.0, mask=None):
    """Analytic float64 gradients of sum(out * dout) with respect to q, k and v.

    Written from the softmax Jacobian directly (not the FlashAttention identity D = rowsum(dO*O)),
    so the library's backward is checked against an independent derivation.
    """
    q, k, v, dout = _as_float64(q, k, v, dout)
    h, h_k = q.shape[2], k.shape[2]
    k_full, v_full = _expand_kv_heads(k, h), _expand_kv_heads(v, h)
    probs, _, tanh = _probabilities(q, k_full, softmax_scale, window_left, window_right, softcap,
                                    mask)

    dv_full = np.einsum("bhqk,bqhd->bkhd", probs, dout, optimize=True)
    dprobs = np.einsum("bqhd,bkhd->bhqk", dout, v_full, optimize=True)
    # Softmax Jacobian: dS_ij = P_ij (dP_ij - sum_l P_il dP_il); masked and empty rows have P = 0.
    dscores = probs * (dprobs - (probs * dprobs).sum(axis=-1, keepdims=True))
    if tanh is not None:
        dscores = dscores * (1.0 - tanh**2)  # d/dx [c tanh(x / c)] = 1 - tanh^2(x / c)
    dq = softmax_scale * np.einsum("bhqk,bkhd->bqhd", dscores, k_full, optimize=True)
    dk_full = softmax_scale * np.einsum("bhqk,bqhd->bkhd", dscores, q, optimize=True)
    return dq, _sum_over_head_groups(dk_full, h_k), _sum_over_head_groups(dv_full, h_k)


# The public API's options, translated here (not by jax_fa3._validation): the default scale is
# 1/sqrt(head_dim) and causal is a window whose right bound is 0.
def resolve_options(head_dim, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, deterministic=False):
    """The keyword arguments of attention_oracle for a flash_attention call's options
    (`deterministic` fixes an accumulation order, not the value: it is accepted and ignored)."""
    left, right = window_size
    if causal:
        if right > 0:
            raise ValueError(f"causal with window_size right {right} > 0")
        right = 0
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    return dict(softmax_scale=scale, window_left=left, window_right=right, softcap=float(softcap))


def oracle_attention(q, k, v, **options):
    """attention_oracle with flash_attention's options (softmax_scale=None, causal, window_size,
    softcap): out (b, s_q, h, d) and lse (b, h, s_q), float64."""
    return attention_oracle(q, k, v, **resolve_options(q.shape[-1], **options))


def oracle_attention_grads(q, k, v, dout, **options):
    """attention_oracle_grads with flash_attention's options: dq, dk, dv, float64."""
    return attention_oracle_grads(q, k, v, dout, **resolve_options(q.shape[-1], **options))


def keys_seen_per_row(s_q, s_k, **options):
    """(s_q,) number of keys each query row sees under flash_attention's options."""
    resolved = resolve_options(1, **options)
    return visibility_mask(s_q, s_k, resolved["window_left"], resolved["window_right"]).sum(-1)
