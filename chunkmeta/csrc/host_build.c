/* chunkmeta's host build: a CPython extension compiled on first use by chunkmeta.jit (for
   chunkmeta.native) into $CHUNKMETA_CACHE_DIR, from this file and its parts (chunkmeta.native's
   SOURCES; host_build.h declares what crosses them). Their jobs:
   - host_plan.c: plan(), one pass over a prefill slice of the host query_start_loc (sizes and the
     first bad index), for chunkmeta.plan, and the passes and argument parsing the builds share;
   - host_one_shot.c: oneshot(), the one-shot's (chunkmeta.one_shot.build_chunk_metadata) whole
     host side, into views of chunkmeta.arena, through the step build's plan and launch;
   - host_step.c: make_steps() / make_step() / step(): a step builder's whole host side of a build
     (chunkmeta.step_builder) in one call, from its input tensors, with the ring's claim and publish;
     step_host(): graph mode's host side of a step (chunkmeta.graph);
   - host_results.c: the step build's result objects (make_results() / results(): from a recipe,
     chunkmeta.results);
   - this file: the module (its method table), and what the parts share: the CUDA driver's launch
     entry points (bind_cuda()), slots objects, torch.Tensor's attributes and the tensor checks
     (set_tensor_types()).
   MODULE_NAME (-D) is the extension's module name: the cache key is part of it, so extensions of
   different sources never collide in one process. */
#ifndef MODULE_NAME
#error "host_build.c: compile with -DMODULE_NAME=<the extension's module name>"
#endif
#include "host_build.h"
#include <dlfcn.h>

/* ---- the CUDA driver's launch entry points ------------------------------------------------ */
typedef int (*FuncGetParamInfo)(void *, size_t, size_t *, size_t *);
LaunchKernel launch_kernel = NULL;
static FuncGetParamInfo param_info = NULL;

/* The number of trailing scratch pointers of a kernel whose parameters are `pointers` 8-byte
   pointers, then int32 scalars up to `count`, then at most MAX_TRAILING 8-byte scratch pointers
   (cuFuncGetParamInfo); -1 for any other layout or without the driver's entry points. 0 for no
   kernel (function 0: a host side that launches nothing). */
int param_layout(void *function, size_t pointers, size_t count) {
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

/* ---- objects of slots classes, made here ------------------------------------------------ */
/* An instance of a slots class with its n slots set through their member descriptors (new
   reference), or NULL with an error. values[] are borrowed. */
PyObject *new_object(PyTypeObject *cls, PyObject *const *descriptors, PyObject *const *values, int n) {
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

/* ---- torch.Tensor's attributes, bound once, and the tensor checks ------------------------ */
PyObject *tensor_attr[T_ATTRS]; /* host_build.h says why */

/* An engine passes new tensor objects every step (views of its persistent buffers), so a
   build checks its input tensors every time; in Python those checks (a dozen attribute reads
   and method calls per tensor) cost more than the rest of the host side. Here they are the
   same reads through the C API. set_tensor_types binds the classes they compare against. */
static PyObject *tensor_type = NULL;
PyObject *dtype_i32 = NULL, *dtype_i64 = NULL;

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
int plain_tensor(PyObject *t, long device, long long *out) {
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

static PyMethodDef methods[] = {
    {"plan", (PyCFunction)(void (*)(void))py_plan, METH_FASTCALL, "the host plan of a prefill slice"},
    {"bind_cuda", py_bind_cuda, METH_NOARGS, "find the driver's launch entry points"},
    {"oneshot", (PyCFunction)(void (*)(void))py_oneshot, METH_FASTCALL, "a one-shot build"},
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
