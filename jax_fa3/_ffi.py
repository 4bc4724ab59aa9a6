"""Loads the compiled extension, registers its XLA FFI targets (once, platform CUDA) and says
whether our Hopper kernels can run here — and if not, why."""
from __future__ import annotations

import functools
import logging
import threading

import jax

logger = logging.getLogger("jax_fa3")
_lock = threading.Lock()
_registered = False


def _installed_extension():
  """The extension of the installed distribution, when `jax_fa3` was imported from a source
  checkout (e.g. `python -m jax_fa3` in the clone after `pip install .`), else None."""
  from importlib import metadata, util  # noqa: PLC0415
  try:
    files = metadata.distribution("jax_fa3").files or []
  except metadata.PackageNotFoundError:
    return None
  for file in files:
    if file.name.startswith("_jax_fa3_cuda.") and file.name.endswith(".so"):
      path = file.locate()
      spec = util.spec_from_file_location("jax_fa3._jax_fa3_cuda", path)
      module = util.module_from_spec(spec)
      spec.loader.exec_module(module)  # finds libjax_fa3_kernels.so beside it (RPATH $ORIGIN)
      return module
  return None


@functools.lru_cache(maxsize=None)
def _extension():
  """(module, None) or (None, reason)."""
  try:
    from jax_fa3 import _jax_fa3_cuda  # noqa: PLC0415 (optional compiled extension)
  except ImportError as e:
    try:
      module = _installed_extension()
    except ImportError as e2:
      return None, f"the installed CUDA extension does not load ({e2})"
    if module is None:
      return None, f"the CUDA extension is not built ({e}); reinstall with nvcc >= 12.8 on PATH"
    return module, None
  return _jax_fa3_cuda, None


def _hopper_gpus() -> list:
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return []
  return [d for d in gpus if str(getattr(d, "compute_capability", "")).startswith("9.")]


@functools.lru_cache(maxsize=None)
def _availability() -> tuple[bool, str | None]:
  module, reason = _extension()
  if module is None:
    return False, reason
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return False, "no GPU backend in this JAX installation (install jax[cuda13])"
  if not _hopper_gpus():
    names = sorted({f"{d.device_kind} (sm_{getattr(d, 'compute_capability', '?')})" for d in gpus})
    return False, f"the kernels need an sm_90 (Hopper) GPU; found {', '.join(names)}"
  return True, None


def kernels_available() -> bool:
  """True when the compiled sm_90a kernels can run on a local GPU."""
  return _availability()[0]


def kernels_unavailable_reason() -> str | None:
  """Why kernels_available() is False, or None."""
  return _availability()[1]


@functools.lru_cache(maxsize=None)
def build_config() -> dict[str, tuple[str, ...]]:
  """What the extension was compiled with: {'head_dims': ('64', ...), 'dtypes': ('bf16', ...)}."""
  module, _ = _extension()
  if module is None:
    return {}
  out = {}
  for part in module.build_config().split(";"):
    key, _, value = part.partition("=")
    out[key] = tuple(v for v in value.split(",") if v)
  return out


def ensure_registered() -> None:
  """Registers every FFI target of the extension with XLA for platform CUDA, once."""
  global _registered
  if _registered:
    return
  with _lock:
    if _registered:
      return
    module, reason = _extension()
    if module is None:
      raise RuntimeError(f"jax_fa3 kernels unavailable: {reason}")
    for name, capsule in module.ffi_targets().items():
      jax.ffi.register_ffi_target(name, capsule, platform="CUDA", api_version=1)
    _registered = True


def has_target(name: str) -> bool:
  module, _ = _extension()
  return module is not None and name in module.ffi_targets()


_announced: set[str] = set()


def announce_once(key: str, message: str) -> None:
  """Logs `message` the first time `key` is seen (e.g. the pure-JAX fallback)."""
  if key not in _announced:
    _announced.add(key)
    logger.warning(message)


# The FFI handlers' size limits (cuda/ffi/attention_dims.h): rows, keys and mask bounds are int32
# in the kernels, which holds for sequence lengths up to 2^29, and the forward's tile scheduler
# counts query tiles (64 rows) over all batches and heads in int32, up to 2^29 of them.
KERNEL_MAX_SEQLEN = 1 << 29
KERNEL_MAX_QUERY_TILES = 1 << 29


