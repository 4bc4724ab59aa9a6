"""Host-checked facts the kernels rely on, with CuTe where needed (no GPU needed).

tests/cuda/check_bwd_layouts.cu is compiled with nvcc and run: for every head-dim bucket, the
P/dS element pairs the kernel stores with one 32-bit st.shared are adjacent and cover the tile
once, and the dQ "fragment order" chunk layout (consumers' stores, bulk reduce, postprocess) is a
bijection onto the (64, d) block. Skipped where nvcc or the CUTLASS headers are missing; CI has
both (the CUDA build needs them anyway).
"""
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _nvcc():
  for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
    if candidate and os.path.exists(candidate):
      return candidate
  return None


def _cutlass_include():
  try:
    import cutlass_library  # noqa: PLC0415
  except ImportError:
    return None
  path = pathlib.Path(cutlass_library.__file__).parent / "source" / "include"
  return path if (path / "cute" / "tensor.hpp").exists() else None


def _compile(out_dir, source: pathlib.Path, name: str, nvcc_flags=(), with_cute: bool = True):
  """Builds source with nvcc (and the CuTe headers unless with_cute is False; host code unless
  nvcc_flags name a GPU arch) into out_dir/name; skips without nvcc or the headers."""
  nvcc = _nvcc()
  cutlass = _cutlass_include() if with_cute else None
  if nvcc is None or (with_cute and cutlass is None):
    pytest.skip(f"needs nvcc ({nvcc or 'not found'})" + (
        f" and the nvidia-cutlass headers ({cutlass or 'not installed'})" if with_cute else ""))
  exe = pathlib.Path(out_dir) / name
  includes = ["-I", str(REPO / "cuda")] + (["-I", str(cutlass)] if with_cute else [])
  build = subprocess.run(
      [nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-w", *nvcc_flags, *includes, "-o",
       str(exe), str(source)],
      capture_output=True, text=True, timeout=900)
  assert build.returncode == 0, build.stderr[-3000:]
  return exe


def _run_checked(exe, *args) -> str:
  """Runs exe; fails on a nonzero exit or FAILED in its output; returns its stdout."""
  run = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=300)
  assert run.returncode == 0 and "FAILED" not in run.stdout, run.stdout + run.stderr
  return run.stdout


def _compile_and_run(tmp_path, name: str, nvcc_flags=(), with_cute: bool = True) -> str:
  """Builds tests/cuda/<name>.cu (see _compile), runs it (see _run_checked)."""
  return _run_checked(_compile(tmp_path, REPO / "tests" / "cuda" / f"{name}.cu", name,
                               nvcc_flags, with_cute))


def test_backward_layout_facts_hold_for_every_bucket(tmp_path):
  # Every bucket, and d128 with 80-row Q blocks (dQ transposed, dS by stmatrix.trans).
  assert _compile_and_run(tmp_path, "check_bwd_layouts").count(": ok") == 6


def test_fp8_forward_p_v_layout_fact_holds_for_every_bucket(tmp_path):
  """The fp8 forward packs P in place and permutes V's keys instead (cuda/flash_fwd/fp8/layout.h):
  tests/cuda/check_fp8_layouts.cu checks, with CuTe's fragment layouts, that every packed A slot
  holds the score of the key the permuted Vt stores there, and A·Vt == S·V on integers."""
  # d64, d128 (its 192-row and 128-row kernels), d256.
  out = _compile_and_run(tmp_path, "check_fp8_layouts")
  assert out.count(": ok") == 4
  # Python's copy of the key permutation (the XLA fallback of the keys-transposed quantization).
  from jax_fa3 import _fp8_quantize  # noqa: PLC0415
  table = next(line for line in out.splitlines() if line.startswith("key_of_slot:"))
  assert tuple(int(x) for x in table.split(":")[1].split()) == _fp8_quantize.KEY_OF_SLOT


def test_fp8_backward_layout_facts_hold_for_every_bucket(tmp_path):
  """The fp8 backward (cuda/flash_bwd/fp8_traits.cuh) packs P'^T and the dK operand y^T in place
  and reads q8 and dO8 transposed with their rows permuted per 32: tests/cuda/
  check_fp8_bwd_layouts.cu checks with CuTe's fragment layouts that every packed A slot holds the
  value of the row the permuted B stores there (and A·Bᵀ == Sᵀ·B on integers), that the e4m3 S^T
  accumulator has the 16-bit one's layout, and that a thread's dK rows are its S^T key rows.
  Its query tiles and dK-operand constants are the emulation's (jax_fa3._fp8_backward_emulation)."""
  from jax_fa3 import _fp8_backward_emulation as emulation, _fp8_emulation  # noqa: PLC0415
  out = _compile_and_run(tmp_path, "check_fp8_bwd_layouts")
  assert out.count(": ok") == 2  # d64, d128
  for bucket in (64, 128):
    line = next(x for x in out.splitlines() if x.startswith(f"d={bucket} fp8"))
    assert f"(tile {emulation.backward_tile_q(bucket)}x128," in line, line
  constants = dict(line.split(": ") for line in out.splitlines() if line.startswith("dk_"))
  assert float(constants["dk_prescale"]) == 2.0**emulation.Y_PRESCALE_LOG2
  assert (np.float32(constants["dk_lazy_margin"])
          == np.float32(2.0**_fp8_emulation.LAZY_MAX_MARGIN_LOG2))
  assert np.float32(constants["dk_min_running_max"]) == np.float32(emulation.MIN_RUNNING_MAX)


