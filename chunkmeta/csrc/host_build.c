/* chunkmeta's host build: a CPython extension compiled on first use by chunkmeta.jit (for
   chunkmeta.native) into $CHUNKMETA_CACHE_DIR. Its jobs:
   - plan(): one pass over a prefill slice of the host query_start_loc (sizes and the first bad
     index), for chunkmeta.plan;
   - make_fill() / build(): a CUDA builder's whole host side of a build in one call: validation,
     the ChunkMetadata it returns, the cuLaunchKernel of the fill (the CUDA C fill of
     chunk_fill.cu, or the Triton kernel) and the host cu_seqlens copy;
   - make_steps() / make_step() / step(): the same for a step builder's tables
     (chunkmeta.step_builder), from its input tensors, with the ring's claim and publish and the
     result objects (make_results() / results(): from a recipe, chunkmeta.results); step_host():
     graph mode's host side of a step (chunkmeta.graph);
   - oneshot(): the one-shot's (chunkmeta.builder.build_chunk_metadata) on CUDA, into views of
     chunkmeta.arena; oneshot_plan(): its plan alone.
   MODULE_NAME (-D) is the extension's module name: the cache key is part of it, so extensions of
   different sources never collide in one process. */
#ifndef MODULE_NAME
#error "host_build.c: compile with -DMODULE_NAME=<the extension's module name>"
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

#include "step_chunks.h"

/* ---- the plan: sum of cdiv(len_i, 2^shift), max len_i, first decreasing index ---------- */
/* The loops are branch-free (decreases are OR-ed into a flag), so the compiler vectorizes
   them; only a bad step pays the second loop that finds the index. Differences are taken in
   unsigned lanes as wide as the offsets: offsets anywhere in the dtype (a caller's garbage
   included) never overflow a signed value, and with no decrease every difference is a true
   length. For int32 offsets that means 32-bit lanes: with no decrease the lengths sum to
   q[n] - q[0] < 2^32, so no sum wraps, and a step with a decrease is rejected whatever the sums
   read. On x86-64 the loops are also built for AVX2 (picked at load time): the baseline SSE2 has
   no 32-bit unsigned max, and scalar code costs ~1 ns per sequence. A shift < 0 plans without
   the chunks (a step build's slices: each of its entries counts its own). */
typedef struct { int64_t chunks, longest, bad; } Plan;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VECTORIZED __attribute__((target_clones("avx2", "default")))
#else
#define VECTORIZED
#endif

/* sum of cdiv(len_i, 2^shift): a plan's chunks, and an entry's rows on a slice its plan checked */
#define CHUNKS(NAME, T, LANE)                                                      \
  VECTORIZED static int64_t NAME(const T *q, int64_t n, int shift) {               \
    LANE chunks = 0, round = ((LANE)1 << shift) - 1;                               \
    for (int64_t i = 1; i <= n; i++) {                                             \
      LANE len = (LANE)q[i] - (LANE)q[i - 1];                                      \
      chunks += (len >> shift) + ((len & round) != 0);                             \
    }                                                                              \
    return (int64_t)chunks;                                                        \
  }
#define PLAN(NAME, CHUNKS_OF, T, LANE)                                             \
  VECTORIZED static Plan NAME(const T *q, int64_t n, int shift) {                  \
    LANE longest = 0;                                                              \
    int decrease = 0;                                                              \
    for (int64_t i = 1; i <= n; i++) {                                             \
      LANE len = (LANE)q[i] - (LANE)q[i - 1];                                      \
      longest = len > longest ? len : longest;                                     \
      decrease |= q[i] < q[i - 1];                                                 \
    }                                                                              \
    Plan p = {shift < 0 ? 0 : CHUNKS_OF(q, n, shift), (int64_t)longest, 0};        \
    if (decrease)                                                                  \
      for (int64_t i = 1; i <= n; i++)                                             \
        if (q[i] < q[i - 1]) { p.bad = i; break; }                                 \
    return p;                                                                      \
  }
CHUNKS(chunks_i32, int32_t, uint32_t)
CHUNKS(chunks_i64, int64_t, uint64_t)
PLAN(plan_i32, chunks_i32, int32_t, uint32_t)
PLAN(plan_i64, chunks_i64, int64_t, uint64_t)

static int64_t load(const void *q, int is64, int64_t i) {
  return is64 ? ((const int64_t *)q)[i] : (int64_t)((const int32_t *)q)[i];
}

static Plan plan_any(const void *q, int is64, int64_t n, int shift) {
  return is64 ? plan_i64((const int64_t *)q, n, shift) : plan_i32((const int32_t *)q, n, shift);
}

static int64_t chunks_any(const void *q, int is64, int64_t n, int shift) {
  return is64 ? chunks_i64((const int64_t *)q, n, shift) : chunks_i32((const int32_t *)q, n, shift);
}

/* ---- a step build's other per-row passes, typed so that they vectorize too -------------- */
/* Offsets and each per-request array come as int32 or int64, independently; a loop that asks
   which (load) at every element costs about a nanosecond per request, which at 1024 requests was
   most of a Mamba2 build's host side. So each pass is instantiated per dtype pair and dispatched
   once. */
typedef struct {
  int bad, any;
} RowFlags;

/* A per-request array's flags (q: the slice's offsets, already checked non-decreasing, so
   len >= 0 and nothing overflows): bad if any request's value is negative or a slice row's
   EXCEEDS(value, len); any: a slice row's value is > 0. num_computed_tokens passes int32
   positions with the row's new tokens (any: a cached prefix, prep_initial_states); a checkpoint
   lies within its row's new tokens (any: a row with one). */
#define ROW_FLAGS(NAME, TQ, TV, EXCEEDS)                                                                              \
  VECTORIZED static RowFlags NAME(const void *q_, const void *v_, int64_t requests, int64_t first, int64_t n) {      \
    const TQ *q = q_;                                                                                                 \
    const TV *values = v_;                                                                                            \
    int bad = 0, any = 0;                                                                                             \
    for (int64_t i = 0; i < requests; i++) bad |= values[i] < 0;                                                      \
    for (int64_t i = 0; i < n; i++) {                                                                                 \
      const int64_t v = values[first + i], len = (int64_t)q[i + 1] - (int64_t)q[i];                                   \
      bad |= EXCEEDS(v, len);                                                                                         \
      any |= v > 0;                                                                                                   \
    }                                                                                                                 \
    RowFlags flags = {bad, any};                                                                                      \
    return flags;                                                                                                     \
  }
#define PAST_INT32(v, len) ((v) > 2147483647LL - (len))
#define PAST_ROW(v, len) ((v) > (len))
#define COMPUTED_ROWS(NAME, TQ, TV) ROW_FLAGS(NAME, TQ, TV, PAST_INT32)
#define CHECKPOINT_ROWS(NAME, TQ, TV) ROW_FLAGS(NAME, TQ, TV, PAST_ROW)
/* the chunks of q's n sequences, each at position values[i] (segment_chunks) */
#define POSITIONED_CHUNKS(NAME, TQ, TV)                                                                               \
  VECTORIZED static int64_t NAME(const void *q_, const void *v_, int64_t n, int shift) {                              \
    const TQ *q = q_;                                                                                                 \
    const TV *values = v_;                                                                                            \
    int64_t total = 0;                                                                                                \
    for (int64_t i = 0; i < n; i++) total += segment_chunks(values[i], (int64_t)q[i + 1] - (int64_t)q[i], shift);     \
    return total;                                                                                                     \
  }
/* the same, each cut in two at its checkpoint cuts[i] when > 0 (sequence_chunk_count) */
#define SPLIT_CHUNKS(NAME, TQ, TV, TC)                                                                                \
  VECTORIZED static int64_t NAME(const void *q_, const void *v_, const void *c_, int64_t n, int shift) {              \
    const TQ *q = q_;                                                                                                 \
    const TV *values = v_;                                                                                            \
    const TC *cuts = c_;                                                                                              \
    int64_t total = 0;                                                                                                \
    for (int64_t i = 0; i < n; i++)                                                                                   \
      total += sequence_chunk_count(values[i], (int64_t)q[i + 1] - (int64_t)q[i], cuts[i], shift);                    \
    return total;                                                                                                     \
  }
/* the chunks of q's n sequences at their packed positions from q[0] (SGLang's logical chunks) */
#define PACKED_CHUNKS(NAME, TQ)                                                                                       \
  VECTORIZED static int64_t NAME(const void *q_, int64_t n, int shift) {                                              \
    const TQ *q = q_;                                                                                                 \
    int64_t total = 0;                                                                                                \
    for (int64_t i = 0; i < n; i++)                                                                                   \
      total += segment_chunks((int64_t)q[i] - (int64_t)q[0], (int64_t)q[i + 1] - (int64_t)q[i], shift);               \
    return total;                                                                                                     \
  }
/* q[0..n] rebased to start (host_cu_seqlens) */
#define REBASE(NAME, TQ)                                                                                              \
  VECTORIZED static void NAME(int32_t *out, const TQ *q, int64_t n, int64_t start) {                                  \
    for (int64_t i = 0; i <= n; i++) out[i] = (int32_t)((int64_t)q[i] - start);                                       \
  }
/* instances per dtype combination, and their table in the order `index` reads (int64 bits,
   the first array's highest) */
