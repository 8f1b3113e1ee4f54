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

import importlib.machinery
import importlib.util
import os
import sys
import types

# Only the hard import in vllm/platforms/cuda.py needs a stand-in; the other
# extensions (vllm._C, _moe_C_stable_libtorch, _qutlass_C) are imported under
# try/except by vLLM itself and are left missing on purpose.
_STUBS = ("vllm._C_stable_libtorch",)

# Keep vLLM quiet and offline on the benchmark host.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


class _StubFinder:
    """Meta-path finder: serve an empty module for the names in _STUBS,
    but only when no real extension is found further down sys.meta_path."""

    def find_spec(self, name, path=None, target=None):
        if name not in _STUBS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec  # a real compiled module exists: use it
        return importlib.machinery.ModuleSpec(name, self, is_package=False)

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__doc__ = "empty stand-in registered by vllm_bootstrap"
        mod.__vllm_bundle_stub__ = True
        return mod

    def exec_module(self, module):
        pass


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())
