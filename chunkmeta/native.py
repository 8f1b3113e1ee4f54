"""Optional compiled helpers: the host plan in C, and a whole build's host side in one C call.

One small CPython extension, ``chunkmeta/csrc/host_build.c`` and its parts (``SOURCES``: the
plan, the step build, the one-shot, the result objects; ``host_build.h`` says what they share),
compiled on first use by ``chunkmeta.jit`` with the machine's C compiler (the one Triton needs
anyway for its launchers) and cached in ``$CHUNKMETA_CACHE_DIR`` (default
``~/.cache/chunkmeta``). Its jobs:

* ``plan(address, n, is64, shift)``: one pass over a prefill slice of the host
  ``query_start_loc`` -> ``(bad_index, num_chunks, max_seqlen)``; ``bad_index`` is 0, or the
  first index where the offsets decrease. numpy needs four or five array calls for this.
* ``step(state, ...)``: the whole host side of a ``chunkmeta.StepTablesBuilder`` build (and so of
  ``ChunkMetadataBuilder``'s), from the build's tensors: their checks (``set_tensor_types`` binds
  torch's classes and the attributes read, once; engines pass new tensor objects every step, and
  those checks cost more in Python than the rest of the host side), the ring's claim, every value
  check, each kernel entry's rows, the host ``cu_seqlens`` copies, the launch of the step kernel
  (``cuLaunchKernel`` straight from C; ``make_steps`` holds its constants; with no kernel it does
  the host side alone, or on a CPU builder fills the tables in C), the result objects
  (``results``: ``make_results`` compiles a ``chunkmeta.results`` recipe) and the publish.
  ``make_step`` binds the builder's parts it reads. ``step_host`` is its host side for graph mode
  (``chunkmeta.StepGraphBuild.prepare``), from the host tensors alone.
* ``oneshot(kernels, arena, ...)``: ``chunkmeta.build_chunk_metadata``'s whole host side once a
  build of its key made a steps capsule: the tensors' checks, the step build's plan, its outputs
  (a region of ``chunkmeta.arena``), the launch (or the CPU's C fill), the host copy and the
  ``ChunkMetadata`` (``set_metadata_class`` binds the class).

The kernel's parameter layout is Triton's: the non-constexpr arguments in order (pointers 8
bytes, int32 scalars 4 bytes), then trailing scratch pointers Triton appends (passed as NULL, as
Triton does when a kernel needs no scratch). ``make_steps`` checks that layout against the
loaded kernel with ``cuFuncGetParamInfo`` (CUDA >= 12.4) and refuses on any difference, so a
Triton release that changes it falls back to Triton's own launcher instead of misreading
arguments. The CUDA C step fill (``chunkmeta/csrc/step_fill.cu``) takes the same parameters.

Without a C compiler or Python headers nothing here loads (one warning says why): the plan
uses numpy and launches go through Triton (tests compare all paths). ``CHUNKMETA_NATIVE=0``
turns it off without the warning.
"""

from __future__ import annotations

import os

import attrs
import torch

from chunkmeta import jit
from chunkmeta.metadata import ChunkMetadata

_NOT_LOADED = object()
_module = _NOT_LOADED
SWITCH = "CHUNKMETA_NATIVE"
# the extension's sources in chunkmeta/csrc, the module's first
SOURCES = ("host_build.c", "host_plan.c", "host_step.c", "host_one_shot.c", "host_results.c")


def module():
    """The compiled extension, or None: ``CHUNKMETA_NATIVE=0``, or it cannot be compiled or
    loaded here (``chunkmeta.jit`` then warns once, saying why)."""
    global _module
    if _module is not _NOT_LOADED:
        return _module
    _module = None
    loaded = jit.extension(
        "chunkmeta_native",
        SOURCES,
        switch=SWITCH,
        libraries=("dl",),
        what="the compiled host build is off (plans use numpy, CUDA builds launch through Triton)",
    )
    if loaded is None:
        return None
    if not loaded.set_metadata_class(ChunkMetadata, [field.name for field in attrs.fields(ChunkMetadata)]):
        return None  # an attrs that stopped making slots: the Python path builds it
    if not loaded.set_tensor_types(torch.Tensor, torch.int32, torch.int64):
        return None  # a torch whose Tensor attributes are not descriptors: the Python path builds
    _module = loaded
    return _module


def cuda_launcher():
    """The extension if it can launch kernels itself (a CUDA driver with cuFuncGetParamInfo)."""
    loaded = module()
    if loaded is None or os.environ.get("CHUNKMETA_FAST_LAUNCH", "1") == "0" or not loaded.bind_cuda():
        return None
    return loaded
