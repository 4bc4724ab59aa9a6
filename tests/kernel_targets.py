"""Which jax_fa3 kernels a compiled program calls: the proof every GPU test gives that the kernel,
not the pure-JAX fallback, produced the values it checks.

The library dispatches at trace time (`jax_fa3._local_attention`, `jax_fa3.fp8`): a call that cannot use a
kernel silently runs the pure-JAX path, which agrees with any reference, so a value check alone
passes on a broken or lean build. A kernel shows up in the compiled HLO as a custom call whose
target is the name the extension registers (cuda/ffi/registry.cc); the pure-JAX path has none.
The compiled text is read (not the lowered StableHLO) because under custom partitioning the
lowered program holds only `@CustomSPMDPartitioning`, the real target appearing after SPMD
partitioning.

The private imports of the test suite's kernel plumbing live here, in one place.
"""
from __future__ import annotations

import collections
import re

import jax

FLASH_FWD = "jax_fa3_flash_fwd"
FLASH_BWD = "jax_fa3_flash_bwd"
FLASH_FWD_KEY_RANGES = "jax_fa3_flash_fwd_key_ranges"  # lengths, segments: a key range per query
FLASH_BWD_KEY_RANGES = "jax_fa3_flash_bwd_key_ranges"
FLASH_FWD_PAGED = "jax_fa3_flash_fwd_paged"  # key ranges over a paged KV cache read in place
# Lengths and cache pieces without segment ids: one (q_len, k_len, diag) per row, on the key-range
# kernels (the forward only).
FLASH_FWD_ROW_BOUNDS = "jax_fa3_flash_fwd_row_bounds"
FLASH_FWD_PAGED_ROW_BOUNDS = "jax_fa3_flash_fwd_paged_row_bounds"
# A decode step (one query per row): GQA query heads as tile rows, split-KV pieces in the kernel.
FLASH_FWD_DECODE = "jax_fa3_flash_fwd_decode"
FLASH_FWD_PAGED_DECODE = "jax_fa3_flash_fwd_paged_decode"
# The same over an e4m3 cache read in place (jax_fa3._fp8_cache_decode).
FLASH_FWD_DECODE_FP8_CACHE = "jax_fa3_flash_fwd_decode_fp8_cache"
FLASH_FWD_PAGED_DECODE_FP8_CACHE = "jax_fa3_flash_fwd_paged_decode_fp8_cache"
FLASH_FWD_FP8 = "jax_fa3_flash_fwd_fp8"
FLASH_BWD_FP8 = "jax_fa3_flash_bwd_fp8"
ROTATE_QUANTIZE_FP8 = "jax_fa3_rotate_quantize_fp8"
HADAMARD = "jax_fa3_hadamard"
SPLIT_KV_COMBINE = "jax_fa3_split_kv_combine"  # the merge of split-KV decoding's pieces
# Every target the extension registers; a test naming any other target is itself wrong.
KNOWN_TARGETS = frozenset({FLASH_FWD, FLASH_BWD, FLASH_FWD_KEY_RANGES, FLASH_BWD_KEY_RANGES, FLASH_FWD_PAGED,
                           FLASH_FWD_ROW_BOUNDS, FLASH_FWD_PAGED_ROW_BOUNDS, FLASH_FWD_DECODE,
                           FLASH_FWD_PAGED_DECODE, FLASH_FWD_DECODE_FP8_CACHE,
                           FLASH_FWD_PAGED_DECODE_FP8_CACHE, FLASH_FWD_FP8,
                           FLASH_BWD_FP8, ROTATE_QUANTIZE_FP8, HADAMARD, SPLIT_KV_COMBINE})

# StableHLO: `stablehlo.custom_call @name(`; compiled HLO: `custom_call_target="name"`.
_TARGET_PATTERNS = (re.compile(r"stablehlo\.custom_call\s+@([A-Za-z0-9_.$-]+)"),
                    re.compile(r'custom_call_target="([^"]+)"'))


def registered_targets() -> frozenset:
  """The FFI target names of the loaded extension (empty without it)."""
  from jax_fa3 import _ffi  # noqa: PLC0415
  module, _ = _ffi._extension()
  return frozenset(module.ffi_targets()) if module is not None else frozenset()


def custom_call_targets(program_text: str) -> collections.Counter:
  """Counts of every custom-call target in HLO or StableHLO text."""
  found = collections.Counter()
  for pattern in _TARGET_PATTERNS:
    found.update(pattern.findall(program_text))
  return found


def kernel_targets(program_text: str) -> collections.Counter:
  """Counts of the jax_fa3 kernel targets in HLO or StableHLO text (empty: pure-JAX only)."""
  return collections.Counter({name: n for name, n in custom_call_targets(program_text).items()
                              if name in KNOWN_TARGETS})


def describe(program_text: str) -> str:
  found = kernel_targets(program_text)
  return ", ".join(f"{n} x {name}" for name, n in sorted(found.items())) or "no kernel target"


def compiled_text(fn, *args) -> str:
  """The optimized HLO text of jit(fn) at args (fn may already be jitted)."""
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return jitted.lower(*args).compile().as_text()


def assert_targets(program_text: str, expected) -> None:
  """Fails unless every target in `expected` is called by the program."""
  expected = frozenset([expected] if isinstance(expected, str) else expected)
  unknown = expected - KNOWN_TARGETS
  assert not unknown, f"not a jax_fa3 kernel target: {sorted(unknown)}"
  missing = expected - set(kernel_targets(program_text))
  assert not missing, (f"pure-JAX fallback: the compiled program does not call "
                       f"{sorted(missing)} (it calls: {describe(program_text)})")


def compile_on_kernels(fn, *args, expected):
  """jit(fn) compiled at args, asserted to call every kernel in `expected`."""
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  compiled = jitted.lower(*args).compile()
  assert_targets(compiled.as_text(), expected)
  return compiled


def run_on_kernels(fn, *args, expected):
  """Compiles jit(fn) at args, asserts it calls every kernel in `expected`, runs it once.

  The same executable is checked and run, so the values a test then compares are the kernel's.
  """
  return compile_on_kernels(fn, *args, expected=expected)(*args)


def jaxpr_equations(fn, *args) -> list:
  """Every equation of fn's jaxpr at args, those of nested jaxprs (custom_partitioning,
  platform_dependent's branches, scans) too: what a program calls before any lowering."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      found.append(eqn)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found
