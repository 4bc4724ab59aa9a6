"""benchmarks/readme_table.py: the README's table from one run, possibly split into several JSONs
(a GPU machine's command has a time limit), never from rows of different runs."""
import json

import pytest

from repo_script import load_script

readme_table = load_script("benchmarks/readme_table.py")

HEADER = {"device": "NVIDIA H200", "date": "2026-12-06", "commit": "abc1234", "jax": "0.11.2"}


def _row(peer, d, seqlen, fwd, bwd):
  return {"peer": peer, "d": d, "causal": False, "seqlen": seqlen, "fwd_tflops": fwd,
          "bwd_tflops": bwd}


def _write(tmp_path, name, header, rows):
  path = tmp_path / name
  path.write_text(json.dumps({"header": header, "rows": rows}))
  return str(path)


def test_one_run_in_two_jsons_gives_one_table(tmp_path):
  first = _write(tmp_path, "d64.json", HEADER, [_row("jax_fa3", 64, 1024, 400, 340),
                                                 _row("cudnn", 64, 1024, 380, 300)])
  second = _write(tmp_path, "d128.json", HEADER, [_row("jax_fa3", 128, 1024, 530, 370),
                                                  _row("cudnn", 128, 1024, 500, 350)])
  header, rows = readme_table.load_runs([first, second])
  text = readme_table.table(header, rows)
  assert "| 64 | no | 1k | 400 | 380 | 1.05× | 340 | 300 | 1.13× |" in text
  assert "| 128 | no | 1k | 530 | 500 | 1.06× | 370 | 350 | 1.06× |" in text


def test_jsons_of_different_runs_or_repeated_rows_are_refused(tmp_path):
  first = _write(tmp_path, "a.json", HEADER, [_row("jax_fa3", 64, 1024, 400, 340)])
  other_gpu = _write(tmp_path, "b.json", dict(HEADER, device="NVIDIA H100 80GB HBM3"),
                     [_row("jax_fa3", 128, 1024, 530, 370)])
  with pytest.raises(ValueError, match="differs in device"):
    readme_table.load_runs([first, other_gpu])
  again = _write(tmp_path, "c.json", HEADER, [_row("jax_fa3", 64, 1024, 401, 341)])
  with pytest.raises(ValueError, match="also in an earlier JSON"):
    readme_table.load_runs([first, again])