#define PER_DTYPE_PAIR(MACRO, NAME)                                                                                   \
  MACRO(NAME##_ii, int32_t, int32_t) MACRO(NAME##_il, int32_t, int64_t) MACRO(NAME##_li, int64_t, int32_t)            \
  MACRO(NAME##_ll, int64_t, int64_t)
#define PAIR_TABLE(NAME) {NAME##_ii, NAME##_il, NAME##_li, NAME##_ll}
#define PER_DTYPE_TRIPLE(MACRO, NAME)                                                                                 \
  MACRO(NAME##_iii, int32_t, int32_t, int32_t) MACRO(NAME##_iil, int32_t, int32_t, int64_t)                           \
  MACRO(NAME##_ili, int32_t, int64_t, int32_t) MACRO(NAME##_ill, int32_t, int64_t, int64_t)                           \
  MACRO(NAME##_lii, int64_t, int32_t, int32_t) MACRO(NAME##_lil, int64_t, int32_t, int64_t)                           \
  MACRO(NAME##_lli, int64_t, int64_t, int32_t) MACRO(NAME##_lll, int64_t, int64_t, int64_t)
#define TRIPLE_TABLE(NAME)                                                                                            \
  {NAME##_iii, NAME##_iil, NAME##_ili, NAME##_ill, NAME##_lii, NAME##_lil, NAME##_lli, NAME##_lll}
PER_DTYPE_PAIR(COMPUTED_ROWS, computed_rows)
PER_DTYPE_PAIR(CHECKPOINT_ROWS, checkpoint_rows)
PER_DTYPE_PAIR(POSITIONED_CHUNKS, positioned_chunks)
PER_DTYPE_TRIPLE(SPLIT_CHUNKS, split_chunks)
PACKED_CHUNKS(packed_chunks_i32, int32_t)
PACKED_CHUNKS(packed_chunks_i64, int64_t)
REBASE(rebase_i32, int32_t)
REBASE(rebase_i64, int64_t)

typedef RowFlags (*RowFlagsPass)(const void *, const void *, int64_t, int64_t, int64_t);
static const RowFlagsPass computed_rows[4] = PAIR_TABLE(computed_rows);
static const RowFlagsPass checkpoint_rows[4] = PAIR_TABLE(checkpoint_rows);
static int64_t (*const positioned_chunks[4])(const void *, const void *, int64_t, int) = PAIR_TABLE(positioned_chunks);
static int64_t (*const split_chunks[8])(const void *, const void *, const void *, int64_t,
                                        int) = TRIPLE_TABLE(split_chunks);
static int64_t (*const packed_chunks[2])(const void *, int64_t, int) = {packed_chunks_i32, packed_chunks_i64};

/* A host cu_seqlens of seqs_out sequences: q[0..n] rebased to start, then zero-length tails up to
   seqs_out (>= n; the padded layouts' rows past the batch) */
static void host_cu_seqlens(int32_t *out, const void *q, int is64, int64_t n, int64_t start, int64_t seqs_out) {
  if (is64)
    rebase_i64(out, (const int64_t *)q, n, start);
  else
    rebase_i32(out, (const int32_t *)q, n, start);
  for (int64_t i = n + 1; i <= seqs_out; i++) out[i] = out[n];
}

/* A build's slice arguments: first_seq an exact int, num_seqs None (the rest of the batch's
   `requests` requests) or an exact int >= 0. 0 with *first and *n set, or -1: anything else
   (a bool or a numpy integer too) takes the general path and its checks. The caller checks the
   range. */
static int slice_args(PyObject *first_obj, PyObject *num_obj, int64_t requests, long long *first, long long *n) {
  if (!PyLong_CheckExact(first_obj) || !(num_obj == Py_None || PyLong_CheckExact(num_obj))) return -1;
  int overflow = 0;
  *first = PyLong_AsLongLongAndOverflow(first_obj, &overflow);
  *n = -1;
  if (!overflow && num_obj != Py_None) *n = PyLong_AsLongLongAndOverflow(num_obj, &overflow);
  if (overflow || (num_obj != Py_None && *n < 0)) return -1;
  if (*n < 0) *n = requests - *first;
  return 0;
}

/* The arguments as C integers: 0, or nonzero with a Python error set (TypeError for a wrong
   count or a non-int, OverflowError for a value outside int64). */
static int int_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
    return -1;
  }
  for (Py_ssize_t i = 0; i < want; i++) {
    int overflow = 0;
    out[i] = PyLong_AsLongLongAndOverflow(args[i], &overflow);
    if (out[i] == -1 && PyErr_Occurred()) return -1;
    if (overflow) {
      PyErr_SetString(PyExc_OverflowError, "argument outside int64");
      return 1;
    }
  }
  return 0;
}

/* plan(address, n, is64, shift) -> (bad_index, num_chunks, max_seqlen) */
static PyObject *py_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[4];
  if (int_args(args, nargs, 4, a)) return NULL;
  if (a[1] < 0 || a[3] < 0 || a[3] > 31) {
    PyErr_SetString(PyExc_ValueError, "plan: n >= 0 and 0 <= shift <= 31");
    return NULL;
  }
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
  PyObject *padding; /* ChunkMetadata.padding of this layout: None, "tail" or "negative" */
} Fill;

/* The number of trailing scratch pointers of a kernel whose parameters are `pointers` 8-byte
   pointers, then int32 scalars up to `count`, then at most MAX_TRAILING 8-byte scratch pointers
   (cuFuncGetParamInfo); -1 for any other layout or without the driver's entry points. 0 for no
   kernel (function 0: a host side that launches nothing). */
static int param_layout(void *function, size_t pointers, size_t count) {
  if (!function) return 0;
  if (!launch_kernel || !param_info) return -1;
  int trailing = 0;
  for (size_t i = 0;; i++) {
    size_t offset = 0, size = 0;
    if (param_info(function, i, &offset, &size) != 0) return i < count ? -1 : trailing;
    if (size != (i < pointers ? 8u : i < count ? 4u : 8u)) return -1;
    if (i >= count && ++trailing > MAX_TRAILING) return -1;
  }
}

static void free_fill(PyObject *capsule) {
  Fill *f = PyCapsule_GetPointer(capsule, "chunkmeta.fill");
  Py_XDECREF(f->padding);
  PyMem_Free(f);
}

/* A fill's kernel on one set of tables: ptrs = (qsl, params, cu, indices, offsets), scalars =
   (first_seq, num_seqs, rows_out, seqs_out, pad_seq); 0 or the CUresult. */
static int launch_fill_kernel(const Fill *f, uint64_t ptrs[5], int32_t scalars[5], int64_t rows_out, void *stream) {
  uint64_t scratch[MAX_TRAILING] = {0};
  void *params[NUM_ARGS + MAX_TRAILING];
  for (int i = 0; i < 5; i++) params[i] = &ptrs[i];
  for (int i = 0; i < 5; i++) params[5 + i] = &scalars[i];
  for (int i = 0; i < f->trailing; i++) params[NUM_ARGS + i] = &scratch[i];
  unsigned grid = rows_out > 0 ? (unsigned)((rows_out + f->block_rows - 1) / f->block_rows) : 1u;
  int err;
  Py_BEGIN_ALLOW_THREADS
  err = launch_kernel(f->function, grid, 1, 1, f->threads, 1, 1, f->shared, stream, params, NULL);
  Py_END_ALLOW_THREADS
  return err;
}

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
             seqs_out, rows_out, pad_seq, params, slots, padding) -> capsule, or None if the
   kernel's parameters are not the layout this file packs. slots: sequence of (cu, indices,
   offsets, cu_host address); padding: the layout's ChunkMetadata.padding. function 0 makes a
   fill that launches nothing: the host side alone, which is how CPU tests check the C checks
   and host copy against the Python plan. */
static PyObject *py_make_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[12];
  if (nargs != 14) {
    PyErr_SetString(PyExc_TypeError, "make_fill takes 14 arguments");
    return NULL;
  }
  if (int_args(args, 12, 12, a)) return NULL;
  if (a[1] < 1 || a[2] < 1 || a[4] < 0 || a[4] > 31) {
    PyErr_SetString(PyExc_ValueError, "make_fill: block_rows >= 1, num_warps >= 1, 0 <= shift <= 31");
    return NULL;
  }
  void *function = (void *)(uintptr_t)a[0];
  /* the expected layout: 5 pointers, 5 int32, then only 8-byte (scratch pointer) parameters */
  int trailing = param_layout(function, 5, NUM_ARGS);
  if (trailing < 0) Py_RETURN_NONE;
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
  Py_INCREF(args[13]);
  f->padding = args[13];
  PyObject *capsule = PyCapsule_New(f, "chunkmeta.fill", free_fill);
  if (!capsule) {
    Py_DECREF(f->padding);
    PyMem_Free(f);
  }
  return capsule;
}

/* ---- the result: a ChunkMetadata made here ------------------------------------------------ */
/* The builder's own views and sizes need none of ChunkMetadata's constructor checks, and its
   attrs __init__ (13 fields, 4 validators) costs more than the launch's arguments: the object
   is allocated here and its slots set through their member descriptors, as object.__setattr__
   would. set_metadata_class binds the class once and refuses one whose fields are not slots. */
#define NUM_FIELDS 13
static PyTypeObject *metadata_type = NULL;
static PyObject *metadata_fields[NUM_FIELDS];

/* set_metadata_class(cls, field_names) -> bool */
static PyObject *py_set_metadata_class(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyType_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "set_metadata_class(cls, field_names)");
    return NULL;
  }
  PyObject *names = PySequence_Fast(args[1], "field_names must be a sequence");
  if (!names) return NULL;
  PyObject *found[NUM_FIELDS] = {NULL};
  int ok = PySequence_Fast_GET_SIZE(names) == NUM_FIELDS;
  for (Py_ssize_t i = 0; ok && i < NUM_FIELDS; i++) {
    found[i] = PyObject_GetAttr(args[0], PySequence_Fast_GET_ITEM(names, i));
    if (!found[i]) PyErr_Clear();
    ok = found[i] && PyObject_TypeCheck(found[i], &PyMemberDescr_Type);
  }
  Py_DECREF(names);
  if (!ok) {
    for (int i = 0; i < NUM_FIELDS; i++) Py_XDECREF(found[i]);
    Py_RETURN_FALSE;
  }
  for (int i = 0; i < NUM_FIELDS; i++) {
    Py_XSETREF(metadata_fields[i], found[i]);
  }
  Py_INCREF(args[0]);
  Py_XSETREF(metadata_type, (PyTypeObject *)args[0]);
  Py_RETURN_TRUE;
}

/* An instance of a slots class with its n slots set through their member descriptors (new
   reference), or NULL with an error. values[] are borrowed. */
static PyObject *new_object(PyTypeObject *cls, PyObject *const *descriptors, PyObject *const *values, int n) {
  PyObject *made = cls->tp_alloc(cls, 0);
  if (!made) return NULL;
  for (int i = 0; i < n; i++) {
    if (Py_TYPE(descriptors[i])->tp_descr_set(descriptors[i], made, values[i]) < 0) {
      Py_DECREF(made);
      return NULL;
    }
  }
  return made;
}

/* A ChunkMetadata with its fields set (new reference), or NULL with an error. values[] are
   borrowed. */
static PyObject *new_metadata(PyObject *const *values) {
  return new_object(metadata_type, metadata_fields, values, NUM_FIELDS);
}

/* torch.Tensor's attributes a build reads of its tensors, bound once (set_tensor_types): the
   descriptors themselves, called directly. Through the attribute lookup each read also paid a
   type lookup and, for a method, a bound call: a step build reads 5 attributes of each host
   input tensor and 6 of each device one, and makes a fresh alias of each FLA cu_seqlens (.data),
   every build. */
enum { T_DTYPE, T_IS_CPU, T_IS_CUDA, T_SHAPE, T_DATA, T_GET_DEVICE, T_IS_CONTIGUOUS, T_STRIDE, T_DATA_PTR, T_ATTRS };
#define T_FIRST_METHOD T_GET_DEVICE /* the getters (data descriptors), then the methods */
static PyObject *tensor_attr[T_ATTRS];

/* t.<attribute> of a torch.Tensor t (a getter): new reference, or NULL with an error. */
static PyObject *tensor_get(int which, PyObject *t) {
  PyObject *descriptor = tensor_attr[which];
  return Py_TYPE(descriptor)->tp_descr_get(descriptor, t, (PyObject *)Py_TYPE(t));
}

/* t.<method>() of a torch.Tensor t: new reference, or NULL with an error. */
static PyObject *tensor_call(int which, PyObject *t) { return PyObject_Vectorcall(tensor_attr[which], &t, 1, NULL); }

/* A new tensor object over the same memory as `view` (new reference), or NULL with an error:
   what FLA's identity-memoized helpers need of each build's cu_seqlens. `.data` makes it without
   the dispatcher, in about half the host time of a detach(); the alias is only read, so the
   version counter it does not share is never consulted. */
static PyObject *fresh_alias(PyObject *view) { return tensor_get(T_DATA, view); }

/* The views of a slot sized (seqs_out, rows_out) as new references in out = (cu_seqlens,
   chunk_indices, chunk_offsets, cu_seqlens_cpu): from the builder's caches (seq_cache:
   (slot, seqs_out) -> (cu_seqlens, chunk_offsets, cu_seqlens_cpu); row_cache: (slot, rows_out)
   -> chunk_indices), else from its cached_views(slot, seqs_out, rows_out). cu_seqlens and
   cu_seqlens_cpu are handed out as new objects (fresh_alias of the cached view): FLA memoizes its
   helpers by argument identity. 0, or -1 with an error. */
