/* The CUDA C fill on the host (tests/kernels/test_cuda_fill_host.py): CUDA's built-ins as host
   code (cuda_host.h), then the real kernel source, chunkmeta/csrc/chunk_fill.cu, and its header,
   as NVRTC compiles them, then the driver that reads cases and prints tables (cuda_host_main.h).
   Built with -I chunkmeta/csrc -I tests/support and the kernel's constants as -D:
     g++ -std=c++20 -pthread -I chunkmeta/csrc -I tests/support -DQSL_T=int -DCHUNK_SHIFT=6 \
       -DSEQ_LANES=64 -DLOG2_WARP_LANES=5 -DTHREADS=64 -DBLOCK_ROWS=64 -DPADDED=0 -DPAD_CHUNK=0 \
       tests/support/cuda_host.cpp */
#include "cuda_host.h"

#include "chunk_fill.cu"

#include "cuda_host_main.h"
