/* What chunk_fill.cu and the programs that run it share: the work layout of one program of the
   CUDA C fill. Included by chunk_fill.cu (NVRTC gets it as an in-memory header), by the bench's
   diagnostic kernels of the same shape (bench/kernel_sweep.py), and by the host harness that runs
   the kernel on the CPU (tests/support/cuda_host.cpp).

   Compile-time constants, supplied as -D or #define by the compiling program
   (chunkmeta.fill.cuda_fill.CudaFill.defines, plus QSL_T):
     QSL_T            the query_start_loc element type: int or long long
     CHUNK_SHIFT      log2(chunk_size)
     SEQ_LANES        a power of two >= THREADS: the sequences every program scans
     LOG2_WARP_LANES  log2(WARP_LANES): the row search's level count
     THREADS          threads per program, a power of two in [32, 1024]
     BLOCK_ROWS       rows per program, a multiple of THREADS
     PADDED           1: rows past NT and sequences past num_seqs are padding (the kernel finds NT)
     PAD_CHUNK        the chunk of a padding row (chunkmeta.layout.padding_row)
     OFFSET_T         the chunk_offsets element type: long long (FLA's int64) or int

   One program: THREADS threads, WARPS warps. Warp w owns WARP_LANES consecutive sequences and takes
   them in SEQS_PER_THREAD rounds of 32, one per lane: in round j lane l holds sequence
   SEQ(j) = w * WARP_LANES + 32 j + l, so each round's loads and stores are one contiguous run.
   A thread also owns ROWS_PER_THREAD rows spaced THREADS apart, so that a warp's 8-byte row
   stores are coalesced. Lanes past num_seqs hold NO_END, so every search stays inside its warp's
   lanes. */
#ifndef CHUNKMETA_CHUNK_FILL_H
#define CHUNKMETA_CHUNK_FILL_H

#if !defined(QSL_T) || !defined(CHUNK_SHIFT) || !defined(SEQ_LANES) || !defined(LOG2_WARP_LANES) || \
    !defined(THREADS) || !defined(BLOCK_ROWS) || !defined(PADDED) || !defined(PAD_CHUNK) || !defined(OFFSET_T)
#error "chunk_fill.h: define QSL_T, CHUNK_SHIFT, SEQ_LANES, LOG2_WARP_LANES, THREADS, BLOCK_ROWS, PADDED, PAD_CHUNK, OFFSET_T"
#endif

#define SEQS_PER_THREAD (SEQ_LANES / THREADS)
#define WARP_LANES (32 * SEQS_PER_THREAD) /* the sequences of one warp */
#define ROWS_PER_THREAD (BLOCK_ROWS / THREADS)
#define WARPS (THREADS / 32)
#define NO_END 0x7fffffff
#define SEQ(j) (warp * WARP_LANES + 32 * (j) + lane)
/* the sequences whose cu_seqlens / chunk_offsets entries program b stores: THREADS of them from
   b * THREADS on, the last program the rest (no division) */
#define STORES_BEGIN ((int)(blockIdx.x * THREADS))
#define STORES_END(seqs_out) (blockIdx.x + 1 == gridDim.x ? (seqs_out) : min(STORES_BEGIN + THREADS, (seqs_out)))

#endif
