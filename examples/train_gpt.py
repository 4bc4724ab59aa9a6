"""Train a small byte-level GPT with jax_fa3 attention (Flax linen + optax AdamW).

The text is this repository's own source files, read as bytes (no downloads). On a GPU the model
is 6 layers, width 512, 8 heads, sequence 1024, in bfloat16; on the CPU (or with --small) it is
2 layers, width 64, sequence 64, in float32, for a few steps.

  python examples/train_gpt.py                               # jax_fa3 attention
  python examples/train_gpt.py --attention xla               # jax.nn.dot_product_attention (XLA)
  python examples/train_gpt.py --compare --plot loss.png     # jax_fa3 vs XLA, same init and data
  python examples/train_gpt.py --compare-fp8 --steps 1000    # jax_fa3 bf16 vs its FP8 mode
  python examples/train_gpt.py --generate 200                # then write 200 bytes, KV cache
  python examples/train_gpt.py --parallel shard_map          # data parallel on all local devices
  python examples/train_gpt.py --packed                      # rows packed with whole files

`--attention xla|cudnn` uses flax.linen.MultiHeadDotProductAttention with the same parameter tree
as our layer, so both models start from the very same parameters. `--attention jax_fa3_fp8` is our
layer in FP8 mode (e4m3 forward with a Hadamard rotation, `fp8_backward="bf16"`); its rotation
signs live outside the parameters, which are again the same.

`--packed` trains on packed rows: each row holds the files it crosses as separate documents, a
token attending only within its own file (segment ids, jax_fa3 attention only) and positions
restarting at each file, so a document's logits are those it gets alone; the loss skips the
first byte of each file (nothing in the row predicts it).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
  sys.path.insert(0, str(REPO))
import jax_fa3.flax  # noqa: E402

VOCAB = 256  # bytes
TEXT_SUFFIXES = (".py", ".md", ".cu", ".cuh", ".h", ".cpp", ".txt", ".toml", ".cmake")


# ----------------------------------------------------------------------------- configuration

@dataclasses.dataclass(frozen=True)
class ModelConfig:
  depth: int
  width: int
  heads: int
  seqlen: int
  dtype: str  # compute dtype; parameters are float32

  @classmethod
  def for_platform(cls, small: bool) -> "ModelConfig":
    if small:
      return cls(depth=2, width=64, heads=4, seqlen=64, dtype="float32")
    return cls(depth=6, width=512, heads=8, seqlen=1024, dtype="bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--attention", choices=("jax_fa3", "jax_fa3_fp8", "xla", "cudnn"),
                      default="jax_fa3")
  parser.add_argument("--parallel", choices=("none", "pmap", "shard_map", "jit"), default="none",
                      help="data parallelism over all local devices")
  parser.add_argument("--small", action="store_true", help="the CPU-sized model (automatic on CPU)")
  parser.add_argument("--depth", type=int, default=None, help="layers (default 6, 2 small)")
  parser.add_argument("--steps", type=int, default=None, help="default: 300 on GPU, 20 small")
  parser.add_argument("--batch", type=int, default=None, help="global batch; default 16 / 8 small")
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--compare", action="store_true",
                      help="train jax_fa3 and xla attention from the same init and data")
  parser.add_argument("--compare-fp8", action="store_true",
                      help="train jax_fa3 in bf16 and in FP8 mode from the same init and data")
  parser.add_argument("--fp8-backward", choices=("bf16", "recompute", "fp8"), default="bf16",
                      help="FP8 mode's backward (flash_attention_fp8's `backward`)")
  parser.add_argument("--plot", default="train_gpt_loss.png",
                      help="PNG written with --compare / --compare-fp8")
  parser.add_argument("--packed", action="store_true",
                      help="rows packed with whole files as documents (segment ids; jax_fa3 only)")
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  parser.add_argument("--generate", type=int, default=0, metavar="N",
                      help="after training jax_fa3, continue --prompt by N bytes (greedy) with "
                           "the attention layers' KV cache")
  parser.add_argument("--prompt", default="def flash_attention(",
                      help="the text --generate continues")
  args = parser.parse_args(argv)
  args.small = args.small or jax.default_backend() == "cpu"
  args.steps = args.steps or (20 if args.small else 300)
  args.batch = args.batch or (8 if args.small else 16)
  return args


def model_config(args) -> ModelConfig:
  config = ModelConfig.for_platform(args.small)
  return dataclasses.replace(config, depth=args.depth) if args.depth else config


# ----------------------------------------------------------------------------- data

def load_documents() -> tuple[np.ndarray, np.ndarray]:
  """This repository's text files, concatenated in a fixed order with a newline between two (which
  counts to the file before it), as uint8 bytes, and the int32 index of each byte's file."""
  files = sorted(p for p in REPO.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
                 and not any(part.startswith(".") or part in ("build", "venv", "third_party")
                             for part in p.relative_to(REPO).parts))
  texts = [p.read_bytes() + (b"\n" if i + 1 < len(files) else b"") for i, p in enumerate(files)]
  documents = np.repeat(np.arange(len(texts), dtype=np.int32), [len(t) for t in texts])
  return np.frombuffer(b"".join(texts), dtype=np.uint8), documents


