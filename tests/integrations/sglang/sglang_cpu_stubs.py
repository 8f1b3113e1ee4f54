"""Import stubs for tests/integrations/sglang/test_sglang_real.py (``make test-sglang``).

SGLang 0.5.23's config modules import torchvision on the way to ForwardBatch and the
linear-attention backends. PyPI's torchvision for torch 2.13 is a CUDA build whose extension fails
against torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and newer ones pull another
torch, so a sys.meta_path finder serves a stub package instead. Testing only: every stubbed name
raises if actually used. Where the carried .py-only SGLang (``.sglang_bundle``, docs/gpu.md) is on the
path, install() first imports its ``sglang_bootstrap``.
"""

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Stub:
    """Placeholder for any attribute of a stubbed module (class or callable)."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        raise RuntimeError("stubbed torchvision object used")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0+stub"
        mod.InterpolationMode = InterpolationMode

        def _getattr(attr):  # PEP 562
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (_Stub,), {})

        mod.__getattr__ = _getattr
        return mod

    def exec_module(self, module):
        pass


def install():
    if importlib.util.find_spec("sglang_bootstrap") is not None:
        import sglang_bootstrap  # noqa: F401  the carried .py-only SGLang's stand-in for sgl_kernel
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
