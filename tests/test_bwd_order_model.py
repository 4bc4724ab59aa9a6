"""tools/bwd_order_model.py: the list-scheduling model behind the backward's sectioned grid order
(cuda/flash_bwd/tile_order.h) picks the kernel's sections and is never worse than the rule before."""
from repo_script import load_script


def _model():
  return load_script("tools/bwd_order_model.py")


def test_sections_match_the_kernels_choice():
  # The same shapes as tests/cuda/check_bwd_tile_order.cu's choices (d, h = h_k, s_q -> heads).
  m = _model()
  budget = 64 << 20
  assert m.section_heads(16, 1, 4096, 128, budget) == 16
  assert m.section_heads(16, 1, 8192, 128, budget) == 8
  assert m.section_heads(16, 1, 16384, 128, budget) == 4
  assert m.section_heads(12, 1, 8192, 128, budget) == 6
  assert m.section_heads(12, 32, 256, 128, budget) == 6
  assert m.section_heads(4, 8, 8192, 128, budget) == 1


def test_sections_never_lengthen_the_tail_and_pay_at_8k():
  rows = {(r["d"], r["seqlen"]): r for r in _model().model()}
  for r in rows.values():
    assert r["sectioned"] >= r["before"] - 1e-9
    assert 0.9 < r["plain"] <= 1.0 and r["sectioned"] <= 1.0
  assert rows[(128, 8192)]["sectioned"] / rows[(128, 8192)]["before"] > 1.05
  assert rows[(64, 8192)]["sectioned"] / rows[(64, 8192)]["before"] > 1.02