def check_kernel_sizes(q_shape, k_shape) -> None:
  """Raises ValueError, naming the limit, for shapes (b, s, h, d) the kernels cannot address;
  checked before a kernel call is traced, so the user sees it instead of the handler's error
  at run time. (Batch dimensions added by vmap are folded in later and checked by the handler.)"""
  b, s_q, h = q_shape[0], q_shape[1], q_shape[2]
  s_k = k_shape[1]
  if s_q > KERNEL_MAX_SEQLEN or s_k > KERNEL_MAX_SEQLEN:
    raise ValueError(
        f"seqlen_q and seqlen_k must be at most 2^29 = {KERNEL_MAX_SEQLEN} on the Hopper kernels "
        f"(they index rows and keys in int32), got seqlen_q={s_q}, seqlen_k={s_k}; split the "
        f"sequence across devices (jax_fa3.ring_attention) or call with shorter sequences")
  if -(-s_q // 64) * h * b > KERNEL_MAX_QUERY_TILES:
    raise ValueError(
        f"ceil(seqlen_q / 64) * heads * batch must be at most 2^29 = {KERNEL_MAX_QUERY_TILES} on "
        f"the Hopper kernels (query tiles are counted in int32), got q of shape {tuple(q_shape)}; "
        f"split the batch into several calls")


def flash_bwd_workspace_bytes(b: int, h: int, s_q: int, d: int, deterministic: bool) -> int:
  """Size of the workspace result the backward handler needs (the formula lives in C++ only)."""
  module, reason = _extension()
  if module is None:
    raise RuntimeError(f"jax_fa3 kernels unavailable: {reason}")
  return int(module.flash_bwd_workspace_bytes(b, h, s_q, d, deterministic))


def flash_bwd_fp8_workspace_bytes(b: int, h: int, s_q: int, d: int, deterministic: bool) -> int:
  """Size of the workspace result the fp8 backward handler needs (the formula lives in C++ only)."""
  module, reason = _extension()
  if module is None:
    raise RuntimeError(f"jax_fa3 kernels unavailable: {reason}")
  return int(module.flash_bwd_fp8_workspace_bytes(b, h, s_q, d, deterministic))


def flash_fwd_fp8_workspace_bytes(b: int, s_q: int, s_k: int, h: int, h_k: int, d: int,
                                  masked: bool, v_transposed: bool) -> int:
  """Size of the workspace result the fp8 forward handler needs (the formula lives in C++ only)."""
  module, reason = _extension()
  if module is None:
    raise RuntimeError(f"jax_fa3 kernels unavailable: {reason}")
  return int(module.flash_fwd_fp8_workspace_bytes(b, s_q, s_k, h, h_k, d, masked, v_transposed))


def _varying_axes(x) -> tuple:
  """The manual mesh axes (inside `shard_map`) that x varies over; () elsewhere."""
  aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
  manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
  varying = manual.varying if manual is not None else getattr(aval, "vma", ())
  return tuple(sorted(varying))


def call(target: str, result_types, *args, **attrs):
  """jax.ffi.ffi_call of one of our targets, its results varying over every manual mesh axis
  any argument varies over. Inside `shard_map` an ffi_call's results vary over none (JAX >=
  0.10; earlier versions carry the inputs' axes over), while the pure-JAX branch of the same
  `lax.platform_dependent` varies like its inputs: without the cast the two branches' types
  differ and tracing fails.

  Registers the targets first where the kernels can run: a caller that chose the kernel through a
  predicate alone (the paged cache's `paged_in_place`, say) may be the process's first kernel
  call. Elsewhere the CUDA branch that holds this call is traced but never lowered."""
  if kernels_available():
    ensure_registered()
  results = jax.ffi.ffi_call(target, result_types)(*args, **attrs)
  axes = tuple(sorted(set().union(*(_varying_axes(a) for a in args))))

  def cast(x):
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    if not missing:
      return x
    if hasattr(jax.lax, "pcast"):
      return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)

  return jax.tree.map(cast, results) if axes else results
