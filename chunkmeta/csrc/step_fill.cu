/* chunkmeta's CUDA C step fill: every table of one step (chunkmeta.tables entries) in one launch,
   the CUDA C twin of chunkmeta.fill.step_fill.step_tables_kernel, with its parameters in its order
   (so chunkmeta.native's step build launches either). Compiled at run time by NVRTC
   (chunkmeta.fill.cuda_fill.CudaStepFill) with these constants as #defines:
     QSL_T, COMP_T, CKPT_T  element types of query_start_loc, num_computed_tokens, checkpoint_offsets
                            (int or long long)
     SEQ_LANES              a power of two >= every slice's sequences and >= THREADS
     THREADS, BLOCK_ROWS    threads per program (a multiple of 32), rows per program (a multiple)
     PADDED                 1: the capacity-shaped layout (rows and sequences past the real ones pad)
     PARAMS_ON_DEVICE       1: the slices from step_params (graph mode)
     NUM_ENTRIES, ENTRIES   the entries, as chunkmeta.tables.Entry tuples in braces
     PAIRED_ENTRIES         bit J: entry J's row capacity is below 2^16 (its scan packs two rounds)
     SHARED_SPANS           1: Mamba2 / logical rows read their sequence's span from shared memory

   Grid: sum_j max(1, cdiv(rows_j, BLOCK_ROWS)) programs; entry j owns the next ones. Each program
   scans its slice's chunk counts itself (warp scans, one barrier), finds each row's sequence over
   the chunk ends (the warps' in registers, then a radix-4 search of shared memory), and stores its
   share of the per-sequence tables: programs never communicate. Relies on
   host-validated input: offsets non-decreasing, positions and counts within int32. */
#include "row_search.h"
#include "step_chunks.h"

/* entry fields (chunkmeta.tables.Entry) */
#define KIND 0
#define SHIFT 1
#define SLICE 2
#define BASE 3
#define FLAG 4
#define OFF0 5
#define OFF1 6
#define OFF2 7
#define OFF3 8
#define SEQS_PAD 9
#define PAD0 10
#define PAD1 11

__device__ constexpr long long entry_table[6][12] = {ENTRIES};

__device__ constexpr int log2_of(int x) { return x > 1 ? 1 + log2_of(x >> 1) : 0; }

/* sequence s's entries of entry J's per-sequence tables: its token end (from the slice's first
   token), its chunk end and its first chunk row (padding: T, NT, NT) */
template <int J>
__device__ __forceinline__ void store_sequence(const COMP_T *computed, const CKPT_T *checkpoints,
                                               char *arena, int first, int s, bool real, long long token_end,
                                               int end, int first_row) {
  constexpr int kind = (int)entry_table[J][KIND], shift = (int)entry_table[J][SHIFT];
  constexpr int flag = (int)entry_table[J][FLAG];
  if (kind == FLA) {
    ((int *)(arena + entry_table[J][OFF0]))[1 + s] = (int)token_end;
    if (flag & FLA_OFFSETS_64)
      ((long long *)(arena + entry_table[J][OFF2]))[1 + s] = end;
    else
      ((int *)(arena + entry_table[J][OFF2]))[1 + s] = end;
  } else if (kind == MAMBA2) {
    ((int *)(arena + entry_table[J][OFF2]))[s] = end - 1;
    if (flag) { /* checkpoints: the last chunk row before the sequence's checkpoint */
      long long mark = 0;
      if (real) {
        const long long cut = (long long)checkpoints[first + s];
        if (cut > 0) mark = first_row + segment_chunks((long long)computed[first + s], cut, shift) - 1;
      }
      ((long long *)(arena + entry_table[J][OFF3]))[s] = mark;
    }
  } else if (kind == LOGICAL && flag) {
    ((char *)(arena + entry_table[J][OFF2]))[s] = real && computed[first + s] > 0;
  }
}

