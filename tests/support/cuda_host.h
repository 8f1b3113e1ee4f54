/* CUDA's built-ins as host code, so that chunkmeta's CUDA C fills (chunkmeta/csrc/chunk_fill.cu and
   step_fill.cu, included after this header by cuda_host.cpp and step_host.cpp) run on the host, for
   tests/kernels/test_cuda_fill_host.py and test_step_fill_host.py: one std::thread per CUDA thread, the blocks of a grid one
   after another (the same THREADS threads run every block). It provides exactly what that kernel
   uses, with CUDA's meaning:
   - threadIdx / blockIdx / gridDim (x only);
   - __syncthreads(): a barrier of the block's threads;
   - __shfl_up_sync(mask, v, d): lane L gets lane L - d's v when L >= d, its own v otherwise;
   - __shfl_sync(mask, v, src): every lane gets lane src's v (src < 32);
     the kernel calls both uniformly (every thread, the same number of times), so a block-wide
     exchange through a buffer between two barriers gives each warp's answer;
   - __shared__: a function-local static, one copy for the block that is running;
   - __global__, __device__, __forceinline__, __launch_bounds__, __restrict__: nothing (inline);
   - min / max: std's.
   The main program (cuda_host_main.h) reads cases from stdin and prints the three tables. */
#include <algorithm>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

struct Dim3 {
  unsigned x, y, z;
};
static thread_local Dim3 threadIdx, blockIdx, gridDim;
static std::barrier<> *block_barrier;
static int shuffle_slots[1024];

static inline void __syncthreads() { block_barrier->arrive_and_wait(); }

static inline int __shfl_up_sync(unsigned, int value, int delta) {
  const int tid = threadIdx.x, lane = tid & 31;
  shuffle_slots[tid] = value;
  block_barrier->arrive_and_wait();
  const int got = lane >= delta ? shuffle_slots[tid - delta] : value;
  block_barrier->arrive_and_wait(); /* nobody overwrites a slot before every thread read */
  return got;
}

static inline int __shfl_sync(unsigned, int value, int source_lane) {
  const int tid = threadIdx.x;
  shuffle_slots[tid] = value;
  block_barrier->arrive_and_wait();
  const int got = shuffle_slots[(tid & ~31) + source_lane];
  block_barrier->arrive_and_wait();
  return got;
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __restrict__
#define __shared__ static
using std::max;
using std::min;

/* Run a kernel over cases on the host: one std::thread per CUDA thread (`threads` of them), for
   every block of every case in turn (grid(c) blocks; launch(c) runs one block), with a barrier
   between blocks, so that no thread starts the next block while the block's shared memory is in
   use. */
template <typename Cases, typename Grid, typename Launch>
static void run_blocks(Cases &cases, int threads_per_block, Grid grid_of, Launch launch) {
  std::barrier<> barrier(threads_per_block);
  block_barrier = &barrier;
  std::vector<std::thread> threads;
  for (int t = 0; t < threads_per_block; t++)
    threads.emplace_back([&, t] {
      threadIdx = {(unsigned)t, 0, 0};
      for (auto &c : cases) {
        const unsigned grid = grid_of(c);
        gridDim = {grid, 1, 1};
        for (unsigned block = 0; block < grid; block++) {
          blockIdx = {block, 0, 0};
          launch(c);
          barrier.arrive_and_wait();
        }
      }
    });
  for (auto &thread : threads) thread.join();
}
