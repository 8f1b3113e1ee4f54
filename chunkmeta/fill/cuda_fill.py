"""The device fill as a CUDA C kernel, compiled at run time with NVRTC: the C build's fast path.

Same job, same parameters and same results as ``chunkmeta.fill.triton_fill.chunk_metadata_kernel``,
which stays the portable path (Triton's CPU interpreter, ROCm, a machine without NVRTC, the
CUDA-graph mode) and the one the first build of each layout launches. What CUDA C can do that
Triton cannot is place shared memory and order the work by hand:

* Each warp's chunk ends go to shared memory once, behind the kernel's only barrier. A row then
  finds its warp among the warps' totals, held in registers, and its sequence among that warp's
  ends with a radix-4 search: three independent shared-memory loads per level. Triton instead
  re-stages the searched array for every ``tl.gather``, a store and two barriers per round. At
  1024 sequences that was where its kernel's time above the I/O floor went (bench/RESULTS.md).
* A warp takes its sequences in rounds of 32, one per lane, so that every load and store of a
  round is one contiguous run and the shared-memory stores have no bank conflicts. Giving each
  thread consecutive sequences instead needs one warp scan in place of one per round, but
  spreads every load over SEQS_PER_THREAD times the lines (four at 1024 sequences).
* The rows, the longest chain of dependent work, are stored first; ``cu_seqlens`` and
  ``chunk_offsets`` after them, split between programs without a division.

Against the previous kernel (consecutive sequences per thread, those stores first), the two
took 0.12-0.22 µs off at 1024 sequences and 0.4-0.5 at 4096, and tied or cost up to 0.03 at 256
(bench/results/kernel_search_variants.txt, items 8-10).

Only ``chunkmeta.native`` launches it in a build: ``cuLaunchKernel`` from C, with the parameter
layout checked there by ``cuFuncGetParamInfo``. The kernel takes ``chunk_metadata_kernel``'s
parameters in its order (``step_params`` is unused: no graph mode here), so nothing else
changes. ``launch`` is a slow ctypes launch, for diagnostics.

NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel that torch's CUDA builds depend on, or from a
CUDA toolkit. The kernel compiles once per process and launch shape (~0.2 s), at the end of the
first build of a layout. Without NVRTC, or with ``CHUNKMETA_CUDA_FILL=0``, ``kernel()`` returns None
and the C build launches the Triton kernel.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import torch

from chunkmeta.plan import cdiv, next_pow2

# One program: THREADS threads, WARPS warps. Warp w owns WARP_LANES consecutive sequences and takes
# them in SEQS_PER_THREAD rounds of 32, one per lane: in round j lane l holds sequence
# SEQ(j) = w * WARP_LANES + 32 j + l, so each round's loads and stores are one contiguous run.
# A thread also owns ROWS_PER_THREAD rows spaced THREADS apart, so that a warp's 8-byte row
# stores are coalesced. SEQ_LANES is a power of two >= THREADS: the sequences every program
# scans. Lanes past num_seqs hold NO_END, so every search stays inside its warp's lanes.
_LAYOUT = r"""
#define SEQS_PER_THREAD (SEQ_LANES / THREADS)
#define WARP_LANES (32 * SEQS_PER_THREAD) /* the sequences of one warp */
#define ROWS_PER_THREAD (BLOCK_ROWS / THREADS)
#define WARPS (THREADS / 32)
#define NO_END 0x7fffffff
#define SEQ(j) (warp * WARP_LANES + 32 * (j) + lane)
/* the sequences whose cu_seqlens / chunk_offsets entries program b stores: THREADS of them from
   b * THREADS on, the last program the rest (no division) */
