"""Masks for the key-range tests (tests/test_key_ranges.py, tests/test_cuda_layouts.py): padded
rows, cache-like diagonals, packed documents with segment ids, and a float64-free numpy oracle of
what each query sees (the rule of `reference.attention_forward`'s masks)."""
import numpy as np


def visible(masks, s_q: int, s_k: int, window_left: int, window_right: int) -> np.ndarray:
  """bool (b, s_q, s_k): query i of row r sees key j."""
  q_len, k_len, diag = (np.asarray(x, np.int64) for x in masks[:3])
  i = np.arange(s_q)[None, :, None]
  j = np.arange(s_k)[None, None, :]
  centre = i + (diag[:, None, None] if diag.ndim == 1 else diag[:, :, None])  # per row or query
  sees = (i < q_len[:, None, None]) & (j < k_len[:, None, None])
  if window_left >= 0:
    sees &= j >= centre - window_left
  if window_right >= 0:
    sees &= j <= centre + window_right
  if len(masks) > 3:
    q_seg, kv_seg = np.asarray(masks[3]), np.asarray(masks[4])
    sees &= q_seg[:, :, None] == kv_seg[:, None, :]
  return sees


def _documents(rng, s: int, lengths) -> np.ndarray:
  """Segment ids of documents of these lengths packed from position 0, the rest padding (id 0,
  after the documents, as MaxText packs)."""
  ids = np.zeros(s, np.int32)
  at = 0
  for doc, n in enumerate(lengths, start=1):
    ids[at:at + n] = doc
    at += n
  assert at <= s
  return ids


WINDOWS = ((-1, -1), (-1, 0), (0, 0), (37, 0), (5, 70), (100, -1))


def cases(seed: int = 0):
  """(name, masks, s_q, s_k, window_left, window_right, contiguous) tuples."""
  rng = np.random.default_rng(seed)
  out = []
  s_q, s_k = 200, 230
  q_len = np.array([0, 1, 130, 200, 64], np.int32)
  k_len = np.array([230, 0, 64, 129, 65], np.int32)
  for wl, wr in WINDOWS:
    out.append(("padded bottom-right", (q_len, k_len, k_len - q_len), s_q, s_k, wl, wr, True))
    out.append(("padded whole diagonal", (q_len, k_len, np.full(5, s_k - s_q, np.int32)), s_q,
                s_k, wl, wr, True))
  # KV cache: 3 new queries against 300 slots; split-KV pieces' diagonals past both ends.
  cache_len = np.array([3, 150, 300, 7], np.int32)
  out.append(("cache", (np.full(4, 3, np.int32), cache_len, cache_len - 3), 3, 300, -1, 0, True))
  out.append(("cache pieces", (np.full(4, 3, np.int32), np.array([0, 300, 40, 300], np.int32),
                               np.array([-5000, 6000, -1, 297], np.int32)), 3, 300, -1, 0, True))
  # Packed documents, self-attention (ids shared by queries and keys), padding id 0 at the end.
  s = 300
  rows = [_documents(rng, s, [100, 1, 63, 64, 50]), _documents(rng, s, [300]),
          _documents(rng, s, [1] * 7 + [129, 70]), _documents(rng, s, [])]
  seg = np.stack(rows)
  full = np.full(len(rows), s, np.int32)
  for wl, wr in WINDOWS:
    out.append(("packed", (full, full, np.zeros(len(rows), np.int32), seg, seg), s, s, wl, wr,
                True))
  # Packed with padding lengths too, and different query / key documents (cross-attention).
  out.append(("packed + lengths", (np.array([200, 300, 7, 0], np.int32),
                                   np.array([250, 300, 300, 10], np.int32),
                                   np.zeros(4, np.int32), seg, seg), s, s, -1, 0, True))
  q_docs = np.stack([_documents(rng, 160, [40, 60, 60]), _documents(rng, 160, [10, 150])])
  k_docs = np.stack([_documents(rng, 250, [100, 50, 100]), _documents(rng, 250, [200, 30])])
  out.append(("cross documents", (np.array([160, 160], np.int32), np.array([250, 250], np.int32),
                                  np.array([90, 90], np.int32), q_docs, k_docs), 160, 250, -1, -1,
              True))
  # Packed varlen cross-attention: query and key sequences of different lengths in one row, each
  # query's window centred on its own sequence's bottom-right diagonal (one per query).
  lens_q, lens_k = [5, 130, 0, 64, 1], [7, 100, 3, 200, 1]
  q_seq = np.repeat(np.arange(5), lens_q)[None].astype(np.int32)
  k_seq = np.repeat(np.arange(5), lens_k)[None].astype(np.int32)
  q_end, k_end = np.cumsum(lens_q), np.cumsum(lens_k)
  per_query = (k_end - q_end)[q_seq].astype(np.int32)
  tq, tk = int(q_end[-1]), int(k_end[-1])
  for wl, wr in ((-1, 0), (-1, -1), (20, 0)):
    out.append(("varlen cross", (np.array([tq], np.int32), np.array([tk], np.int32), per_query,
                                 q_seq, k_seq), tq, tk, wl, wr, True))
  # Ids out of order but each one contiguous; an id only the queries have (sees nothing).
  q_ids = np.array([[3, 3, 1, 1, 9, 2, 2, 2]], np.int32)
  k_ids = np.array([[2, 2, 3, 3, 3, 1, 1, 1, 1, 0]], np.int32)
  out.append(("unordered ids", (np.array([8], np.int32), np.array([10], np.int32),
                                np.array([2], np.int32), q_ids, k_ids), 8, 10, -1, -1, True))
  # Ids past the scatter path's range [0, s_k) (negative, large): the sort path.
  big = np.array([[-7, -7, 1 << 30, 1 << 30, 1 << 30, 5, 5, 5]], np.int32)
  out.append(("large ids", (np.array([8], np.int32), np.array([8], np.int32),
                            np.array([0], np.int32), big, big), 8, 8, -1, 0, True))
  big_split = np.array([[-7, 1 << 30, -7, 5]], np.int32)
  out.append(("large ids split", (np.array([4], np.int32), np.array([4], np.int32),
                                  np.array([0], np.int32), big_split, big_split), 4, 4, -1, -1,
              False))
  # Not contiguous: a key segment split in two.
  split = np.array([[1, 2, 1, 2, 2, 1]], np.int32)
  out.append(("split segment", (np.array([6], np.int32), np.array([6], np.int32),
                                np.array([0], np.int32), split, split), 6, 6, -1, -1, False))
  return out
