"""Stand-in modules for an engine's compiled extensions, for the .py-only bundles (bench/bundle).

A bundle's bootstrap (``vllm_bootstrap``, ``sglang_bootstrap``) calls ``install`` before any engine
import. The finder serves an empty module for each stubbed name, but only when no real module is
found further down ``sys.meta_path``: where the compiled package is installed, it is used.
"""

import importlib.machinery
import sys
import types


class Missing:
    """A name taken from a lenient stand-in: attribute access works, calling raises."""

    def __init__(self, name, owner):
        self._name, self._owner = name, owner

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}", self._owner)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a stand-in ({self._owner}): the compiled package is not installed")

    def __repr__(self):
        return f"<stand-in {self._name}>"


class StubFinder:
    """Meta-path finder for ``names``: exact module names, or (``packages=True``) whole packages,
    their submodules too, whose every attribute is a ``Missing`` (``from pkg import op`` works)."""

    def __init__(self, names, owner, packages=False):
        self.names, self.owner, self.packages = tuple(names), owner, packages

    def _stubbed(self, name):
        if self.packages:
            return any(name == top or name.startswith(top + ".") for top in self.names)
        return name in self.names

    def find_spec(self, name, path=None, target=None):
        if not self._stubbed(name):
            return None
        for finder in sys.meta_path:
            if isinstance(finder, StubFinder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec  # a real compiled module exists: use it
        return importlib.machinery.ModuleSpec(name, self, is_package=self.packages)

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__doc__ = f"empty stand-in registered by {self.owner}"
        mod.__bundle_stub__ = True
        if self.packages:
            mod.__path__ = []

            def __getattr__(attr):  # PEP 562: any name imported from the stand-in
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return Missing(f"{spec.name}.{attr}", self.owner)

            mod.__getattr__ = __getattr__
        return mod

    def exec_module(self, module):
        pass


def install(names, owner, packages=False):
    """Put a StubFinder for ``names`` first on sys.meta_path (once per owner)."""
    if not any(isinstance(f, StubFinder) and f.owner == owner for f in sys.meta_path):
        sys.meta_path.insert(0, StubFinder(names, owner, packages))
