"""The device fill as a CUDA C kernel (``chunkmeta/csrc/chunk_fill.cu``), compiled at run time
with NVRTC (``chunkmeta.jit``): the C build's fast path.

Same job, same parameters and same results as ``chunkmeta.fill.triton_fill.chunk_metadata_kernel``,
which stays the portable path (Triton's CPU interpreter, ROCm, a machine without NVRTC, the
CUDA-graph mode) and the one the first build of each layout launches. What CUDA C can do that
Triton cannot is place shared memory and order the work by hand:

* Each warp's chunk ends go to shared memory once, behind the kernel's only barrier. A row then
  finds its warp among the warps' totals, held in registers, and its sequence among that warp's
  ends with a radix-4 search: three independent shared-memory loads per level. Triton instead
  re-stages the searched array for every ``tl.gather``, a store and two barriers per round.
* A warp takes its sequences in rounds of 32, one per lane, so that every load and store of a
  round is one contiguous run and the shared-memory stores have no bank conflicts. Giving each
  thread consecutive sequences instead needs one warp scan in place of one per round, but
  spreads every load over SEQS_PER_THREAD times the lines.
* The rows, the longest chain of dependent work, are stored first; ``cu_seqlens`` and
  ``chunk_offsets`` after them, split between programs without a division.

The evidence for each choice (and the variants not kept) is in bench/RESULTS.md ("Kernel
sweeps", "Kernel variants").

Only ``chunkmeta.native`` launches it in a build: ``cuLaunchKernel`` from C, with the parameter
layout checked there by ``cuFuncGetParamInfo``. The kernel takes ``chunk_metadata_kernel``'s
parameters in its order (``step_params`` is unused: no graph mode here), so nothing else
changes. ``launch`` is a slow ctypes launch, for diagnostics.

The kernel's constants (``CudaFill.defines``, and ``QSL_T``) are ``#define``s put before the
source (``_source``); ``chunk_fill.h`` is NVRTC's one header. It compiles once per launch shape
and NVRTC version (cached on disk by ``chunkmeta.jit``) and loads once per process, at the end of
the first build of a layout. Without NVRTC, or when it fails, ``kernel()`` returns None, the C
build launches the Triton kernel, and one warning says why; ``CHUNKMETA_CUDA_FILL=0`` turns the
CUDA C fill off without it.
"""

from __future__ import annotations

import ctypes

import torch

from chunkmeta import jit
from chunkmeta.jit import check
from chunkmeta.jit import nvrtc_version as nvrtc_version  # the Makefile and bench ask this module
from chunkmeta.plan import cdiv, next_pow2

SWITCH = "CHUNKMETA_CUDA_FILL"
HEADER = "chunk_fill.h"  # the layout macros the kernel and the host harness share
ENTRY = b"chunk_metadata_fill"
_MAX_SEQ_LANES = 8192  # 32 KiB of static shared memory (the static limit is 48 KiB)
_modules: dict[tuple, int] = {}  # (device, query_start_loc type, defines) -> CUfunction (0: failed), per process


def launch_shape(block_seqs: int) -> tuple[int, int]:
    """``(SEQ_LANES, THREADS)`` for a sequence capacity; a program owns THREADS rows (one each).

    SEQ_LANES is the capacity rounded up to a power of two (at least a warp); THREADS is 256 up to
    1024 sequences and 512 above, the fastest or tied shapes of the kernel sweeps
    (bench/RESULTS.md, "Kernel sweeps"; bench/kernel_sweep.py measures every shape).
    """
    lanes = max(next_pow2(block_seqs), 32)
    return lanes, min(lanes, 256 if lanes <= 1024 else 512)


