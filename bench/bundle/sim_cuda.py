"""CPU-only hosts: pretend to be a CUDA machine, so that a bundle's smoke test (check_imports.py)
walks the import paths the engine takes on the GPU machine. Never on a real GPU host.

* ``fake_triton_driver()``: Triton believes its CUDA driver is active (an H200, sm_90), so the
  real ``@triton.jit`` decorators and module-level device queries run;
* ``fake_cuda()``: ``torch.cuda.is_available()`` is True and ``torch.version.cuda`` is set, as the
  engines' ``is_cuda()`` checks read them (kernels still cannot run).
"""

import torch


def fake_triton_driver():
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    backends["nvidia"].driver.is_active = staticmethod(lambda: True)

    class FakeDriver:  # just enough for module-level queries at import time
        class utils:
            @staticmethod
            def get_device_properties(i):
                return {"max_shared_mem": 232448, "multiprocessor_count": 132}

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def __getattr__(self, name):
            raise AttributeError(name)

    driver.set_active(FakeDriver())
    torch.cuda.get_device_name = lambda *a: "NVIDIA H200 (simulated)"
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    torch.cuda.device_count = lambda: 1


def fake_cuda():
    fake_triton_driver()
    torch.cuda.is_available = lambda: True
    torch.cuda.chunkmeta_simulated = True  # what a bootstrap asks before it relies on a real device
    torch.cuda.current_device = lambda: 0
    torch.version.cuda = torch.version.cuda or "13.0"