static int slot_views(PyObject *seq_cache, PyObject *row_cache, PyObject *cached_views, int64_t slot,
                      int64_t seqs_out, int64_t rows_out, PyObject **out) {
  PyObject *seq_key = Py_BuildValue("(LL)", (long long)slot, (long long)seqs_out);
  PyObject *row_key = Py_BuildValue("(LL)", (long long)slot, (long long)rows_out);
  PyObject *seqs = NULL, *rows = NULL, *cached[4];
  if (seq_key && row_key) {
    seqs = PyDict_GetItemWithError(seq_cache, seq_key);
    if (seqs && !(PyTuple_CheckExact(seqs) && PyTuple_GET_SIZE(seqs) == 3)) seqs = NULL;
    if (!PyErr_Occurred()) rows = PyDict_GetItemWithError(row_cache, row_key);
  }
  Py_XDECREF(seq_key);
  Py_XDECREF(row_key);
  if (PyErr_Occurred()) return -1;
  PyObject *made = NULL;
  if (seqs && rows) {
    cached[0] = PyTuple_GET_ITEM(seqs, 0);
    cached[1] = rows;
    cached[2] = PyTuple_GET_ITEM(seqs, 1);
    cached[3] = PyTuple_GET_ITEM(seqs, 2);
  } else {
    made = PyObject_CallFunction(cached_views, "LLL", (long long)slot, (long long)seqs_out, (long long)rows_out);
    if (!made) return -1;
    if (!(PyTuple_CheckExact(made) && PyTuple_GET_SIZE(made) == 4)) {
      Py_DECREF(made);
      PyErr_SetString(PyExc_TypeError, "cached_views must return a 4-tuple");
      return -1;
    }
    for (int i = 0; i < 4; i++) cached[i] = PyTuple_GET_ITEM(made, i);
  }
  for (int i = 0; i < 4; i++) Py_INCREF(cached[i]); /* held across the fresh_alias calls below */
  Py_XDECREF(made);
  out[0] = fresh_alias(cached[0]);
  out[3] = out[0] ? fresh_alias(cached[3]) : NULL;
  out[1] = cached[1];
  out[2] = cached[2];
  Py_DECREF(cached[0]);
  Py_DECREF(cached[3]);
  if (!out[0] || !out[3]) {
    for (int i = 0; i < 4; i++) Py_XDECREF(out[i]);
    return -1;
  }
  return 0;
}

/* build(fill, host_address, host_len, is64, first_seq, num_seqs, qsl, slot, stream, generation,
         lease, seq_cache, row_cache, cached_views) -> ChunkMetadata, or an int: -1 when the input is invalid
   (first_seq not an int, num_seqs neither None nor an int >= 0, a bad slice or offsets: nothing
   was launched or written, and the caller re-plans slowly for the precise error), or the
   CUresult of a failed launch (nothing written on the host). num_seqs None: the rest of the
   batch. The result is made before the launch, so nothing can fail once the slot is written. */
static PyObject *py_build(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 14) {
    PyErr_SetString(PyExc_TypeError, "build takes 14 arguments");
    return NULL;
  }
  if (!metadata_type) {
    PyErr_SetString(PyExc_RuntimeError, "set_metadata_class was not called");
    return NULL;
  }
  Fill *f = PyCapsule_GetPointer(args[0], "chunkmeta.fill");
  if (!f) return NULL;
  long long a[3], b[4], first_seq, num_seqs;
  if (int_args(args + 1, 3, 3, a) || int_args(args + 6, 4, 4, b)) return NULL;
  if (slice_args(args[4], args[5], a[1] - 1, &first_seq, &num_seqs)) return PyLong_FromLong(-1);
  const char *host = (const char *)(uintptr_t)a[0];
  int64_t requests = a[1] - 1, first = first_seq, n = num_seqs, slot = b[1];
  int is64 = (int)a[2];
  /* n is bounded by the capacity before first + n is formed, so the sum cannot overflow */
  if (first < 0 || first > requests || n < 0 || n > f->cap_seqs || first + n > requests || slot < 0 ||
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

  PyObject *views[4];
  if (slot_views(args[11], args[12], args[13], slot, seqs_out, rows_out, views)) return NULL;
  PyObject *ints[6] = {PyLong_FromLongLong(1LL << f->shift), PyLong_FromLongLong(n), PyLong_FromLongLong(tokens),
                       PyLong_FromLongLong(p.chunks), PyLong_FromLongLong(p.longest), PyLong_FromLongLong(slot)};
  PyObject *md = NULL;
  if (ints[0] && ints[1] && ints[2] && ints[3] && ints[4] && ints[5]) {
    PyObject *values[NUM_FIELDS] = {views[0], views[3], views[1], views[2], ints[0], ints[1], ints[2],
                                    ints[3],  ints[4],  f->padding, args[9], args[10], ints[5]};
    md = new_metadata(values);
  }
  for (int i = 0; i < 6; i++) Py_XDECREF(ints[i]);
  for (int i = 0; i < 4; i++) Py_DECREF(views[i]);
  if (!md) return NULL;

  if (f->function && (n > 0 || f->seqs_out >= 0)) {
    uint64_t ptrs[5] = {(uint64_t)b[0], f->params, f->cu[slot], f->indices[slot], f->offsets[slot]};
    int32_t scalars[5] = {(int32_t)first, (int32_t)n, (int32_t)rows_out, (int32_t)seqs_out, f->pad_seq};
    int err = launch_fill_kernel(f, ptrs, scalars, rows_out, (void *)(uintptr_t)b[2]);
    if (err) {
      Py_DECREF(md);
      return PyLong_FromLong(err);
    }
  }
  /* the host cu_seqlens: the slice rebased to 0, then zero-length tails up to seqs_out */
  int32_t *out = f->cu_host[slot];
  host_cu_seqlens(out, q, is64, n, start, seqs_out);
  return md;
}


/* ---- a step build's result objects, from a recipe (chunkmeta.results) ------------------ */
/* make_results compiles a recipe once (every field's op and operands, each class's slot
   descriptors, checked then); results() makes one build's objects from it: the step's views
   from the view cache, its host ints from the plan's tuples. A view the cache lacks is one
   slice of its base (the ring's view_base, fetched per slot at compile time; make_view's
   `base[:count]`), put in the cache as make_view puts it: most steps make a view for each table
   whose row count is new, and make_view's Python frame cost as much again as the slice. ROW
   views (two calls) go through make_view. The ops are chunkmeta.results' (its docstring
   states them; python_results is the same in Python). */
enum { R_CONST, R_ITEM, R_VIEW, R_GENERATION, R_LEASE, R_SLOT, R_TABLES };
enum { R_COUNTS, R_FACTS, R_FIXED };
#define MAX_FIELDS 16
#define MAX_OUTPUTS 8

typedef struct {
  int op, shape, fresh, source, index, when;
  long long add;
  PyObject *obj;   /* R_CONST: the value; R_VIEW: the region (an offset or a host buffer's name) */
  PyObject **base; /* R_VIEW but ROW: the region's view base per slot, or NULL (make_view) */
  Py_ssize_t base_len;
  /* R_VIEW: per slot, the view this field got last and its count. A repeated count (a step like
     the one before in that slot: decodes, one request's next chunk) then costs a compare where
     the cache lookup packs and hashes a key and allocates a count above 256. */
  PyObject **last_view;
  long long *last_count;
} Field;

typedef struct {
  PyTypeObject *cls;
  PyObject *name;
  int fields;
  PyObject *descriptors[MAX_FIELDS];
  Field field[MAX_FIELDS];
} Output;

typedef struct {
  int outputs;
  Output out[MAX_OUTPUTS + 1]; /* the tables, then the StepTables that holds them */
  Py_ssize_t need[2];          /* the counts / facts tuples' least lengths */
  PyObject *views, *make_view, *view_base, *lease, *shapes[3];
  int depth;           /* the ring's slots: every base array's length */
  Py_ssize_t limit;    /* the view cache's entries, at most (the ring's view_limit) */
} Results;

static void free_results(PyObject *capsule) {
  Results *r = PyCapsule_GetPointer(capsule, "chunkmeta.results");
  if (!r) return;
  for (int o = 0; o <= r->outputs; o++) {
    Output *out = &r->out[o];
    Py_XDECREF(out->cls);
    Py_XDECREF(out->name);
    for (int i = 0; i < out->fields; i++) {
      Field *f = &out->field[i];
      Py_XDECREF(out->descriptors[i]);
      Py_XDECREF(f->obj);
      if (f->base) {
        for (int k = 0; k < r->depth; k++) Py_XDECREF(f->base[k]);
        PyMem_Free(f->base);
      }
      if (f->last_view) {
        for (int k = 0; k < r->depth; k++) Py_XDECREF(f->last_view[k]);
        PyMem_Free(f->last_view);
      }
      PyMem_Free(f->last_count);
    }
  }
  Py_XDECREF(r->views);
  Py_XDECREF(r->make_view);
  Py_XDECREF(r->view_base);
  Py_XDECREF(r->lease);
  for (int i = 0; i < 3; i++) Py_XDECREF(r->shapes[i]);
  PyMem_Free(r);
}

/* A VIEW field's bases, one per slot (view_base(slot, region, shape)), and its empty per-slot
   memo; 0, or -1 with an error. */
static int view_bases(Results *r, Field *field) {
  field->last_view = PyMem_Calloc(r->depth, sizeof(PyObject *));
  field->last_count = PyMem_Calloc(r->depth, sizeof(long long));
  if (!field->last_view || !field->last_count) {
    PyErr_NoMemory();
    return -1;
  }
  if (field->shape == 2) return 0; /* ROW: make_view */
  if (!(field->base = PyMem_Calloc(r->depth, sizeof(PyObject *)))) {
    PyErr_NoMemory();
    return -1;
  }
  for (int k = 0; k < r->depth; k++) {
    PyObject *slot = PyLong_FromLong(k);
    field->base[k] = slot ? PyObject_CallFunctionObjArgs(r->view_base, slot, field->obj, r->shapes[field->shape], NULL)
                          : NULL;
    Py_XDECREF(slot);
    if (!field->base[k]) return -1;
    Py_ssize_t len = PyObject_Length(field->base[k]);
    if (len < 0) return -1;
    field->base_len = k ? (len < field->base_len ? len : field->base_len) : len;
  }
  return 0;
}

/* One output (cls, descriptors, fields) into out; 0, or -1 with an error. top: the StepTables. */
static int compile_output(Results *r, PyObject *cls, PyObject *descriptors, PyObject *fields, int top, Output *out,
                          Py_ssize_t *need) {
  if (!PyType_Check(cls) || !PyTuple_Check(descriptors) || !PyTuple_Check(fields) ||
      PyTuple_GET_SIZE(descriptors) != PyTuple_GET_SIZE(fields) || PyTuple_GET_SIZE(fields) > MAX_FIELDS) {
    PyErr_SetString(PyExc_TypeError, "an output is (cls, descriptors, fields) of equal lengths");
    return -1;
  }
  Py_INCREF(cls);
  out->cls = (PyTypeObject *)cls;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); i++) {
    PyObject *d = PyTuple_GET_ITEM(descriptors, i), *f = PyTuple_GET_ITEM(fields, i);
    Field *field = &out->field[i];
    memset(field, 0, sizeof *field);
    field->when = -1;
    out->fields = (int)i + 1; /* from here free_results releases this field */
    Py_INCREF(d);
    out->descriptors[i] = d;
    if (!PyObject_TypeCheck(d, &PyMemberDescr_Type) || !PyTuple_Check(f) || PyTuple_GET_SIZE(f) < 1) {
      PyErr_SetString(PyExc_TypeError, "a field needs a slot descriptor and an op tuple");
      return -1;
    }
    field->op = (int)PyLong_AsLong(PyTuple_GET_ITEM(f, 0));
    Py_ssize_t size = PyTuple_GET_SIZE(f);
    int ok = 0;
    switch (field->op) {
      case R_CONST:
        ok = size == 2;
        if (ok) field->obj = Py_NewRef(PyTuple_GET_ITEM(f, 1));
        break;
      case R_ITEM:
        ok = size == 3;
        if (ok) {
          field->source = (int)PyLong_AsLong(PyTuple_GET_ITEM(f, 1));
          field->index = (int)PyLong_AsLong(PyTuple_GET_ITEM(f, 2));
        }
        ok = ok && (field->source == R_COUNTS || field->source == R_FACTS) && field->index >= 0;
        break;
      case R_VIEW:
        ok = size == 8;
        if (ok) {
          field->obj = Py_NewRef(PyTuple_GET_ITEM(f, 1));
          field->shape = (int)PyLong_AsLong(PyTuple_GET_ITEM(f, 2));
          field->fresh = PyObject_IsTrue(PyTuple_GET_ITEM(f, 3));
          field->source = (int)PyLong_AsLong(PyTuple_GET_ITEM(f, 4));
          field->index = (int)PyLong_AsLong(PyTuple_GET_ITEM(f, 5));
          field->add = PyLong_AsLongLong(PyTuple_GET_ITEM(f, 6));
          field->when = (int)PyLong_AsLong(PyTuple_GET_ITEM(f, 7));
        }
        ok = ok && field->shape >= 0 && field->shape < 3 && field->fresh >= 0 && field->source >= R_COUNTS &&
             field->source <= R_FIXED && field->index >= 0 && field->when >= -1;
        if (ok && !PyErr_Occurred() && view_bases(r, field)) return -1;
        break;
      case R_GENERATION:
      case R_LEASE:
      case R_SLOT:
        ok = size == 1;
        break;
      case R_TABLES:
        ok = size == 1 && top;
        break;
    }
    if (PyErr_Occurred()) return -1;
    if (!ok) {
      PyErr_Format(PyExc_ValueError, "field %zd of %s: not a valid recipe op", i, ((PyTypeObject *)cls)->tp_name);
      return -1;
    }
    if ((field->op == R_ITEM || field->op == R_VIEW) && field->source != R_FIXED)
      need[field->source] = need[field->source] > field->index + 1 ? need[field->source] : field->index + 1;
    if (field->when >= 0) need[R_FACTS] = need[R_FACTS] > field->when + 1 ? need[R_FACTS] : field->when + 1;
  }
  return 0;
}

