/* The host build's step build (host_build.c lists the host build's files): make_steps() /
   make_step() / step(), a step builder's tables (chunkmeta.step_builder) from its input tensors,
   with the ring's claim and publish, the launch of the step kernel (step_fill.cu, or Triton's) or
   the serial CPU fill, and the result objects (host_results.c); step_host(): graph mode's host
   side of a step (chunkmeta.graph). */
#include "host_build.h"

#include "step_chunks.h"

/* ---- a step build: every table's sizes and checks, host copies and one launch ----------- */
/* The host side of chunkmeta.step_builder.StepTablesBuilder.build for accepted tensors. A steps
   capsule (make_steps) holds what never changes: the kernel (step_tables_kernel, or 0: no
   launch), or for a CPU builder the CPU fill (cpu_fill_entry), its launch shape, each slot's
   arena and host cu_seqlens buffers, and the entries (kind, shift, slice, base, flag, rows_pad,
   seqs_pad, the four region offsets, pad0, pad1). */
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
PyObject *py_make_steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
   cpu_fill_entry counts each sequence's rows with it. */
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
   request's (indexed first + s); is64 flags: their element types. Input validated by step_plan. */
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
  /* a seqs_pad below 0: a bounded build's FLA entry (padded rows, the slice's own sequences) */
  const int64_t seqs_out = st->padded && st->seqs_pad[j] >= 0 ? st->seqs_pad[j] : n;
  const int64_t pad0 = st->pad0[j], pad1 = st->pad1[j];
  if (kind == FLA && (flag & FLA_WRITE_FIRST)) { /* fresh outputs: entry 0 too */
    ((int32_t *)r0)[0] = 0;
    if (flag & FLA_OFFSETS_64)
      ((int64_t *)r2)[0] = 0;
    else
      ((int32_t *)r2)[0] = 0;
  }
  for (int64_t s = 0; s < seqs_out; s++) { /* the per-sequence tables */
    const int real = s < n;
    const int64_t end = real ? ends[s] : num_chunks;
    if (kind == FLA) {
      ((int32_t *)r0)[1 + s] = (int32_t)(real ? load(q, q64, s + 1) - base : num_tokens);
      if (flag & FLA_OFFSETS_64)
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
    if (kind == FLA && (flag & FLA_INDICES_64)) { /* int64 (seq, chunk) pairs */
      int64_t *pair = (int64_t *)r1 + 2 * r;
      pair[0] = real ? seq : pad0;
      pair[1] = real ? chunk : pad1;
    } else if (kind == FLA || (kind == CONV && flag)) { /* int32 (seq, chunk) pairs */
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

/* One step build's plan (step_plan): a[] = (host, host_len, is64), c[] = (computed,
   computed_is64, checkpoints, checkpoints_is64): host addresses of R entries, 0 when no entry
   reads them. 0 with *p set, or -1: input the general path must check (nothing written).
   Validates exactly what the Python plan checks of the values. */
int step_plan(const Steps *st, const long long *a, PyObject *first_obj, PyObject *num_obj, const long long *c,
              StepPlan *p) {
  long long first, n;
  if (slice_args(first_obj, num_obj, a[1] - 1, &first, &n)) return -1;
  const char *host = (const char *)(uintptr_t)a[0];
  int is64 = (int)a[2];
  int64_t requests = a[1] - 1;
  if (requests < 0 || first < 0 || first > requests || n > st->cap_seqs || first + n > requests) return -1;
  int needs_batch = 0;
  for (int j = 0; j < st->entries; j++) needs_batch |= st->slice[j] == 1;
  if (needs_batch && requests > st->cap_seqs) return -1;
  /* the slices: offsets >= 0, non-decreasing, within the token capacity */
  const void *q = host + first * (is64 ? 8 : 4);
  int64_t start = load(q, is64, 0), end = load(q, is64, n);
  if (start < 0 || end < start || end - start > st->cap_tokens) return -1;
  Plan slice = plan_any(q, is64, n, -1); /* its checks and longest row; each entry counts its own chunks */
  if (slice.bad) return -1;
  Plan batch = {0, 0, 0};
  int64_t batch_start = 0, batch_end = 0;
  if (needs_batch) {
    batch_start = load(host, is64, 0), batch_end = load(host, is64, requests);
    if (batch_start < 0 || batch_end < batch_start || batch_end - batch_start > st->cap_tokens) return -1;
    /* a batch that is the slice (a prefill-only step) was planned above */
    batch = first == 0 && n == requests ? slice : plan_any(host, is64, requests, -1);
    if (batch.bad) return -1;
  }
  /* per-row inputs of the slice: computed >= 0 with c + len <= INT32_MAX, 0 <= checkpoint <= len
     (every request's entry is >= 0: the Python plan checks the whole array) */
  const char *computed = (const char *)(uintptr_t)c[0], *checkpoints = (const char *)(uintptr_t)c[2];
  int prep = 0, any_checkpoint = 0;
  if (computed) {
    RowFlags flags = computed_rows[is64 << 1 | (int)c[1]](q, computed, requests, first, n);
    if (flags.bad) return -1;
    prep = flags.any;
  }
  if (checkpoints) {
    RowFlags flags = checkpoint_rows[is64 << 1 | (int)c[3]](q, checkpoints, requests, first, n);
    if (flags.bad) return -1;
    any_checkpoint = flags.any;
  }
  /* the rows of every entry; rows_q / rows_n: each entry's slice, for the counts entries share */
  const void *rows_q[MAX_ENTRIES];
  int64_t rows_n[MAX_ENTRIES];
  for (int j = 0; j < st->entries; j++) {
    int whole = st->slice[j] == 1;
    const void *sq = rows_q[j] = whole ? (const void *)host : q;
    int64_t sn = rows_n[j] = whole ? requests : n;
    if (st->kind[j] == TOKENS) {
      p->counts[j] = whole ? batch_end - batch_start : end - start;
    } else if (st->base[j] == 0) { /* a slice planned above: its offsets do not decrease */
      /* an earlier entry's count over the same rows at the same chunk size (the FLA tables of
         the prefill rows and of the batch are one pass in a prefill-only step) */
      int same = -1;
      for (int k = 0; k < j && same < 0; k++)
        if (st->base[k] == 0 && st->kind[k] != TOKENS && st->shift[k] == st->shift[j] && rows_q[k] == sq &&
            rows_n[k] == sn)
          same = k;
      p->counts[j] = same >= 0 ? p->counts[same] : chunks_any(sq, is64, sn, st->shift[j]);
    } else {
      const char *rows_computed = computed ? computed + (whole ? 0 : first) * (c[1] ? 8 : 4) : NULL;
      const char *rows_checkpoints = checkpoints ? checkpoints + (whole ? 0 : first) * (c[3] ? 8 : 4) : NULL;
      int split = st->kind[j] == MAMBA2 && st->flag[j] && rows_checkpoints;
      if (st->base[j] == 2 && !rows_computed) return -1;
      if (st->base[j] == 1) /* SGLang's logical chunks, at packed positions */
        p->counts[j] = packed_chunks[is64](sq, sn, st->shift[j]);
      else if (split) /* Mamba2's chunks at absolute positions, cut at checkpoints */
        p->counts[j] = split_chunks[is64 << 2 | (int)c[1] << 1 | (int)c[3]](sq, rows_computed, rows_checkpoints, sn,
                                                                             st->shift[j]);
      else /* the same without checkpoints */
        p->counts[j] = positioned_chunks[is64 << 1 | (int)c[1]](sq, rows_computed, sn, st->shift[j]);
    }
    p->rows[j] = st->padded ? st->rows_pad[j] : p->counts[j];
  }
  p->host = host, p->q = q, p->is64 = is64;
  p->first = first, p->n = n, p->requests = requests;
  p->start = start, p->end = end, p->batch_start = batch_start, p->batch_end = batch_end;
  p->longest = slice.longest, p->batch_longest = batch.longest;
  p->prep = prep, p->any_checkpoint = any_checkpoint;
  return 0;
}

/* A planned step's launch into `arena` (st's kernel, or its CPU fill), then the FLA entries' host
   cu_seqlens into cu_hosts[j]: d[] = (qsl_dev, computed_dev, checkpoints_dev, stream, and those
   three tensors' is64 flags, which the CPU fill reads). 0, or the CUresult of a failed launch
   (then no host copy is written). */
int step_launch(const Steps *st, const StepPlan *p, const long long *d, uint64_t arena, int32_t *const *cu_hosts) {
  /* an exact layout with no row and no sequence to write (an empty prefill of FLA tables) launches
     nothing: entry 0 of cu_seqlens / chunk_offsets is already 0, unless fresh outputs need it */
  int writes = st->padded;
  for (int j = 0; j < st->entries; j++)
    writes |= p->rows[j] > 0 || (st->slice[j] == 1 ? p->requests : p->n) > 0 ||
              (st->kind[j] == FLA && (st->flag[j] & FLA_WRITE_FIRST));
  if (writes && st->function) {
    uint64_t ptrs[5] = {(uint64_t)d[0], (uint64_t)d[1], (uint64_t)d[2], arena, (uint64_t)d[0]};
    int32_t scalars[9] = {(int32_t)p->first, (int32_t)p->n, (int32_t)p->requests, 0, 0, 0, 0, 0, 0};
    unsigned grid = 0; /* entries' program ranges as the kernel computes them */
    for (int j = 0; j < st->entries; j++) {
      scalars[3 + j] = (int32_t)p->rows[j];
      int64_t programs = (p->rows[j] + st->block_rows - 1) / st->block_rows;
      grid += (unsigned)(programs > 0 ? programs : 1);
    }
    uint64_t scratch[MAX_TRAILING] = {0};
    void *params[STEP_ARGS + MAX_TRAILING];
    for (int i = 0; i < 5; i++) params[i] = &ptrs[i];
    for (int i = 0; i < 9; i++) params[5 + i] = &scalars[i];
    for (int i = 0; i < st->trailing; i++) params[STEP_ARGS + i] = &scratch[i];
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = launch_kernel(st->function, grid, 1, 1, st->threads, 1, 1, st->shared, (void *)(uintptr_t)d[3], params,
                        NULL);
    Py_END_ALLOW_THREADS
    if (err) return err;
  } else if (writes && st->cpu_fill) {
    for (int j = 0; j < st->entries; j++) {
      int whole = st->slice[j] == 1;
      int64_t sfirst = whole ? 0 : p->first, sn = whole ? p->requests : p->n;
      const char *sq = (const char *)(uintptr_t)d[0] + sfirst * (d[4] ? 8 : 4);
      cpu_fill_entry(st, j, (char *)(uintptr_t)arena, sq, (int)d[4], (const char *)(uintptr_t)d[1], (int)d[5],
                     (const char *)(uintptr_t)d[2], (int)d[6], sfirst, sn, p->rows[j]);
    }
  }
  /* host cu_seqlens of the FLA entries: the slice rebased to 0, then zero-length tails */
  for (int j = 0; j < st->entries; j++) {
    int32_t *out = st->kind[j] == FLA ? cu_hosts[j] : NULL;
    if (!out) continue;
    int whole = st->slice[j] == 1;
    const void *sq = whole ? (const void *)p->host : p->q;
    int64_t sn = whole ? p->requests : p->n, s0 = whole ? p->batch_start : p->start;
    host_cu_seqlens(out, sq, p->is64, sn, s0, st->padded && st->seqs_pad[j] >= 0 ? st->seqs_pad[j] : sn);
  }
  return 0;
}

/* A planned step as Python sees it: (counts, (first_seq, n, tokens, max_seqlen, requests,
   batch_tokens, batch_max, prep, any_checkpoint)), with a third element, whether st launched
   (else the caller launches the fill), when `with_launched` is set. New reference, or NULL. */
static PyObject *step_tuple(const Steps *st, const StepPlan *p, int with_launched) {
  /* the facts' two flags are bools: they are the result objects' bool fields (prep_initial_states) */
  const int64_t fact_ints[7] = {p->first,    p->n,
                                p->end - p->start,
                                p->longest,  p->requests,
                                p->batch_end - p->batch_start,
                                p->batch_longest};
  PyObject *count_tuple = int_tuple(p->counts, st->entries, 0), *facts = int_tuple(fact_ints, 7, 2);
  PyObject *made = count_tuple && facts ? PyTuple_New(with_launched ? 3 : 2) : NULL;
  if (!made) {
    Py_XDECREF(count_tuple);
    Py_XDECREF(facts);
    return NULL;
  }
  PyTuple_SET_ITEM(facts, 7, PyBool_FromLong(p->prep));
  PyTuple_SET_ITEM(facts, 8, PyBool_FromLong(p->any_checkpoint));
  PyTuple_SET_ITEM(made, 0, count_tuple);
  PyTuple_SET_ITEM(made, 1, facts);
  if (with_launched) PyTuple_SET_ITEM(made, 2, PyBool_FromLong(st->function || st->cpu_fill));
  return made;
}

/* One step build's host side and launch into ring slot `slot` (tensors_step, py_step_host): a[],
   c[] as step_plan's, d[] as step_launch's. -> step_tuple's, or an int: -1 for input the general
   path must check (nothing written or launched), or the CUresult of a failed launch. */
static PyObject *run_step(Steps *st, const long long *a, PyObject *first_obj, PyObject *num_obj, const long long *c,
                          const long long *d, long long slot, int with_launched) {
  StepPlan p;
  if (slot < 0 || slot >= st->slots || step_plan(st, a, first_obj, num_obj, c, &p)) return PyLong_FromLong(-1);
  int32_t *cu_hosts[MAX_ENTRIES];
  for (int j = 0; j < st->entries; j++) cu_hosts[j] = st->cu_host[j][slot];
  int err = step_launch(st, &p, d, st->arena[slot], cu_hosts);
  return err ? PyLong_FromLong(err) : step_tuple(st, &p, with_launched);
}

/* ---- a step build from the caller's tensors --------------------------------------------- */
/* Each tensor is checked every build (plain_tensor, host_build.c): engines pass new tensor
   objects every step. */
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
  long long c[4], d[7] = {qsl[0], dummy, dummy, stream, qsl[2], 0, 0};
  int index = (int)qsl[2];
  for (int k = 0; k < 2; k++) { /* computed, then checkpoints */
    if (!(wants >> k & 1)) continue;
    if (!plain_tensor(t[5 + 2 * k], -1, rows[k]) || rows[k][1] != host[1] - 1 ||
        !plain_tensor(t[4 + 2 * k], device, dev[k]) || dev[k][1] != host[1] - 1)
      return PyLong_FromLong(-1);
    d[1 + k] = dev[k][0];
    d[5 + k] = dev[k][2];
    index |= (int)dev[k][2] << (1 + k);
  }
  c[0] = rows[0][0], c[1] = rows[0][2], c[2] = rows[1][0], c[3] = rows[1][2];
  PyObject *capsule = PyTuple_GET_ITEM(table, index);
  if (capsule == Py_None) return PyLong_FromLong(-1);
  Steps *st = PyCapsule_GetPointer(capsule, "chunkmeta.steps");
  if (!st) return NULL;
  return run_step(st, host, t[2], t[3], c, d, slot, 1);
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
PyObject *py_make_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *py_step_host(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
  long long c[4] = {rows[0][0], rows[0][2], rows[1][0], rows[1][2]}, d[7] = {0};
  return run_step(st, host, args[4], args[5], c, d, 0, 0);
}
