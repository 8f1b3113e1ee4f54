/* The host build's one-table builds (host_build.c lists the host build's files), in a file of
   their own: the step build (host_step.c) uses nothing of it.
   - make_fill() / build(): a CUDA builder's whole host side of a build in one call: validation,
     the ChunkMetadata it returns, the cuLaunchKernel of the fill (the CUDA C fill of
     chunk_fill.cu, or the Triton kernel) and the host cu_seqlens copy;
   - oneshot(): the one-shot's (chunkmeta.builder.build_chunk_metadata) on CUDA, into views of
     chunkmeta.arena; oneshot_plan(): its plan alone.
   set_metadata_class() binds the ChunkMetadata class that build() and oneshot() return. */
#include "host_build.h"

/* ---- the launch: cuLaunchKernel on a Triton-compiled kernel ------------------------------ */
#define NUM_ARGS 10 /* qsl, params, cu, indices, offsets (8 B); 5 int32 scalars */

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

/* make_fill(function, block_rows, num_warps, shared, shift, cap_seqs, cap_tokens, cap_rows,
             seqs_out, rows_out, pad_seq, params, slots, padding) -> capsule, or None if the
   kernel's parameters are not the layout this file packs. slots: sequence of (cu, indices,
   offsets, cu_host address); padding: the layout's ChunkMetadata.padding. function 0 makes a
   fill that launches nothing: the host side alone, which is how CPU tests check the C checks
   and host copy against the Python plan. */
PyObject *py_make_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *py_set_metadata_class(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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

/* A ChunkMetadata with its fields set (new reference), or NULL with an error. values[] are
   borrowed. */
static PyObject *new_metadata(PyObject *const *values) {
  return new_object(metadata_type, metadata_fields, values, NUM_FIELDS);
}

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
PyObject *py_build(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *py_oneshot_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *py_oneshot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
