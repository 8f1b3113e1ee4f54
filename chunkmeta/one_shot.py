"""build_chunk_metadata: one batch's FLA tables into fresh tensors, with no ring.

The tables are the step kernel's FLA entry (``chunkmeta.tables.one_shot_layout``: entry 0 written
too, since nothing zeroes the memory), launched once into a region of ``chunkmeta.arena``'s blocks
sized to the batch. The kernel is compiled once per process per power-of-two bucket of sequences;
once it is, the whole host side is one C call (``chunkmeta.native``'s ``oneshot``: the tensors'
checks, the step build's plan and launch, the arena's slices, the host copy, the result). On CPU
tensors that call fills the tables in C, after a first build of the torch fill.
"""

from __future__ import annotations

import torch

from chunkmeta import arena as _arena
from chunkmeta import native
from chunkmeta import plan as _plan
from chunkmeta import tables as _tables
from chunkmeta.errors import ChunkMetaError
from chunkmeta.fill import resolve_backend
from chunkmeta.fill.torch_fill import fill_entry_torch
from chunkmeta.metadata import ChunkMetadata

_INT_DTYPES = (torch.int32, torch.int64)
# The one-shot's Triton fills, compiled once per process: (chunk_size, lanes, indices dtype) -> StepFill
_FILLS: dict[tuple, object] = {}
# ... and the C build's capsules per backend asked for: (chunk_size, lanes, indices dtype,
# query_start_loc dtype, device: a CUDA index or -1) -> steps capsule, or None (no C build)
_C: dict[str, dict[tuple, object]] = {backend: {} for backend in ("auto", "triton", "torch")}
# the widest sizes one build supports, per chunk size
_WIDEST = {}


def build_chunk_metadata(
    query_start_loc: torch.Tensor,
    query_start_loc_cpu,
    *,
    chunk_size: int = 64,
    first_seq: int = 0,
    num_seqs: int | None = None,
    backend: str = "auto",
    indices_dtype: torch.dtype = torch.int32,
) -> ChunkMetadata:
    """One-shot build into fresh tensors (sized to this batch): no ring, always live.

    The tables are new slices of ``chunkmeta.arena``'s blocks (views, not allocations: nothing
    else ever writes them; a live result keeps its blocks from being freed), and one launch
    fills them, every entry included (no memset). A one-shot captured into a CUDA graph
    allocates them instead, from the graph's pool. ``indices_dtype=torch.int64`` writes
    ``chunk_indices`` as int64 (the ROCm Kimi-K3 helper's contract for int64 ``cu_seqlens``),
    outside FLA's int32 contract. For a step loop, keep a ``ChunkMetadataBuilder`` instead: it
    allocates once.
    """
    made = _one_shot_c(query_start_loc, query_start_loc_cpu, chunk_size, first_seq, num_seqs, backend, indices_dtype)
    if made is not None:
        return made
    if not isinstance(query_start_loc, torch.Tensor):
        raise ChunkMetaError(f"query_start_loc is a {type(query_start_loc).__name__}: must be the device torch tensor.")
    host = _plan.host_array(query_start_loc_cpu)
    _plan.check_device_tensor(query_start_loc, host.shape[0], None)
    _plan.check_chunk_size(chunk_size)
    if indices_dtype not in _INT_DTYPES:
        raise ChunkMetaError(f"indices_dtype={indices_dtype!r}: must be torch.int32 (FLA's) or torch.int64.")
    device = query_start_loc.device
    resolved = resolve_backend(backend, device)
    step = _plan.plan_step(host, first_seq, num_seqs, chunk_size, _widest(chunk_size), _plan.host_address(host))
    # validated: from here on nothing fails on bad input
    n, nt = step.num_seqs, step.num_chunks
    lanes = _lanes(n)
    layout = _tables.one_shot_layout(chunk_size, lanes, indices_dtype)
    offsets, cu, indices, cu_cpu, region = _outputs(device, layout, n, nt, indices_dtype)
    _plan.write_host_cu_seqlens(step, cu_cpu.numpy())
    if resolved == "torch":
        regions = (cu, indices, offsets, None)
        fill_entry_torch(
            layout.entry, query_start_loc, query_start_loc, query_start_loc, regions, step.first_seq, n, nt, False
        )
    else:
        _launch(query_start_loc, region, layout, (chunk_size, lanes, indices_dtype), step.first_seq, n, nt)
    key = (chunk_size, lanes, indices_dtype, query_start_loc.dtype, device.index if device.type == "cuda" else -1)
    if key not in _C[backend]:
        _C[backend][key] = _make_steps(resolved, layout, key, device)
    return ChunkMetadata(
        cu, cu_cpu, indices, offsets, chunk_size, n, step.num_tokens, nt, step.max_seqlen, None, 0, None, 0
    )


def _lanes(num_seqs: int) -> int:
    """A one-shot's bucket of sequences: its kernel is compiled once per process per bucket."""
    return _plan.next_pow2(max(num_seqs, 16))


def _widest(chunk_size: int) -> _plan.Capacity:
    """The widest sizes one build supports: validated against them, the tables sized to the batch."""
    widest = _WIDEST.get(chunk_size)
    if widest is None:
        widest = _WIDEST[chunk_size] = _plan.Capacity(
            _plan.MAX_NUM_SEQS, _plan.INT32_MAX - chunk_size, _plan.INT32_MAX // chunk_size
        )
    return widest


