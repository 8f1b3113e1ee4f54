"""bench/bundle/rehearse.sh puts this first on PYTHONPATH: only the GPU image's packages and the
bundle's wheels import (REHEARSE_ALLOWED: files of distribution names, one per line, '#'
comments; REHEARSE_ALSO: more names), so a CPU rehearsal stops at the import the GPU machine
would stop at. A top-level module is refused when it is found only in this venv's site-packages
and none of the distributions that provide it is allowed; everything else on the path (the
bundle's unpacked tree, the repository) imports as usual. REHEARSE_FAKE_CUDA=1: the bundle's
sim_cuda.fake_cuda() (torch and Triton believe in a GPU; kernels still cannot run)."""

import importlib.abc
import importlib.metadata
import os
import sys


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _allowed() -> set:
    names = os.environ.get("REHEARSE_ALSO", "").split()
    for path in os.environ.get("REHEARSE_ALLOWED", "").split(os.pathsep):
        if path:
            for line in open(path):
                line = line.split("#")[0].strip()
                if line:
                    names.append(line.split("==")[0])
    return {_norm(name) for name in names}


class _ImageOnly(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.allowed = _allowed()
        self.providers = importlib.metadata.packages_distributions()

    def find_spec(self, name, path=None, target=None):
        if "." in name or name not in self.providers:
            return None
        if any(_norm(d) in self.allowed for d in self.providers[name]):
            return None
        for entry in sys.path:  # the first path entry that has it decides, as the import would
            if os.path.exists(os.path.join(entry, name)) or os.path.exists(os.path.join(entry, name + ".py")):
                if "site-packages" in entry:
                    providers = ", ".join(self.providers[name])
                    raise ImportError(f"rehearse: {name} ({providers}) is neither on the GPU image nor in the bundle")
                return None
        return None


sys.meta_path.insert(0, _ImageOnly())
if os.environ.get("REHEARSE_FAKE_CUDA") == "1":
    import sim_cuda

    sim_cuda.fake_cuda()
