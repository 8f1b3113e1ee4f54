"""Process-wide test setup, shared by tests/ and bench/.

Triton decides at import time whether kernels are compiled or interpreted, so on a machine
without CUDA ``TRITON_INTERPRET=1`` must be set here, before any test module imports triton
(directly, through chunkmeta's triton backend, or through FLA).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    import pytest

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
