"""A logical KV cache laid out as a shuffled pool of pages, for the GPU tests of paged caches."""
import jax
import jax.numpy as jnp
import numpy as np


def shuffled_pages(cache, page_size, seed, spare=3):
  """The logical cache (b, capacity, h_k, d) as a pool of pages in shuffled order, plus `spare`
  pages no row uses (random values of the cache's dtype), and its page table int32
  (b, capacity / page_size)."""
  b, capacity = cache.shape[:2]
  per_row = capacity // page_size
  rng = np.random.default_rng(seed)
  num_pages = b * per_row + spare
  table = rng.permutation(num_pages)[:b * per_row].reshape(b, per_row).astype(np.int32)
  shape = (num_pages, page_size) + cache.shape[2:]
  pool = np.array(jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(cache.dtype))
  pool[table.reshape(-1)] = np.asarray(cache).reshape((b * per_row, page_size) + cache.shape[2:])
  return jnp.asarray(pool), jnp.asarray(table)
