"""Per-file passed / failed / errors / skipped / xfailed table of pytest JUnit XML reports.

  python3 tools/junit_table.py OUT/*.xml [--timed-out FILE ...] [--crashed FILE ...]

Reads reports written with `-o junit_family=xunit1` (each testcase carries its `file`). Files
named after --timed-out (a chunk killed by its time limit, so its report is missing) are listed
as TIMEOUT, those after --crashed (pytest died without a report: a segfault, an abort, the OOM
killer) as CRASHED. Exits 1 if anything failed, errored, timed out or crashed.
"""
from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET

COLUMNS = ("passed", "failed", "errors", "skipped", "xfailed")


def outcome(case) -> str:
  children = {child.tag for child in case}
  if "failure" in children:
    return "failed"
  if "error" in children:
    return "errors"
  if "skipped" in children:
    skipped = case.find("skipped")
    return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
  return "passed"


def tally(paths) -> dict:
  table = collections.defaultdict(collections.Counter)
  for path in paths:
    for case in ET.parse(path).getroot().iter("testcase"):
      name = case.get("file") or case.get("classname", "?").replace(".", "/") + ".py"
      table[name][outcome(case)] += 1
  return table


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("reports", nargs="*")
  parser.add_argument("--timed-out", nargs="*", default=[])
  parser.add_argument("--crashed", nargs="*", default=[])
  args = parser.parse_args(argv)
  table = tally(args.reports)
  width = max([len(f) for f in list(table) + args.timed_out + args.crashed] + [len("file")])
  print(f"{'file':<{width}}  " + "  ".join(f"{c:>7}" for c in COLUMNS))
  totals = collections.Counter()
  for name in sorted(table):
    totals.update(table[name])
    print(f"{name:<{width}}  " + "  ".join(f"{table[name][c]:>7}" for c in COLUMNS))
  for name in args.timed_out:
    print(f"{name:<{width}}  TIMEOUT (no report: the chunk hit its time limit)")
  for name in args.crashed:
    print(f"{name:<{width}}  CRASHED (no report: pytest died before writing one; see the log)")
  print(f"{'total':<{width}}  " + "  ".join(f"{totals[c]:>7}" for c in COLUMNS))
  bad = totals["failed"] or totals["errors"] or args.timed_out or args.crashed
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
