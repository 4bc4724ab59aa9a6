"""Pure-JAX FlashAttention: the CPU path and the fallback when no kernel applies.

Semantics are those of docs/CONTRACTS.md (GQA, bottom-right aligned windows, soft-capping, rows that
see no key give output 0 and LSE +inf). The computation is blocked like FlashAttention so that no
s_q x s_k array ever exists for long inputs:

- forward: a loop over query blocks, and inside it a scan over key/value blocks carrying an online
  softmax (running max, running sum, unnormalised output accumulator);
- backward: a scan over key/value blocks (accumulating that block's dK, dV), and inside it a scan
  over query blocks that recomputes P = exp(S - LSE) and returns each query block's share of dQ.

Both sequence lengths are padded up to a multiple of their block size; padded keys are masked and
padded query rows are sliced away. Scores, softmax and accumulators are float32 (float64 for float64
inputs); matmuls run at HIGHEST precision so that float32 means float32 on GPUs too (no TF32).

Callers validate inputs (rank 4, (b, s, h, d) layout, h % h_k == 0, one dtype); everything that is
not an array is a static Python scalar.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512

_HIGHEST = lax.Precision.HIGHEST


def _filled(shape, value, dtype, like):
    """jnp.full(shape, value) that varies over the same shard_map axes as the arrays in `like`.

    A lax.scan carry must keep its type; under shard_map (check_vma) a carry that starts as a plain
    constant but absorbs sharded inputs changes type. zeros_like inserts the needed pvary.
    """
    out = jnp.full(shape, value, dtype)
    for x in like:
        out = out + jnp.zeros_like(x, dtype=dtype, shape=())
    # JAX 0.6's zeros_like(shape=()) does not carry the varying axes: add what is still missing.
    vma = lambda a: frozenset(getattr(jax.typeof(a), "vma", ()) or ())
    missing = frozenset().union(*(vma(x) for x in like)) - vma(out) if like else frozenset()
    if missing:
        out = jax.lax.pvary(out, tuple(sorted(missing)))
    return out


def _compute_dtype(dtype):
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _block_size(requested, seqlen, default):
    """The requested block size, or the default clipped to the sequence (one block when short)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"block size must be positive, got {requested}")
        return int(requested)
    return max(1, min(default, seqlen))