/* make_results(outputs, top, views, make_view, view_base, depth, limit, lease) -> capsule.
   outputs: ((name, cls, descriptors, fields), ...); top: (cls, descriptors, fields), the
   StepTables; views, make_view, view_base, depth: the ring's; limit: its cache's entries. */
static PyObject *py_make_results(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long sizes[2];
  if (nargs != 8 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) > MAX_OUTPUTS || !PyTuple_Check(args[1]) ||
      PyTuple_GET_SIZE(args[1]) != 3 || !PyDict_Check(args[2]) || !PyCallable_Check(args[3]) ||
      !PyCallable_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError,
                    "make_results(outputs, top, views: dict, make_view, view_base, depth, limit, lease)");
    return NULL;
  }
  if (int_args(args + 5, 2, 2, sizes)) return NULL;
  if (sizes[0] < 1 || sizes[0] > MAX_SLOTS || sizes[1] < 1) {
    PyErr_SetString(PyExc_ValueError, "make_results: depth must be 1..64 and limit positive");
    return NULL;
  }
  Results *r = PyMem_Calloc(1, sizeof(Results));
  if (!r) return PyErr_NoMemory();
  PyObject *capsule = PyCapsule_New(r, "chunkmeta.results", free_results);
  if (!capsule) {
    PyMem_Free(r);
    return NULL;
  }
  r->views = Py_NewRef(args[2]);
  r->make_view = Py_NewRef(args[3]);
  r->view_base = Py_NewRef(args[4]);
  r->depth = (int)sizes[0];
  r->limit = (Py_ssize_t)sizes[1];
  r->lease = Py_NewRef(args[7]);
  for (int i = 0; i < 3; i++)
    if (!(r->shapes[i] = PyLong_FromLong(i))) goto fail;
  Py_ssize_t outputs = PyTuple_GET_SIZE(args[0]);
  for (Py_ssize_t o = 0; o < outputs; o++) {
    PyObject *item = PyTuple_GET_ITEM(args[0], o);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
      PyErr_SetString(PyExc_TypeError, "an output is (name, cls, descriptors, fields)");
      goto fail;
    }
    r->outputs = (int)o + 1;
    r->out[o].name = Py_NewRef(PyTuple_GET_ITEM(item, 0));
    if (compile_output(r, PyTuple_GET_ITEM(item, 1), PyTuple_GET_ITEM(item, 2), PyTuple_GET_ITEM(item, 3), 0,
                       &r->out[o], r->need))
      goto fail;
  }
  r->outputs = (int)outputs;
  Output *top = &r->out[outputs];
  if (compile_output(r, PyTuple_GET_ITEM(args[1], 0), PyTuple_GET_ITEM(args[1], 1), PyTuple_GET_ITEM(args[1], 2), 1,
                     top, r->need))
    goto fail;
  if (!top->cls->tp_dictoffset) { /* results() makes its tables the top object's __dict__ */
    PyErr_SetString(PyExc_TypeError, "make_results: the top class must have an instance __dict__ (StepTables)");
    goto fail;
  }
  return capsule;
fail:
  Py_DECREF(capsule);
  return NULL;
}

/* One field's value (new reference), or NULL with an error. k: the slot's index (-1: not one of
   the ring's; make_view then decides). */
static PyObject *field_value(Results *r, Field *f, PyObject *slot, long k, PyObject *generation,
                             PyObject *const *sources, PyObject *tables) {
  switch (f->op) {
    case R_CONST:
      return Py_NewRef(f->obj);
    case R_ITEM:
      return Py_NewRef(PyTuple_GET_ITEM(sources[f->source], f->index));
    case R_GENERATION:
      return Py_NewRef(generation);
    case R_LEASE:
      return Py_NewRef(r->lease);
    case R_SLOT:
      return Py_NewRef(slot);
    case R_TABLES:
      return Py_NewRef(tables);
  }
  /* R_VIEW */
  if (f->when >= 0) {
    int on = PyObject_IsTrue(PyTuple_GET_ITEM(sources[R_FACTS], f->when));
    if (on < 0) return NULL;
    if (!on) Py_RETURN_NONE;
  }
  long long count = f->add;
  if (f->source != R_FIXED) {
    long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(sources[f->source], f->index));
    if (n == -1 && PyErr_Occurred()) return NULL;
    count += n;
  }
  PyObject *view = NULL;
  if (k >= 0 && f->last_view[k] && f->last_count[k] == count) {
    view = Py_NewRef(f->last_view[k]);
  } else {
    PyObject *count_obj = PyLong_FromLongLong(count);
    if (!count_obj) return NULL;
    PyObject *key = PyTuple_Pack(4, slot, f->obj, count_obj, r->shapes[f->shape]);
    view = key ? PyDict_GetItemWithError(r->views, key) : NULL; /* borrowed */
    Py_XINCREF(view);
    if (!view && !PyErr_Occurred() && f->base && k >= 0 && count >= 0 && count <= f->base_len) {
      PyObject *prefix = PySlice_New(NULL, count_obj, NULL);
      view = prefix ? PyObject_GetItem(f->base[k], prefix) : NULL;
      Py_XDECREF(prefix);
      if (view && PyDict_GET_SIZE(r->views) >= r->limit) PyDict_Clear(r->views);
      if (view && PyDict_SetItem(r->views, key, view)) Py_CLEAR(view);
    } else if (!view && !PyErr_Occurred()) { /* ROW, or what make_view refuses */
      view = PyObject_CallFunctionObjArgs(r->make_view, slot, f->obj, count_obj, r->shapes[f->shape], NULL);
    }
    Py_XDECREF(key);
    Py_DECREF(count_obj);
    if (view && k >= 0) {
      Py_XSETREF(f->last_view[k], Py_NewRef(view));
      f->last_count[k] = count;
    }
  }
  if (!view || !f->fresh) return view;
  PyObject *fresh = fresh_alias(view);
  Py_DECREF(view);
  return fresh;
}

/* An output's object (new reference), or NULL with an error. */
static PyObject *make_output(Results *r, Output *out, PyObject *slot, long k, PyObject *generation,
                             PyObject *const *sources, PyObject *tables) {
  PyObject *values[MAX_FIELDS];
  int made = 0;
  for (; made < out->fields; made++)
    if (!(values[made] = field_value(r, &out->field[made], slot, k, generation, sources, tables))) break;
  PyObject *object = made == out->fields ? new_object(out->cls, out->descriptors, values, out->fields) : NULL;
  for (int i = 0; i < made; i++) Py_DECREF(values[i]);
  return object;
}

/* results(capsule, slot, generation, counts, facts) -> StepTables. counts / facts: tuples (a
   NamedTuple is one) at least as long as the recipe reads. */
static PyObject *py_results(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "results(capsule, slot, generation, counts, facts)");
    return NULL;
  }
  Results *r = PyCapsule_GetPointer(args[0], "chunkmeta.results");
  if (!r) return NULL;
  PyObject *const sources[2] = {args[3], args[4]};
  for (int i = 0; i < 2; i++)
    if (!PyTuple_Check(sources[i]) || PyTuple_GET_SIZE(sources[i]) < r->need[i]) {
      PyErr_SetString(PyExc_TypeError, "results: counts and facts must be tuples as long as the recipe reads");
      return NULL;
    }
  long k = PyLong_AsLong(args[1]);
  if (k == -1 && PyErr_Occurred()) { /* not an int: make_view takes it or says why; anything else stands */
    if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
    PyErr_Clear();
  }
  if (k < 0 || k >= r->depth) k = -1; /* not one of the ring's slots: no memo, no base (make_view decides) */
  PyObject *tables = PyDict_New();
  if (!tables) return NULL;
  for (int o = 0; o < r->outputs; o++) {
    PyObject *object = make_output(r, &r->out[o], args[1], k, args[2], sources, NULL);
    int err = object ? PyDict_SetItem(tables, r->out[o].name, object) : -1;
    Py_XDECREF(object);
    if (err) {
      Py_DECREF(tables);
      return NULL;
    }
  }
  PyObject *step = make_output(r, &r->out[r->outputs], args[1], k, args[2], sources, tables);
  /* the tables are also the StepTables' instance __dict__ (its __attrs_post_init__ does the same):
     step.<name> is a plain lookup */
  if (step && PyObject_GenericSetDict(step, tables, NULL)) Py_CLEAR(step);
  Py_DECREF(tables);
  return step;
}


/* ---- a step build: every table's sizes and checks, host copies and one launch ----------- */
/* The host side of chunkmeta.step_builder.StepTablesBuilder.build for accepted tensors. A steps
   capsule (make_steps) holds what never changes: the kernel (step_tables_kernel, or 0: no
   launch), or for a CPU builder the CPU fill (cpu_fill_entry), its launch shape, each slot's
   arena and host cu_seqlens buffers, and the entries (kind, shift, slice, base, flag, rows_pad,
   seqs_pad, the four region offsets, pad0, pad1). */
#define MAX_ENTRIES 6
#define STEP_ARGS 14 /* qsl, computed, checkpoints, arena, params (8 B); 9 int32 scalars */

typedef struct {
  void *function;
  unsigned block_rows, threads, shared;
  int trailing, slots, entries, padded, cpu_fill;
  int64_t cap_seqs, cap_tokens;
  int kind[MAX_ENTRIES], shift[MAX_ENTRIES], slice[MAX_ENTRIES], base[MAX_ENTRIES], flag[MAX_ENTRIES];
  int64_t rows_pad[MAX_ENTRIES], seqs_pad[MAX_ENTRIES], off[MAX_ENTRIES][4], pad0[MAX_ENTRIES], pad1[MAX_ENTRIES];
  uint64_t arena[MAX_SLOTS];
  int32_t *cu_host[MAX_ENTRIES][MAX_SLOTS]; /* FLA entries: the slot's host cu_seqlens */
  int64_t *ends;                            /* cpu_fill: a slice's chunk ends, cap_seqs entries */
} Steps;

