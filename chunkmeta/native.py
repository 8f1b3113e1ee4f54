"""Optional compiled helpers: the host plan in C, and a whole build's host side in one C call.

Two jobs, one small CPython extension compiled on first use with the machine's C compiler (the
one Triton needs anyway for its launchers) into ``$CHUNKMETA_CACHE_DIR`` (default
``~/.cache/chunkmeta``):

* ``plan(address, n, is64, shift)``: one pass over a prefill slice of the host
  ``query_start_loc`` -> ``(bad_index, num_chunks, max_seqlen)``; ``bad_index`` is 0, or the
  first index where the offsets decrease. numpy needs four or five array calls for this.
* ``build(fill, ...)``: a build's whole host side for a CUDA builder: the plan and every
  validation check, the launch of the already-compiled Triton kernel (``cuLaunchKernel``
  straight from C, with the parameters packed here), and the host ``cu_seqlens_cpu`` copy.
  Python then only wraps the result in a ``ChunkMetadata``. A fill (``make_fill``) holds what
  never changes between builds: the kernel handle, its launch shape and the ring's pointers.

The kernel's parameter layout is Triton's: the non-constexpr arguments in order (pointers 8
bytes, int32 scalars 4 bytes), then trailing scratch pointers Triton appends (passed as NULL, as
Triton does when a kernel needs no scratch). ``make_fill`` checks that layout against the
loaded kernel with ``cuFuncGetParamInfo`` (CUDA >= 12.4) and refuses on any difference, so a
Triton release that changes it falls back to Triton's own launcher instead of misreading
arguments.

Without a compiler or Python headers, or with ``CHUNKMETA_NATIVE=0``, nothing here loads: the
plan uses numpy and launches go through Triton (tests compare all paths).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

/* ---- the plan: sum of cdiv(len_i, 2^shift), max len_i, first decreasing index ---------- */
/* The main loop is branch-free (decreases are OR-ed into a flag), so the compiler vectorizes
   it; only a bad step pays the second loop that finds the index. Differences and sums are
   taken in unsigned arithmetic: offsets anywhere in int64 (a caller's garbage included) never
   overflow a signed value, and with no decrease every difference is a true length. */
typedef struct { int64_t chunks, longest, bad; } Plan;

#define PLAN(NAME, T)                                                              \
  static Plan NAME(const T *q, int64_t n, int shift) {                             \
    Plan p = {0, 0, 0};                                                            \
    uint64_t chunks = 0, longest = 0, round = ((uint64_t)1 << shift) - 1;          \
    int decrease = 0;                                                              \
    for (int64_t i = 1; i <= n; i++) {                                             \
      uint64_t len = (uint64_t)(int64_t)q[i] - (uint64_t)(int64_t)q[i - 1];        \
      decrease |= q[i] < q[i - 1];                                                 \
      chunks += (len + round) >> shift;                                            \
      longest = len > longest ? len : longest;                                     \
    }                                                                              \
    if (decrease)                                                                  \
      for (int64_t i = 1; i <= n; i++)                                             \
        if (q[i] < q[i - 1]) { p.bad = i; break; }                                 \
    p.chunks = (int64_t)chunks;                                                    \
    p.longest = (int64_t)longest;                                                  \
    return p;                                                                      \
  }
PLAN(plan_i32, int32_t)
PLAN(plan_i64, int64_t)

static int64_t load(const void *q, int is64, int64_t i) {
  return is64 ? ((const int64_t *)q)[i] : (int64_t)((const int32_t *)q)[i];
}

static Plan plan_any(const void *q, int is64, int64_t n, int shift) {
  return is64 ? plan_i64((const int64_t *)q, n, shift) : plan_i32((const int32_t *)q, n, shift);
}

/* The arguments as C integers: 0, or -1 with a Python error set, or 1 when one lies outside
   int64 (no error set: build() answers that as invalid input, the others raise). */
static int ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
    return -1;
  }
  for (Py_ssize_t i = 0; i < want; i++) {
    int overflow = 0;
    out[i] = PyLong_AsLongLongAndOverflow(args[i], &overflow);
    if (out[i] == -1 && PyErr_Occurred()) return -1;
    if (overflow) return 1;
  }
  return 0;
}

static int int_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out) {
  int status = ints(args, nargs, want, out);
  if (status == 1) PyErr_SetString(PyExc_OverflowError, "argument outside int64");
  return status;
}

/* plan(address, n, is64, shift) -> (bad_index, num_chunks, max_seqlen) */
static PyObject *py_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[4];
  if (int_args(args, nargs, 4, a)) return NULL;
  Plan p = plan_any((const void *)(uintptr_t)a[0], (int)a[2], a[1], (int)a[3]);
  return Py_BuildValue("(LLL)", (long long)p.bad, (long long)p.chunks, (long long)p.longest);
}

/* ---- the launch: cuLaunchKernel on a Triton-compiled kernel ------------------------------ */
typedef int (*LaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, void *, void **, void **);
typedef int (*FuncGetParamInfo)(void *, size_t, size_t *, size_t *);
static LaunchKernel launch_kernel = NULL;
static FuncGetParamInfo param_info = NULL;

#define MAX_SLOTS 64
#define NUM_ARGS 10     /* qsl, params, cu, indices, offsets (8 B); 5 int32 scalars */
#define MAX_TRAILING 4  /* scratch pointers Triton appends */

typedef struct {
  void *function;
  unsigned block_rows, threads, shared;
  int trailing, shift, slots;
  int64_t cap_seqs, cap_tokens, cap_rows;
  int64_t seqs_out, rows_out; /* padded layouts: fixed sizes; exact layout: -1 (N and NT) */
  int32_t pad_seq;
  uint64_t params;
  uint64_t cu[MAX_SLOTS], indices[MAX_SLOTS], offsets[MAX_SLOTS];
  int32_t *cu_host[MAX_SLOTS];
} Fill;

static void free_fill(PyObject *capsule) { PyMem_Free(PyCapsule_GetPointer(capsule, "chunkmeta.fill")); }

/* bind_cuda() -> bool: find cuLaunchKernel and cuFuncGetParamInfo in the loaded driver. */
static PyObject *py_bind_cuda(PyObject *self, PyObject *unused) {
  if (!launch_kernel) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib) {
      launch_kernel = (LaunchKernel)dlsym(lib, "cuLaunchKernel");
      param_info = (FuncGetParamInfo)dlsym(lib, "cuFuncGetParamInfo");
    }
  }
  return PyBool_FromLong(launch_kernel != NULL && param_info != NULL);
}

/* make_fill(function, block_rows, num_warps, shared, shift, cap_seqs, cap_tokens, cap_rows,
             seqs_out, rows_out, pad_seq, params, slots) -> capsule, or None if the kernel's
   parameters are not the layout this file packs. slots: sequence of (cu, indices, offsets,
   cu_host address). function 0 makes a fill that launches nothing: the host side alone, which
   is how CPU tests check the C checks and host copy against the Python plan. */
static PyObject *py_make_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[12];
  if (nargs != 13) {
    PyErr_SetString(PyExc_TypeError, "make_fill takes 13 arguments");
    return NULL;
  }
  if (int_args(args, 12, 12, a)) return NULL;
  void *function = (void *)(uintptr_t)a[0];
  if (function && (!launch_kernel || !param_info)) Py_RETURN_NONE;
  /* the expected layout: 5 pointers, 5 int32, then only 8-byte (scratch pointer) parameters */
  int trailing = 0;
  for (size_t i = 0; function; i++) {
    size_t offset = 0, size = 0;
    if (param_info(function, i, &offset, &size) != 0) {
      if (i < NUM_ARGS) Py_RETURN_NONE;
      break;
    }
    size_t want = i < 5 ? 8 : (i < NUM_ARGS ? 4 : 8);
    if (size != want) Py_RETURN_NONE;
    if (i >= NUM_ARGS && ++trailing > MAX_TRAILING) Py_RETURN_NONE;
  }
  PyObject *slots = PySequence_Fast(args[12], "slots must be a sequence");
  if (!slots) return NULL;
  Py_ssize_t count = PySequence_Fast_GET_SIZE(slots);
  if (count < 1 || count > MAX_SLOTS) {
    Py_DECREF(slots);
    PyErr_SetString(PyExc_ValueError, "1..64 slots");
    return NULL;
  }
  Fill *f = PyMem_Calloc(1, sizeof(Fill));
  if (!f) {
    Py_DECREF(slots);
    return PyErr_NoMemory();
  }
  f->function = function;
  f->block_rows = (unsigned)a[1];
  f->threads = 32u * (unsigned)a[2];
  f->shared = (unsigned)a[3];
  f->shift = (int)a[4];
  f->cap_seqs = a[5];
  f->cap_tokens = a[6];
  f->cap_rows = a[7];
  f->seqs_out = a[8];
  f->rows_out = a[9];
  f->pad_seq = (int32_t)a[10];
  f->params = (uint64_t)a[11];
  f->trailing = trailing;
  f->slots = (int)count;
  for (Py_ssize_t s = 0; s < count; s++) {
    long long p[4];
    PyObject *item = PySequence_Fast(PySequence_Fast_GET_ITEM(slots, s), "slot must be a sequence");
    if (!item || PySequence_Fast_GET_SIZE(item) != 4 || int_args(PySequence_Fast_ITEMS(item), 4, 4, p)) {
      Py_XDECREF(item);
      Py_DECREF(slots);
      PyMem_Free(f);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "slot: (cu, indices, offsets, cu_host)");
      return NULL;
    }
    Py_DECREF(item);
    f->cu[s] = (uint64_t)p[0];
    f->indices[s] = (uint64_t)p[1];
    f->offsets[s] = (uint64_t)p[2];
    f->cu_host[s] = (int32_t *)(uintptr_t)p[3];
  }
  Py_DECREF(slots);
  PyObject *capsule = PyCapsule_New(f, "chunkmeta.fill", free_fill);
  if (!capsule) PyMem_Free(f);
  return capsule;
}

/* build(fill, host_address, host_len, is64, first_seq, num_seqs (-1: the rest), qsl, slot, stream)
   -> (num_seqs, num_tokens, num_chunks, max_seqlen), or an int: -1 when the input is invalid
   (nothing was launched or written: the caller re-plans slowly for the precise error), or the
   CUresult of a failed launch (nothing written on the host). */
static PyObject *py_build(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[8];
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "build takes 9 arguments");
    return NULL;
  }
  Fill *f = PyCapsule_GetPointer(args[0], "chunkmeta.fill");
  if (!f) return NULL;
  int status = ints(args + 1, 8, 8, a);
  if (status == 1) return PyLong_FromLong(-1); /* first_seq / num_seqs outside int64 */
  if (status) return NULL;
  const char *host = (const char *)(uintptr_t)a[0];
  int64_t requests = a[1] - 1, first = a[3], n = a[4], slot = a[6];
  int is64 = (int)a[2];
  if (n < 0) n = requests - first;
  if (first < 0 || first > requests || n < 0 || first + n > requests || n > f->cap_seqs || slot < 0 ||
      slot >= f->slots)
    return PyLong_FromLong(-1);
  const void *q = host + first * (is64 ? 8 : 4);
  int64_t start = load(q, is64, 0), end = load(q, is64, n);
  if (start < 0 || end < start || end - start > f->cap_tokens) return PyLong_FromLong(-1);
  int64_t tokens = end - start; /* no overflow: 0 <= start <= end */
  Plan p = plan_any(q, is64, n, f->shift);
  if (p.bad || p.chunks > f->cap_rows) return PyLong_FromLong(-1);

  int64_t seqs_out = f->seqs_out < 0 ? n : f->seqs_out;
  int64_t rows_out = f->rows_out < 0 ? p.chunks : f->rows_out;
  if (f->function && (n > 0 || f->seqs_out >= 0)) {
    uint64_t ptrs[5] = {(uint64_t)a[5], f->params, f->cu[slot], f->indices[slot], f->offsets[slot]};
    int32_t scalars[5] = {(int32_t)first, (int32_t)n, (int32_t)rows_out, (int32_t)seqs_out, f->pad_seq};
    uint64_t scratch[MAX_TRAILING] = {0};
    void *params[NUM_ARGS + MAX_TRAILING];
    for (int i = 0; i < 5; i++) params[i] = &ptrs[i];
    for (int i = 0; i < 5; i++) params[5 + i] = &scalars[i];
    for (int i = 0; i < f->trailing; i++) params[NUM_ARGS + i] = &scratch[i];
    unsigned grid = rows_out > 0 ? (unsigned)((rows_out + f->block_rows - 1) / f->block_rows) : 1u;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = launch_kernel(f->function, grid, 1, 1, f->threads, 1, 1, f->shared, (void *)(uintptr_t)a[7], params,
                        NULL);
    Py_END_ALLOW_THREADS
    if (err) return PyLong_FromLong(err);
  }
  /* the host cu_seqlens: the slice rebased to 0, then zero-length tails up to seqs_out */
  int32_t *out = f->cu_host[slot];
  for (int64_t i = 0; i <= n; i++) out[i] = (int32_t)(load(q, is64, i) - start);
  for (int64_t i = n + 1; i <= seqs_out; i++) out[i] = (int32_t)tokens;
  PyObject *result = PyTuple_New(4);
  if (!result) return NULL;
  PyTuple_SET_ITEM(result, 0, PyLong_FromLongLong(n));
  PyTuple_SET_ITEM(result, 1, PyLong_FromLongLong(tokens));
  PyTuple_SET_ITEM(result, 2, PyLong_FromLongLong(p.chunks));
  PyTuple_SET_ITEM(result, 3, PyLong_FromLongLong(p.longest));
  return result;
}

static PyMethodDef methods[] = {
    {"plan", (PyCFunction)(void (*)(void))py_plan, METH_FASTCALL, "the host plan of a prefill slice"},
    {"bind_cuda", py_bind_cuda, METH_NOARGS, "find the driver's launch entry points"},
    {"make_fill", (PyCFunction)(void (*)(void))py_make_fill, METH_FASTCALL, "a builder's launch constants"},
    {"build", (PyCFunction)(void (*)(void))py_build, METH_FASTCALL, "one build's host side"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "MODULE_NAME", NULL, -1, methods};

PyMODINIT_FUNC PyInit_MODULE_NAME(void) { return PyModule_Create(&module); }
"""

