"""Calls an FFI target directly (bypassing Python validation) in a child process, so that a
handler that crashed instead of returning ffi::Error fails one test rather than the whole run."""
import subprocess
import sys
import tempfile
import textwrap

_TEMPLATE = """
import jax, jax.numpy as jnp, numpy as np
from jax_fa3 import _ffi
_ffi.ensure_registered()
{body}
try:
  jax.block_until_ready(result())
  print("NO ERROR")
except Exception as e:
  print("RAISED", type(e).__name__, str(e))
"""


def ffi_error_message(body: str) -> str:
  """Runs `body` (which defines result()) in a child; returns the error text it raised."""
  code = _TEMPLATE.format(body=textwrap.dedent(body))
  # From a neutral directory, so the child imports the installed package (with its extension)
  # rather than a source checkout in the current directory.
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                        cwd=tempfile.gettempdir())
  assert proc.returncode == 0, f"child crashed (rc {proc.returncode}): {proc.stderr[-2000:]}"
  assert "RAISED" in proc.stdout, proc.stdout
  return proc.stdout
