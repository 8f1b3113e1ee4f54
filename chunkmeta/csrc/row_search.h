/* The CUDA C step fill's row search (step_fill.cu; NVRTC gets this as an
   in-memory header, chunkmeta.fill.cuda_fill, and the host harness includes it from here): which
   sequence a chunk row falls in, given each sequence's inclusive chunk end (non-decreasing), in
   two levels. First the block's warps, from each warp's last end held in every thread's registers
   (no memory read); then, within one warp's sequences, a radix-4 search of shared memory whose
   three loads a level are independent, where a binary search would chain one load a step. */
#ifndef CHUNKMETA_ROW_SEARCH_H
#define CHUNKMETA_ROW_SEARCH_H

/* The warps whose sequences all end at or before row r (warp_last[v]: the last end of warp v, in
   registers); *start becomes the last end of the last of them (unchanged when there is none). */
template <int Warps>
__device__ __forceinline__ int warps_at_or_before(const int *warp_last, int r, int *start) {
  int w = 0;
#pragma unroll
  for (int v = 0; v < Warps - 1; v++) {
    const bool past = warp_last[v] <= r;
    w += past;
    *start = past ? warp_last[v] : *start;
  }
  return w;
}

/* The ends at or before r among one warp's 2^Log2Lanes ends (ends[0..)), the last of which lies
   past r; *start becomes the largest of them (unchanged when there is none). */
template <int Log2Lanes>
__device__ __forceinline__ int ends_at_or_before(const int *ends, int r, int *start) {
  constexpr int lanes = 1 << Log2Lanes;
  int pos = 0;
  if (Log2Lanes & 1) { /* an odd number of levels: one binary level first */
    const int e = ends[lanes / 2 - 1];
    if (e <= r) {
      pos = lanes / 2;
      *start = e;
    }
  }
#pragma unroll
  for (int step = (Log2Lanes & 1 ? lanes / 2 : lanes) / 4; step >= 1; step /= 4) {
    const int a = ends[pos + step - 1], b = ends[pos + 2 * step - 1], c = ends[pos + 3 * step - 1];
    const bool in_a = a <= r, in_b = b <= r, in_c = c <= r;
    *start = in_c ? c : in_b ? b : in_a ? a : *start;
    pos += (in_a + in_b + in_c) * step;
  }
  return pos;
}

#endif
