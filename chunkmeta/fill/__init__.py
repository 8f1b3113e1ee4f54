"""The device fills, each beside its launcher; only the builders and graph mode launch them.

Every table is an entry of one kernel (``chunkmeta.tables``), with one fill per backend:

* ``step_fill``: the Triton step kernel (CUDA builders, graph mode, and CPU tensors under
  Triton's interpreter). Importing it imports triton, so it is imported on first use.
* ``cuda_fill``: its CUDA C twin, compiled with NVRTC, launched by the C build.
* ``torch_fill``: the same tables in vectorized torch ops (CPU tensors, devices without Triton).

A CPU builder's C build fills its tables itself (``cpu_fill_entry`` in ``chunkmeta/csrc/host_step.c``,
launched from ``chunkmeta.native``'s step build): the step kernel's logic run serially, after the
layout's first build ran the torch fill.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from chunkmeta.errors import ChunkMetaError

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The fill a builder on ``device`` uses; ChunkMetaError for one that cannot run there."""
    if backend not in BACKENDS:
        raise ChunkMetaError(f"backend={backend!r}: must be one of {BACKENDS}.")
    has_triton = _has_triton()
    if backend == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if backend == "triton":
        if not has_triton:
            raise ChunkMetaError("backend='triton' needs the triton package; use backend='torch'.")
        if device.type == "cpu" and not _triton_interprets():
            raise ChunkMetaError(
                "backend='triton' on CPU tensors runs only under Triton's interpreter: set TRITON_INTERPRET=1 "
                "before triton is first imported, or use backend='torch' (the default on CPU)."
            )
    return backend


@functools.cache
def _has_triton() -> bool:
    # find_spec searches sys.path (file system calls) until triton is imported: once per process
    return importlib.util.find_spec("triton") is not None


def _triton_interprets() -> bool:
    """Whether chunkmeta's Triton kernel runs in the interpreter (fixed when it is first imported)."""
    loaded = sys.modules.get("chunkmeta.fill.step_fill")
    if loaded is None and "triton" not in sys.modules:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    from chunkmeta.fill import step_fill

    return type(step_fill.step_tables_kernel).__name__ == "InterpretedFunction"


def resolve_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ChunkMetaError(f"device={device!r}: not a torch device ({exc}).") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ChunkMetaError(
                f"device={str(device)!r}: this torch ({torch.__version__}, {build}) sees no CUDA device; "
                "use device='cpu', or install the torch build your engine runs."
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device
