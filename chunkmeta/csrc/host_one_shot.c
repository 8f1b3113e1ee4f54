/* The host build's one-shot (host_build.c lists the host build's files): oneshot(), the whole
   host side of chunkmeta.one_shot.build_chunk_metadata once a build of its key made a steps
   capsule: the tensors' checks, the step build's plan and launch (host_step.c) of the one FLA
   entry the one-shot writes, into a region of chunkmeta.arena sized to the batch, the host copy
   and the ChunkMetadata. set_metadata_class() binds that class. */
#include "host_build.h"

#include "step_chunks.h"

/* ---- the result: a ChunkMetadata made here ------------------------------------------------ */
/* The one-shot's own views and sizes need none of ChunkMetadata's constructor checks, and its
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

/* The data_ptr() of a tensor into *out; 0, or -1 with an error. */
static int data_pointer(PyObject *tensor, uint64_t *out) {
  PyObject *v = tensor_call(T_DATA_PTR, tensor);
  *out = v ? (uint64_t)PyLong_AsUnsignedLongLong(v) : 0;
  Py_XDECREF(v);
  return PyErr_Occurred() ? -1 : 0;
}

/* oneshot(kernels, arena, qsl, qsl_cpu, first_seq, num_seqs, chunk_size, indices_dtype, device,
           stream) -> ChunkMetadata, or an int: -1 for anything the general path must take
   (nothing written or launched), or the CUresult of a failed launch (its key is then set to
   None in `kernels`). kernels: chunkmeta.one_shot._C[backend], steps capsules keyed (chunk_size,
   lanes, indices_dtype, qsl dtype, device); device: the current CUDA device, or -1 for CPU
   tensors (stream 0). The region comes from arena.take(n, nt, offsets_at, indices_at, indices64):
   (chunk_offsets, cu_seqlens, chunk_indices, cu_seqlens_cpu), the launch's arena at cu_seqlens. */
PyObject *py_oneshot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 10 || !PyDict_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "oneshot(kernels: dict, arena, qsl, qsl_cpu, first_seq, num_seqs, chunk_size, "
                                     "indices_dtype, device, stream)");
    return NULL;
  }
  if (!PyLong_CheckExact(args[6])) return PyLong_FromLong(-1); /* a chunk_size of another type */
  if (!metadata_type) {
    PyErr_SetString(PyExc_RuntimeError, "set_metadata_class was not called");
    return NULL;
  }
  long long e[2], host[3], qsl[3], first, n;
  if (int_args(args + 8, 2, 2, e)) return NULL;
  if (!plain_tensor(args[3], -1, host) || host[1] < 1 || !plain_tensor(args[2], (long)e[0], qsl) ||
      qsl[1] != host[1] || slice_args(args[4], args[5], host[1] - 1, &first, &n) || n > 65536)
    return PyLong_FromLong(-1);
  long long lanes = 16; /* chunkmeta.one_shot._lanes's bucket */
  while (lanes < n) lanes <<= 1;
  PyObject *key = Py_BuildValue("(OLOOL)", args[6], lanes, args[7], qsl[2] ? dtype_i64 : dtype_i32, e[0]);
  /* held: arena.take runs Python, and another thread may replace the dict's entry meanwhile */
  PyObject *capsule = key ? PyDict_GetItemWithError(args[0], key) : NULL;
  Py_XINCREF(capsule);
  const Steps *st = capsule && PyCapsule_CheckExact(capsule) ? PyCapsule_GetPointer(capsule, "chunkmeta.steps") : NULL;
  StepPlan p;
  long long c[4] = {0};
  /* the plan's widest rows (chunkmeta.one_shot._widest): INT32_MAX / chunk_size */
  if (!st || step_plan(st, host, args[4], args[5], c, &p) || p.counts[0] > (2147483647LL >> st->shift[0])) {
    Py_XDECREF(capsule);
    Py_XDECREF(key);
    return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
  }
  static PyObject *take = NULL;
  PyObject *n_obj = PyLong_FromLongLong(p.n), *nt_obj = PyLong_FromLongLong(p.counts[0]), *outputs = NULL;
  PyObject *where[2] = {PyLong_FromLongLong(st->off[0][2]), PyLong_FromLongLong(st->off[0][1])};
  if (n_obj && nt_obj && where[0] && where[1] && (take || (take = PyUnicode_InternFromString("take")))) {
    /* vectorcall: no argument tuple (this call is most of a one-shot's host time) */
    PyObject *call[6] = {args[1], n_obj, nt_obj, where[0], where[1], st->flag[0] & FLA_INDICES_64 ? Py_True : Py_False};
    outputs = PyObject_VectorcallMethod(take, call, 6, NULL);
  }
  Py_XDECREF(where[0]);
  Py_XDECREF(where[1]);
  /* the launch's arena is the region at cu_seqlens (the tables' offsets are the entry's), and
     the host copy goes to cu_seqlens_cpu: two data_ptr() calls, each a call into torch (the
     other two outputs are arena.take's views too, chunkmeta.arena: not called, not checked) */
  uint64_t region = 0, cu_cpu = 0;
  if (!outputs || !PyTuple_Check(outputs) || PyTuple_GET_SIZE(outputs) != 4 ||
      data_pointer(PyTuple_GET_ITEM(outputs, 1), &region) || data_pointer(PyTuple_GET_ITEM(outputs, 3), &cu_cpu)) {
    if (outputs && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "arena.take must return 4 tensors");
    Py_XDECREF(outputs);
    outputs = NULL;
  }
  PyObject *md = NULL;
  if (outputs) {
    const long long d[7] = {qsl[0], qsl[0], qsl[0], e[1], qsl[2], qsl[2], qsl[2]};
    int32_t *cu_hosts[1] = {(int32_t *)(uintptr_t)cu_cpu};
    int err = step_launch(st, &p, d, region, cu_hosts);
    if (err) { /* this capsule does not launch from C: not retried every call */
      md = PyDict_SetItem(args[0], key, Py_None) ? NULL : PyLong_FromLong(err);
    } else {
      PyObject *ints[3] = {PyLong_FromLongLong(p.end - p.start), PyLong_FromLongLong(p.longest), PyLong_FromLong(0)};
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
  Py_DECREF(capsule);
  Py_DECREF(key);
  return md;
}
