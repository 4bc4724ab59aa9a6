"""benchmarks/fp8_accuracy.py --sources: the fp8 forward's error split by rounding source, on a
small shape. As attention sharpens the e4m3 rounding of q and k dominates (its error in a score
grows with the score), while P's and V's stay flat or shrink; the fp8 path's total follows it."""
import pytest
from repo_script import load_script

fp8_accuracy = load_script("benchmarks/fp8_accuracy.py")


@pytest.fixture(scope="module")
def rows():
  return {alpha: fp8_accuracy.measure_sources(alpha, 64, batch=1, heads=2, seqlen=256, seed=0)
          for alpha in (1.0, 16.0)}


def test_the_q_k_rounding_dominates_sharp_attention(rows):
  sharp, flat = rows[16.0], rows[1.0]
  assert sharp["mean_top_p"] > 0.7 > 0.1 > flat["mean_top_p"]
  assert sharp["qk"] > 3 * max(sharp["p"], sharp["v"])
  assert sharp["qk"] > 2 * flat["qk"]
  assert sharp["p"] < flat["p"]
  # The fp8 path's error is the sources' (independent roundings add in quadrature).
  for row in rows.values():
    combined = (row["qk"] ** 2 + row["p"] ** 2 + row["v"] ** 2) ** 0.5
    assert 0.7 * combined < row["fp8"] < 1.3 * combined


def test_bf16_error_is_the_output_rounding_at_any_sharpness(rows):
  for row in rows.values():
    assert row["bf16"] < 5e-3  # bf16 output rounding, ~2^-9 relative
