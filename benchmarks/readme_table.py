"""The README's performance table and plot, from one JSON written by bench_attention.py.

Prints a markdown table (forward and backward TFLOP/s of jax_fa3 and its peers per head dim,
causal or not, and sequence length, with jax_fa3's ratio to cuDNN; the fp8 forward of jax_fa3
and cuDNN when the run has them) and writes a PNG with a
forward and a backward panel per head dim, stamped with the run's date, GPU and commit. Both come
from the same run, so every number in them was measured beside the others.

  python benchmarks/readme_table.py RUN.json [MORE.json ...] [--png benchmarks/readme_performance.png]
      [--seqlens 1024,4096,8192,16384] [--commit abc1234]

Several JSONs are one run split into calls (a GPU machine's command has a time limit): their
headers must name the same device, date, commit and JAX, and no row may appear twice.

`--commit` labels a JSON written before bench_attention.py recorded its commit; `--readme
README.md` also replaces the table between the README's two performance-table markers.
"""
from __future__ import annotations

import argparse
import json

# Column order and labels; a peer absent from the run gets no column.
PEERS = (("jax_fa3", "jax_fa3"), ("cudnn", "cuDNN"), ("pallas_mgpu", "Pallas MGPU (fp16)"),
         ("fa3_kernels", "FA3 kernels"), ("xla", "XLA"))
# Forward only, shown when the run has them: the user's fp8 call from bf16 inputs (rotation and
# quantization inside the timing) and cuDNN's fp8 attention from pre-quantized inputs.
FP8_PEERS = (("jax_fa3_fp8_e2e", "jax_fa3 fp8 from bf16"), ("cudnn_fp8", "cuDNN fp8"))
DIRECTIONS = (("fwd", "forward"), ("bwd", "backward"))


def load(path: str, commit: str | None = None) -> tuple[dict, list[dict]]:
  with open(path) as f:
    data = json.load(f)
  if not isinstance(data, dict) or "rows" not in data or "header" not in data:
    raise ValueError(f"{path}: not a bench_attention.py JSON (expected 'header' and 'rows')")
  header = dict(data["header"])
  if commit:
    header["commit"] = commit
  header.setdefault("commit", "unknown")
  return header, data["rows"]


RUN_KEYS = ("device", "date", "commit", "jax")


def _row_key(row: dict) -> tuple:
  return (row["peer"], row["d"], row["causal"], row["seqlen"])


def load_runs(paths: list[str], commit: str | None = None) -> tuple[dict, list[dict]]:
  """One header and the rows of every JSON, which must come from one run (same RUN_KEYS)."""
  header, rows = load(paths[0], commit)
  seen = {_row_key(r) for r in rows}
  for path in paths[1:]:
    other, more = load(path, commit)
    differ = [k for k in RUN_KEYS if other.get(k) != header.get(k)]
    if differ:
      raise ValueError(f"{path}: not the run of {paths[0]} (differs in {', '.join(differ)})")
    for r in more:
      key = _row_key(r)
      if key in seen:
        raise ValueError(f"{path}: row {key} is also in an earlier JSON")
      seen.add(key)
      rows.append(r)
  return header, rows


def _value(rows, peer, d, causal, seqlen, direction):
  for r in rows:
    if _row_key(r) == (peer, d, causal, seqlen):
      return r.get(f"{direction}_tflops")
  return None


def _cell(x) -> str:
  return "—" if x is None else f"{x:.0f}"


def stamp(header: dict) -> str:
  return (f"{header.get('device', '?')}, {header.get('date', '?')}, commit {header['commit']}, "
          f"JAX {header.get('jax', '?')}")


