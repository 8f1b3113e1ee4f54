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

import importlib.util
import os
import sys

import bundle_stubs  # bench/bundle, copied into the bundle beside this file

# Only the hard import in vllm/platforms/cuda.py needs a stand-in; the other
# extensions (vllm._C, _moe_C_stable_libtorch, _qutlass_C) are imported under
# try/except by vLLM itself and are left missing on purpose.
_STUBS = ("vllm._C_stable_libtorch",)

# Keep vLLM quiet and offline on the benchmark host.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

bundle_stubs.install(_STUBS, owner="vllm_bootstrap")


# vLLM inspects model classes in a subprocess (`python -m vllm.model_executor.models.registry`,
# so that the parent never initializes CUDA). That process would start without this bootstrap and
# fail on the missing compiled module, and ModelConfig then reports every architecture as
# unsupported. Once the registry module has run, its command (which vLLM documents as the
# variable to change) imports this bootstrap first.
_REGISTRY = "vllm.model_executor.models.registry"
_COMMAND = [sys.executable, "-c", f"import vllm_bootstrap; from {_REGISTRY} import _run; _run()"]


class _RegistryCommand:
    def find_spec(self, name, path=None, target=None):
        if name != _REGISTRY:
            return None
        sys.meta_path.remove(self)  # the registry loads once; the real finders find it
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def run(module):
                exec_module(module)
                module._SUBPROCESS_COMMAND = _COMMAND

            spec.loader.exec_module = run
        return spec


if _REGISTRY in sys.modules:
    sys.modules[_REGISTRY]._SUBPROCESS_COMMAND = _COMMAND
else:
    sys.meta_path.insert(0, _RegistryCommand())