static void free_steps(PyObject *capsule) {
  Steps *st = PyCapsule_GetPointer(capsule, "chunkmeta.steps");
  PyMem_Free(st->ends);
  PyMem_Free(st);
}

/* make_steps(function, block_rows, num_warps, shared, cap_seqs, cap_tokens, padded, entries,
              arenas, cu_hosts, cpu_fill) -> capsule, or None if the kernel's parameters are not
   the layout packed here. entries: (kind, shift, slice, base, flag, rows_pad, seqs_pad, off0,
   off1, off2, off3, pad0, pad1) tuples; arenas: a slot's arena address each; cu_hosts: per
   entry, a host address per slot (0 for non-FLA); cpu_fill: with function 0, fill the (CPU)
   arenas in C (cpu_fill_entry) instead of leaving the fill to the caller. */
static PyObject *py_make_steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[7], cpu_fill;
  if (nargs != 11) {
    PyErr_SetString(PyExc_TypeError, "make_steps takes 11 arguments");
    return NULL;
  }
  if (int_args(args, 7, 7, a) || int_args(args + 10, 1, 1, &cpu_fill)) return NULL;
  void *function = (void *)(uintptr_t)a[0];
  if (function && cpu_fill) {
    PyErr_SetString(PyExc_ValueError, "make_steps: a kernel or the CPU fill, not both");
    return NULL;
  }
  int trailing = param_layout(function, 5, STEP_ARGS); /* 5 pointers, 9 int32, then scratch pointers */
  if (trailing < 0) Py_RETURN_NONE;
  Steps *st = PyMem_Calloc(1, sizeof(Steps));
  if (!st) return PyErr_NoMemory();
  st->cpu_fill = cpu_fill != 0;
  st->function = function;
  st->block_rows = (unsigned)(a[1] > 0 ? a[1] : 1);
  st->threads = 32u * (unsigned)(a[2] > 0 ? a[2] : 1);
  st->shared = (unsigned)a[3];
  st->cap_seqs = a[4];
  st->cap_tokens = a[5];
  st->padded = (int)a[6];
  st->trailing = trailing;
  PyObject *entries = PySequence_Fast(args[7], "entries"), *arenas = PySequence_Fast(args[8], "arenas"),
           *hosts = PySequence_Fast(args[9], "cu_hosts");
  int ok = entries && arenas && hosts;
  if (ok) {
    st->entries = (int)PySequence_Fast_GET_SIZE(entries);
    st->slots = (int)PySequence_Fast_GET_SIZE(arenas);
    ok = st->entries >= 1 && st->entries <= MAX_ENTRIES && st->slots >= 1 && st->slots <= MAX_SLOTS &&
         PySequence_Fast_GET_SIZE(hosts) == st->entries;
  }
  for (int j = 0; ok && j < st->entries; j++) {
    long long e[13];
    PyObject *item = PySequence_Fast(PySequence_Fast_GET_ITEM(entries, j), "entry");
    ok = item && PySequence_Fast_GET_SIZE(item) == 13 && !int_args(PySequence_Fast_ITEMS(item), 13, 13, e);
    Py_XDECREF(item);
    if (!ok) break;
    st->kind[j] = (int)e[0], st->shift[j] = (int)e[1], st->slice[j] = (int)e[2], st->base[j] = (int)e[3];
    st->flag[j] = (int)e[4], st->rows_pad[j] = e[5], st->seqs_pad[j] = e[6];
    for (int k = 0; k < 4; k++) st->off[j][k] = e[7 + k];
    st->pad0[j] = e[11], st->pad1[j] = e[12];
    ok = st->shift[j] >= 0 && st->shift[j] <= 31;
    PyObject *per_slot = ok ? PySequence_Fast(PySequence_Fast_GET_ITEM(hosts, j), "cu_host") : NULL;
    ok = per_slot && PySequence_Fast_GET_SIZE(per_slot) == st->slots;
    for (int k = 0; ok && k < st->slots; k++) {
      long long address;
      ok = !int_args(PySequence_Fast_ITEMS(per_slot) + k, 1, 1, &address);
      st->cu_host[j][k] = (int32_t *)(uintptr_t)address;
    }
    Py_XDECREF(per_slot);
  }
  for (int k = 0; ok && k < st->slots; k++) {
    long long address;
    ok = !int_args(PySequence_Fast_ITEMS(arenas) + k, 1, 1, &address);
    st->arena[k] = (uint64_t)address;
  }
  Py_XDECREF(entries);
  Py_XDECREF(arenas);
  Py_XDECREF(hosts);
  if (ok && st->cpu_fill) {
    st->ends = PyMem_Malloc(sizeof(int64_t) * (size_t)(st->cap_seqs > 0 ? st->cap_seqs : 1));
    if (!st->ends) {
      PyMem_Free(st);
      return PyErr_NoMemory();
    }
  }
  if (!ok) {
    PyMem_Free(st);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "make_steps: bad entries, arenas or cu_hosts");
    return NULL;
  }
  PyObject *capsule = PyCapsule_New(st, "chunkmeta.steps", free_steps);
  if (!capsule) {
    PyMem_Free(st->ends);
    PyMem_Free(st);
  }
  return capsule;
}

/* The chunks of sequence s of a slice (q: the slice's offsets, base: q[0]) in an entry's chunk
   grid: its tokens start at 0 (base_kind 0), at their packed position from the slice's start (1)
   or after the request's computed tokens (2), and with `split` they are cut in two at its
   checkpoint. computed / checkpoints: the per-request arrays, `row` the request's index there.
   run_step counts rows with it, cpu_fill_entry finds each row's sequence. */
static int64_t sequence_chunks(const void *q, int q64, int64_t base, int64_t s, int base_kind, int shift, int split,
                               const void *computed, int computed64, const void *checkpoints, int checkpoints64,
                               int64_t row) {
  const int64_t start = load(q, q64, s), len = load(q, q64, s + 1) - start;
  const int64_t pos = base_kind == 0 ? 0 : base_kind == 1 ? start - base : load(computed, computed64, row);
  return sequence_chunk_count(pos, len, split ? load(checkpoints, checkpoints64, row) : 0, shift);
}

/* One entry of the step kernel on a CPU builder's arena, serially: what step_fill.cu's run_entry
   writes (the same tables, padding and untouched entries), its sequences' chunk ends in st->ends.
   q: the slice's query_start_loc (n + 1 entries from `first`), computed / checkpoints: every
   request's (indexed first + s); is64 flags: their element types. Input validated by run_step. */
static void cpu_fill_entry(const Steps *st, int j, char *arena, const char *q, int q64, const char *computed,
                           int computed64, const char *checkpoints, int checkpoints64, int64_t first, int64_t n,
                           int64_t num_rows) {
  const int kind = st->kind[j], shift = st->shift[j], base_kind = st->base[j], flag = st->flag[j];
  const int split = kind == MAMBA2 && flag;
  const int64_t base = load(q, q64, 0), num_tokens = load(q, q64, n) - base;
  int64_t *ends = st->ends, num_chunks = 0;
  for (int64_t s = 0; s < n; s++) {
    num_chunks += sequence_chunks(q, q64, base, s, base_kind, shift, split, computed, computed64, checkpoints,
                                  checkpoints64, first + s);
    ends[s] = num_chunks;
  }
  char *r0 = arena + st->off[j][0], *r1 = arena + st->off[j][1], *r2 = arena + st->off[j][2],
       *r3 = arena + st->off[j][3];
  const int64_t seqs_out = st->padded ? st->seqs_pad[j] : n, pad0 = st->pad0[j], pad1 = st->pad1[j];
  for (int64_t s = 0; s < seqs_out; s++) { /* the per-sequence tables */
    const int real = s < n;
    const int64_t end = real ? ends[s] : num_chunks;
    if (kind == FLA) {
      ((int32_t *)r0)[1 + s] = (int32_t)(real ? load(q, q64, s + 1) - base : num_tokens);
      if (flag)
        ((int64_t *)r2)[1 + s] = end;
      else
        ((int32_t *)r2)[1 + s] = (int32_t)end;
    } else if (kind == MAMBA2) {
      ((int32_t *)r2)[s] = (int32_t)(end - 1);
      if (split) {
        int64_t mark = 0, cut = real ? load(checkpoints, checkpoints64, first + s) : 0;
        if (cut > 0)
          mark = (s ? ends[s - 1] : 0) + segment_chunks(load(computed, computed64, first + s), cut, shift) - 1;
        ((int64_t *)r3)[s] = mark;
      }
    } else if (kind == LOGICAL && flag) {
      r2[s] = (char)(real && load(computed, computed64, first + s) > 0);
    }
  }
  int64_t seq = 0;
  for (int64_t r = 0; r < num_rows; r++) { /* the rows, in order: each one's sequence and chunk */
    const int real = r < num_chunks;
    while (real && ends[seq] <= r) seq++; /* the first sequence whose chunks end past r */
    const int64_t chunk = real ? r - (seq ? ends[seq - 1] : 0) : 0;
    if (kind == FLA || (kind == CONV && flag)) { /* int32 (seq, chunk) pairs */
      int32_t *pair = (int32_t *)(kind == FLA ? r1 : r0) + 2 * r;
      pair[0] = (int32_t)(real ? seq : pad0);
      pair[1] = (int32_t)(real ? chunk : pad1);
    } else if (kind == CONV) {
      ((int32_t *)r0)[r] = (int32_t)(real ? seq : pad0);
      ((int32_t *)r1)[r] = (int32_t)(real ? chunk : pad1);
    } else if (kind == TOKENS) {
      ((int32_t *)r0)[r] = (int32_t)(real ? seq : pad0);
    } else { /* MAMBA2, LOGICAL: the chunk's token range within its segment */
      int64_t start = 0, stop = 0, row_start = 0, pos = 0;
      if (real) {
        row_start = load(q, q64, seq);
        const int64_t len = load(q, q64, seq + 1) - row_start;
        pos = base_kind == 1 ? row_start - base : load(computed, computed64, first + seq);
        const int64_t cut = split ? load(checkpoints, checkpoints64, first + seq) : 0;
        const ChunkSpan span = chunk_span(pos, len, cut, shift, chunk);
        start = span.start;
        stop = span.stop;
      }
      if (kind == MAMBA2) {
        ((int32_t *)r0)[1 + r] = (int32_t)(real ? row_start - base + stop - pos : num_tokens);
        ((int32_t *)r1)[r] = (int32_t)(real ? seq : pad0);
      } else {
        ((int32_t *)r0)[r] = (int32_t)(real ? start >> shift : pad0);
        ((int32_t *)r1)[r] = (int32_t)(real ? start & ((1LL << shift) - 1) : pad1);
      }
    }
  }
}

/* A tuple of the n values as ints, then `spare` items left for the caller to set (new
   reference), or NULL with an error. (Py_BuildValue parses its format on every call.) */
static PyObject *int_tuple(const int64_t *values, int n, int spare) {
  PyObject *made = PyTuple_New(n + spare);
  for (int i = 0; made && i < n; i++) {
    PyObject *value = PyLong_FromLongLong(values[i]);
    if (value)
      PyTuple_SET_ITEM(made, i, value);
    else
      Py_CLEAR(made);
  }
  return made;
}

/* One step build's host side and launch (tensors_step, py_step_host): a[] = (host, host_len,
   is64), c[] = (computed, computed_is64, checkpoints, checkpoints_is64): host addresses of R
   entries, 0 when no entry reads them; d[] = (qsl_dev, computed_dev, checkpoints_dev, slot,
   stream, and those three tensors' is64 flags, which the CPU fill reads). -> (counts, (first_seq,
   n, tokens, max_seqlen, requests, batch_tokens, batch_max, prep, any_checkpoint)), with a third
   element, the launch's bool, when `with_launched` is set; or an int: -1 for input the general
   path must check (nothing written or launched), or the CUresult of a failed launch. Validates
   exactly what the Python plan checks of the values; host copies are written only after the
   launch succeeded. */