def table(header: dict, rows: list[dict], seqlens: list[int] | None = None) -> str:
  present = {r["peer"] for r in rows}
  peers = [(p, label) for p, label in PEERS if p in present]
  if not any(p == "jax_fa3" for p, _ in peers):
    raise ValueError("the run has no jax_fa3 rows")
  keys = sorted({(r["d"], r["causal"], r["seqlen"]) for r in rows if r["peer"] == "jax_fa3"})
  if seqlens:
    keys = [k for k in keys if k[2] in seqlens]
  directions = [(d, label) for d, label in DIRECTIONS
                if any(r.get(f"{d}_tflops") for r in rows)]
  head = ["d", "causal", "seqlen"]
  for _, dlabel in directions:
    head += [f"{dlabel}: {label}" if i == 0 else label for i, (_, label) in enumerate(peers)]
    if "cudnn" in present:
      head.append("÷ cuDNN")
  fp8 = [(p, label) for p, label in FP8_PEERS if p in present]
  head += [label for _, label in fp8]
  lines = [f"TFLOP/s, {stamp(header)}; Pallas MGPU runs fp16; — = not run or failed.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for d, causal, s in keys:
    cells = [str(d), "yes" if causal else "no", f"{s // 1024}k" if s % 1024 == 0 else str(s)]
    for direction, _ in directions:
      values = {p: _value(rows, p, d, causal, s, direction) for p, _ in peers}
      cells += [_cell(values[p]) for p, _ in peers]
      if "cudnn" in present:
        ours, cudnn = values["jax_fa3"], values.get("cudnn")
        cells.append("—" if ours is None or not cudnn else f"{ours / cudnn:.2f}×")
    cells += [_cell(_value(rows, p, d, causal, s, "fwd")) for p, _ in fp8]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(header: dict, rows: list[dict], path: str) -> None:
  import matplotlib  # noqa: PLC0415
  import matplotlib.ticker  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  head_dims = sorted({r["d"] for r in rows if r["peer"] == "jax_fa3"})
  directions = [(d, label) for d, label in DIRECTIONS if any(r.get(f"{d}_tflops") for r in rows)]
  fig, axes = plt.subplots(len(directions), len(head_dims), squeeze=False,
                           figsize=(max(6.0, 3.6 * len(head_dims)), 3.0 * len(directions) + 1.0), sharey="row")
  colors = dict(zip((p for p, _ in PEERS), ("C3", "C0", "C2", "C1", "C7")))
  for row, (direction, dlabel) in enumerate(directions):
    for col, d in enumerate(head_dims):
      ax = axes[row][col]
      for peer, label in PEERS:
        for causal, style in ((False, "-"), (True, "--")):
          pts = sorted((r["seqlen"], r[f"{direction}_tflops"]) for r in rows
                       if (r["peer"], r["d"], r["causal"]) == (peer, d, causal)
                       and r.get(f"{direction}_tflops"))
          if pts:
            ax.plot(*zip(*pts), style, marker="o", markersize=3, color=colors[peer],
                    label=f"{label}{', causal' if causal else ''}")
      ax.set_xscale("log", base=2)
      ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
          lambda x, _: f"{x / 1024:g}k" if x >= 1024 else f"{x:g}"))
      ax.set_title(f"{dlabel}, d={d}", fontsize=9)
      ax.set_xlabel("sequence length", fontsize=8)
      ax.tick_params(labelsize=7)
      if col == 0:
        ax.set_ylabel("TFLOP/s", fontsize=8)
  # Every panel's lines in one legend (a peer may run at one head dim only).
  legend = {}
  for ax in (a for row in axes for a in row):
    for handle, label in zip(*ax.get_legend_handles_labels()):
      legend.setdefault(label, handle)
  fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=4, fontsize=7,
             frameon=False)
  fig.suptitle(f"jax_fa3 and peers, bf16, 16k tokens per call\n{stamp(header)}", fontsize=9)
  fig.tight_layout(rect=(0, 0.1, 1, 0.93))
  fig.savefig(path, dpi=130)


BEGIN = "<!-- performance table: generated by benchmarks/readme_table.py -->"
END = "<!-- end of performance table -->"


def update_readme(path: str, text: str, source: str) -> None:
  with open(path) as f:
    readme = f.read()
  if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
    raise ValueError(f"{path} must hold the markers {BEGIN!r} and {END!r} once each, in order")
  head, rest = readme.split(BEGIN)
  _, tail = rest.split(END)
  block = f"{BEGIN}\nFrom `{source}`.\n\n{text}\n\n{END}"
  with open(path, "w") as f:
    f.write(head + block + tail)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("json", nargs="+",
                      help="JSONs written by benchmarks/bench_attention.py in one run")
  parser.add_argument("--png", default="benchmarks/readme_performance.png")
  parser.add_argument("--seqlens", default=None,
                      help="comma-separated subset for the table (the plot shows every seqlen)")
  parser.add_argument("--commit", default=None,
                      help="label for a JSON whose header does not name its commit")
  parser.add_argument("--readme", default=None,
                      help="a README whose performance-table markers get the table")
  args = parser.parse_args()
  header, rows = load_runs(args.json, args.commit)
  seqlens = [int(s) for s in args.seqlens.split(",")] if args.seqlens else None
  text = table(header, rows, seqlens)
  print(text)
  plot(header, rows, args.png)
  if args.readme:
    update_readme(args.readme, text, "`, `".join(args.json))


if __name__ == "__main__":
  main()