def _num_blocks(seqlen, block):
    return -(-seqlen // block)


# ---------------------------------------------------------------------------------------------
# Layout helpers. Blocked layouts put the block index first so that scan/map can iterate over it,
# and heads before positions so that every per-block product is a plain batched matmul over
# (b, h_k) with no transposes inside the loops:
#   query-like (b, s_q, h, d)   -> (n_q_blocks, b, h_k, group, block_q, d)
#   key-like   (b, s_k, h_k, d) -> (n_k_blocks, b, h_k, block_k, d)
#   row stats  (b, h, s_q)      -> (n_q_blocks, b, h_k, group, block_q)
# where group = h // h_k is the number of query heads sharing a kv head (query head i = kv head
# i // group, so splitting h as (h_k, group) is exactly the GQA assignment).
# ---------------------------------------------------------------------------------------------

def _pad_axis(x, axis, new_length, value=0):
    padding = [(0, 0)] * x.ndim
    padding[axis] = (0, new_length - x.shape[axis])
    return jnp.pad(x, padding, constant_values=value)


def _block_queries(x, block, num_kv_heads):
    b, s, h, d = x.shape
    n = _num_blocks(s, block)
    x = _pad_axis(x, 1, n * block)
    x = x.reshape(b, n, block, num_kv_heads, h // num_kv_heads, d)
    return jnp.transpose(x, (1, 0, 3, 4, 2, 5))


def _unblock_queries(x, seqlen):
    n, b, h_k, group, block, d = x.shape
    x = jnp.transpose(x, (1, 0, 4, 2, 3, 5)).reshape(b, n * block, h_k * group, d)
    return x[:, :seqlen]


def _block_keys(x, block):
    b, s, h_k, d = x.shape
    n = _num_blocks(s, block)
    x = _pad_axis(x, 1, n * block).reshape(b, n, block, h_k, d)
    return jnp.transpose(x, (1, 0, 3, 2, 4))


def _unblock_keys(x, seqlen):
    n, b, h_k, block, d = x.shape
    return jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(b, n * block, h_k, d)[:, :seqlen]


def _block_row_stats(x, block, num_kv_heads, pad_value):
    b, h, s = x.shape
    n = _num_blocks(s, block)
    x = _pad_axis(x, 2, n * block, pad_value)
    x = x.reshape(b, num_kv_heads, h // num_kv_heads, n, block)
    return jnp.moveaxis(x, 3, 0)


def _unblock_row_stats(x, seqlen):
    n, b, h_k, group, block = x.shape
    return jnp.moveaxis(x, 0, 3).reshape(b, h_k * group, n * block)[..., :seqlen]


# ---------------------------------------------------------------------------------------------
# Per-block pieces shared by forward and backward.
# ---------------------------------------------------------------------------------------------

class _Problem:
    """Static description of one attention call: lengths, blocks, masking and score options."""

    def __init__(self, s_q, s_k, block_q, block_k, softmax_scale, window_left, window_right,
                 softcap, compute_dtype):
        self.s_q, self.s_k = s_q, s_k
        self.block_q, self.block_k = block_q, block_k
        self.softmax_scale = float(softmax_scale)
        self.window_left, self.window_right = int(window_left), int(window_right)
        self.softcap = float(softcap)
        self.compute_dtype = compute_dtype

    def visible(self, q_block_index, k_block_index, q_tags=None, k_tags=None):
        """Which (query, key) pairs of these two blocks may interact: (block_q, block_k) bool, or
        (b, 1, 1, block_q, block_k) given per-batch tags (see `_block_tags`)."""
        query = q_block_index * self.block_q + jnp.arange(self.block_q)[:, None]
        key = k_block_index * self.block_k + jnp.arange(self.block_k)[None, :]
        if q_tags is None:
            return self._in_window(query, key, self.s_k - self.s_q)  # bottom-right alignment
        (q_length, diagonal, q_segment), (k_length, k_segment) = q_tags, k_tags
        query, key = query[None], key[None]
        # One diagonal per row (b,) or per query of the block (b, block_q).
        centre_offset = diagonal[:, None, None] if diagonal.ndim == 1 else diagonal[:, :, None]
        # Positions past a row's length are padding: they neither see nor are seen.
        visible = (self._in_window(query, key, centre_offset)
                   & (query < q_length[:, None, None]) & (key < k_length[:, None, None]))
        if q_segment is not None:
            visible &= q_segment[:, :, None] == k_segment[:, None, :]
        return visible[:, None, None]

    def _in_window(self, query, key, diagonal):
        """Key inside the sequence and the window centred on key query + diagonal."""
        centre = query + diagonal
        visible = key < self.s_k  # keys past the blocks' end are never visible
        if self.window_left >= 0:
            visible &= key >= centre - self.window_left
        if self.window_right >= 0:
            visible &= key <= centre + self.window_right
        return visible

    def scores(self, q_block, k_block):
        """Soft-capped scores (b, h_k, group, block_q, block_k) and tanh(raw / softcap) or None."""
        q_block = q_block.astype(self.compute_dtype)
        k_block = k_block.astype(self.compute_dtype)
        raw = self.softmax_scale * jnp.einsum(
            "bhgqd,bhkd->bhgqk", q_block, k_block, precision=_HIGHEST)
        if self.softcap > 0:
            tanh = jnp.tanh(raw / self.softcap)
            return self.softcap * tanh, tanh
        return raw, None

    def masked_scores(self, q_block, k_block, q_block_index, k_block_index, q_tags=None,
                      k_tags=None):
        scores, tanh = self.scores(q_block, k_block)
        visible = self.visible(q_block_index, k_block_index, q_tags, k_tags)
        return jnp.where(visible, scores, -jnp.inf), tanh


def _block_tags(masks, s_q, s_k, block_q, block_k):
    """Per-batch masking inputs split into blocks, scanned along with their blocks: q_tags =
    (q_lengths, diagonals, q segment ids or None), k_tags = (kv_lengths, kv segment ids or None),
    per-row values broadcast to (n_blocks, b), segment ids (n_blocks, b, block); or (None, None)
    without masks. masks: see `attention_forward`."""
    if masks is None:
        return None, None
    q_length, k_length, diagonal, *segments = masks
    q_segment, k_segment = segments or (None, None)

    def per_row(x, seqlen, block):
        return jnp.broadcast_to(x, (_num_blocks(seqlen, block),) + x.shape)

    def per_token(segment, seqlen, block):
        if segment is None:
            return None
        n = _num_blocks(seqlen, block)
        blocked = _pad_axis(segment, 1, n * block).reshape(segment.shape[0], n, block)
        return jnp.swapaxes(blocked, 0, 1)

    diagonals = (per_token(diagonal, s_q, block_q) if diagonal.ndim == 2
                 else per_row(diagonal, s_q, block_q))
    q_tags = (per_row(q_length, s_q, block_q), diagonals, per_token(q_segment, s_q, block_q))
    k_tags = (per_row(k_length, s_k, block_k), per_token(k_segment, s_k, block_k))
    return q_tags, k_tags


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

def _forward_query_block(problem, k_blocks, v_blocks, k_tags, q_block, q_block_index, q_tags):
    """Online softmax of one query block over all key blocks -> (out block, lse block)."""
    b, h_k, group, block_q, d = q_block.shape
    dtype = problem.compute_dtype

    def step(carry, key_block_inputs):
        row_max, row_sum, acc = carry  # (b, h_k, group, block_q) x2 and (..., d)
        k_block, v_block, k_block_index, k_block_tags = key_block_inputs
        scores, _ = problem.masked_scores(q_block, k_block, q_block_index, k_block_index,
                                          q_tags, k_block_tags)
        new_max = jnp.maximum(row_max, scores.max(axis=-1))
        # While a row has seen nothing, its max is -inf; shift by 0 instead so that
        # exp(-inf - shift) = 0 rather than exp(-inf + inf) = NaN.
        shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max).astype(dtype)
        rescale = jnp.exp(row_max - shift)
        probs = jnp.exp(scores - shift[..., None])
        row_sum = row_sum * rescale + probs.sum(axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "bhgqk,bhkd->bhgqd", probs, v_block.astype(dtype), precision=_HIGHEST)
        return (new_max, row_sum, acc), None

    stats_shape = (b, h_k, group, block_q)
    like = (q_block, k_blocks, v_blocks)
    init = (_filled(stats_shape, -jnp.inf, dtype, like), _filled(stats_shape, 0, dtype, like),
            _filled(stats_shape + (d,), 0, dtype, like))
    k_block_indices = jnp.arange(k_blocks.shape[0])
    (row_max, row_sum, acc), _ = lax.scan(step, init,
                                          (k_blocks, v_blocks, k_block_indices, k_tags))

    empty_row = row_sum == 0  # no visible key (every probability underflowing is impossible:
    #                            the max itself contributes exp(0) = 1)
    safe_sum = jnp.where(empty_row, 1.0, row_sum)
    out = jnp.where(empty_row[..., None], 0.0, acc / safe_sum[..., None])
    lse = jnp.where(empty_row, jnp.inf, row_max + jnp.log(safe_sum))
    return out, lse


def attention_forward(q, k, v, *, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                      block_q=None, block_k=None, masks=None):
    """Blocked attention forward.

    Args:
      q: (b, s_q, h, d); k, v: (b, s_k, h_k, d) with h % h_k == 0, all of one dtype.
      softmax_scale, window_left, window_right, softcap: see docs/CONTRACTS.md.
      block_q, block_k: block sizes (default: 512, or the sequence length when shorter).
      masks: optional integer arrays (q_lengths (b,), kv_lengths (b,), diagonals (b,)), or
        (q_lengths, kv_lengths, diagonals (b, s_q), q_segment_ids (b, s_q),
        kv_segment_ids (b, s_k)): query i of batch row r sees key j only if i < q_lengths[r],
        j < kv_lengths[r], the window centred on key i + diagonals[r] (or diagonals[r, i], one
        per query) holds j (s_k - s_q is the unmasked bottom-right alignment) and their segment
        ids are equal; rows that see nothing give out 0 and lse +inf.

    Returns:
      out (b, s_q, h, d) in q's dtype, and lse (b, h, s_q): float32, or float64 for float64 inputs
      (so that a float64 backward can recompute P exactly); +inf for rows that see no key.
    """
    s_q, h_k = q.shape[1], k.shape[2]
    problem = _Problem(
        s_q, k.shape[1], _block_size(block_q, s_q, DEFAULT_BLOCK_Q),
        _block_size(block_k, k.shape[1], DEFAULT_BLOCK_K), softmax_scale, window_left,
        window_right, softcap, _compute_dtype(q.dtype))

    q_blocks = _block_queries(q, problem.block_q, h_k)
    k_blocks = _block_keys(k, problem.block_k)
    v_blocks = _block_keys(v, problem.block_k)
    q_block_indices = jnp.arange(q_blocks.shape[0])
    q_tags, k_tags = _block_tags(masks, s_q, problem.s_k, problem.block_q, problem.block_k)

    per_query_block = functools.partial(_forward_query_block, problem, k_blocks, v_blocks, k_tags)
    out_blocks, lse_blocks = lax.map(lambda args: per_query_block(*args),
                                     (q_blocks, q_block_indices, q_tags))
    out = _unblock_queries(out_blocks, s_q).astype(q.dtype)
    lse = _unblock_row_stats(lse_blocks, s_q)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

def _backward_key_block(problem, query_side, k_block, v_block, k_block_index, k_tags):
    """Gradients for one key/value block: (dk block, dv block, dq contributions of all q blocks).

    query_side = (q_blocks, dout_blocks, lse_blocks, delta_blocks, q_tags) in blocked layouts.
    """
    dtype = problem.compute_dtype
    k_block = k_block.astype(dtype)
    v_block = v_block.astype(dtype)

    def step(carry, query_block_inputs):
        dk_acc, dv_acc = carry  # (b, h_k, block_k, d) each
        q_block, dout_block, lse_block, delta_block, q_tags, q_block_index = query_block_inputs
        q_block = q_block.astype(dtype)
        dout_block = dout_block.astype(dtype)
        scores, tanh = problem.masked_scores(q_block, k_block, q_block_index, k_block_index,
                                             q_tags, k_tags)
        # lse = +inf on empty rows and scores = -inf where masked: both make P exactly 0.
        probs = jnp.exp(scores - lse_block[..., None])
        dv_acc = dv_acc + jnp.einsum("bhgqk,bhgqd->bhkd", probs, dout_block, precision=_HIGHEST)
        dprobs = jnp.einsum("bhgqd,bhkd->bhgqk", dout_block, v_block, precision=_HIGHEST)
        dscores = probs * (dprobs - delta_block[..., None])
        if tanh is not None:
            dscores = dscores * (1.0 - tanh * tanh)  # derivative of softcap * tanh(x / softcap)
        dscores = dscores * problem.softmax_scale
        dq_block = jnp.einsum("bhgqk,bhkd->bhgqd", dscores, k_block, precision=_HIGHEST)
        dk_acc = dk_acc + jnp.einsum("bhgqk,bhgqd->bhkd", dscores, q_block, precision=_HIGHEST)
        return (dk_acc, dv_acc), dq_block

    zeros = _filled(k_block.shape, 0, dtype, (k_block, v_block, *query_side[:4]))
    q_block_indices = jnp.arange(query_side[0].shape[0])
    (dk_block, dv_block), dq_parts = lax.scan(step, (zeros, zeros),
                                             (*query_side, q_block_indices))
    return dk_block, dv_block, dq_parts


def attention_backward(q, k, v, out, lse, dout, *, softmax_scale, window_left=-1,
                       window_right=-1, softcap=0.0, block_q=None, block_k=None, dlse=None,
                       masks=None):
    """Blocked attention backward (FlashAttention-2 style, recomputing P from the LSE).

    Args:
      q, k, v, softmax_scale, window_left, window_right, softcap, block_q, block_k: as for
        attention_forward.
      out: (b, s_q, h, d), the forward output; lse: (b, h, s_q), the forward LSE (+inf on empty rows).
      dout: (b, s_q, h, d), the cotangent of out.
      dlse: optional (b, h, s_q), the cotangent of a returned lse; since d lse_i / d s_ij = P_ij it
        enters as dS = P ∘ (dP − D + dlse), i.e. D − dlse in place of D.
      masks: as for attention_forward (the same masks as the forward's).

    Returns:
      dq (b, s_q, h, d), dk and dv (b, s_k, h_k, d), in the inputs' dtype; dk and dv are summed over
      the query heads that share each kv head.
    """
    s_q, s_k, h_k = q.shape[1], k.shape[1], k.shape[2]
    dtype = _compute_dtype(q.dtype)
    problem = _Problem(
        s_q, s_k, _block_size(block_q, s_q, DEFAULT_BLOCK_Q),
        _block_size(block_k, s_k, DEFAULT_BLOCK_K), softmax_scale, window_left, window_right,
        softcap, dtype)

    # D_i = sum_d dO_id O_id = sum_j P_ij dP_ij, the softmax Jacobian's row term; (b, h, s_q).
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(dtype), out.astype(dtype),
                       precision=_HIGHEST)
    if dlse is not None:
      delta = delta - dlse.astype(dtype)
    q_tags, k_tags = _block_tags(masks, s_q, s_k, problem.block_q, problem.block_k)
    # Padded query rows get lse = +inf (so P = 0 there) and dout = 0.
    query_side = (_block_queries(q, problem.block_q, h_k),
                  _block_queries(dout, problem.block_q, h_k),
                  _block_row_stats(lse.astype(dtype), problem.block_q, h_k, jnp.inf),
                  _block_row_stats(delta, problem.block_q, h_k, 0.0), q_tags)
    k_blocks = _block_keys(k, problem.block_k)
    v_blocks = _block_keys(v, problem.block_k)

    def step(dq_acc, key_block_inputs):
        dk_block, dv_block, dq_parts = _backward_key_block(problem, query_side, *key_block_inputs)
        return dq_acc + dq_parts, (dk_block, dv_block)

    dq_init = _filled(query_side[0].shape, 0, dtype, (*query_side[:4], k_blocks, v_blocks))
    k_block_indices = jnp.arange(k_blocks.shape[0])
    dq_blocks, (dk_blocks, dv_blocks) = lax.scan(step, dq_init,
                                                 (k_blocks, v_blocks, k_block_indices, k_tags))
    dq = _unblock_queries(dq_blocks, s_q).astype(q.dtype)
    dk = _unblock_keys(dk_blocks, s_k).astype(k.dtype)
    dv = _unblock_keys(dv_blocks, s_k).astype(v.dtype)
    return dq, dk, dv