static PyObject *run_step(Steps *st, const long long *a, PyObject *first_obj, PyObject *num_obj, const long long *c,
                          const long long *d, int with_launched) {
  long long first, n;
  if (slice_args(first_obj, num_obj, a[1] - 1, &first, &n)) return PyLong_FromLong(-1);
  const char *host = (const char *)(uintptr_t)a[0];
  int is64 = (int)a[2];
  int64_t requests = a[1] - 1, slot = d[3];
  if (requests < 0 || first < 0 || first > requests || n > st->cap_seqs || first + n > requests || slot < 0 ||
      slot >= st->slots)
    return PyLong_FromLong(-1);
  int needs_batch = 0;
  for (int j = 0; j < st->entries; j++) needs_batch |= st->slice[j] == 1;
  if (needs_batch && requests > st->cap_seqs) return PyLong_FromLong(-1);
  /* the slices: offsets >= 0, non-decreasing, within the token capacity */
  const void *q = host + first * (is64 ? 8 : 4);
  int64_t start = load(q, is64, 0), end = load(q, is64, n);
  if (start < 0 || end < start || end - start > st->cap_tokens) return PyLong_FromLong(-1);
  Plan slice = plan_any(q, is64, n, -1); /* its checks and longest row; each entry counts its own chunks */
  if (slice.bad) return PyLong_FromLong(-1);
  Plan batch = {0, 0, 0};
  int64_t batch_start = 0, batch_end = 0;
  if (needs_batch) {
    batch_start = load(host, is64, 0), batch_end = load(host, is64, requests);
    if (batch_start < 0 || batch_end < batch_start || batch_end - batch_start > st->cap_tokens)
      return PyLong_FromLong(-1);
    batch = plan_any(host, is64, requests, -1);
    if (batch.bad) return PyLong_FromLong(-1);
  }
  /* per-row inputs of the slice: computed >= 0 with c + len <= INT32_MAX, 0 <= checkpoint <= len
     (every request's entry is >= 0: the Python plan checks the whole array) */
  const char *computed = (const char *)(uintptr_t)c[0], *checkpoints = (const char *)(uintptr_t)c[2];
  int prep = 0, any_checkpoint = 0;
  if (computed) {
    RowFlags flags = computed_rows[is64 << 1 | (int)c[1]](q, computed, requests, first, n);
    if (flags.bad) return PyLong_FromLong(-1);
    prep = flags.any;
  }
  if (checkpoints) {
    RowFlags flags = checkpoint_rows[is64 << 1 | (int)c[3]](q, checkpoints, requests, first, n);
    if (flags.bad) return PyLong_FromLong(-1);
    any_checkpoint = flags.any;
  }
  /* the rows of every entry */
  int64_t rows[MAX_ENTRIES] = {0}, counts[MAX_ENTRIES] = {0};
  for (int j = 0; j < st->entries; j++) {
    int whole = st->slice[j] == 1;
    const void *sq = whole ? (const void *)host : q;
    int64_t sn = whole ? requests : n;
    if (st->kind[j] == TOKENS) {
      counts[j] = whole ? batch_end - batch_start : end - start;
    } else if (st->base[j] == 0) { /* a slice planned above: its offsets do not decrease */
      counts[j] = chunks_any(sq, is64, sn, st->shift[j]);
    } else {
      const char *rows_computed = computed ? computed + (whole ? 0 : first) * (c[1] ? 8 : 4) : NULL;
      const char *rows_checkpoints = checkpoints ? checkpoints + (whole ? 0 : first) * (c[3] ? 8 : 4) : NULL;
      int split = st->kind[j] == MAMBA2 && st->flag[j] && rows_checkpoints;
      if (st->base[j] == 2 && !rows_computed) return PyLong_FromLong(-1);
      if (st->base[j] == 1) /* SGLang's logical chunks, at packed positions */
        counts[j] = packed_chunks[is64](sq, sn, st->shift[j]);
      else if (split) /* Mamba2's chunks at absolute positions, cut at checkpoints */
        counts[j] = split_chunks[is64 << 2 | (int)c[1] << 1 | (int)c[3]](sq, rows_computed, rows_checkpoints, sn,
                                                                          st->shift[j]);
      else /* the same without checkpoints */
        counts[j] = positioned_chunks[is64 << 1 | (int)c[1]](sq, rows_computed, sn, st->shift[j]);
    }
    rows[j] = st->padded ? st->rows_pad[j] : counts[j];
  }
  /* the launch: entries' program ranges as the kernel computes them */
  if (st->function) {
    uint64_t ptrs[5] = {(uint64_t)d[0], (uint64_t)d[1], (uint64_t)d[2], st->arena[slot], (uint64_t)d[0]};
    int32_t scalars[9] = {(int32_t)first, (int32_t)n, (int32_t)requests, 0, 0, 0, 0, 0, 0};
    unsigned grid = 0;
    for (int j = 0; j < st->entries; j++) {
      scalars[3 + j] = (int32_t)rows[j];
      int64_t programs = (rows[j] + st->block_rows - 1) / st->block_rows;
      grid += (unsigned)(programs > 0 ? programs : 1);
    }
    uint64_t scratch[MAX_TRAILING] = {0};
    void *params[STEP_ARGS + MAX_TRAILING];
    for (int i = 0; i < 5; i++) params[i] = &ptrs[i];
    for (int i = 0; i < 9; i++) params[5 + i] = &scalars[i];
    for (int i = 0; i < st->trailing; i++) params[STEP_ARGS + i] = &scratch[i];
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = launch_kernel(st->function, grid, 1, 1, st->threads, 1, 1, st->shared, (void *)(uintptr_t)d[4], params,
                        NULL);
    Py_END_ALLOW_THREADS
    if (err) return PyLong_FromLong(err);
  } else if (st->cpu_fill) {
    char *arena = (char *)(uintptr_t)st->arena[slot];
    for (int j = 0; j < st->entries; j++) {
      int whole = st->slice[j] == 1;
      int64_t sfirst = whole ? 0 : first, sn = whole ? requests : n;
      const char *sq = (const char *)(uintptr_t)d[0] + sfirst * (d[5] ? 8 : 4);
      cpu_fill_entry(st, j, arena, sq, (int)d[5], (const char *)(uintptr_t)d[1], (int)d[6],
                     (const char *)(uintptr_t)d[2], (int)d[7], sfirst, sn, rows[j]);
    }
  }
  /* host cu_seqlens of the FLA entries: the slice rebased to 0, then zero-length tails */
  for (int j = 0; j < st->entries; j++) {
    int32_t *out = st->kind[j] == FLA ? st->cu_host[j][slot] : NULL;
    if (!out) continue;
    int whole = st->slice[j] == 1;
    const void *sq = whole ? (const void *)host : q;
    int64_t sn = whole ? requests : n, s0 = whole ? batch_start : start;
    host_cu_seqlens(out, sq, is64, sn, s0, st->padded ? st->seqs_pad[j] : sn);
  }
  /* the facts' two flags are bools: they are the result objects' bool fields (prep_initial_states) */
  const int64_t fact_ints[7] = {first, n, end - start, slice.longest, requests, batch_end - batch_start,
                                batch.longest};
  PyObject *count_tuple = int_tuple(counts, st->entries, 0), *facts = int_tuple(fact_ints, 7, 2);
  PyObject *made = count_tuple && facts ? PyTuple_New(with_launched ? 3 : 2) : NULL;
  if (!made) {
    Py_XDECREF(count_tuple);
    Py_XDECREF(facts);
    return NULL;
  }
  PyTuple_SET_ITEM(facts, 7, PyBool_FromLong(prep));
  PyTuple_SET_ITEM(facts, 8, PyBool_FromLong(any_checkpoint));
  PyTuple_SET_ITEM(made, 0, count_tuple);
  PyTuple_SET_ITEM(made, 1, facts);
  if (with_launched) PyTuple_SET_ITEM(made, 2, PyBool_FromLong(st->function || st->cpu_fill));
  return made;
}

/* ---- a step build from the caller's tensors --------------------------------------------- */
/* An engine passes new tensor objects every step (views of its persistent buffers), so a
   build checks its input tensors every time; in Python those checks (a dozen attribute reads
   and method calls per tensor) cost more than the rest of the host side. Here they are the
   same reads through the C API. set_tensor_types binds the classes they compare against. */
static PyObject *tensor_type = NULL, *dtype_i32 = NULL, *dtype_i64 = NULL;

/* set_tensor_types(torch.Tensor, torch.int32, torch.int64) -> bool: False (nothing
   bound) where an attribute is not what the reads call: a data descriptor for a getter (which no
   instance attribute can shadow, as through the lookup), a callable for a method. */
static PyObject *py_set_tensor_types(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyType_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "set_tensor_types(Tensor, int32, int64)");
    return NULL;
  }
  static const char *names[T_ATTRS] = {"dtype",      "is_cpu",        "is_cuda", "shape",   "data",
                                       "get_device", "is_contiguous", "stride",  "data_ptr"};
  PyObject *found[T_ATTRS] = {NULL};
  int ok = 1;
  for (int i = 0; ok && i < T_ATTRS; i++) {
    found[i] = PyObject_GetAttrString(args[0], names[i]);
    PyTypeObject *kind = found[i] ? Py_TYPE(found[i]) : NULL;
    ok = kind && (i < T_FIRST_METHOD ? kind->tp_descr_get && kind->tp_descr_set : PyCallable_Check(found[i]));
  }
  if (!ok) {
    for (int i = 0; i < T_ATTRS; i++) Py_XDECREF(found[i]);
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
    PyErr_Clear();
    Py_RETURN_FALSE;
  }
  for (int i = 0; i < T_ATTRS; i++) Py_XSETREF(tensor_attr[i], found[i]);
  PyObject **bound[] = {&tensor_type, &dtype_i32, &dtype_i64};
  for (int i = 0; i < 3; i++) {
    Py_INCREF(args[i]);
    Py_XSETREF(*bound[i], args[i]);
  }
  Py_RETURN_TRUE;
}

/* A plain tensor the C build takes: exactly torch.Tensor, int32 or int64, strided, 1-D,
   stride 1, on `device` (-1: the CPU, else that CUDA device). 1 with its (address, length,
   is64) in out[], or 0 with no error set: anything else (a subclass, another device, an error
   from a getter) takes the general path, whose checks raise the precise error. The layout is
   not read: of the other layouts only a sparse COO tensor is 1-D, and its is_contiguous() and
   stride() raise (the general path's check_dense then names it). */
static int plain_tensor(PyObject *t, long device, long long *out) {
  if (!tensor_type || Py_TYPE(t) != (PyTypeObject *)tensor_type) return 0;
  PyObject *v = tensor_get(T_DTYPE, t);
  int is64 = v == dtype_i64, ok = is64 || v == dtype_i32;
  Py_XDECREF(v);
  if (ok) {
    v = tensor_get(device < 0 ? T_IS_CPU : T_IS_CUDA, t);
    ok = v == Py_True;
    Py_XDECREF(v);
  }
  if (ok && device >= 0) {
    v = tensor_call(T_GET_DEVICE, t);
    ok = v && PyLong_Check(v) && PyLong_AsLong(v) == device;
    Py_XDECREF(v);
  }
  long long length = -1;
  if (ok) {
    v = tensor_get(T_SHAPE, t);
    ok = v && PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 1 && PyLong_Check(PyTuple_GET_ITEM(v, 0));
    if (ok) length = PyLong_AsLongLong(PyTuple_GET_ITEM(v, 0));
    Py_XDECREF(v);
    ok = ok && length >= 0;
  }
  /* stride 1, as the general path's checks require: for 2+ entries that is contiguity (no
     stride tuple to make), for 0 or 1 the stride itself (contiguous whatever it is) */
  if (ok && length >= 2) {
    v = tensor_call(T_IS_CONTIGUOUS, t);
    ok = v == Py_True;
    Py_XDECREF(v);
  } else if (ok) {
    v = tensor_call(T_STRIDE, t);
    ok = v && PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 1 && PyLong_Check(PyTuple_GET_ITEM(v, 0)) &&
         PyLong_AsLongLong(PyTuple_GET_ITEM(v, 0)) == 1;
    Py_XDECREF(v);
  }
  unsigned long long address = 0;
  if (ok) {
    v = tensor_call(T_DATA_PTR, t);
    ok = v && PyLong_Check(v);
    if (ok) address = PyLong_AsUnsignedLongLong(v);
    Py_XDECREF(v);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    ok = 0;
  }
  if (!ok) return 0;
  static int32_t nothing; /* an empty array's address, host or device: never read */
  out[0] = (long long)(address ? address : (uintptr_t)&nothing);
  out[1] = length;
  out[2] = is64;
  return 1;
}