#define STORES_BEGIN ((int)(blockIdx.x * THREADS))
#define STORES_END(seqs_out) (blockIdx.x + 1 == gridDim.x ? (seqs_out) : min(STORES_BEGIN + THREADS, (seqs_out)))
"""

_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(THREADS)
chunk_metadata_fill(const QSL_T *__restrict__ query_start_loc, const int *__restrict__ step_params,
                    int *__restrict__ cu_seqlens, long long *__restrict__ chunk_indices,
                    long long *__restrict__ chunk_offsets, int first_seq, int num_seqs, int num_rows,
                    int seqs_out, int pad_seq) {
  /* per sequence, its chunk end counted from its warp's first chunk; NO_END past num_seqs */
  __shared__ int warp_ends[SEQ_LANES];
  __shared__ int warp_chunks[WARPS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const QSL_T *q = query_start_loc + first_seq;

  /* every load first: each sequence's start and stop offsets, and the base */
  QSL_T starts[SEQS_PER_THREAD], stops[SEQS_PER_THREAD];
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) starts[j] = SEQ(j) < num_seqs ? q[SEQ(j)] : (QSL_T)0;
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) stops[j] = SEQ(j) < num_seqs ? q[SEQ(j) + 1] : (QSL_T)0;
  const QSL_T base = q[0];
  const int num_tokens = PADDED ? (int)(q[num_seqs] - base) : 0;

  /* chunks per sequence, then their running sum through the warp's sequences in order: one warp
     scan per round, the rounds interleaved, then each round carried past the ones before it */
  int ends[SEQS_PER_THREAD];
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) {
    /* lengths fit int32 (host-validated): the unsigned add cannot wrap */
    unsigned len = SEQ(j) < num_seqs ? (unsigned)(stops[j] - starts[j]) : 0u;
    ends[j] = (int)((len + ((1u << CHUNK_SHIFT) - 1u)) >> CHUNK_SHIFT);
  }
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
#pragma unroll
    for (int j = 0; j < SEQS_PER_THREAD; j++) {
      int other = __shfl_up_sync(0xffffffffu, ends[j], d);
      if (lane >= d) ends[j] += other;
    }
  }
  int rounds_before = 0;
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) {
    const int round = __shfl_sync(0xffffffffu, ends[j], 31);
    ends[j] += rounds_before;
    rounds_before += round;
  }
  if (lane == 31) warp_chunks[warp] = rounds_before;
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) warp_ends[SEQ(j)] = SEQ(j) < num_seqs ? ends[j] : NO_END;
  __syncthreads(); /* the only barrier */

  /* each warp's last chunk end, in every thread's registers: NT, and where each warp starts */
  int warp_last[WARPS];
  int before = 0, num_chunks = 0;
#pragma unroll
  for (int w = 0; w < WARPS; w++) {
    before += w < warp ? warp_chunks[w] : 0;
    num_chunks += warp_chunks[w];
    warp_last[w] = num_chunks;
  }

  /* each row's sequence is the number of chunk ends at or before it: first its warp (the warps
     ending at or before it, counted in registers), then within that warp's sequences (a radix-4
     search of shared memory: three independent loads per level) */
#pragma unroll
  for (int k = 0; k < ROWS_PER_THREAD; k++) {
    const int r = blockIdx.x * BLOCK_ROWS + k * THREADS + tid;
    int w = 0, warp_start = 0;
#pragma unroll
    for (int v = 0; v < WARPS - 1; v++) {
      const bool past = warp_last[v] <= r;
      w += past;
      warp_start = past ? warp_last[v] : warp_start;
    }
    const int *ends_of = warp_ends + w * WARP_LANES;
    const int target = r - warp_start;
    int pos = 0, start = 0;
    if (LOG2_WARP_LANES & 1) { /* an odd number of levels: one binary level first */
      const int e = ends_of[WARP_LANES / 2 - 1];
      if (e <= target) {
        pos = WARP_LANES / 2;
        start = e;
      }
    }
#pragma unroll
    for (int step = (LOG2_WARP_LANES & 1 ? WARP_LANES / 2 : WARP_LANES) / 4; step >= 1; step /= 4) {
      const int a = ends_of[pos + step - 1], b = ends_of[pos + 2 * step - 1], c = ends_of[pos + 3 * step - 1];
      const bool in_a = a <= target, in_b = b <= target, in_c = c <= target;
      start = in_c ? c : in_b ? b : in_a ? a : start;
      pos += (in_a + in_b + in_c) * step;
    }
    if (r < num_rows) {
      int seq = w * WARP_LANES + pos, chunk = target - start;
      if (PADDED && r >= num_chunks) {
        seq = pad_seq;
        chunk = PAD_CHUNK;
      }
      chunk_indices[r] = (long long)(unsigned)seq | ((long long)chunk << 32);
    }
  }

  /* cu_seqlens[1:] and chunk_offsets[1:] last, off the rows' longer chain */
  const int lo = STORES_BEGIN, hi = STORES_END(seqs_out);
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) {
    const int s = SEQ(j);
    if (s >= lo && s < hi) {
      const bool real = !PADDED || s < num_seqs; /* padded tails repeat (T, NT) */
      cu_seqlens[1 + s] = real ? (int)(stops[j] - base) : num_tokens;
      chunk_offsets[1 + s] = real ? before + ends[j] : num_chunks;
    }
  }
  if (PADDED && blockIdx.x == 0 && tid == 0) {
    cu_seqlens[seqs_out] = num_tokens;
    chunk_offsets[seqs_out] = num_chunks;
  }
}
"""

