"""Per-kernel SASS evidence for the compiled kernels library: tensor-core, TMA and register-split
instructions, and local-memory traffic (LDL/STL = register spills), one line per kernel.

    pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm   # CUDA 13's, if not on PATH
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
           "LDL": r"\bLDL\b", "STL": r"\bSTL\b",
           # A wgmma whose very next instruction waits for it (each SASS instruction is two
           # lines: text, then the rest of its encoding). ptxas serializes wgmmas it cannot prove
           # safe (`-Xptxas -v`: "Potential Performance Loss", C7514/C7520) exactly this way.
           "GMMA_THEN_WAIT": r"\b[HQ]GMMA\b[^\n]*\n[^\n]*\n[^\n]*WARPGROUP\.DEPBAR"}


def find_cuobjdump() -> str | None:
  """cuobjdump's path (PATH, else the nvidia-cuda-cuobjdump wheel) if it can dump SASS: it runs
  nvdisasm, which must be on PATH or next to it (the wheels share a directory). Else None."""
  path = shutil.which("cuobjdump")
  if path is None:
    try:
      import nvidia  # noqa: PLC0415
      candidates = [os.path.join(root, "cu13", "bin", "cuobjdump") for root in nvidia.__path__]
      path = next((c for c in candidates if os.path.exists(c)), None)
    except ImportError:
      pass
  if path is None:
    return None
  nvdisasm_beside = os.path.exists(os.path.join(os.path.dirname(path), "nvdisasm"))
  return path if nvdisasm_beside or shutil.which("nvdisasm") else None


def short_name(kernel: str) -> str:
  """A demangled kernel name without namespace qualifiers and parameter list."""
  return re.sub(r"jax_fa3::|cutlass::|\(anonymous namespace\)::", "", kernel).split("(")[0]


def kernel_counts(path: str) -> list[tuple[str, dict[str, int]]]:
  """(demangled kernel name, {instruction: count}) for every kernel in the library, sorted."""
  tool = find_cuobjdump()
  if tool is None:
    sys.exit("cuobjdump/nvdisasm not found: "
             "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
  # cuobjdump looks nvdisasm up on PATH: put its own directory (the wheels' shared one) first.
  env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
  run = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, env=env)
  if run.returncode != 0:
    raise RuntimeError(f"cuobjdump --dump-sass {path} failed: {run.stderr.strip()}")
  sass = run.stdout
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
    print(f"| {short_name(name)} | " + " | ".join(str(v) for v in counts.values()) + " |")
  print(f"\nlocal-memory instructions (spills) in all kernels: {spills}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/lean/libjax_fa3_kernels.so"))