/* Warp w owns the WARP_LANES consecutive sequences from w * WARP_LANES, in one of two layouts.
   Lanes: in round k lane l holds sequence w * WARP_LANES + 32 k + l, so each round's loads and
   stores are one contiguous run and the shared-memory ends are written without bank conflicts
   (the contiguous layout cost the FLA entry up to 26% more device time at 4096 sequences:
   bench/results/runs.jsonl, gpu_compare@2026-12-03T13:35:28Z against the one-table fill).
   Contiguous: thread t holds sequences t * ROUNDS + k, k < ROUNDS, and the warp scans once, not
   once a round: the entries that count chunks in 64 bits from a position (Mamba2, logical) up to
   4 rounds. In one process on an H100 (bench/results/step_fill_sweep-2026-12-06.json, capacity
   1024: 1024 lanes of 256 threads, four sequences a thread; two a thread, at 257-512 sequences,
   and four of 512 threads, at 1025-2048, were not measured) the lanes layout took the Mamba2 step
   3.16-3.20 us with 512-1024 prefills, the contiguous one 2.86-2.98 (the old kernel, also
   contiguous, 3.04-3.07); with 4-64 prefills the lanes layout was 0.04-0.20 us faster (a thread
   holds one or two sequences there, not four), but choosing the layout at run time by the
   sequence count lost at 1 and at 512-1024 prefills and missed the lanes figure at 4-32
   (step_fill_sweep-2026-12-06b.json): the layout is a compile-time choice. */
constexpr int WARPS = THREADS / 32, ROUNDS = SEQ_LANES / THREADS, WARP_LANES = 32 * ROUNDS;
constexpr int LOG2_WARP_LANES = log2_of(WARP_LANES), ROWS_PER_THREAD = BLOCK_ROWS / THREADS;
constexpr int NO_END = 0x7fffffff; /* the end of a lane past the slice's sequences: past every row */

/* The warp's running sum of its sequences' chunks, in place (run[k] becomes the chunks of the
   warp's sequences up to and including the one lane holds in round k): the warp's total.

   scan_rounds: a lane holds one sequence a round (the lanes layout, below): one warp scan a round,
   the rounds interleaved, then each round carried past the ones before. With Paired, two rounds
   in one word (the even one low): half the shuffles, which are the scan's cost from 4 rounds on.
   Neither half can carry into the other: a round's sum is at most the entry's row capacity
   (< 2^16 then), which the host's checks keep every step within. */
template <bool Paired>
__device__ __forceinline__ int scan_rounds(int (&run)[ROUNDS], int lane) {
  int round_total[ROUNDS];
  if constexpr (Paired) {
    /* sized at least 1: the array is declared (not instantiated away) where ROUNDS is 1 too */
    unsigned pair[ROUNDS / 2 > 0 ? ROUNDS / 2 : 1];
#pragma unroll
    for (int k = 0; k < ROUNDS / 2; k++) pair[k] = (unsigned)run[2 * k] | (unsigned)run[2 * k + 1] << 16;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
#pragma unroll
      for (int k = 0; k < ROUNDS / 2; k++) {
        const unsigned other = __shfl_up_sync(0xffffffffu, pair[k], d);
        if (lane >= d) pair[k] += other;
      }
    }
#pragma unroll
    for (int k = 0; k < ROUNDS / 2; k++) {
      const unsigned total = __shfl_sync(0xffffffffu, pair[k], 31);
      run[2 * k] = (int)(pair[k] & 0xffffu);
      run[2 * k + 1] = (int)(pair[k] >> 16);
      round_total[2 * k] = (int)(total & 0xffffu);
      round_total[2 * k + 1] = (int)(total >> 16);
    }
  } else {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
#pragma unroll
      for (int k = 0; k < ROUNDS; k++) {
        const int other = __shfl_up_sync(0xffffffffu, run[k], d);
        if (lane >= d) run[k] += other;
      }
    }
#pragma unroll
    for (int k = 0; k < ROUNDS; k++) round_total[k] = __shfl_sync(0xffffffffu, run[k], 31);
  }
  int total = 0;
#pragma unroll
  for (int k = 0; k < ROUNDS; k++) {
    run[k] += total;
    total += round_total[k];
  }
  return total;
}

/* scan_contiguous: a thread holds ROUNDS consecutive sequences (the contiguous layout): summed in
   order, then one warp scan of the threads' sums. */
__device__ __forceinline__ int scan_contiguous(int (&run)[ROUNDS], int lane) {
#pragma unroll
  for (int k = 1; k < ROUNDS; k++) run[k] += run[k - 1];
  int through = run[ROUNDS - 1]; /* the chunks of lanes 0..lane */
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, through, d);
    if (lane >= d) through += other;
  }
  const int ahead = through - run[ROUNDS - 1];
#pragma unroll
  for (int k = 0; k < ROUNDS; k++) run[k] += ahead;
  return __shfl_sync(0xffffffffu, through, 31);
}