def _outputs(device: torch.device, layout: _tables.OneShotLayout, num_seqs: int, num_chunks: int, indices_dtype):
    """``(chunk_offsets, cu_seqlens, chunk_indices, cu_seqlens_cpu, region bytes)``: slices of
    the arena of the current stream, or, on a stream being captured into a CUDA graph, of a
    fresh allocation (``chunkmeta.arena`` says why)."""
    wide = indices_dtype == torch.int64
    args = (num_seqs, num_chunks, layout.offsets_at, layout.indices_at, wide)
    if device.type != "cuda":
        return _arena.arena(-1, 0).take(*args, region=True)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        if torch.cuda.is_current_stream_capturing():
            # from the graph's pool, sized to the batch
            return _arena.Arena(index, block_bytes=0, host_entries=0).take(*args, region=True)
        stream = torch.cuda.current_stream(index).cuda_stream
        return _arena.arena(index, stream).take(*args, region=True)


def _launch(query_start_loc, region, layout, fill_key, first_seq: int, num_seqs: int, num_chunks: int) -> None:
    """The Triton step kernel's launch of the one-shot's entry into ``region``."""
    fill = _FILLS.get(fill_key)
    if fill is None:
        from chunkmeta.fill.step_fill import StepFill  # imports triton

        fill = _FILLS[fill_key] = StepFill(entries=(layout.entry,), block_seqs=fill_key[1], padded=False)
    ints = (first_seq, num_seqs, 0, num_chunks, 0, 0, 0, 0, 0)
    qsl = query_start_loc.data_ptr()
    dtypes = (query_start_loc.dtype,) * 3  # no entry reads the per-request arrays
    if not fill.launch(dtypes, (qsl, qsl, qsl, region.data_ptr(), qsl), ints):
        fill(query_start_loc, query_start_loc, query_start_loc, region, ints)


def _make_steps(backend: str, layout, key: tuple, device: torch.device):
    """The C build's capsule for a one-shot key after its first build (which compiled the Triton
    kernel): launching the CUDA C fill or that kernel on CUDA (Triton's builds only: a CUDA torch
    one-shot keeps its fill), filling in C on the CPU (the torch fill's builds only: a CPU Triton
    one-shot stays the interpreter's); None where it cannot."""
    module = native.module()
    if module is None:
        return None
    chunk_size, lanes, _, qsl_dtype, _ = key
    entries = [layout.entry.packed(0)]
    caps = (lanes, _plan.INT32_MAX - chunk_size)
    if device.type != "cuda":
        if backend != "torch":
            return None
        return module.make_steps(0, 1, 1, 0, *caps, 0, entries, [0], [[0]], 1)
    if backend != "triton" or native.cuda_launcher() is None:
        return None
    from chunkmeta.fill.cuda_fill import CudaStepFill

    dtypes = (qsl_dtype,) * 3
    candidates = []
    # one row per thread, as the one-table CUDA fill had it: with the step fill's 256 rows per
    # program (8 per thread at these buckets' 32 threads) the one-shot of 1 x 192k took 2.83 us of
    # device time on the H200 against that fill's 2.23 (gpu_compare@2026-12-03T13:24:40Z, 13:25:34Z)
    threads = CudaStepFill(entries=(layout.entry,), block_seqs=lanes, padded=False).threads
    cuda = CudaStepFill(entries=(layout.entry,), block_seqs=lanes, padded=False, block_rows=threads)
    kernel = cuda.kernel(dtypes, device)
    if kernel is not None:
        candidates.append((*kernel, cuda.block_rows))
    fill = _FILLS[(chunk_size, lanes, key[2])]  # the Triton kernel this key's first build compiled
    kernel = fill.plain_kernel(dtypes)
    if kernel is not None:
        candidates.append((*kernel, fill.block_rows))
    for function, num_warps, shared, block_rows in candidates:
        made = module.make_steps(function, block_rows, num_warps, shared, *caps, 0, entries, [0], [[0]], 0)
        if made is not None:
            return made
    return None


def _one_shot_c(query_start_loc, query_start_loc_cpu, chunk_size, first_seq, num_seqs, backend, indices_dtype):
    """The one-shot's whole host side in one C call once a build of its key made a capsule;
    None where the general path must run (first calls, bad input, a stream being captured)."""
    kernels = _C.get(backend)
    if not kernels or indices_dtype not in _INT_DTYPES or type(query_start_loc) is not torch.Tensor:
        return None  # nothing is compiled yet (and CUDA may be uninitialized)
    module = native.module()
    if module is None:
        return None
    if query_start_loc.is_cuda:
        device = torch._C._cuda_getDevice()
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        stream = torch._C._cuda_getCurrentRawStream(device)
    else:
        device, stream = -1, 0
    made = module.oneshot(
        kernels,
        _arena.arena(device, stream),
        query_start_loc,
        query_start_loc_cpu,
        first_seq,
        num_seqs,
        chunk_size,
        indices_dtype,
        device,
        stream,
    )
    return None if type(made) is int else made