def test_forward_tile_scheduler_covers_every_tile_once(tmp_path):
  """The forward's persistent scheduler (cuda/flash_fwd/tile_scheduler.h) with the pair order of
  masked problems: tests/cuda/check_tile_scheduler.cu checks that the CTAs' tile sequences map onto
  every (m_block, head, batch) exactly once, that masked problems give every CTA the same work
  within one pair, and that a round of pairs reads few heads' K/V."""
  out = _compile_and_run(tmp_path, "check_tile_scheduler", with_cute=False)
  assert out.rstrip().endswith(": ok")


def test_backward_grid_order_covers_every_tile_once_longest_first(tmp_path):
  """The backward's grid orders (cuda/flash_bwd/tile_order.h): tests/cuda/check_bwd_tile_order.cu
  walks each grid in launch order and checks that it maps onto every (K block, kv head, batch)
  once, the K blocks of one pair in increasing order (deterministic mode relies on it) and, in the
  longest-first order of causal problems, section by section with K blocks never decreasing inside
  a section; and that longest first is chosen only for causal / right-windowed problems, in
  sections of the most kv heads that fit the L2 budget."""
  out = _compile_and_run(tmp_path, "check_bwd_tile_order", with_cute=False)
  assert out.rstrip().endswith("47 cases, 0 failures")


def test_whole_row_block_ranges(tmp_path):
  """The whole-row kernels' block ranges and mask shortcuts (cuda/flash_fwd/block_info.h,
  cuda/flash_bwd/block_range.h) over the (q_len, k_len, diag) they take: tests/cuda/
  check_block_ranges.cu compares them with the per-element visibility rule for lengths 0 .. past
  a block, diagonals across [-s_q, s_k], causal / window / no masks and several block shapes; the
  K blocks visiting a Q block must form the one run from n_first that the deterministic dQ order
  counts."""
  out = _compile_and_run(tmp_path, "check_block_ranges", with_cute=False)
  assert out.rstrip().endswith(": ok")


def test_key_range_block_logic_on_python_covers(tmp_path):
  """The masked kernels' block logic (cuda/common/key_ranges.h and the two block files) on the
  ranges and covers jax_fa3._key_ranges builds for padded rows, cache diagonals and packed
  documents (tests/key_range_cases.py): tests/cuda/check_key_ranges.cu checks that no tile skips a
  visible block or leaves one unmasked that holds a hidden pair, and that the backward's pairing
  of Q and K blocks is the one run per Q block that the deterministic dQ order counts. Where the
  masks are one (q_len, k_len, diag) per row, the forward's row bounds must give every row the
  same range and pass the same tile checks."""
  from jax_fa3 import _key_ranges, _local_attention  # noqa: PLC0415
  from key_range_cases import cases  # noqa: PLC0415
  exe = _compile(tmp_path, REPO / "tests" / "cuda" / "check_key_ranges.cu", "check_key_ranges",
                 with_cute=False)
  lines = []
  chosen = [c for c in cases() if c[6]]
  for _, masks, s_q, s_k, wl, wr, _ in chosen:
    lo, hi, _ = _key_ranges.row_ranges(masks, s_q, s_k, wl, wr)
    ranges, covers = (np.asarray(x) for x in _key_ranges.kernel_operands(lo, hi, s_k))
    by_row = len(masks) == 3 and np.ndim(masks[2]) == 1  # row bounds hold these masks
    lines.append(f"{s_q} {s_k} {ranges.shape[0]} {int(by_row)} {wl} {wr}")
    lines.append(" ".join(map(str, ranges.ravel())))
    lines.append(" ".join(map(str, covers.ravel())))
    if by_row:
      lines.append(" ".join(map(str, np.asarray(_local_attention._row_bounds(masks)).ravel())))
  data = tmp_path / "cases.txt"
  data.write_text(f"{len(chosen)}\n" + "\n".join(lines) + "\n")
  out = _run_checked(exe, data)
  assert out.rstrip().endswith(": ok") and out.startswith(f"{len(chosen)} cases"), out


def test_python_knows_the_forward_key_blocks(tmp_path):
  """jax_fa3._local_attention.FORWARD_KEY_BLOCK (which page sizes the paged kernel reads in
  place) copies cuda/common/buckets.h's forward_key_block, which sizes the kernels' K/V tiles."""
  from jax_fa3 import _local_attention  # noqa: PLC0415
  source = tmp_path / "key_blocks.cc"
  source.write_text('#include <cstdio>\n#include "common/buckets.h"\nint main() {\n'
                    '  for (int bucket : jax_fa3::kHeadDimBuckets)\n'
                    '    std::printf("%d %d\\n", bucket, jax_fa3::forward_key_block(bucket));\n}\n')
  exe = _compile(tmp_path, source, "key_blocks", ["-x", "cu"], with_cute=False)
  printed = dict(tuple(map(int, line.split())) for line in _run_checked(exe).splitlines())
  assert printed == _local_attention.FORWARD_KEY_BLOCK
