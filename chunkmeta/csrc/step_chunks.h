/* What the step fill's two ports share: the entry kinds, and where a sequence's chunks lie in an
   entry's chunk grid. Included by step_fill.cu (the CUDA kernel; NVRTC gets this as an in-memory
   header, chunkmeta.fill.cuda_fill) and by the host build (host_plan.c: the step build's row counts;
   host_step.c: its serial CPU fill), and so by the host harness that runs step_fill.cu on the CPU
   (tests/support/step_host.cpp). chunkmeta.fill.step_fill states the same in Triton.
   Integer arithmetic only: no includes. */
#ifndef CHUNKMETA_STEP_CHUNKS_H
#define CHUNKMETA_STEP_CHUNKS_H

#if defined(__CUDACC__)
#define STEP_CHUNKS_FN __device__ __forceinline__
#else
#define STEP_CHUNKS_FN static inline
#endif

/* entry kinds (chunkmeta.tables.Entry) */
#define FLA 1
#define CONV 2
#define MAMBA2 3
#define LOGICAL 4
#define TOKENS 5

/* an FLA entry's flag bits (chunkmeta.tables.FLA_*): int64 chunk_offsets, entry 0 of cu_seqlens /
   chunk_offsets written too (fresh outputs: the one-shot's), int64 chunk_indices */
#define FLA_OFFSETS_64 1
#define FLA_WRITE_FIRST 2
#define FLA_INDICES_64 4

/* chunks of a segment of len tokens at position pos: one per multiple of 2^shift inside it and
   one at its end; an empty one mid-chunk gets one, on a boundary none */
STEP_CHUNKS_FN long long segment_chunks(long long pos, long long len, int shift) {
  if (len > 0) return ((pos + len - 1) >> shift) - (pos >> shift) + 1;
  return (pos & ((1LL << shift) - 1)) != 0;
}

/* chunks of a sequence of len tokens at position pos, cut in two segments at its checkpoint when
   cut > 0 */
STEP_CHUNKS_FN long long sequence_chunk_count(long long pos, long long len, long long cut, int shift) {
  return cut > 0 ? segment_chunks(pos, cut, shift) + segment_chunks(pos + cut, len - cut, shift)
                 : segment_chunks(pos, len, shift);
}

/* chunk t of such a sequence: its positions [start, stop) */
typedef struct {
  long long start, stop;
} ChunkSpan;

STEP_CHUNKS_FN ChunkSpan chunk_span(long long pos, long long len, long long cut, int shift, long long t) {
  long long seg_pos = pos, seg_len = len;
  if (cut > 0) {
    const long long first_chunks = segment_chunks(pos, cut, shift);
    if (t >= first_chunks) {
      seg_pos = pos + cut;
      seg_len = len - cut;
      t -= first_chunks;
    } else {
      seg_len = cut;
    }
  }
  const long long boundary = seg_pos >> shift, limit = (boundary + t + 1) << shift;
  ChunkSpan span = {t == 0 ? seg_pos : (boundary + t) << shift, limit < seg_pos + seg_len ? limit : seg_pos + seg_len};
  return span;
}

#endif
