/* What crosses the host build's files (host_build.c lists them and their jobs): the functions and
   tables one file defines and another uses; everything else stays static to its file. Every file
   includes this first, so that Python.h comes before any system header (it sets feature macros).
   chunkmeta.jit compiles each file alone and links them into one extension with
   -fvisibility=hidden: none of these names is exported (only PyInit_, which PyMODINIT_FUNC marks),
   so none can be interposed by another library's symbol of the same name. */
#ifndef CHUNKMETA_HOST_BUILD_H
#define CHUNKMETA_HOST_BUILD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* ---- host_plan.c: the plan passes, the host copy, the arguments ---------------------------- */
typedef struct {
  int64_t chunks, longest, bad;
} Plan;
typedef struct {
  int bad, any;
} RowFlags;

static inline int64_t load(const void *q, int is64, int64_t i) {
  return is64 ? ((const int64_t *)q)[i] : (int64_t)((const int32_t *)q)[i];
}

Plan plan_any(const void *q, int is64, int64_t n, int shift);
int64_t chunks_any(const void *q, int is64, int64_t n, int shift);

/* the typed per-row passes, indexed by their arrays' int64 bits (the first array's highest) */
typedef RowFlags (*RowFlagsPass)(const void *, const void *, int64_t, int64_t, int64_t);
extern const RowFlagsPass computed_rows[4];
extern const RowFlagsPass checkpoint_rows[4];
extern int64_t (*const positioned_chunks[4])(const void *, const void *, int64_t, int);
extern int64_t (*const split_chunks[8])(const void *, const void *, const void *, int64_t, int);
extern int64_t (*const packed_chunks[2])(const void *, int64_t, int);

void host_cu_seqlens(int32_t *out, const void *q, int is64, int64_t n, int64_t start, int64_t seqs_out);
int slice_args(PyObject *first_obj, PyObject *num_obj, int64_t requests, long long *first, long long *n);
int int_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out);

/* ---- host_build.c: the driver's launch entry points, slots objects, tensors ----------------- */
#define MAX_SLOTS 64
#define MAX_TRAILING 4 /* scratch pointers Triton appends */

typedef int (*LaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                            void **, void **);
extern LaunchKernel launch_kernel; /* cuLaunchKernel once bind_cuda() found it, else NULL */
int param_layout(void *function, size_t pointers, size_t count);
PyObject *new_object(PyTypeObject *cls, PyObject *const *descriptors, PyObject *const *values, int n);

/* torch.Tensor's attributes a build reads of its tensors, bound once (set_tensor_types): the
   descriptors themselves, called directly. Through the attribute lookup each read also paid a
   type lookup and, for a method, a bound call: a step build reads 5 attributes of each host
   input tensor and 6 of each device one, and makes a fresh alias of each FLA cu_seqlens (.data),
   every build. */
enum { T_DTYPE, T_IS_CPU, T_IS_CUDA, T_SHAPE, T_DATA, T_GET_DEVICE, T_IS_CONTIGUOUS, T_STRIDE, T_DATA_PTR, T_ATTRS };
#define T_FIRST_METHOD T_GET_DEVICE /* the getters (data descriptors), then the methods */
extern PyObject *tensor_attr[T_ATTRS];
extern PyObject *dtype_i32, *dtype_i64; /* torch.int32, torch.int64 */

/* t.<attribute> of a torch.Tensor t (a getter): new reference, or NULL with an error. */
static inline PyObject *tensor_get(int which, PyObject *t) {
  PyObject *descriptor = tensor_attr[which];
  return Py_TYPE(descriptor)->tp_descr_get(descriptor, t, (PyObject *)Py_TYPE(t));
}

/* t.<method>() of a torch.Tensor t: new reference, or NULL with an error. */
static inline PyObject *tensor_call(int which, PyObject *t) {
  return PyObject_Vectorcall(tensor_attr[which], &t, 1, NULL);
}

/* A new tensor object over the same memory as `view` (new reference), or NULL with an error:
   what FLA's identity-memoized helpers need of each build's cu_seqlens. `.data` makes it without
   the dispatcher, in about half the host time of a detach(); the alias is only read, so the
   version counter it does not share is never consulted. */
static inline PyObject *fresh_alias(PyObject *view) { return tensor_get(T_DATA, view); }

int plain_tensor(PyObject *t, long device, long long *out);

/* ---- host_step.c: a step build's constants, plan and launch (the one-shot's too) ---------- */
/* A steps capsule (make_steps, "chunkmeta.steps") holds what never changes: the kernel
   (step_tables_kernel, or 0: no launch), or for a CPU builder the CPU fill (cpu_fill_entry), its
   launch shape, each slot's arena and host cu_seqlens buffers, and the entries (kind, shift,
   slice, base, flag, rows_pad, seqs_pad, the four region offsets, pad0, pad1). */
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

/* a planned step: its slices, flags and every entry's rows (counts: the exact layout's) */
typedef struct {
  const char *host;
  const void *q;
  int is64, prep, any_checkpoint;
  int64_t first, n, requests, start, end, batch_start, batch_end, longest, batch_longest;
  int64_t counts[MAX_ENTRIES], rows[MAX_ENTRIES];
} StepPlan;

int step_plan(const Steps *st, const long long *a, PyObject *first_obj, PyObject *num_obj, const long long *c,
              StepPlan *p);
int step_launch(const Steps *st, const StepPlan *p, const long long *d, uint64_t arena, int32_t *const *cu_hosts);

/* ---- the module's methods (host_build.c's table), defined by its parts ---------------------- */
/* host_plan.c */
PyObject *py_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* host_one_shot.c */
PyObject *py_set_metadata_class(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_oneshot(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* host_step.c */
PyObject *py_make_steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_make_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_step_host(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* host_results.c */
PyObject *py_make_results(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_results(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
