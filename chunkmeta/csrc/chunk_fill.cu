/* chunkmeta's CUDA C fill: one step's cu_seqlens[1:], chunk_offsets[1:] and chunk_indices from the
   device query_start_loc, in one launch with no host<->device sync. Compiled at run time by NVRTC
   (chunkmeta.jit, for chunkmeta.fill.cuda_fill) with the constants of chunk_fill.h; launched by
   chunkmeta.native's C build with chunkmeta.fill.triton_fill.chunk_metadata_kernel's parameters
   in its order (step_params is unused: no graph mode here), its layout checked there with
   cuFuncGetParamInfo.

   Grid: cdiv(num_rows, BLOCK_ROWS) programs (at least 1) of THREADS threads; no dynamic shared
   memory. Program b writes rows [b * BLOCK_ROWS, (b + 1) * BLOCK_ROWS) below num_rows and the
   cu_seqlens / chunk_offsets entries STORES_BEGIN..STORES_END(seqs_out); entry 0 of both is never
   written (the builder's buffers hold 0 there). Every program scans all num_seqs <= SEQ_LANES
   sequences itself, so programs never communicate. Relies on host-validated input: offsets
   non-decreasing, lengths and NT within int32. chunk_indices is stored as int64 pairs
   (seq | chunk << 32), i.e. the int32 [num_rows, 2] table. */
#include "chunk_fill.h"
#include "row_search.h"

extern "C" __global__ void __launch_bounds__(THREADS)
chunk_metadata_fill(const QSL_T *__restrict__ query_start_loc, const int *__restrict__ step_params,
                    int *__restrict__ cu_seqlens, long long *__restrict__ chunk_indices,
                    OFFSET_T *__restrict__ chunk_offsets, int first_seq, int num_seqs, int num_rows,
                    int seqs_out, int pad_seq) {
  /* per sequence, its chunk end counted from its warp's first chunk; NO_END past num_seqs */
  __shared__ int warp_ends[SEQ_LANES];
  __shared__ int warp_chunks[WARPS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const QSL_T *q = query_start_loc + first_seq;

  /* every load first: each sequence's start and stop offsets, and the base */
  QSL_T starts[SEQS_PER_THREAD], stops[SEQS_PER_THREAD];
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) starts[j] = SEQ(j) < num_seqs ? q[SEQ(j)] : (QSL_T)0;
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) stops[j] = SEQ(j) < num_seqs ? q[SEQ(j) + 1] : (QSL_T)0;
  const QSL_T base = q[0];
  const int num_tokens = PADDED ? (int)(q[num_seqs] - base) : 0;

  /* chunks per sequence, then their running sum through the warp's sequences in order: one warp
     scan per round, the rounds interleaved, then each round carried past the ones before it */
  int ends[SEQS_PER_THREAD];
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) {
    /* lengths fit int32 (host-validated): the unsigned add cannot wrap */
    unsigned len = SEQ(j) < num_seqs ? (unsigned)(stops[j] - starts[j]) : 0u;
    ends[j] = (int)((len + ((1u << CHUNK_SHIFT) - 1u)) >> CHUNK_SHIFT);
  }
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
#pragma unroll
    for (int j = 0; j < SEQS_PER_THREAD; j++) {
      int other = __shfl_up_sync(0xffffffffu, ends[j], d);
      if (lane >= d) ends[j] += other;
    }
  }
  int rounds_before = 0;
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) {
    const int round = __shfl_sync(0xffffffffu, ends[j], 31);
    ends[j] += rounds_before;
    rounds_before += round;
  }
  if (lane == 31) warp_chunks[warp] = rounds_before;
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) warp_ends[SEQ(j)] = SEQ(j) < num_seqs ? ends[j] : NO_END;
  __syncthreads(); /* the only barrier */

  /* each warp's last chunk end, in every thread's registers: NT, and where each warp starts */
  int warp_last[WARPS];
  int before = 0, num_chunks = 0;
#pragma unroll
  for (int w = 0; w < WARPS; w++) {
    before += w < warp ? warp_chunks[w] : 0;
    num_chunks += warp_chunks[w];
    warp_last[w] = num_chunks;
  }

  /* each row's sequence is the number of chunk ends at or before it: the warps' (registers), then
     within its warp's sequences (row_search.h) */
#pragma unroll
  for (int k = 0; k < ROWS_PER_THREAD; k++) {
    const int r = blockIdx.x * BLOCK_ROWS + k * THREADS + tid;
    int warp_start = 0, start = 0;
    const int w = warps_at_or_before<WARPS>(warp_last, r, &warp_start);
    const int target = r - warp_start;
    const int pos = ends_at_or_before<LOG2_WARP_LANES>(warp_ends + w * WARP_LANES, target, &start);
    if (r < num_rows) {
      int seq = w * WARP_LANES + pos, chunk = target - start;
      if (PADDED && r >= num_chunks) {
        seq = pad_seq;
        chunk = PAD_CHUNK;
      }
      chunk_indices[r] = (long long)(unsigned)seq | ((long long)chunk << 32);
    }
  }

  /* cu_seqlens[1:] and chunk_offsets[1:] last, off the rows' longer chain */
  const int lo = STORES_BEGIN, hi = STORES_END(seqs_out);
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) {
    const int s = SEQ(j);
    if (s >= lo && s < hi) {
      const bool real = !PADDED || s < num_seqs; /* padded tails repeat (T, NT) */
      cu_seqlens[1 + s] = real ? (int)(stops[j] - base) : num_tokens;
      chunk_offsets[1 + s] = real ? before + ends[j] : num_chunks;
    }
  }
  if (PADDED && blockIdx.x == 0 && tid == 0) {
    cu_seqlens[seqs_out] = num_tokens;
    chunk_offsets[seqs_out] = num_chunks;
  }
}