ENTRY = b"chunk_metadata_fill"
_MAX_SEQ_LANES = 8192  # 32 KiB of static shared memory (the static limit is 48 KiB)
_modules: dict[tuple, int] = {}  # (device, offsets type, defines) -> CUfunction (0: failed), per process


def launch_shape(block_seqs: int) -> tuple[int, int]:
    """``(SEQ_LANES, THREADS)`` for a sequence capacity; a program owns THREADS rows (one each).

    Measured on an H200 in sweeps of 15-24 shapes (bench/results/kernel_sweep*.txt,
    kernel_search_variants.txt items 7-10): 256 threads up to 1024 sequences, 512 above. At 1024
    sequences, 256-thread programs of one row per thread were the fastest or tied within one
    timer step: in this kernel's layout 128-thread ones took 0.05-0.22 µs more, 512-thread ones
    0.21-0.25 and 1024-thread ones 0.8-0.9. At 4096, 512 threads beat 256 by 0.16-0.26 µs and
    128 by 0.82-0.96.
    """
    lanes = max(next_pow2(block_seqs), 32)
    return lanes, min(lanes, 256 if lanes <= 1024 else 512)


def _enabled() -> bool:
    return os.environ.get("CHUNKMETA_CUDA_FILL", "1") != "0"


class CudaFill:
    """The CUDA C fill for one builder layout: compiled (once per process and shape) on the first
    ``kernel()`` call for a ``query_start_loc`` dtype."""

    def __init__(self, *, chunk_size: int, block_seqs: int, padded: bool, pad_chunk: int = 0,
                 threads: int | None = None, block_rows: int | None = None):
        lanes, default_threads = launch_shape(block_seqs)
        self.threads = threads or default_threads
        self.block_rows = block_rows or self.threads
        self.seq_lanes = max(lanes, self.threads)
        if self.threads & (self.threads - 1) or not 32 <= self.threads <= 1024 or self.block_rows % self.threads:
            raise ValueError(f"threads={self.threads}, block_rows={self.block_rows}: threads a power of two in "
                             "[32, 1024] dividing block_rows")
        warp_lanes = 32 * self.seq_lanes // self.threads
        self.defines = (("CHUNK_SHIFT", chunk_size.bit_length() - 1), ("SEQ_LANES", self.seq_lanes),
                        ("LOG2_WARP_LANES", warp_lanes.bit_length() - 1),
                        ("THREADS", self.threads), ("BLOCK_ROWS", self.block_rows), ("PADDED", int(padded)),
                        ("PAD_CHUNK", pad_chunk))

    def kernel(self, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int] | None:
        """``(CUfunction, num_warps, dynamic shared bytes)`` for ``query_start_loc`` of ``dtype`` on
        ``device``, as ``chunkmeta.native.make_fill`` takes it; None when it cannot be had."""
        if (not _enabled() or device.type != "cuda" or self.seq_lanes > _MAX_SEQ_LANES
                or dtype not in (torch.int32, torch.int64)):
            return None
        qsl_t = "long long" if dtype == torch.int64 else "int"
        key = (device.index, qsl_t, self.defines)
        function = _modules.get(key)
        if function is None:
            try:
                image = compile_cubin(_source(qsl_t, self.defines), torch.cuda.get_device_capability(device))
                function = load_function(image, device, ENTRY)
            except Exception:  # noqa: BLE001 -- any failure (no NVRTC, an old one, a driver error): Triton
                function = 0
            _modules[key] = function
        return (function, self.threads // 32, 0) if function else None

    def launch(self, function: int, stream: int, *args: int) -> None:
        """One launch through ctypes (diagnostics: slow on the host). ``args``: the kernel's 5
        pointers then its 5 int32 scalars, as ``chunk_metadata_kernel`` takes them."""
        launch(function, max(cdiv(args[7], self.block_rows), 1), self.threads, stream, args[:5], args[5:])


def launch(function: int, grid: int, threads: int, stream: int, pointers, int32s) -> None:
    """``cuLaunchKernel`` through ctypes: pointer parameters, then int32 ones."""
    values = [ctypes.c_uint64(a) for a in pointers] + [ctypes.c_int32(a) for a in int32s]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    _check(_cuda().cuLaunchKernel(ctypes.c_void_p(function), grid, 1, 1, threads, 1, 1, 0, ctypes.c_void_p(stream),
                                  params, None), "cuLaunchKernel")


def _source(qsl_t: str, defines, body: str | None = None) -> bytes:
    """``body`` (default: the fill; or a diagnostic kernel of the same shape) after its defines."""
    head = "".join(f"#define {name} {value}\n" for name, value in defines)
    return (f"#define QSL_T {qsl_t}\n" + head + _LAYOUT + (_SOURCE if body is None else body)).encode()


# -- NVRTC and the driver, through ctypes (one-time work per kernel shape) ------------------

_libs: dict[str, ctypes.CDLL] = {}


def _nvrtc_candidates() -> list[str]:
    """NVRTC libraries to try, those of torch's CUDA major version first (a cubin from a newer
    NVRTC may not load on the driver torch runs on)."""
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    found = []
    for root in sys.path:  # the nvidia-cuda-nvrtc wheels: nvidia/cu13/lib, nvidia/cuda_nvrtc/lib
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    found = [p for p in found if "builtins" not in p and "alt" not in os.path.basename(p)] + names
    major = (torch.version.cuda or "").split(".")[0]
    return sorted(found, key=lambda p: not (major and (p.endswith(f".so.{major}") or f"/cu{major}/" in p)))


def _nvrtc() -> ctypes.CDLL:
    if "nvrtc" not in _libs:
        errors = []
        for candidate in _nvrtc_candidates():
            try:
                # NVRTC opens its builtins library by name at compile time; a wheel's copy sits
                # next to it but off the loader's path, so load it first (where there is one)
                directory = os.path.dirname(candidate)
                for builtins in sorted(glob.glob(os.path.join(directory, "libnvrtc-builtins.so*")) if directory else []):
                    try:
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                    except OSError:  # NVRTC may still find one on the loader's path
                        pass
                _libs["nvrtc"] = ctypes.CDLL(candidate)
                break
            except OSError as e:
                errors.append(str(e))
        else:
            raise OSError("NVRTC not found: " + "; ".join(errors[-2:]))
    return _libs["nvrtc"]


def nvrtc_version() -> str | None:
    """The NVRTC this process would compile with ("13.0"), or None without one."""
    try:
        major, minor = ctypes.c_int(), ctypes.c_int()
        _check(_nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    except (OSError, RuntimeError):
        return None
    return f"{major.value}.{minor.value}"


def _cuda() -> ctypes.CDLL:
    if "cuda" not in _libs:
        _libs["cuda"] = ctypes.CDLL("libcuda.so.1")
    return _libs["cuda"]


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with error {result}")


def compile_cubin(source: bytes, capability: tuple[int, int]) -> bytes:
    """The kernel's cubin for ``capability`` (sm_XY), compiled by NVRTC."""
    nvrtc = _nvrtc()
    program = ctypes.c_void_p()
    _check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"chunk_metadata_fill.cu", 0, None, None),
           "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture=sm_{capability[0]}{capability[1]}".encode(), b"-default-device"]
        array = (ctypes.c_char_p * len(options))(*options)
        result = nvrtc.nvrtcCompileProgram(program, len(options), array)
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC failed ({result}): {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


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
        _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device.index), "cuDevicePrimaryCtxRetain")
        _contexts[device.index] = context
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    _check(_driver_call("cuCtxPushCurrent")(context), "cuCtxPushCurrent")
    try:
        _check(cuda.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        _check(cuda.cuModuleGetFunction(ctypes.byref(function), module, entry), "cuModuleGetFunction")
    finally:
        _driver_call("cuCtxPopCurrent")(ctypes.byref(ctypes.c_void_p()))
    return function.value