template <int J>
__device__ __forceinline__ void run_entry(const QSL_T *__restrict__ query_start_loc,
                                          const COMP_T *__restrict__ computed, const CKPT_T *__restrict__ checkpoints,
                                          char *__restrict__ arena, int first, int n, int num_rows, int pid,
                                          int programs, int *ends) {
  constexpr int kind = (int)entry_table[J][KIND], shift = (int)entry_table[J][SHIFT];
  constexpr int base_kind = (int)entry_table[J][BASE], flag = (int)entry_table[J][FLAG];
  constexpr bool split = kind == MAMBA2 && flag;
  constexpr bool row_spans = SHARED_SPANS && (kind == MAMBA2 || kind == LOGICAL);
  /* chunks counted from the sequence's own first token, in 32 bits (FLA, conv) */
  constexpr bool count32 = base_kind == 0 && !split && !row_spans;
  /* the other entries' sequences, up to 4 a thread, lie contiguous in each thread (the layouts above) */
  constexpr bool contiguous = !count32 && ROUNDS <= 4;
  constexpr bool paired = ((PAIRED_ENTRIES >> J) & 1) && ROUNDS % 2 == 0 && !contiguous;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  /* the sequence this thread holds in round k, by the layout (every loop over its rounds) */
  const auto sequence = [=](int k) { return contiguous ? tid * ROUNDS + k : warp * WARP_LANES + 32 * k + lane; };
  const QSL_T *q = query_start_loc + first;

  /* every load first, the slice's base and end included: a load issued after the barrier would
     put a whole global-memory latency on the critical path */
  const QSL_T base = q[0];
  /* the padding's token end; an exact layout has no padding (and no load for it) */
  const long long num_tokens = PADDED ? (long long)(q[n] - base) : 0;
  QSL_T starts[ROUNDS], stops[ROUNDS];
  /* a MAMBA2 / LOGICAL row needs its sequence's start, length and position (and checkpoint):
     with SHARED_SPANS kept in shared memory from the loads below, so that a row reads them there
     after its search, not from global memory (a dependent load on the rows' critical path, which
     made the Mamba2 step 6% slower than the old kernel at 1024 sequences: issue 33's A/B, H100).
     Relative token positions, lengths, positions (computed + len) and checkpoints fit int32
     (host-validated), so each is an int: 12 KiB at 1024 lanes, 16 with checkpoints; the host
     turns SHARED_SPANS off where the kernel's static shared memory would pass its budget
     (chunkmeta.fill.cuda_fill.SHARED_SPAN_LIMIT). */
  __shared__ int span_start[row_spans ? SEQ_LANES : 1], span_len[row_spans ? SEQ_LANES : 1];
  __shared__ int span_pos[row_spans ? SEQ_LANES : 1], span_cut[row_spans && split ? SEQ_LANES : 1];
#pragma unroll
  for (int k = 0; k < ROUNDS; k++) {
    const int s = sequence(k);
    starts[k] = s < n ? q[s] : (QSL_T)0;
    stops[k] = s < n ? q[s + 1] : (QSL_T)0;
  }

  /* per sequence its chunks, then their running sum through the warp's sequences in order
     (scan_rounds or scan_contiguous, by the layout) */
  int count[ROUNDS], run[ROUNDS];
#pragma unroll
  for (int k = 0; k < ROUNDS; k++) {
    const int s = sequence(k);
    int c = 0;
    if (count32) {
      /* chunks from the sequence's own first token (FLA, conv): 32-bit, since at 4096 sequences
         the scan's instructions are the kernel's time (16 warps an SM); lengths fit int32
         (host-validated), so the unsigned add cannot wrap */
      const unsigned len = s < n ? (unsigned)(stops[k] - starts[k]) : 0u;
      c = (int)((len + ((1u << shift) - 1u)) >> shift);
    } else if (s < n) {
      const long long pos =
          base_kind == 1 ? (long long)(starts[k] - base) : (long long)computed[first + s];
      const long long cut = split ? (long long)checkpoints[first + s] : 0;
      c = (int)sequence_chunk_count(pos, (long long)(stops[k] - starts[k]), cut, shift);
      if (row_spans) {
        span_start[s] = (int)(starts[k] - base);
        span_len[s] = (int)(stops[k] - starts[k]);
        span_pos[s] = (int)pos;
        if (split) span_cut[s] = (int)cut;
      }
    }
    count[k] = run[k] = c;
  }
  /* run[k]: sequence s's chunk end counted from its warp's first chunk */
  const int warp_total = contiguous ? scan_contiguous(run, lane) : scan_rounds<paired>(run, lane);
  __shared__ int warp_totals[WARPS];
  if (lane == 31) warp_totals[warp] = warp_total;
#pragma unroll
  for (int k = 0; k < ROUNDS; k++) {
    const int s = sequence(k);
    ends[s] = s < n ? run[k] : NO_END;
  }
  __syncthreads(); /* the only barrier */

  /* warp_last[w]: the chunks of warps 0..w, in every thread's registers (the row search's first
     level); before: the chunks ahead of this thread's warp */
  int before = 0, num_chunks = 0, warp_last[WARPS];
#pragma unroll
  for (int w = 0; w < WARPS; w++) {
    before += w < warp ? warp_totals[w] : 0;
    num_chunks += warp_totals[w];
    warp_last[w] = num_chunks;
  }

  /* rows: each one's sequence is the number of sequences whose chunks end at or before it, found
     over the warps (registers), then within its warp's sequences (row_search.h). Every row of the
     thread is searched before any is stored, so the searches overlap. */
  int row_seq[ROWS_PER_THREAD], row_chunk[ROWS_PER_THREAD];
#pragma unroll
  for (int k = 0; k < ROWS_PER_THREAD; k++) {
    const int r = pid * BLOCK_ROWS + k * THREADS + tid;
    int warp_start = 0, start = 0;
    const int w = warps_at_or_before<WARPS>(warp_last, r, &warp_start);
    const int target = r - warp_start;
    const int pos = ends_at_or_before<LOG2_WARP_LANES>(ends + w * WARP_LANES, target, &start);
    row_seq[k] = w * WARP_LANES + pos;
    row_chunk[k] = target - start;
  }
#pragma unroll
  for (int k = 0; k < ROWS_PER_THREAD; k++) {
    const int r = pid * BLOCK_ROWS + k * THREADS + tid;
    if (r >= num_rows) break;
    /* an exact layout's rows are its chunks (the host's count) */
    const bool real = !PADDED || r < num_chunks;
    const int seq = real ? row_seq[k] : 0, chunk = real ? row_chunk[k] : 0;
    if (kind == FLA && (flag & FLA_INDICES_64)) { /* int64 (seq, chunk) pairs */
      long long *pair = (long long *)(arena + entry_table[J][OFF1]) + 2 * (long long)r;
      pair[0] = real ? seq : entry_table[J][PAD0];
      pair[1] = real ? chunk : entry_table[J][PAD1];
    } else if (kind == FLA || (kind == CONV && flag)) { /* int32 (seq, chunk) pairs, one 8-byte store */
      const long long pad0 = entry_table[J][PAD0], pad1 = entry_table[J][PAD1];
      const long long a = real ? seq : pad0, b = real ? chunk : pad1;
      ((long long *)(arena + entry_table[J][kind == FLA ? OFF1 : OFF0]))[r] =
          (long long)(unsigned)(int)a | ((long long)(int)b << 32);
    } else if (kind == CONV) {
      ((int *)(arena + entry_table[J][OFF0]))[r] = real ? seq : (int)entry_table[J][PAD0];
      ((int *)(arena + entry_table[J][OFF1]))[r] = real ? chunk : (int)entry_table[J][PAD1];
    } else if (kind == TOKENS) {
      ((int *)(arena + entry_table[J][OFF0]))[r] = real ? seq : (int)entry_table[J][PAD0];
    } else if (kind == MAMBA2 || kind == LOGICAL) {
      long long start = 0, stop = 0, row_start = 0, pos = 0;
      if (real) {
        long long len, cut = 0;
        if (row_spans) {
          row_start = span_start[seq]; /* from the slice's first token */
          len = span_len[seq];
          pos = span_pos[seq];
          if (split) cut = span_cut[seq];
        } else {
          row_start = (long long)(q[seq] - base);
          len = (long long)(q[seq + 1] - q[seq]);
          pos = base_kind == 1 ? row_start : (long long)computed[first + seq];
          if (split) cut = (long long)checkpoints[first + seq];
        }
        const ChunkSpan span = chunk_span(pos, len, cut, shift, chunk);
        start = span.start;
        stop = span.stop;
      }
      if (kind == MAMBA2) {
        ((int *)(arena + entry_table[J][OFF0]))[1 + r] = (int)(real ? row_start + stop - pos : num_tokens);
        ((int *)(arena + entry_table[J][OFF1]))[r] = real ? seq : (int)entry_table[J][PAD0];
      } else {
        ((int *)(arena + entry_table[J][OFF0]))[r] = real ? (int)(start >> shift) : (int)entry_table[J][PAD0];
        ((int *)(arena + entry_table[J][OFF1]))[r] =
            real ? (int)(start & ((1LL << shift) - 1)) : (int)entry_table[J][PAD1];
      }
    }
  }

  /* per-sequence tables last, off the rows' longer chain: program pid stores its share of the
     sequences, from its lanes' registers; a padded layout's entries past the lanes are padding
     (a SEQS_PAD below 0: a bounded build's FLA entry, padded rows and the slice's own sequences) */
  const int seqs_out = PADDED && entry_table[J][SEQS_PAD] >= 0 ? (int)entry_table[J][SEQS_PAD] : n;
  /* THREADS of them a program, the last program the rest (no division) */
  const int lo = pid * THREADS, hi = pid + 1 == programs ? seqs_out : min(lo + THREADS, seqs_out);
#pragma unroll
  for (int k = 0; k < ROUNDS; k++) {
    const int s = sequence(k);
    if (s >= lo && s < hi) {
      const bool real = !PADDED || s < n; /* an exact layout stores its n sequences only */
      const int end = real ? before + run[k] : num_chunks;
      store_sequence<J>(computed, checkpoints, arena, first, s, real, real ? (long long)(stops[k] - base) : num_tokens,
                        end, end - count[k]);
    }
  }
  if (PADDED) /* an exact layout has no entries past its sequences */
    for (int s = max(lo, SEQ_LANES) + tid; s < hi; s += THREADS)
      store_sequence<J>(computed, checkpoints, arena, first, s, false, num_tokens, num_chunks, num_chunks);

  if (kind == FLA && (flag & FLA_WRITE_FIRST) && pid == 0 && tid == 0) { /* fresh outputs: entry 0 too */
    ((int *)(arena + entry_table[J][OFF0]))[0] = 0;
    if (flag & FLA_OFFSETS_64)
      ((long long *)(arena + entry_table[J][OFF2]))[0] = 0;
    else
      ((int *)(arena + entry_table[J][OFF2]))[0] = 0;
  }
}

