"""Import this BEFORE any vllm module when running the .py-only vLLM bundle.

The bundle carries vLLM 0.33.0's .py files only (no compiled extensions). This file
- selects vLLM's CPU platform unless VLLM_TARGET_DEVICE says otherwise, with pinned memory
  reported as a CUDA host has it (see below why the CPU platform is the default);
- registers an empty stand-in for ``vllm._C_stable_libtorch``, the one compiled module that
  ``vllm/platforms/cuda.py`` imports unconditionally;
- with VLLM_TARGET_DEVICE=cuda (bench/vllm_engine.py: vLLM's own engine on the CUDA platform),
  also defines the ``torch.ops._C`` operators that platform's path touches
  (``vllm_c_standins``) and an empty ``vllm.vllm_flash_attn._vllm_fa2_C`` (a hard import of
  ``vllm_flash_attn``; the engine runs Triton attention, never FlashAttention);
- makes vLLM's model-registry subprocess import this file first.
Any other ``torch.ops._C*`` call fails with a normal AttributeError.
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

# VLLM_TARGET_DEVICE=cuda, set by the caller: vLLM's CUDA platform with the stand-ins below
CUDA_PLATFORM = os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cuda"
if CUDA_PLATFORM:
    import vllm_c_standins  # beside this file in the bundle

    _STUBS = (*_STUBS, "vllm.vllm_flash_attn._vllm_fa2_C")
    vllm_c_standins.register()
bundle_stubs.install(_STUBS, owner="vllm_bootstrap")


# By default the bundle runs vLLM's CPU platform on the GPU host: without the compiled package
# some model modules (Kimi-K3's, through fused_moe) call torch.ops._C at import, and the step
# benchmarks need vLLM's ops, not its engine (bench/vllm_engine.py runs the engine's CUDA
# platform for dense hybrids, whose modules import with the stand-ins). On the CPU platform the
# table builders, the Triton ops and the model-class checks are the same code, and tensors still
# live on the device the caller names. One choice of the CPU platform would skew the stock
# path's timings: it says pinned memory is unavailable, so vLLM's host->device copies would be
# pageable; on a CUDA host it is available, as vLLM's CUDA platform says. (The CPU platform also
# swaps causal_conv1d_fn for a torch version: bench/vllm_step_loop.py, its one user here, takes
# the Triton one.)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _on_cuda_host():
    import torch

    # a CPU rehearsal's simulated GPU (bench/bundle/sim_cuda.py) has no memory to pin
    return torch.cuda.is_available() and not getattr(torch.cuda, "chunkmeta_simulated", False)


def _pinned_memory_as_on_cuda(exec_module, module):
    exec_module(module)
    if _on_cuda_host():
        module.CpuPlatform.is_pin_memory_available = classmethod(lambda cls: True)


# vLLM inspects model classes in a subprocess (`python -m vllm.model_executor.models.registry`,
# so that the parent never initializes CUDA). That process would start without this bootstrap and
# fail on the missing compiled module, and ModelConfig then reports every architecture as
# unsupported. Once the registry module has run, its command (which vLLM documents as the
# variable to change) imports this bootstrap first.
_REGISTRY = "vllm.model_executor.models.registry"
_COMMAND = [sys.executable, "-c", f"import vllm_bootstrap; from {_REGISTRY} import _run; _run()"]


def _registry_command(exec_module, module):
    exec_module(module)
    module._SUBPROCESS_COMMAND = _COMMAND


# module -> how it executes: wrap(exec_module, module)
_ON_IMPORT = {_REGISTRY: _registry_command}
if not CUDA_PLATFORM:
    _ON_IMPORT["vllm.platforms.cpu"] = _pinned_memory_as_on_cuda


class _OnImport:
    """Runs a vLLM module's execution through its wrapper in _ON_IMPORT."""

    def __init__(self):
        self.busy = set()

    def find_spec(self, name, path=None, target=None):
        wrap = _ON_IMPORT.get(name)
        if wrap is None or name in sys.modules or name in self.busy:
            return None  # busy: the real finders, asked below, must not come back here
        self.busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module
            spec.loader.exec_module = lambda module: wrap(exec_module, module)
        return spec


_late = [name for name in _ON_IMPORT if name in sys.modules]
if _late:
    raise ImportError(f"vllm_bootstrap must be imported before {', '.join(_late)}")
sys.meta_path.insert(0, _OnImport())
