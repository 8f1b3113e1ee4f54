"""The step kernel as CUDA C (``chunkmeta/csrc/step_fill.cu``), compiled at run time with NVRTC
(``chunkmeta.jit``): the C build's fast path.

Same job, same parameters and same results as ``chunkmeta.fill.step_fill.step_tables_kernel``,
which stays the portable path (Triton's CPU interpreter, ROCm, a machine without NVRTC, the
CUDA-graph mode) and the one the first build of each layout launches. What CUDA C can do that
Triton cannot is place shared memory and order the work by hand: each program's chunk ends go to
shared memory once; a row then finds its warp among the warps' totals, held in registers, and its
sequence among that warp's ends with a radix-4 search, three independent shared-memory loads per
level (``chunkmeta/csrc/row_search.h``), where Triton re-stages the searched array for every
``tl.gather``. The evidence is in bench/RESULTS.md (the step-fill sweeps).

Only ``chunkmeta.native`` launches it in a build: ``cuLaunchKernel`` from C, with the parameter
layout checked there by ``cuFuncGetParamInfo``. The kernel's constants (``CudaStepFill.defines``
and the input element types) are ``#define``s put before the source; ``step_chunks.h`` and
``row_search.h`` are NVRTC's headers. It compiles once per launch shape and NVRTC version (cached
on disk by ``chunkmeta.jit``) and loads once per process, at the end of the first build of a
layout. Without NVRTC, or when it fails, ``kernel()`` returns None, the C build launches the Triton
kernel, and one warning says why; ``CHUNKMETA_CUDA_FILL=0`` turns the CUDA C fill off without it.
"""

from __future__ import annotations

import ctypes

import torch

from chunkmeta import jit, tables
from chunkmeta.jit import check
from chunkmeta.jit import nvrtc_version as nvrtc_version  # the Makefile and bench ask this module
from chunkmeta.plan import cdiv, next_pow2

SWITCH = "CHUNKMETA_CUDA_FILL"
_MAX_SEQ_LANES = 8192  # 32 KiB of static shared memory (the static limit is 48 KiB)
_modules: dict[tuple, int] = {}  # (device, "step", input dtypes, defines) -> CUfunction (0: failed), per process


STEP_SOURCE = "step_fill.cu"
STEP_HEADER = "step_chunks.h"  # what the kernel and the C build's CPU fill share
ROW_SEARCH = "row_search.h"  # the row search (its Triton twin: chunkmeta.fill.row_search)
STEP_ENTRY = b"step_tables_fill"


# Mamba2 / SGLang-logical rows read their sequence's span from shared memory (SHARED_SPANS, see
# step_fill.cu) while the kernel's static shared memory, every entry's arrays summed, stays within
# this; above it (from 2048 sequence lanes) they load it from global memory. Static shared memory
# is capped at 48 KiB (ptxas refused 112 KiB at 8192 lanes).
SHARED_SPAN_LIMIT = 40 << 10
_SEQ_END_BYTES = 4  # ends[]: an int per lane


def _span_bytes(entry) -> int:
    """Shared bytes per lane of an entry's spans (an ``Entry`` or its plain tuple): start, length,
    position (and checkpoint)."""
    kind, flag = entry[0], entry[4]
    if kind not in (tables.MAMBA2, tables.LOGICAL):
        return 0
    return 16 if kind == tables.MAMBA2 and flag else 12