/* entry J's program range, then the next entry's */
template <int J>
__device__ __forceinline__ void dispatch(const QSL_T *query_start_loc, const COMP_T *computed,
                                         const CKPT_T *checkpoints, char *arena, int first_seq, int num_seqs,
                                         int batch_seqs, const int *rows, int start, int *ends) {
  if constexpr (J < NUM_ENTRIES) {
    const int programs = max((rows[J] + BLOCK_ROWS - 1) / BLOCK_ROWS, 1);
    const int pid = (int)blockIdx.x;
    if (pid >= start && pid < start + programs) {
      const bool whole = entry_table[J][SLICE] == 1;
      run_entry<J>(query_start_loc, computed, checkpoints, arena, whole ? 0 : first_seq,
                   whole ? batch_seqs : num_seqs, rows[J], pid - start, programs, ends);
      return;
    }
    dispatch<J + 1>(query_start_loc, computed, checkpoints, arena, first_seq, num_seqs, batch_seqs, rows,
                    start + programs, ends);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS)
step_tables_fill(const QSL_T *__restrict__ query_start_loc, const COMP_T *__restrict__ num_computed_tokens,
                 const CKPT_T *__restrict__ checkpoint_offsets, char *__restrict__ arena,
                 const int *__restrict__ step_params, int first_seq, int num_seqs, int batch_seqs, int rows0,
                 int rows1, int rows2, int rows3, int rows4, int rows5) {
  __shared__ int ends[SEQ_LANES];
  if (PARAMS_ON_DEVICE) {
    first_seq = step_params[0];
    num_seqs = step_params[1];
    batch_seqs = step_params[2];
  }
  const int rows[6] = {rows0, rows1, rows2, rows3, rows4, rows5};
  dispatch<0>(query_start_loc, num_computed_tokens, checkpoint_offsets, arena, first_seq, num_seqs, batch_seqs, rows,
              0, ends);
}