class CudaFill:
    """The CUDA C fill for one builder layout: compiled (once per process and shape) on the first
    ``kernel()`` call for a ``query_start_loc`` dtype.

    ``defines``: the kernel's compile-time constants (``chunk_fill.h`` lists them), ``QSL_T``
    apart; the grid is ``cdiv(num_rows, block_rows)`` programs (at least 1) of ``threads``."""

    def __init__(
        self,
        *,
        chunk_size: int,
        block_seqs: int,
        padded: bool,
        pad_chunk: int = 0,
        offsets_dtype: torch.dtype = torch.int64,
        threads: int | None = None,
        block_rows: int | None = None,
    ):
        lanes, default_threads = launch_shape(block_seqs)
        self.threads = threads or default_threads
        self.block_rows = block_rows or self.threads
        self.seq_lanes = max(lanes, self.threads)
        if self.threads & (self.threads - 1) or not 32 <= self.threads <= 1024 or self.block_rows % self.threads:
            raise ValueError(
                f"threads={self.threads}, block_rows={self.block_rows}: threads a power of two in "
                "[32, 1024] dividing block_rows"
            )
        warp_lanes = 32 * self.seq_lanes // self.threads
        self.defines = (
            ("CHUNK_SHIFT", chunk_size.bit_length() - 1),
            ("SEQ_LANES", self.seq_lanes),
            ("LOG2_WARP_LANES", warp_lanes.bit_length() - 1),
            ("THREADS", self.threads),
            ("BLOCK_ROWS", self.block_rows),
            ("PADDED", int(padded)),
            ("PAD_CHUNK", pad_chunk),
            ("OFFSET_T", "int" if offsets_dtype == torch.int32 else "long long"),
        )

    def kernel(self, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int] | None:
        """``(CUfunction, num_warps, dynamic shared bytes)`` for ``query_start_loc`` of ``dtype`` on
        ``device``, as ``chunkmeta.native.make_fill`` takes it; None when it cannot be had."""
        if (
            not jit.enabled(SWITCH)
            or device.type != "cuda"
            or self.seq_lanes > _MAX_SEQ_LANES
            or dtype not in (torch.int32, torch.int64)
        ):
            return None
        qsl_t = qsl_type(dtype)
        key = (device.index, qsl_t, self.defines)
        function = _modules.get(key)
        if function is None:
            try:
                image = compile_cubin(_source(qsl_t, self.defines), torch.cuda.get_device_capability(device))
                function = load_function(image, device, ENTRY)
            except Exception as exc:  # noqa: BLE001 -- any failure (no NVRTC, an old one, a driver error): Triton
                why = str(exc) if isinstance(exc, jit.Unavailable) else f"{type(exc).__name__}: {exc}"
                jit.unavailable(SWITCH, "the CUDA C fill is off (the C build launches the Triton kernel)", why)
                function = 0
            _modules[key] = function
        return (function, self.threads // 32, 0) if function else None

    def launch(self, function: int, stream: int, *args: int) -> None:
        """One launch through ctypes (diagnostics: slow on the host). ``args``: the kernel's 5
        pointers then its 5 int32 scalars, as ``chunk_metadata_kernel`` takes them."""
        launch(function, max(cdiv(args[7], self.block_rows), 1), self.threads, stream, args[:5], args[5:])


STEP_SOURCE = "step_fill.cu"
STEP_HEADER = "step_chunks.h"  # what the kernel and the C build's CPU fill share
ROW_SEARCH = "row_search.h"  # the row search both kernels share
STEP_ENTRY = b"step_tables_fill"


class CudaStepFill:
    """The CUDA C step fill (``chunkmeta/csrc/step_fill.cu``) for one step builder's entries and
    layout: ``chunkmeta.fill.step_fill.step_tables_kernel``'s twin, with its parameters, launched
    by ``chunkmeta.native``'s step build. Compiled once per process and shape on the first
    ``kernel()`` call for a triple of input dtypes. ``threads`` / ``block_rows``: another launch
    shape than the default (bench/step_fill_sweep.py)."""

    def __init__(
        self,
        *,
        entries,
        block_seqs: int,
        padded: bool,
        params_on_device: bool = False,
        threads: int | None = None,
        block_rows: int | None = None,
    ):
        lanes = max(next_pow2(block_seqs), 32)
        self.threads = threads or min(lanes, 256 if lanes <= 1024 else 512)
        self.seq_lanes = lanes
        # rows per program, a multiple of threads: 256 up to 1024 sequences, then max(512, lanes
        # / 8) (512 x 512 at 4096): the fastest shapes of bench/step_fill_sweep.py at 256, 1024
        # and 4096 sequences (bench/results/step_fill_sweep-2026-12-02*.json; at 4096, 256 x 256
        # won only at one and 4 + 4 requests, by 0.08 us at most, and took 1.7-2.6x as long from
        # 2048 + 2048). 8192 is unswept
        self.block_rows = (
            block_rows or cdiv(256 if lanes <= 1024 else max(512, lanes // 8), self.threads) * self.threads
        )
        if self.threads & (self.threads - 1) or not 32 <= self.threads <= lanes or self.block_rows % self.threads:
            raise ValueError(
                f"threads={self.threads}, block_rows={self.block_rows}: threads a power of two in "
                f"[32, {lanes}] (the sequence lanes) dividing block_rows"
            )
        table = ",".join("{" + ",".join(str(int(v)) for v in entry) + "}" for entry in entries)
        self.defines = (
            ("SEQ_LANES", self.seq_lanes),
            ("THREADS", self.threads),
            ("BLOCK_ROWS", self.block_rows),
            ("PADDED", int(padded)),
            ("PARAMS_ON_DEVICE", int(params_on_device)),
            ("NUM_ENTRIES", len(entries)),
            ("ENTRIES", table),
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


def launch(function: int, grid: int, threads: int, stream: int, pointers, int32s) -> None:
    """``cuLaunchKernel`` through ctypes: pointer parameters, then int32 ones."""
    values = [ctypes.c_uint64(a) for a in pointers] + [ctypes.c_int32(a) for a in int32s]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    check(
        _cuda().cuLaunchKernel(
            ctypes.c_void_p(function), grid, 1, 1, threads, 1, 1, 0, ctypes.c_void_p(stream), params, None
        ),
        "cuLaunchKernel",
    )


def _source(qsl_t: str, defines, body: str | None = None) -> bytes:
    """The translation unit NVRTC compiles: ``QSL_T`` and ``defines`` as ``#define``s, then
    ``chunk_fill.cu`` (default), or ``body``, a diagnostic kernel of the same shape, after
    ``chunk_fill.h``."""
    head = f"#define QSL_T {qsl_t}\n" + "".join(f"#define {name} {value}\n" for name, value in defines)
    return (head + (jit.source("chunk_fill.cu") if body is None else f'#include "{HEADER}"\n' + body)).encode()


def compile_cubin(source: bytes, capability: tuple[int, int]) -> bytes:
    """A translation unit of ``_source``'s, compiled by NVRTC for ``capability`` (sm_XY), with
    ``chunk_fill.h`` and ``row_search.h`` as its headers (``chunkmeta.jit.cubin``: cached on disk)."""
    return jit.cubin(source, capability, {HEADER: jit.source(HEADER), ROW_SEARCH: jit.source(ROW_SEARCH)})


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
