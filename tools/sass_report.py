"""Per-kernel SASS evidence for the compiled kernels library: tensor-core, TMA and register-split
instructions, and local-memory traffic (LDL/STL = register spills), one line per kernel.

    pip install nvidia-cuda-cuobjdump        # cuobjdump for CUDA 13, if not on PATH
    python tools/sass_report.py build/<dir>/libjax_fa3_kernels.so
"""
import os
import re
import shutil
import subprocess
import sys

COUNTED = {"HGMMA": r"\bHGMMA\b", "QGMMA": r"\bQGMMA\b", "UTMALDG": r"\bUTMALDG\b",
           "UTMASTG": r"\bUTMASTG\b", "UTMAREDG": r"\bUTMAREDG\b", "UBLKRED": r"\bUBLKRED\b",
           "USETMAXREG": r"\bUSETMAXREG\b",
           "LDL": r"\bLDL\b", "STL": r"\bSTL\b"}


def cuobjdump() -> str:
  found = shutil.which("cuobjdump")
  if found:
    return found
  try:
    import nvidia  # noqa: PLC0415
    for root in nvidia.__path__:
      candidate = os.path.join(root, "cu13", "bin", "cuobjdump")
      if os.path.exists(candidate):
        return candidate
  except ImportError:
    pass
  sys.exit("cuobjdump not found: pip install nvidia-cuda-cuobjdump")


def find_cuobjdump() -> str | None:
  """cuobjdump's path, or None (cuobjdump() exits instead)."""
  try:
    return cuobjdump()
  except SystemExit:
    return None


def kernel_counts(path: str) -> list[tuple[str, dict[str, int]]]:
  """(demangled kernel name, {instruction: count}) for every kernel in the library, sorted."""
  sass = subprocess.run([cuobjdump(), "--dump-sass", path], check=True, capture_output=True,
                        text=True).stdout
  functions = re.split(r"\n\s*Function : ", sass)[1:]
  names = [f.split("\n", 1)[0].strip() for f in functions]
  demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                             text=True).stdout.splitlines()
  return sorted(((name, {k: len(re.findall(p, body)) for k, p in COUNTED.items()})
                 for name, body in zip(demangled, functions)), key=lambda item: item[0])


def main(path: str) -> int:
  print("| kernel | " + " | ".join(COUNTED) + " |")
  print("|---|" + "---|" * len(COUNTED))
  spills = 0
  for name, counts in kernel_counts(path):
    spills += counts["LDL"] + counts["STL"]
    short = re.sub(r"jax_fa3::|cutlass::|\(anonymous namespace\)::", "", name).split("(")[0]
    print(f"| {short} | " + " | ".join(str(v) for v in counts.values()) + " |")
  print(f"\nlocal-memory instructions (spills) in all kernels: {spills}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/lean/libjax_fa3_kernels.so"))