class CudaStepFill:
    """The CUDA C step fill (``chunkmeta/csrc/step_fill.cu``) for one step builder's entries and
    layout: ``chunkmeta.fill.step_fill.step_tables_kernel``'s twin, with its parameters, launched
    by ``chunkmeta.native``'s step build. Compiled once per process and shape on the first
    ``kernel()`` call for a triple of input dtypes. ``row_capacities``: each entry's rows in the
    padded layout (``SlotLayout.rows_pad``), which no step exceeds. ``threads`` / ``block_rows``:
    another launch shape than the default (bench/diagnostics/step_fill_sweep.py)."""

    def __init__(
        self,
        *,
        entries,
        block_seqs: int,
        padded: bool,
        params_on_device: bool = False,
        row_capacities=(),
        threads: int | None = None,
        block_rows: int | None = None,
        shared_spans: bool | None = None,
    ):
        lanes = max(next_pow2(block_seqs), 32)
        self.threads = threads or min(lanes, 256 if lanes <= 1024 else 512)
        self.seq_lanes = lanes
        # rows per program, a multiple of threads: 256 up to 1024 sequences, then max(512, lanes
        # / 8) (512 x 512 at 4096): the fastest shapes of bench/diagnostics/step_fill_sweep.py at
        # 256, 1024 and 4096 sequences (bench/results/step_fill_sweep-2026-12-02*.json; at 4096,
        # 256 x 256 won only at one and 4 + 4 requests, by 0.08 us at most, and took 1.7-2.6x as
        # long from 2048 + 2048). 8192 is unswept
        self.block_rows = (
            block_rows or cdiv(256 if lanes <= 1024 else max(512, lanes // 8), self.threads) * self.threads
        )
        if self.threads & (self.threads - 1) or not 32 <= self.threads <= lanes or self.block_rows % self.threads:
            raise ValueError(
                f"threads={self.threads}, block_rows={self.block_rows}: threads a power of two in "
                f"[32, {lanes}] (the sequence lanes) dividing block_rows"
            )
        table = ",".join("{" + ",".join(str(int(v)) for v in entry) + "}" for entry in entries)
        # entries whose every step's rows fit 16 bits (their capacity: the host's checks keep each
        # step within it) scan two rounds per shuffle; none without capacities (the one-shot's)
        paired = sum(1 << j for j, rows in enumerate(row_capacities) if rows < 1 << 16)
        if shared_spans is None:
            shared_spans = _SEQ_END_BYTES * lanes + sum(_span_bytes(e) * lanes for e in entries) <= SHARED_SPAN_LIMIT
        self.defines = (
            ("SEQ_LANES", self.seq_lanes),
            ("THREADS", self.threads),
            ("BLOCK_ROWS", self.block_rows),
            ("PADDED", int(padded)),
            ("PARAMS_ON_DEVICE", int(params_on_device)),
            ("NUM_ENTRIES", len(entries)),
            ("ENTRIES", table),
            ("PAIRED_ENTRIES", paired),
            ("SHARED_SPANS", int(shared_spans)),
        )

    def source(self, dtypes) -> bytes:
        """The translation unit: the element types and constants as ``#define``s, then the kernel."""
        names = ("QSL_T", "COMP_T", "CKPT_T")
        head = "".join(f"#define {name} {qsl_type(dtype)}\n" for name, dtype in zip(names, dtypes, strict=True))
        head += "".join(f"#define {name} {value}\n" for name, value in self.defines)
        return (head + jit.source(STEP_SOURCE)).encode()

    def kernel(self, dtypes, device: torch.device) -> tuple[int, int, int] | None:
        """``(CUfunction, num_warps, dynamic shared bytes)`` for inputs of ``dtypes`` on ``device``,
        as ``chunkmeta.native.make_steps`` takes it; None when it cannot be had."""
        if (
            not jit.enabled(SWITCH)
            or device.type != "cuda"
            or self.seq_lanes > _MAX_SEQ_LANES
            or any(dtype not in (torch.int32, torch.int64) for dtype in dtypes)
        ):
            return None
        key = (device.index, "step", tuple(dtypes), self.defines)
        function = _modules.get(key)
        if function is None:
            try:
                image = compile_step_cubin(self.source(dtypes), torch.cuda.get_device_capability(device))
                function = load_function(image, device, STEP_ENTRY)
            except Exception as exc:  # noqa: BLE001 -- any failure: the Triton step kernel
                why = str(exc) if isinstance(exc, jit.Unavailable) else f"{type(exc).__name__}: {exc}"
                jit.unavailable(SWITCH, "the CUDA C fill is off (the C build launches the Triton kernel)", why)
                function = 0
            _modules[key] = function
        return (function, self.threads // 32, 0) if function else None


def qsl_type(dtype: torch.dtype) -> str:
    """``QSL_T``: the C type of ``query_start_loc``'s elements."""
    return "long long" if dtype == torch.int64 else "int"


def compile_step_cubin(source: bytes, capability: tuple[int, int]) -> bytes:
    """A ``CudaStepFill.source`` compiled by NVRTC for ``capability``, with ``step_chunks.h`` and
    ``row_search.h`` as its headers (cached on disk)."""
    headers = {STEP_HEADER: jit.source(STEP_HEADER), ROW_SEARCH: jit.source(ROW_SEARCH)}
    return jit.cubin(source, capability, headers, program="step_tables_fill.cu")


# -- the driver, through ctypes (one-time work per kernel shape) ---------------------------

_libs: dict[str, ctypes.CDLL] = {}


def _cuda() -> ctypes.CDLL:
    if "cuda" not in _libs:
        _libs["cuda"] = ctypes.CDLL("libcuda.so.1")
    return _libs["cuda"]


def _driver_call(name: str):
    """A driver entry point, preferring its ``_v2`` ABI (what cuda.h's macros select)."""
    cuda = _cuda()
    return getattr(cuda, name + "_v2", None) or getattr(cuda, name)


_contexts: dict[int, ctypes.c_void_p] = {}  # device index -> its primary context, retained for good


def load_function(image: bytes, device: torch.device, entry: bytes) -> int:
    """Load a cubin into ``device``'s primary context (the one torch's runtime uses): its
    CUfunction ``entry``. The context is made current only for the load, whatever is current on
    this thread, and stays retained for the life of the process: a module lives as long as its
    context, and the CUfunction is launched for as long as the builder lives."""
    cuda = _cuda()
    context = _contexts.get(device.index)
    if context is None:
        context = ctypes.c_void_p()
        check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device.index), "cuDevicePrimaryCtxRetain")
        _contexts[device.index] = context
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    check(_driver_call("cuCtxPushCurrent")(context), "cuCtxPushCurrent")
    try:
        check(cuda.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        check(cuda.cuModuleGetFunction(ctypes.byref(function), module, entry), "cuModuleGetFunction")
    finally:
        _driver_call("cuCtxPopCurrent")(ctypes.byref(ctypes.c_void_p()))
    return function.value