/* A step build from its tensors: t[] = (qsl, qsl_cpu, first_seq, num_seqs, computed, computed_cpu,
   checkpoints, checkpoints_cpu), each tensor checked every build (plain_tensor). -> (counts,
   facts, launched), or an int as run_step returns. table: a tuple of 8, a steps capsule (or
   None: no C build) per device dtype combination, index qsl int64 | computed int64 << 1 |
   checkpoints int64 << 2; wants: bit 0 when an entry reads num_computed_tokens, bit 1
   checkpoint_offsets (the others are ignored, and `dummy`, a device address, stands for them);
   device: the builder's CUDA device, or -1 for the CPU. launched: whether the capsule launched
   its kernel (else the caller launches the fill). */
static PyObject *tensors_step(PyObject *table, long long wants, PyObject *const *t, long long slot, long long stream,
                              long long dummy, long device) {
  long long host[3], qsl[3], rows[2][3] = {{0, 0, 0}, {0, 0, 0}}, dev[2][3];
  if (!plain_tensor(t[1], -1, host) || host[1] < 1 || !plain_tensor(t[0], device, qsl) || qsl[1] != host[1])
    return PyLong_FromLong(-1);
  long long c[4], d[8] = {qsl[0], dummy, dummy, slot, stream, qsl[2], 0, 0};
  int index = (int)qsl[2];
  for (int k = 0; k < 2; k++) { /* computed, then checkpoints */
    if (!(wants >> k & 1)) continue;
    if (!plain_tensor(t[5 + 2 * k], -1, rows[k]) || rows[k][1] != host[1] - 1 ||
        !plain_tensor(t[4 + 2 * k], device, dev[k]) || dev[k][1] != host[1] - 1)
      return PyLong_FromLong(-1);
    d[1 + k] = dev[k][0];
    d[6 + k] = dev[k][2];
    index |= (int)dev[k][2] << (1 + k);
  }
  c[0] = rows[0][0], c[1] = rows[0][2], c[2] = rows[1][0], c[3] = rows[1][2];
  PyObject *capsule = PyTuple_GET_ITEM(table, index);
  if (capsule == Py_None) return PyLong_FromLong(-1);
  Steps *st = PyCapsule_GetPointer(capsule, "chunkmeta.steps");
  if (!st) return NULL;
  return run_step(st, host, t[2], t[3], c, d, 1);
}

/* ---- a whole step build in one call ------------------------------------------------------ */
/* StepTablesBuilder.build's C build: the current device and stream, the ring's claim, the host
   side and launch (tensors_step), the result objects and the publish. As separate calls from
   Python that glue cost about 2 us of a 15.6 us build at 1024 requests on the H200's host
   (diag_launch record of 2026-12-02 08:02). A step state (make_step) holds the builder's parts
   it reads; the steps tables and the results executors stay the builder's own objects, read at
   every build. */
typedef struct {
  PyObject *tables;           /* list [exact, padded]: each tensors_step's table */
  PyObject *results;          /* dict {False: f, True: f}, f(slot, generation, counts, facts) -> StepTables */
  PyObject *ring;             /* the builder's TableRing: a SlotLedger */
  PyObject *slot_generations; /* its _slot_generation list */
  PyObject *spoiled;          /* chunkmeta.ring.SPOILED */
  PyObject *get_device, *get_stream, *device_obj; /* CUDA: torch._C's current device and raw stream */
  Py_ssize_t depth;           /* the ring's slots: slot_generations' length */
  long long wants, dummy;
  long device;
} StepState;

static PyObject *name_generation = NULL;

static void release_step_state(StepState *s) {
  PyObject *held[] = {s->tables, s->results, s->ring, s->slot_generations, s->spoiled, s->get_device,
                      s->get_stream, s->device_obj};
  for (int i = 0; i < 8; i++) Py_XDECREF(held[i]);
  PyMem_Free(s);
}

static void free_step_state(PyObject *capsule) {
  StepState *s = PyCapsule_GetPointer(capsule, "chunkmeta.step");
  if (s) release_step_state(s);
}

/* make_step(tables, results, ring, spoiled, wants, dummy, device, get_device, get_stream)
   -> capsule. tables: a list of two tables (exact, padded); results: a dict of the two
   executors; ring: a SlotLedger (its slots: its _slot_generation's length); device: a CUDA
   index, whose get_device() / get_stream(device) are torch._C._cuda_getDevice /
   _cuda_getCurrentRawStream, or -1 (the CPU: both None). */
static PyObject *py_make_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long e[3];
  if (nargs != 9 || !PyList_Check(args[0]) || PyList_GET_SIZE(args[0]) != 2 || !PyDict_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError,
                    "make_step(tables: list of 2, results: dict, ring, spoiled, wants, dummy, device, get_device, "
                    "get_stream)");
    return NULL;
  }
  if (int_args(args + 4, 3, 3, e)) return NULL;
  if (!name_generation && !(name_generation = PyUnicode_InternFromString("generation"))) return NULL;
  PyObject *slots = PyObject_GetAttrString(args[2], "_slot_generation");
  if (!slots || !PyList_Check(slots) || PyList_GET_SIZE(slots) < 1 ||
      (e[2] >= 0 && (!PyCallable_Check(args[7]) || !PyCallable_Check(args[8])))) {
    Py_XDECREF(slots);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "make_step: a ring without slots, or no getter");
    return NULL;
  }
  StepState *s = PyMem_Calloc(1, sizeof(StepState));
  if (!s) {
    Py_DECREF(slots);
    return PyErr_NoMemory();
  }
  s->tables = Py_NewRef(args[0]);
  s->results = Py_NewRef(args[1]);
  s->ring = Py_NewRef(args[2]);
  s->slot_generations = slots;
  s->spoiled = Py_NewRef(args[3]);
  s->wants = e[0], s->dummy = e[1], s->device = (long)e[2], s->depth = PyList_GET_SIZE(slots);
  if (s->device >= 0) {
    s->get_device = Py_NewRef(args[7]);
    s->get_stream = Py_NewRef(args[8]);
    s->device_obj = PyLong_FromLong(s->device);
  }
  PyObject *capsule = s->device < 0 || s->device_obj ? PyCapsule_New(s, "chunkmeta.step", free_step_state) : NULL;
  if (!capsule) release_step_state(s);
  return capsule;
}

/* The current CUDA stream of the state's device in *stream: 0, or -1 when another device is
   current (the launch would go there) or with an error set. */
static int current_stream(StepState *s, long long *stream) {
  PyObject *current = PyObject_CallNoArgs(s->get_device);
  long index = current ? PyLong_AsLong(current) : -1;
  Py_XDECREF(current);
  if (PyErr_Occurred() || index != s->device) return -1;
  PyObject *raw = PyObject_CallOneArg(s->get_stream, s->device_obj);
  *stream = raw ? PyLong_AsLongLong(raw) : -1;
  Py_XDECREF(raw);
  return PyErr_Occurred() ? -1 : 0;
}

/* step(state, qsl, qsl_cpu, first_seq, num_seqs, computed, computed_cpu, checkpoints,
        checkpoints_cpu, padded) -> the StepTables (built and published); or (slot, generation,
   counts, facts): the host side done and nothing launched (a capsule without a kernel: the
   caller launches the fill, makes the results and publishes); or an int as run_step returns
   (nothing written or published: -1, the general path; a CUresult). The claim and the publish
   are SlotLedger.claim's and .publish's (chunkmeta.ring): the next generation in slot
   generation % depth; then the slot's generation, then the ledger's. */
static PyObject *py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "step takes 10 arguments");
    return NULL;
  }
  StepState *s = PyCapsule_GetPointer(args[0], "chunkmeta.step");
  if (!s) return NULL;
  PyObject *padded = args[9];
  if (padded != Py_True && padded != Py_False) return PyLong_FromLong(-1);
  long long stream = 0;
  if (s->device >= 0 && current_stream(s, &stream)) {
    if (!PyErr_Occurred()) return PyLong_FromLong(-1);
    return NULL;
  }
  PyObject *newest = PyObject_GetAttr(s->ring, name_generation);
  long long generation = newest ? PyLong_AsLongLong(newest) + 1 : 0;
  Py_XDECREF(newest);
  if (PyErr_Occurred()) return NULL;
  long long slot = generation % s->depth;
  PyObject *table = PyList_GET_ITEM(s->tables, padded == Py_True);
  if (!PyTuple_Check(table) || PyTuple_GET_SIZE(table) != 8) {
    PyErr_SetString(PyExc_TypeError, "step: a steps table is a tuple of 8");
    return NULL;
  }
  Py_INCREF(table); /* the caller's Python may replace it while a getter runs */
  PyObject *out = tensors_step(table, s->wants, args + 1, slot, stream, s->dummy, s->device);
  Py_DECREF(table);
  if (!out || PyLong_Check(out)) return out;
  PyObject *slot_obj = PyLong_FromLongLong(slot), *generation_obj = PyLong_FromLongLong(generation);
  PyObject *made = NULL;
  if (slot_obj && generation_obj) {
    PyObject *counts = PyTuple_GET_ITEM(out, 0), *facts = PyTuple_GET_ITEM(out, 1);
    if (PyTuple_GET_ITEM(out, 2) == Py_False) {
      made = PyTuple_Pack(4, slot_obj, generation_obj, counts, facts);
    } else {
      PyObject *results = PyDict_GetItemWithError(s->results, padded); /* borrowed */
      PyObject *call[4] = {slot_obj, generation_obj, counts, facts};
      Py_XINCREF(results);
      made = results ? PyObject_Vectorcall(results, call, 4, NULL) : NULL;
      Py_XDECREF(results);
      /* published, or the slot (its kernel queued) spoiled: its last build's object is overwritten */
      if (PyList_SetItem(s->slot_generations, slot, Py_NewRef(made ? generation_obj : s->spoiled)) ||
          (made && PyObject_SetAttr(s->ring, name_generation, generation_obj)))
        Py_CLEAR(made);
    }
  }
  Py_XDECREF(slot_obj);
  Py_XDECREF(generation_obj);
  Py_DECREF(out);
  return made;
}

/* step_host(steps, wants, qsl_cpu, max_len, first_seq, num_seqs, computed_cpu, checkpoints_cpu)
   -> (counts, facts) as run_step gives them, or -1 (nothing written): graph mode's host side
   (chunkmeta.graph.StepGraphBuild.prepare), whose captured kernel reads the engine's static
   device buffers, so only the host tensors are checked. steps: a host-only capsule (no kernel)
   of one slot; wants as tensors_step's; max_len: the static query_start_loc's entries, which
   bound the batch. */
