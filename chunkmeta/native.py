"""An optional compiled helper for the host plan: one pass over the prefill slice, in C.

The host plan must find NT = sum(cdiv(len_i, C)) and check that offsets never decrease, every
step, before anything is launched. numpy does it in four or five array calls (about a
microsecond each); one C loop does it in well under a microsecond for a thousand sequences.

The source below is compiled on first use with the machine's C compiler (the one Triton needs
anyway to build its kernel launchers) into ``$CHUNKMETA_CACHE_DIR`` (default
``~/.cache/chunkmeta``) and loaded with ctypes. Without a compiler, or with
``CHUNKMETA_NATIVE=0``, the plan uses numpy; both give the same answers (tests compare them).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_SOURCE = r"""
#include <stdint.h>
/* For offsets q[0..n] (q[0] >= 0 and q[n] - q[0] checked by the caller): return 0 and set
   out = {sum of cdiv(len_i, 2^shift), max len_i}, or return i where q[i] < q[i - 1].
   The main loop is branch-free (a negative length shows in the OR of all lengths), so the
   compiler vectorizes it; only a bad step pays the second loop that finds the index. */
#define PLAN(NAME, T)                                                              \
  int64_t NAME(const T *q, int64_t n, int64_t shift, int64_t *out) {               \
    int64_t chunks = 0, longest = 0, sign = 0, round = ((int64_t)1 << shift) - 1; \
    for (int64_t i = 1; i <= n; i++) {                                             \
      int64_t len = (int64_t)q[i] - (int64_t)q[i - 1];                             \
      sign |= len;                                                                 \
      chunks += (len + round) >> shift;                                            \
      longest = len > longest ? len : longest;                                     \
    }                                                                              \
    if (sign < 0)                                                                  \
      for (int64_t i = 1; i <= n; i++)                                             \
        if (q[i] < q[i - 1]) return i;                                             \
    out[0] = chunks;                                                               \
    out[1] = longest;                                                              \
    return 0;                                                                      \
  }
PLAN(chunkmeta_plan_i32, int32_t)
PLAN(chunkmeta_plan_i64, int64_t)
"""

_NOT_LOADED = object()
_functions = _NOT_LOADED


def _cache_dir() -> Path:
    return Path(os.environ.get("CHUNKMETA_CACHE_DIR") or Path.home() / ".cache" / "chunkmeta")


def _compile(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise OSError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "plan.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run([compiler, "-O3", "-shared", "-fPIC", str(source), "-o", str(built)], check=True,
                       capture_output=True, timeout=60)
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file


def functions():
    """``{np.dtype name: ctypes function}`` for int32/int64 offsets, or None (use numpy)."""
    global _functions
    if _functions is not _NOT_LOADED:
        return _functions
    _functions = None
    if os.environ.get("CHUNKMETA_NATIVE", "1") == "0":
        return None
    digest = hashlib.sha256((_SOURCE + sys.platform + os.uname().machine).encode()).hexdigest()[:16]
    target = _cache_dir() / f"plan-{digest}.so"
    try:
        if not target.exists():
            _compile(target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):
        return None
    loaded = {}
    for dtype in ("int32", "int64"):
        fn = getattr(library, f"chunkmeta_plan_{'i32' if dtype == 'int32' else 'i64'}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = ctypes.c_int64
        loaded[dtype] = fn
    _functions = loaded
    return _functions
