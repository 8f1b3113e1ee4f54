/* The host build's plan passes (host_build.c lists the host build's files): plan(), one pass over
   a prefill slice of the host query_start_loc (sizes and the first bad index), for chunkmeta.plan;
   the typed per-row passes a step build's checks and row counts run (host_step.c); the host
   cu_seqlens copy; and the slice and integer arguments every build parses. */
#include "host_build.h"

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

Plan plan_any(const void *q, int is64, int64_t n, int shift) {
  return is64 ? plan_i64((const int64_t *)q, n, shift) : plan_i32((const int32_t *)q, n, shift);
}

int64_t chunks_any(const void *q, int is64, int64_t n, int shift) {
  return is64 ? chunks_i64((const int64_t *)q, n, shift) : chunks_i32((const int32_t *)q, n, shift);
}

/* ---- a step build's other per-row passes, typed so that they vectorize too -------------- */
/* Offsets and each per-request array come as int32 or int64, independently; a loop that asks
   which (load) at every element costs about a nanosecond per request, which at 1024 requests was
   most of a Mamba2 build's host side. So each pass is instantiated per dtype pair and dispatched
   once. */

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

const RowFlagsPass computed_rows[4] = PAIR_TABLE(computed_rows);
const RowFlagsPass checkpoint_rows[4] = PAIR_TABLE(checkpoint_rows);
int64_t (*const positioned_chunks[4])(const void *, const void *, int64_t, int) = PAIR_TABLE(positioned_chunks);
int64_t (*const split_chunks[8])(const void *, const void *, const void *, int64_t,
                                        int) = TRIPLE_TABLE(split_chunks);
int64_t (*const packed_chunks[2])(const void *, int64_t, int) = {packed_chunks_i32, packed_chunks_i64};

/* A host cu_seqlens of seqs_out sequences: q[0..n] rebased to start, then zero-length tails up to
   seqs_out (>= n; the padded layouts' rows past the batch) */
void host_cu_seqlens(int32_t *out, const void *q, int is64, int64_t n, int64_t start, int64_t seqs_out) {
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
int slice_args(PyObject *first_obj, PyObject *num_obj, int64_t requests, long long *first, long long *n) {
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
int int_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out) {
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
PyObject *py_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[4];
  if (int_args(args, nargs, 4, a)) return NULL;
  if (a[1] < 0 || a[3] < 0 || a[3] > 31) {
    PyErr_SetString(PyExc_ValueError, "plan: n >= 0 and 0 <= shift <= 31");
    return NULL;
  }
  Plan p = plan_any((const void *)(uintptr_t)a[0], (int)a[2], a[1], (int)a[3]);
  return Py_BuildValue("(LLL)", (long long)p.bad, (long long)p.chunks, (long long)p.longest);
}