_NOT_LOADED = object()
_module = _NOT_LOADED


def _cache_dir() -> Path:
    return Path(os.environ.get("CHUNKMETA_CACHE_DIR") or Path.home() / ".cache" / "chunkmeta")


def _compile(source: str, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    include = sysconfig.get_paths()["include"]
    if compiler is None or not (Path(include) / "Python.h").exists():
        raise OSError("no C compiler or no Python headers")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source_file = Path(tmp) / "native.c"
        source_file.write_text(source)
        built = Path(tmp) / target.name
        subprocess.run([compiler, "-O3", "-shared", "-fPIC", f"-I{include}", str(source_file), "-o", str(built),
                        "-ldl"], check=True, capture_output=True, timeout=120)
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file


def module():
    """The compiled extension, or None (no compiler / headers, or ``CHUNKMETA_NATIVE=0``)."""
    global _module
    if _module is not _NOT_LOADED:
        return _module
    _module = None
    if os.environ.get("CHUNKMETA_NATIVE", "1") == "0":
        return None
    key = _SOURCE + sys.version + sys.platform + os.uname().machine
    name = "chunkmeta_native_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    target = _cache_dir() / f"{name}{suffix}"
    try:
        if not target.exists():
            _compile(_SOURCE.replace("MODULE_NAME", name), target)
        spec = importlib.util.spec_from_file_location(name, target)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    except (OSError, ImportError, subprocess.SubprocessError):
        return None
    _module = loaded
    return _module


def cuda_launcher():
    """The extension if it can launch kernels itself (a CUDA driver with cuFuncGetParamInfo)."""
    loaded = module()
    if loaded is None or os.environ.get("CHUNKMETA_FAST_LAUNCH", "1") == "0" or not loaded.bind_cuda():
        return None
    return loaded
