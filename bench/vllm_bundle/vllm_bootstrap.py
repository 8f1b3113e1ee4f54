"""Import this BEFORE any vllm module when running the .py-only vLLM bundle.

The bundle carries vLLM 0.33.0's .py files only (no compiled extensions).
On a CUDA host, vLLM's platform detection picks CudaPlatform, whose module
does a hard ``import vllm._C_stable_libtorch`` (a .so built for torch 2.14);
without it every vllm.v1 import fails.  This file registers an empty stand-in
for the compiled extension module that is imported only to register
custom ops, so CudaPlatform (and therefore PIN_MEMORY=True, is_cuda()) work.
The per-step table builders are plain torch/python and never call those ops;
any code that DOES call torch.ops._C* will fail with a normal AttributeError.

Alternative with no patch at all: export VLLM_TARGET_DEVICE=cpu (selects
CpuPlatform: imports fine, but PIN_MEMORY=False so H2D copies are unpinned).
"""

import os

import bundle_stubs  # bench/bundle, copied into the bundle beside this file

# Only the hard import in vllm/platforms/cuda.py needs a stand-in; the other
# extensions (vllm._C, _moe_C_stable_libtorch, _qutlass_C) are imported under
# try/except by vLLM itself and are left missing on purpose.
_STUBS = ("vllm._C_stable_libtorch",)

# Keep vLLM quiet and offline on the benchmark host.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

bundle_stubs.install(_STUBS, owner="vllm_bootstrap")
