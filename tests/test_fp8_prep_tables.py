"""The fp8 preparation benchmark's tables (benchmarks/bench_attention.py `prep_table`,
benchmarks/bench_fp8.py `table`) render a row with the fields `prep_rows` writes, leading with the
user's call from bf16 (what `flash_attention_fp8` runs on Hopper), and take its share of the fp8
kernel's time from the non-causal kernel row of the same shape; and the benchmark's inputs with
fewer k/v heads (`--kv-heads`, GQA/MQA); and bench_fp8's check of the FP8 forward's speed targets
over the points measured."""
import jax
import jax.numpy as jnp
import pytest
from repo_script import load_script

bench_attention = load_script("benchmarks/bench_attention.py")
bench_fp8 = load_script("benchmarks/bench_fp8.py")

PARTS = {"user_call": 201.8, "fused": 208.6, "xla": 675.9, "q_rotated": 47.7,
         "v_per_head": 111.3, "v_kernel_layout": 95.6, "v_kernel_layout_xla_mean": 120.0}


def _prep_row(d=128, seqlen=8192):
  row = dict(peer="fp8_prep", d=d, h=2048 // d, b=2, seqlen=seqlen)
  for name, us in PARTS.items():
    row[f"{name}_us"] = us
    row[f"{name}_gbps"] = 100.0e3 / us  # any positive rate
  return row


def _attention_row(peer, fwd_ms, causal=False, d=128, seqlen=8192):
  return dict(peer=peer, d=d, seqlen=seqlen, causal=causal, fwd_ms=fwd_ms, fwd_tflops=900.0)


def test_prep_table_leads_with_the_users_call_and_its_share_of_the_kernel():
  rows = [_attention_row("jax_fa3_fp8", 1.2), _attention_row("jax_fa3_fp8", 0.6, causal=True)]
  table = bench_attention.prep_table([_prep_row()], rows)
  header, _, line = table.splitlines()
  assert header.startswith("| d | seqlen | user's call µs")
  cells = [c.strip() for c in line.strip("|").split("|")]
  assert cells[:3] == ["128", "8192", "202 (496)"]
  assert cells[5] == "16.8%"  # 201.8 µs of the 1.2 ms non-causal kernel, not the causal one
  assert len(cells) == len(header.strip("|").split("|"))


def test_fp8_table_quotes_the_users_call_as_the_prep_pass():
  rows = [_attention_row(peer, ms) for peer, ms in
          (("jax_fa3", 1.8), ("jax_fa3_fp8_e2e", 1.4), ("jax_fa3_fp8_vt", 1.2), ("cudnn_fp8", 1.3))]
  table = bench_fp8.table(rows, [_prep_row()])
  header, _, line = table.splitlines()
  names = [c.strip() for c in header.strip("|").split("|")]
  cells = [c.strip() for c in line.strip("|").split("|")]
  assert cells[names.index("prep pass µs")] == "202"
  assert cells[names.index("from bf16 ÷ pre-quantized")] == "1.17×"


def test_benchmark_inputs_take_fewer_kv_heads_for_gqa_and_refuse_a_non_divisor():
  key = jax.random.PRNGKey(0)
  q, k, v = bench_attention._qkv(key, 1, 8, 16, 32, jnp.bfloat16, kv_heads=2)
  assert (q.shape, k.shape, v.shape) == ((1, 8, 16, 32), (1, 8, 2, 32), (1, 8, 2, 32))
  full = bench_attention._qkv(key, 1, 8, 16, 32, jnp.bfloat16)
  assert all(x.shape == (1, 8, 16, 32) for x in full)
  assert bool(jnp.all(full[1][:, :, :2] == k))  # the same draw, its first heads
  with pytest.raises(ValueError, match="kv_heads=3 must divide the 16 query heads"):
    bench_attention._qkv(key, 1, 8, 16, 32, jnp.bfloat16, kv_heads=3)


def _fp8_rows(d, causal, s, bf16_ms, e2e_ms, pre_ms, pre_tflops, cudnn_ms):
  rows = []
  for peer, ms in (("jax_fa3", bf16_ms), ("jax_fa3_fp8_e2e", e2e_ms), ("jax_fa3_fp8_vt", pre_ms),
                   ("cudnn_fp8", cudnn_ms)):
    row = _attention_row(peer, ms, causal=causal, d=d, seqlen=s)
    row["fwd_tflops"] = pre_tflops if peer == "jax_fa3_fp8_vt" else 800.0
    rows.append(row)
  return rows


def test_fp8_targets_report_the_worst_point_and_whether_all_hold():
  rows = (_fp8_rows(256, False, 8192, 1.6, 0.80, 0.78, 1250.0, 0.95)
          + _fp8_rows(256, True, 8192, 0.9, 0.42, 0.40, 1150.0, 0.50)
          + _fp8_rows(256, False, 4096, 0.8, 0.60, 0.40, 1000.0, 0.60)   # 4k: no kernel target
          + _fp8_rows(128, False, 16384, 3.4, 2.00, 1.90, 1000.0, 2.40))
  checked = {t["target"]: t for t in bench_fp8.targets(rows)}
  kernel256 = checked["d256 kernel TFLOP/s, non-causal, >= 8192"]
  assert (kernel256["holds"], kernel256["points"], kernel256["worst"]) == (True, 1, 1250.0)
  kernel128 = checked["d128 kernel TFLOP/s, non-causal, >= 8192"]
  assert (kernel128["holds"], kernel128["worst_at"]) == (False, "d128 non-causal 16384")
  causal = checked["kernel causal / non-causal TFLOP/s, >= 8192"]
  assert causal["holds"] and causal["worst"] == pytest.approx(1150 / 1250)
  overhead = checked["from bf16 / pre-quantized time at 8192"]  # 8k only: 0.80/0.78, 0.42/0.40
  assert overhead["points"] == 2 and overhead["worst"] == pytest.approx(0.42 / 0.40)
  assert overhead["holds"]
  cudnn = checked["from bf16, speed / cuDNN fp8's"]  # every point; 4k: 0.60 / 0.60 = 1.0
  assert cudnn["points"] == 4 and not cudnn["holds"]
  assert cudnn["worst"] == pytest.approx(1.0) and cudnn["worst_at"] == "d256 non-causal 4096"
  table = bench_fp8.targets_table(bench_fp8.targets(rows))
  assert table.splitlines()[2].startswith("| d128 kernel TFLOP/s, non-causal, >= 8192 | ≥ 1050 |")
  assert table.splitlines()[2].endswith("| 1 | no |")
