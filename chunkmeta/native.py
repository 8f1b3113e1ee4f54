"""Optional compiled helpers: the host plan in C, and a whole build's host side in one C call.

One small CPython extension, ``chunkmeta/csrc/host_build.c`` and its parts (``SOURCES``: the
plan, the one-table build, the step build, the result objects; ``host_build.h`` says what they
share), compiled on first use by ``chunkmeta.jit`` with the machine's C compiler (the one Triton
needs anyway for its launchers) and cached in ``$CHUNKMETA_CACHE_DIR`` (default
``~/.cache/chunkmeta``). Its jobs:

* ``plan(address, n, is64, shift)``: one pass over a prefill slice of the host
  ``query_start_loc`` -> ``(bad_index, num_chunks, max_seqlen)``; ``bad_index`` is 0, or the
  first index where the offsets decrease. numpy needs four or five array calls for this.
* ``build(fill, ...)``: a build's whole host side for a CUDA builder: the plan and every
  validation check, the ``ChunkMetadata`` it returns (made there, from the builder's cached
  views), the launch of the already-compiled kernel (``cuLaunchKernel`` straight from C, with
  the parameters packed there), and the host ``cu_seqlens_cpu`` copy. The builder's Python only
  checks its input tensors and records the ring generation. A fill (``make_fill``) holds what
  never changes between builds: the kernel handle, its launch shape, the ring's pointers and the
  layout's padding.
* ``step(state, ...)``: the same for ``chunkmeta.StepTablesBuilder``, from the build's tensors:
  their checks (``set_tensor_types`` binds torch's classes and the attributes read, once; engines
  pass new tensor objects every step, and those checks cost more in Python than the rest of the
  host side), the ring's claim, every value check, each kernel entry's rows, the host ``cu_seqlens`` copies, the launch
  of the step kernel (``make_steps`` holds its constants; with no kernel it does the host side
  alone, as CPU builds use it), the result objects (``results``: ``make_results`` compiles a
  ``chunkmeta.results`` recipe) and the publish. ``make_step`` binds the builder's parts it
  reads. ``step_host`` is its host side for graph mode
  (``chunkmeta.StepGraphBuild.prepare``), from the host tensors alone.
* ``oneshot(fills, arena, ...)``: ``chunkmeta.build_chunk_metadata``'s whole host side on CUDA
  once its fill is compiled: the tensors' checks, the plan, its outputs (views from
  ``chunkmeta.arena``), the host copy, the launch and the ``ChunkMetadata``.

The kernel's parameter layout is Triton's: the non-constexpr arguments in order (pointers 8
bytes, int32 scalars 4 bytes), then trailing scratch pointers Triton appends (passed as NULL, as
Triton does when a kernel needs no scratch). ``make_fill`` checks that layout against the
loaded kernel with ``cuFuncGetParamInfo`` (CUDA >= 12.4) and refuses on any difference, so a
Triton release that changes it falls back to Triton's own launcher instead of misreading
arguments. The CUDA C fill (``chunkmeta/csrc/chunk_fill.cu``) takes the same parameters.

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
SOURCES = ("host_build.c", "host_plan.c", "host_launch.c", "host_step.c", "host_results.c")


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


class CBuild:
    """A CUDA builder's C build: for each layout whose kernel is known, a build's whole host side
    in one ``build()`` call of the extension (``module``).

    ``add_layout`` makes a layout's fill from the kernels it may launch, best first; ``kernel``
    says which one each layout got. ``build`` returns None whenever the general path must run:
    a layout without a fill, another current device, any invalid input (the caller re-plans for
    the precise error) or a failed launch (the CUresult turns that layout's C build off: a
    kernel that cannot launch is not retried every step).
    """

    def __init__(self, module, ring, chunk_size: int, device_index: int, params_ptr: int):
        self.module = module
        self.ring = ring
        self.chunk_size = chunk_size
        self.device_index = device_index
        self.params_ptr = params_ptr
        self._fills: dict[tuple, object] = {}  # (pad, dtype) -> capsule, or False
        # which kernel the C build launches per (pad, dtype): "cuda", "triton", or None
        self.kernel: dict[tuple, str | None] = {}

    def has_layout(self, pad, dtype) -> bool:
        return (pad, dtype) in self._fills

    def add_layout(self, pad, dtype, shape, candidates) -> None:
        """``shape``: the layout's fixed ``(seqs_out, rows_out, pad_seq, pad_chunk)`` (``-1`` sizes:
        the exact layout's N and NT); ``candidates``: ``(name, (CUfunction, block_rows, num_warps,
        shared bytes))`` pairs. The first one ``make_fill`` accepts is kept."""
        cap = self.ring.capacity
        slots = [self.ring.pointers(k) for k in range(self.ring.depth)]
        made, chosen = None, None
        for name, (function, block_rows, num_warps, shared) in candidates:
            made = self.module.make_fill(
                function,
                block_rows,
                num_warps,
                shared,
                self.chunk_size.bit_length() - 1,
                cap.seqs,
                cap.tokens,
                cap.rows,
                shape[0],
                shape[1],
                shape[2],
                self.params_ptr,
                slots,
                pad,
            )
            if made:
                chosen = name
                break
        self._fills[(pad, dtype)] = made or False
        self.kernel[(pad, dtype)] = chosen

    def build(self, pad, query_start_loc, host_address: int, host_len: int, is64: bool, first_seq, num_seqs):
        """The ChunkMetadata of one build, or None (nothing written, no generation used)."""
        key = (pad, query_start_loc.dtype)
        fill = self._fills.get(key)
        if not fill or torch._C._cuda_getDevice() != self.device_index:
            return None
        ring = self.ring
        slot, generation = ring.claim()
        metadata = self.module.build(
            fill,
            host_address,
            host_len,
            is64,
            first_seq,
            num_seqs,
            query_start_loc.data_ptr(),
            slot,
            torch._C._cuda_getCurrentRawStream(self.device_index),
            generation,
            ring,
            ring.seq_views,
            ring.row_views,
            ring.cached_views,
        )
        if type(metadata) is int:
            if metadata > 0:  # a CUresult: the launch failed
                self._fills[key] = False
                self.kernel[key] = None
            return None
        ring.publish(slot, generation)
        return metadata