static PyObject *py_step_host(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "step_host takes 8 arguments");
    return NULL;
  }
  Steps *st = PyCapsule_GetPointer(args[0], "chunkmeta.steps");
  if (!st) return NULL;
  if (st->function || st->cpu_fill) {
    PyErr_SetString(PyExc_ValueError, "step_host takes a host-only steps capsule");
    return NULL;
  }
  long long wants, max_len;
  if (int_args(args + 1, 1, 1, &wants) || int_args(args + 3, 1, 1, &max_len)) return NULL;
  long long host[3], rows[2][3] = {{0, 0, 0}, {0, 0, 0}};
  if (!plain_tensor(args[2], -1, host) || host[1] < 1 || host[1] > max_len) return PyLong_FromLong(-1);
  for (int k = 0; k < 2; k++) /* computed, then checkpoints */
    if (wants >> k & 1 && (!plain_tensor(args[6 + k], -1, rows[k]) || rows[k][1] != host[1] - 1))
      return PyLong_FromLong(-1);
  long long c[4] = {rows[0][0], rows[0][2], rows[1][0], rows[1][2]}, d[8] = {0};
  return run_step(st, host, args[4], args[5], c, d, 0);
}

/* ---- the one-shot: its plan and host copy, then its launch, from C ------------------------ */
/* A one-shot's plan (chunkmeta.builder.build_chunk_metadata): the slice [first, first + n) of a
   host query_start_loc of `length` entries, in its widest sizes (2^16 sequences, int32 tokens
   and chunks of 2^shift). 0 with *out set, or -1: anything the general path must check. */
typedef struct {
  const void *q; /* the slice's offsets */
  int64_t first, n, start, end;
  Plan plan;
} OneShotPlan;

static int one_shot_plan(const char *host, int is64, int64_t length, PyObject *first_obj, PyObject *num_obj,
                         int shift, OneShotPlan *out) {
  long long first, n;
  int64_t requests = length - 1;
  if (shift < 0 || shift > 31 || slice_args(first_obj, num_obj, requests, &first, &n)) return -1;
  if (requests < 0 || first < 0 || first > requests || n > 65536 || first + n > requests) return -1;
  out->q = host + first * (is64 ? 8 : 4);
  out->first = first, out->n = n;
  out->start = load(out->q, is64, 0), out->end = load(out->q, is64, n);
  if (out->start < 0 || out->end < out->start || out->end - out->start > 2147483647LL - (1LL << shift)) return -1;
  out->plan = plan_any(out->q, is64, n, shift);
  return out->plan.bad || out->plan.chunks > (2147483647LL >> shift) ? -1 : 0;
}

/* oneshot_plan(host, length, is64, first_seq, num_seqs, shift, cu_host, cu_len) -> (n, tokens,
   chunks, longest) with the host cu_seqlens written at cu_host (cu_len == n + 1), or -1: the
   plan alone, which CPU tests check against chunkmeta.plan. */
static PyObject *py_oneshot_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "oneshot_plan takes 8 arguments");
    return NULL;
  }
  long long a[3], b[3];
  if (int_args(args, 3, 3, a) || int_args(args + 5, 3, 3, b)) return NULL;
  OneShotPlan p;
  if (b[0] < 0 || b[0] > 31 ||
      one_shot_plan((const char *)(uintptr_t)a[0], (int)a[2], a[1], args[3], args[4], (int)b[0], &p) ||
      b[2] != p.n + 1)
    return PyLong_FromLong(-1);
  host_cu_seqlens((int32_t *)(uintptr_t)b[1], p.q, (int)a[2], p.n, p.start, p.n);
  return Py_BuildValue("(LLLL)", (long long)p.n, (long long)(p.end - p.start), (long long)p.plan.chunks,
                       (long long)p.plan.longest);
}

/* The data_ptr() of each of n tensors into out; 0, or -1 with an error. */
static int data_pointers(PyObject *const *tensors, int n, uint64_t *out) {
  for (int i = 0; i < n; i++) {
    PyObject *v = tensor_call(T_DATA_PTR, tensors[i]);
    out[i] = v ? (uint64_t)PyLong_AsUnsignedLongLong(v) : 0;
    Py_XDECREF(v);
    if (PyErr_Occurred()) return -1;
  }
  return 0;
}

/* oneshot(fills, arena, qsl, qsl_cpu, first_seq, num_seqs, chunk_size, indices_dtype, device,
           stream) -> ChunkMetadata, or an int: -1 for anything the general path must take
   (nothing written or launched), or the CUresult of a failed launch (its fill is then set to
   None in `fills`). The one-shot's whole host side on CUDA in one call: the tensors' checks, the
   plan, its outputs from the arena (chunkmeta.arena: `arena.take(n, nt)`), the host copy, the
   launch of the fill compiled for it (fills: chunkmeta.builder._ONE_SHOT_C, keyed (chunk_size,
   lanes, indices_dtype, qsl dtype)) and the result. */
static PyObject *py_oneshot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 10 || !PyDict_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "oneshot(fills: dict, arena, qsl, qsl_cpu, first_seq, num_seqs, chunk_size, "
                                     "indices_dtype, device, stream)");
    return NULL;
  }
  if (!PyLong_CheckExact(args[6])) return PyLong_FromLong(-1); /* a chunk_size of another type */
  if (!metadata_type) {
    PyErr_SetString(PyExc_RuntimeError, "set_metadata_class was not called");
    return NULL;
  }
  long long chunk_size = PyLong_AsLongLong(args[6]), e[2];
  if (chunk_size == -1 && PyErr_Occurred()) PyErr_Clear();
  if (int_args(args + 8, 2, 2, e)) return NULL;
  long long host[3], qsl[3];
  if (chunk_size < 1 || chunk_size > (1LL << 31) || (chunk_size & (chunk_size - 1)) || e[0] < 0 ||
      !plain_tensor(args[3], -1, host) || host[1] < 1 || !plain_tensor(args[2], (long)e[0], qsl) || qsl[1] != host[1])
    return PyLong_FromLong(-1);
  int shift = 0;
  while ((1LL << shift) < chunk_size) shift++;
  OneShotPlan p;
  if (one_shot_plan((const char *)(uintptr_t)host[0], (int)host[2], host[1], args[4], args[5], shift, &p))
    return PyLong_FromLong(-1);
  long long lanes = 16; /* chunkmeta.builder._one_shot_key's bucket */
  while (lanes < p.n) lanes <<= 1;
  PyObject *key = Py_BuildValue("(LLOO)", chunk_size, lanes, args[7], qsl[2] ? dtype_i64 : dtype_i32);
  /* held: arena.take runs Python, and another thread may replace the dict's entry meanwhile */
  PyObject *fill = key ? PyDict_GetItemWithError(args[0], key) : NULL;
  Py_XINCREF(fill);
  Fill *f = fill && PyCapsule_CheckExact(fill) ? PyCapsule_GetPointer(fill, "chunkmeta.fill") : NULL;
  if (!f || !f->function) { /* no fill compiled for it yet, or none that launches from C */
    Py_XDECREF(fill);
    Py_XDECREF(key);
    return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
  }
  static PyObject *take = NULL;
  PyObject *n_obj = PyLong_FromLongLong(p.n), *nt_obj = PyLong_FromLongLong(p.plan.chunks), *outputs = NULL;
  if (n_obj && nt_obj && (take || (take = PyUnicode_InternFromString("take"))))
    outputs = PyObject_CallMethodObjArgs(args[1], take, n_obj, nt_obj, NULL);
  /* outputs: (chunk_offsets, cu_seqlens, chunk_indices, cu_seqlens_cpu), fresh */
  uint64_t at[4];
  if (!outputs || !PyTuple_Check(outputs) || PyTuple_GET_SIZE(outputs) != 4 ||
      data_pointers(&PyTuple_GET_ITEM(outputs, 0), 4, at)) {
    if (outputs && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "arena.take must return 4 tensors");
    Py_XDECREF(outputs);
    outputs = NULL;
  }
  PyObject *md = NULL;
  if (outputs) {
    uint64_t ptrs[5] = {(uint64_t)qsl[0], (uint64_t)qsl[0], at[1], at[2], at[0]};
    int32_t scalars[5] = {(int32_t)p.first, (int32_t)p.n, (int32_t)p.plan.chunks, (int32_t)p.n, 0};
    int err = launch_fill_kernel(f, ptrs, scalars, p.plan.chunks, (void *)(uintptr_t)e[1]);
    if (err) { /* this fill does not launch from C: not retried every call */
      md = PyDict_SetItem(args[0], key, Py_None) ? NULL : PyLong_FromLong(err);
    } else {
      host_cu_seqlens((int32_t *)(uintptr_t)at[3], p.q, (int)host[2], p.n, p.start, p.n);
      PyObject *ints[3] = {PyLong_FromLongLong(p.end - p.start), PyLong_FromLongLong(p.plan.longest),
                           PyLong_FromLong(0)};
      if (ints[0] && ints[1] && ints[2]) {
        PyObject *values[NUM_FIELDS] = {PyTuple_GET_ITEM(outputs, 1), PyTuple_GET_ITEM(outputs, 3),
                                        PyTuple_GET_ITEM(outputs, 2), PyTuple_GET_ITEM(outputs, 0),
                                        args[6], n_obj, ints[0], nt_obj, ints[1], Py_None, ints[2], Py_None, ints[2]};
        md = new_metadata(values);
      }
      for (int i = 0; i < 3; i++) Py_XDECREF(ints[i]);
    }
  }
  Py_XDECREF(outputs);
  Py_XDECREF(n_obj);
  Py_XDECREF(nt_obj);
  Py_DECREF(fill);
  Py_DECREF(key);
  return md;
}

static PyMethodDef methods[] = {
    {"plan", (PyCFunction)(void (*)(void))py_plan, METH_FASTCALL, "the host plan of a prefill slice"},
    {"bind_cuda", py_bind_cuda, METH_NOARGS, "find the driver's launch entry points"},
    {"make_fill", (PyCFunction)(void (*)(void))py_make_fill, METH_FASTCALL, "a builder's launch constants"},
    {"build", (PyCFunction)(void (*)(void))py_build, METH_FASTCALL, "one build's host side"},
    {"oneshot_plan", (PyCFunction)(void (*)(void))py_oneshot_plan, METH_FASTCALL, "a one-shot's plan and host copy"},
    {"oneshot", (PyCFunction)(void (*)(void))py_oneshot, METH_FASTCALL, "a one-shot build on CUDA"},
    {"make_steps", (PyCFunction)(void (*)(void))py_make_steps, METH_FASTCALL, "a step builder's launch constants"},
    {"step_host", (PyCFunction)(void (*)(void))py_step_host, METH_FASTCALL, "graph mode's host side of a step"},
    {"make_step", (PyCFunction)(void (*)(void))py_make_step, METH_FASTCALL, "a step builder's C build state"},
    {"step", (PyCFunction)(void (*)(void))py_step, METH_FASTCALL, "a whole step build"},
    {"set_tensor_types", (PyCFunction)(void (*)(void))py_set_tensor_types, METH_FASTCALL, "bind torch's classes"},
    {"make_results", (PyCFunction)(void (*)(void))py_make_results, METH_FASTCALL, "a step's result recipe"},
    {"results", (PyCFunction)(void (*)(void))py_results, METH_FASTCALL, "one step build's result objects"},
    {"set_metadata_class", (PyCFunction)(void (*)(void))py_set_metadata_class, METH_FASTCALL,
     "the class build() returns"},
    {NULL, NULL, 0, NULL}};

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)
#define PASTE_(a, b) a##b
#define PASTE(a, b) PASTE_(a, b)

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, STRINGIFY(MODULE_NAME), NULL, -1, methods};

PyMODINIT_FUNC PASTE(PyInit_, MODULE_NAME)(void) { return PyModule_Create(&module); }
