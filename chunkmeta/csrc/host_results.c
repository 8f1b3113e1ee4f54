/* The host build's result objects (host_build.c lists the host build's files): make_results()
   compiles a chunkmeta.results recipe, results() makes a step build's objects from it (the step
   build, host_step.c, calls it through the builder's results executors). */
#include "host_build.h"

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
PyObject *py_make_results(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
  /* results() makes its tables the top object's __dict__; with no outputs the top object is the
     one table (a single-table builder's) */
  if (r->outputs && !top->cls->tp_dictoffset) {
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

/* results(capsule, slot, generation, counts, facts) -> StepTables, or with no outputs the top
   object alone (a single-table builder's table). counts / facts: tuples (a
   NamedTuple is one) at least as long as the recipe reads. */
PyObject *py_results(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
  if (!r->outputs) return make_output(r, &r->out[0], args[1], k, args[2], sources, NULL);
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