def load_corpus() -> np.ndarray:
  """load_documents' bytes alone."""
  return load_documents()[0]


def batches(corpus: np.ndarray, batch: int, seqlen: int, seed: int, documents=None):
  """Endless (batch, seqlen + 1) int32 windows at random offsets, the same for a given seed; with
  `documents` (load_documents), (batch, seqlen + 1, 2): each byte and its file's segment id in
  the row (0 for the first file the row touches, then 1, 2, ...)."""
  rng = np.random.default_rng(seed)
  if len(corpus) <= seqlen + 1:
    raise ValueError(f"the corpus ({len(corpus)} bytes) is shorter than seqlen + 1")
  while True:
    starts = rng.integers(0, len(corpus) - seqlen - 1, size=batch)
    tokens = np.stack([corpus[s:s + seqlen + 1] for s in starts]).astype(np.int32)
    if documents is None:
      yield tokens
      continue
    files = np.stack([documents[s:s + seqlen + 1] for s in starts])
    yield np.stack([tokens, files - files[:, :1]], axis=-1).astype(np.int32)


def positions_in_document(segment_ids):
  """(batch, length) int32: each token's position inside its document (segments are runs)."""
  index = jnp.arange(segment_ids.shape[-1], dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


# ----------------------------------------------------------------------------- model

def reference_attention_fn(query, key, value, *, implementation):
  """Causal attention through jax.nn.dot_product_attention ('xla' or 'cudnn')."""
  return jax.nn.dot_product_attention(query, key, value, is_causal=True,
                                      implementation=implementation)


def attention_layer(kind: str, heads: int, dtype, fp8_backward: str, decode: bool = False):
  """Our layer or Flax's with XLA/cuDNN attention: the same parameter tree either way."""
  if kind == "jax_fa3":
    return jax_fa3.flax.linen.MultiHeadDotProductAttention(
        num_heads=heads, causal=True, dtype=dtype, decode=decode, name="attention")
  if kind == "jax_fa3_fp8":
    return jax_fa3.flax.linen.MultiHeadDotProductAttention(
        num_heads=heads, causal=True, dtype=dtype, fp8=True, fp8_backward=fp8_backward,
        name="attention")
  return nn.MultiHeadDotProductAttention(
      num_heads=heads, dtype=dtype, name="attention",
      attention_fn=functools.partial(reference_attention_fn, implementation=kind))


class Block(nn.Module):
  config: ModelConfig
  attention: str
  fp8_backward: str = "bf16"
  decode: bool = False

  @nn.compact
  def __call__(self, x, segment_ids=None):
    cfg = self.config
    attention = attention_layer(self.attention, cfg.heads, cfg.dtype, self.fp8_backward,
                                self.decode)
    documents = {} if segment_ids is None else dict(q_segment_ids=segment_ids,
                                                    kv_segment_ids=segment_ids)
    x = x + attention(nn.LayerNorm(dtype=cfg.dtype)(x), **documents)
    h = nn.Dense(4 * cfg.width, dtype=cfg.dtype)(nn.LayerNorm(dtype=cfg.dtype)(x))
    return x + nn.Dense(cfg.width, dtype=cfg.dtype)(nn.gelu(h))


class GPT(nn.Module):
  config: ModelConfig
  attention: str = "jax_fa3"
  fp8_backward: str = "bf16"  # FP8 mode's backward (attention "jax_fa3_fp8")
  decode: bool = False  # generation: the attention layers keep a KV cache ('cache' collection)

  @nn.compact
  def __call__(self, tokens, segment_ids=None):
    """Logits of `tokens`; with segment_ids (packed documents) each token attends within its
    document and positions restart at each document."""
    cfg = self.config
    embed = nn.Embed(VOCAB, cfg.width, dtype=cfg.dtype)
    positions = self.param("positions", nn.initializers.normal(0.02), (cfg.seqlen, cfg.width))
    start = 0
    if self.decode:  # the tokens continue the sequence cached so far (after the sizing init)
      initialized = self.has_variable("cache", "position")
      position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
      if initialized:
        start = position.value
        position.value = start + tokens.shape[-1]
    if segment_ids is None:
      position = jax.lax.dynamic_slice_in_dim(positions, start, tokens.shape[-1])
    else:
      position = jnp.take(positions, positions_in_document(segment_ids), axis=0)
    x = embed(tokens) + position.astype(cfg.dtype)
    for _ in range(cfg.depth):
      x = Block(cfg, self.attention, self.fp8_backward, self.decode)(x, segment_ids)
    x = nn.LayerNorm(dtype=cfg.dtype)(x)
    return embed.attend(x).astype(jnp.float32)  # tied output embedding


# ----------------------------------------------------------------------------- training

def loss_fn(params, model: GPT, batch, constants):
  if batch.ndim == 2:
    logits = model.apply({"params": params, **constants}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
  tokens, segments = batch[..., 0], batch[..., 1]  # packed documents (batches(documents=...))
  logits = model.apply({"params": params, **constants}, tokens[:, :-1], segments[:, :-1])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  same_document = segments[:, 1:] == segments[:, :-1]  # a file's first byte has no context
  return jnp.sum(losses * same_document) / jnp.maximum(jnp.sum(same_document), 1)


def make_train_step(model: GPT, optimizer, parallel: str, devices, constants):
  """A step (params, opt_state, batch) -> (params, opt_state, loss) for the parallel mode;
  `constants`: the model's untrained variable collections (FP8 mode's rotation signs)."""

  def step(params, opt_state, batch, axis_name=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, model, batch, constants)
    if axis_name is not None:  # average over the data-parallel shards
      loss, grads = jax.lax.pmean((loss, grads), axis_name)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  if parallel == "none":
    return jax.jit(step, donate_argnums=(0, 1))
  if parallel == "pmap":
    return jax.pmap(functools.partial(step, axis_name="data"), axis_name="data",
                    devices=devices, donate_argnums=(0, 1))
  mesh = Mesh(np.asarray(devices), ("data",))
  if parallel == "shard_map":
    # check_vma=False: the CPU reference path's lax.scan carries start as non-varying zeros,
    # which the varying-manual-axes check rejects; the explicit pmean above is what matters.
    sharded = jax.shard_map(functools.partial(step, axis_name="data"), mesh=mesh,
                            in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()),
                            check_vma=False)
    return jax.jit(sharded, donate_argnums=(0, 1))
  if parallel == "jit":  # GSPMD: batch sharded, parameters replicated; XLA inserts the psum
    replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jax.jit(step, in_shardings=(replicated, replicated, by_batch),
                   out_shardings=(replicated, replicated, replicated), donate_argnums=(0, 1))
  raise ValueError(f"unknown --parallel {parallel!r}")


def place(tree, parallel: str, devices):
  """Puts parameters / optimizer state where the step of `parallel` expects them."""
  if parallel == "pmap":
    # One copy per device along a new leading axis (pmap's layout), already spread over the
    # devices so that the first and later steps see one input layout (no recompilation).
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(devices),) + jnp.shape(x)), tree)
    return jax.device_put(stacked, NamedSharding(Mesh(np.asarray(devices), ("data",)), P("data")))
  if parallel in ("shard_map", "jit"):
    return jax.device_put(tree, NamedSharding(Mesh(np.asarray(devices), ("data",)), P()))
  return tree


