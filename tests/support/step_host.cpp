/* The CUDA C step fill on the host (tests/kernels/test_step_fill_host.py): CUDA's built-ins as host
   code (cuda_host.h), then the real kernel source, chunkmeta/csrc/step_fill.cu, as NVRTC compiles
   it, then the driver that reads cases and prints each one's arena (step_host_main.h). Built with
   -I chunkmeta/csrc -I tests/support and the kernel's constants as -D (CudaStepFill.defines, and
   QSL_T / COMP_T / CKPT_T). */
#include "cuda_host.h"

#include "step_fill.cu"

#include "step_host_main.h"
