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

   Grid: sum_j max(1, cdiv(rows_j, BLOCK_ROWS)) programs; entry j owns the next ones. Each program
   scans its slice's chunk counts itself (block-wide, in shared memory), finds each row's sequence
   over the chunk ends (the warp's in registers, then a radix-4 search of shared memory), and
   stores its share of the per-sequence tables: programs never communicate. Relies on
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

/* thread t holds sequences [t * per_thread, (t + 1) * per_thread), so warp w the WARP_LANES from
   w * WARP_LANES */
constexpr int WARPS = THREADS / 32, WARP_LANES = SEQ_LANES / WARPS, LOG2_WARP_LANES = log2_of(WARP_LANES);
constexpr int ROWS_PER_THREAD = BLOCK_ROWS / THREADS;

template <int J>
__device__ __forceinline__ void run_entry(const QSL_T *__restrict__ query_start_loc,
                                          const COMP_T *__restrict__ computed, const CKPT_T *__restrict__ checkpoints,
                                          char *__restrict__ arena, int first, int n, int num_rows, int pid,
                                          int programs, int *ends) {
  constexpr int kind = (int)entry_table[J][KIND], shift = (int)entry_table[J][SHIFT];
  constexpr int base_kind = (int)entry_table[J][BASE], flag = (int)entry_table[J][FLAG];
  constexpr bool split = kind == MAMBA2 && flag;
  const int tid = threadIdx.x;
  const QSL_T *q = query_start_loc + first;
  const long long base = q[0];

  /* per sequence: its chunks, then their inclusive running sum in ends[] (shared) */
  constexpr int per_thread = SEQ_LANES / THREADS;
  long long sum = 0;
  int mine[per_thread];
#pragma unroll
  for (int k = 0; k < per_thread; k++) {
    const int s = tid * per_thread + k;
    long long count = 0;
    if (s < n) {
      const long long start = q[s], len = (long long)q[s + 1] - start;
      const long long pos = base_kind == 0 ? 0 : base_kind == 1 ? start - base : (long long)computed[first + s];
      const long long cut = split ? (long long)checkpoints[first + s] : 0;
      count = sequence_chunk_count(pos, len, cut, shift);
    }
    sum += count;
    mine[k] = (int)sum;
  }
  /* the threads' totals scanned across the block: within warps by shuffles, then the warps' */
  __shared__ int warp_totals[WARPS];
  const int lane = tid & 31, warp = tid >> 5;
  int running = (int)sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, running, d);
    if (lane >= d) running += other;
  }
  if (lane == 31) warp_totals[warp] = running;
  __syncthreads();
  /* warp_last[w]: the chunks of warps 0..w, in every thread's registers (the row search's first level) */
  int before = running - (int)sum, num_chunks = 0, warp_last[WARPS];
#pragma unroll
  for (int w = 0; w < WARPS; w++) {
    before += w < warp ? warp_totals[w] : 0;
    num_chunks += warp_totals[w];
    warp_last[w] = num_chunks;
  }
#pragma unroll
  for (int k = 0; k < per_thread; k++) ends[tid * per_thread + k] = before + mine[k];
  __syncthreads();

  /* per-sequence tables: program pid stores its share of the sequences (a SEQS_PAD below 0: a
     bounded build's FLA entry, padded rows and the slice's own sequences) */
  const int seqs_out = PADDED && entry_table[J][SEQS_PAD] >= 0 ? (int)entry_table[J][SEQS_PAD] : n;
  const int share = (seqs_out + programs - 1) / programs;
  const long long num_tokens = (long long)q[n] - base;
  for (int s = pid * share + tid; s < min(seqs_out, pid * share + share); s += THREADS) {
    const bool real = s < n;
    const int end = real ? ends[s] : num_chunks;
    if (kind == FLA) {
      int *cu = (int *)(arena + entry_table[J][OFF0]);
      cu[1 + s] = (int)(real ? (long long)q[s + 1] - base : num_tokens);
      if (flag & FLA_OFFSETS_64)
        ((long long *)(arena + entry_table[J][OFF2]))[1 + s] = end;
      else
        ((int *)(arena + entry_table[J][OFF2]))[1 + s] = end;
    } else if (kind == MAMBA2) {
      ((int *)(arena + entry_table[J][OFF2]))[s] = end - 1;
      if (split) {
        long long mark = 0;
        if (real) {
          const long long cut = (long long)checkpoints[first + s];
          if (cut > 0) {
            const long long first_row = s ? ends[s - 1] : 0;
            mark = first_row + segment_chunks((long long)computed[first + s], cut, shift) - 1;
          }
        }
        ((long long *)(arena + entry_table[J][OFF3]))[s] = mark;
      }
    } else if (kind == LOGICAL && flag) {
      ((char *)(arena + entry_table[J][OFF2]))[s] = real && computed[first + s] > 0;
    }
  }

  if (kind == FLA && (flag & FLA_WRITE_FIRST) && pid == 0 && tid == 0) { /* fresh outputs: entry 0 too */
    ((int *)(arena + entry_table[J][OFF0]))[0] = 0;
    if (flag & FLA_OFFSETS_64)
      ((long long *)(arena + entry_table[J][OFF2]))[0] = 0;
    else
      ((int *)(arena + entry_table[J][OFF2]))[0] = 0;
  }

  /* rows: each one's sequence is the number of sequences whose chunks end at or before it, found
     over the warps (registers), then within its warp's sequences (row_search.h). Past the real
     sequences ends[] holds num_chunks, past any real row. Every row of the thread is searched
     before any is stored, so the searches overlap. */
  int row_seq[ROWS_PER_THREAD], row_chunk[ROWS_PER_THREAD];
#pragma unroll
  for (int k = 0; k < ROWS_PER_THREAD; k++) {
    const int r = pid * BLOCK_ROWS + k * THREADS + tid;
    int start = 0;
    const int w = warps_at_or_before<WARPS>(warp_last, r, &start);
    const int pos = ends_at_or_before<LOG2_WARP_LANES>(ends + w * WARP_LANES, r, &start);
    row_seq[k] = w * WARP_LANES + pos;
    row_chunk[k] = r - start;
  }
#pragma unroll
  for (int k = 0; k < ROWS_PER_THREAD; k++) {
    const int r = pid * BLOCK_ROWS + k * THREADS + tid;
    if (r >= num_rows) break;
    const bool real = r < num_chunks;
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
        row_start = q[seq];
        long long len = (long long)q[seq + 1] - row_start;
        pos = base_kind == 1 ? row_start - base : (long long)computed[first + seq];
        const ChunkSpan span = chunk_span(pos, len, split ? (long long)checkpoints[first + seq] : 0, shift, chunk);
        start = span.start;
        stop = span.stop;
      }
      if (kind == MAMBA2) {
        ((int *)(arena + entry_table[J][OFF0]))[1 + r] = (int)(real ? row_start - base + stop - pos : num_tokens);
        ((int *)(arena + entry_table[J][OFF1]))[r] = real ? seq : (int)entry_table[J][PAD0];
      } else {
        ((int *)(arena + entry_table[J][OFF0]))[r] = real ? (int)(start >> shift) : (int)entry_table[J][PAD0];
        ((int *)(arena + entry_table[J][OFF1]))[r] =
            real ? (int)(start & ((1LL << shift) - 1)) : (int)entry_table[J][PAD1];
      }
    }
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