def shard_batch(batch: np.ndarray, parallel: str, devices):
  if parallel == "pmap":
    return jax.device_put(batch.reshape((len(devices), -1) + batch.shape[1:]),
                          NamedSharding(Mesh(np.asarray(devices), ("data",)), P("data")))
  if parallel in ("shard_map", "jit"):
    return jax.device_put(batch, NamedSharding(Mesh(np.asarray(devices), ("data",)), P("data")))
  return batch


def progress(iterable, total: int, desc: str, quiet: bool):
  if quiet:
    return iterable
  try:
    from tqdm.auto import tqdm
    return tqdm(iterable, total=total, desc=desc)
  except ImportError:
    def printed():
      for i, item in enumerate(iterable):
        if i % max(1, total // 10) == 0 or i == total - 1:
          print(f"{desc}: step {i + 1}/{total}", flush=True)
        yield item
    return printed()


def train(args, attention: str, init_params, corpus, documents=None) -> dict:
  """Trains from `init_params` on the batches of args.seed; returns losses and throughput."""
  config = model_config(args)
  devices = jax.local_devices() if args.parallel != "none" else jax.local_devices()[:1]
  if args.batch % len(devices):
    raise ValueError(f"--batch {args.batch} must be divisible by the {len(devices)} devices")
  model = GPT(config, attention, args.fp8_backward)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps),
      weight_decay=0.1))
  params = place(jax.tree.map(jnp.array, init_params), args.parallel, devices)  # a fresh copy
  opt_state = place(optimizer.init(init_params), args.parallel, devices)
  # Untrained collections (FP8 mode's rotation signs) from the model's own init; the parameters
  # are the shared init_params.
  constants = {}
  if attention == "jax_fa3_fp8":
    variables = jax.jit(model.init)(jax.random.key(args.seed),
                                    np.zeros((1, config.seqlen), np.int32))
    constants = {name: tree for name, tree in variables.items() if name != "params"}
  step = make_train_step(model, optimizer, args.parallel, devices, constants)

  losses, data = [], batches(corpus, args.batch, config.seqlen, args.seed, documents)
  start = None
  bar = progress(range(args.steps), args.steps, f"{attention}/{args.parallel}", args.quiet)
  for i in bar:
    params, opt_state, loss = step(params, opt_state, shard_batch(next(data), args.parallel,
                                                                  devices))
    losses.append(float(np.mean(loss)))  # waits for the step; pmap returns one loss per device
    if i == 0:
      start = time.perf_counter()  # throughput excludes the first step (compilation)
    if hasattr(bar, "set_postfix"):
      bar.set_postfix(loss=f"{losses[-1]:.3f}")
  elapsed = time.perf_counter() - start
  timed_tokens = (args.steps - 1) * args.batch * config.seqlen
  tokens_per_s = timed_tokens / elapsed if args.steps > 1 else float("nan")
  tail = max(1, args.steps // 10)  # single-step losses are noisy: also the mean of the last 10%
  print(f"{attention:8s} {args.parallel:9s} devices={len(devices)} final loss {losses[-1]:.4f}, "
        f"mean of the last {tail} steps {np.mean(losses[-tail:]):.4f} ({tokens_per_s:,.0f} "
        f"tokens/s after the first step)")
  label = attention if attention != "jax_fa3_fp8" else f"{attention} ({args.fp8_backward} backward)"
  if attention.startswith("jax_fa3") and not jax_fa3.kernels_available():
    label += " (pure-JAX path)"  # no Hopper kernels here: say so next to the numbers
  if args.parallel == "pmap":  # one copy per device: keep the first
    params = jax.tree.map(lambda x: x[0], params)
  return dict(attention=attention, label=label, losses=losses, tokens_per_s=tokens_per_s,
              params=jax.device_get(params))


def plot_losses(results: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for r in results:
    ax.plot(np.arange(1, len(r["losses"]) + 1), r["losses"],
            label=f"{r['label']}: {r['tokens_per_s']:,.0f} tok/s")
  ax.set(xlabel="step", ylabel="train loss (nats/byte)", title="byte-level GPT, same init/data")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"wrote {path}")


# ----------------------------------------------------------------------------- generation

def generate(config: ModelConfig, params, prompt: bytes, length: int) -> bytes:
  """Greedy continuation of `prompt` by `length` bytes with the KV cache (decode=True): the prompt
  as one chunk, then one token per step, each step attending over the cache."""
  if not prompt or len(prompt) + length > config.seqlen:
    raise ValueError(f"the prompt (1 byte or more) and the continuation must fit in the "
                     f"model's {config.seqlen} positions, got {len(prompt)} + {length}")
  model = GPT(config, "jax_fa3", decode=True)
  cache = jax.jit(model.init)(jax.random.key(0), np.zeros((1, config.seqlen), np.int32))["cache"]
  step = jax.jit(lambda cache, tokens: model.apply({"params": params, "cache": cache}, tokens,
                                                   mutable=["cache"]))
  tokens = np.frombuffer(prompt, np.uint8).astype(np.int32)[None]
  out = []
  for _ in range(length):
    logits, variables = step(cache, tokens)
    cache = variables["cache"]
    tokens = np.asarray(jnp.argmax(logits[:, -1], axis=-1), np.int32)[:, None]
    out.append(int(tokens[0, 0]))
  return bytes(out)


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  if args.attention == "cudnn" and jax.default_backend() != "gpu":
    raise SystemExit("--attention cudnn needs an NVIDIA GPU")
  if args.packed and (args.attention != "jax_fa3" or args.compare or args.compare_fp8):
    raise SystemExit("--packed needs --attention jax_fa3 (segment ids) and no comparison")
  config = model_config(args)
  corpus, documents = load_documents()
  print(f"{jax.default_backend()}: {len(jax.local_devices())} device(s); corpus "
        f"{len(corpus):,} bytes; model {config}; batch {args.batch}, {args.steps} steps")
  # Both attention kinds share one parameter tree, so one init serves every run.
  init = jax.jit(GPT(config).init)
  init_params = init(jax.random.key(args.seed), np.zeros((1, config.seqlen), np.int32))["params"]
  kinds = (("jax_fa3", "xla") if args.compare else ("jax_fa3", "jax_fa3_fp8")
           if args.compare_fp8 else (args.attention,))
  results = [train(args, kind, init_params, corpus, documents if args.packed else None)
             for kind in kinds]
  if len(results) == 2:
    a, b = results
    gap = np.max(np.abs(np.subtract(a["losses"], b["losses"])))
    print(f"largest loss difference {a['attention']} vs {b['attention']} over {args.steps} "
          f"steps: {gap:.2e}")
    # Single-step losses are noisy; the runs' end points are compared on the mean of the last 10%.
    tail = max(1, args.steps // 10)
    ends = [float(np.mean(r["losses"][-tail:])) for r in results]
    print(f"mean loss of the last {tail} steps: {a['attention']} {ends[0]:.4f}, {b['attention']} "
          f"{ends[1]:.4f} ({100 * (ends[1] / ends[0] - 1):+.2f}%)")
    plot_losses(results, args.plot)
  if args.generate:
    trained = next(r for r in results if r["attention"] == "jax_fa3")
    prompt = args.prompt.encode()
    text = generate(config, trained["params"], prompt, args.generate)
    print(f"generated (greedy, KV cache): {(prompt + text).decode(errors='replace')!r}")
  return results


if __name__ == "__main__":
  main()
