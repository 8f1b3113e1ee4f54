"""Smoke test for the SGLang .py bundle: imports what tests/integrations/sglang's GPU test and
bench/sglang_mamba2.py import (ForwardBatch, the hybrid linear attention backends, SGLang's SSD
ops), then lists the distributions it loaded from outside the standard library.
Usage, from the repo root (the bundle's setup_env.sh sourced):
    python .sglang_bundle/check_imports.py          # on the GPU machine
    SIM_FAKE_CUDA=1 python ...                      # CPU-only host: take the CUDA import paths
"""

import os
import sys
import sysconfig
import time

t0 = time.time()
if os.environ.get("SIM_FAKE_CUDA"):
    import sim_cuda

    sim_cuda.fake_cuda()
    os.environ.setdefault("TRITON_INTERPRET", "0")
elif not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as conftest.py does on a CPU host

import sglang_bootstrap  # noqa: E402,F401

sys.path[:0] = ["tests/support", "tests/integrations/sglang"]
import sglang_cpu_stubs  # noqa: E402

sglang_cpu_stubs.install()  # the tests' torchvision stand-in, as they install it

from sglang.kernels.ops.mamba.triton_ops import ssd_combined  # noqa: E402
from sglang.srt.layers.attention import hybrid_linear_attn_backend as hlab  # noqa: E402
from sglang.srt.layers.attention.linear import gdn_backend  # noqa: E402,F401
from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata  # noqa: E402,F401
from sglang.srt.model_executor.forward_batch_info import ForwardBatch  # noqa: E402,F401

print(f"imports ok in {time.time() - t0:.1f}s:", hlab.Mamba2AttnBackend.__name__, ssd_combined.__name__)
print("sgl_kernel is a stand-in:", getattr(sys.modules.get("sgl_kernel"), "__bundle_stub__", False))

from importlib.metadata import packages_distributions  # noqa: E402

stdlib = sysconfig.get_paths()["stdlib"]
dists = packages_distributions()
found = {}
for name, mod in list(sys.modules.items()):
    path = getattr(mod, "__file__", None) or ""
    top = name.partition(".")[0]
    if path and not path.startswith(stdlib) and top not in found and not top.startswith("__"):
        found[top] = (",".join(sorted(set(dists.get(top, ["?"])))), path.split("/" + top)[0])
for top, (dist, where) in sorted(found.items()):
    print(f"  {top:24} {dist:24} {where}")
