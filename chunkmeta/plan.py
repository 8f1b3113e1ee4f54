"""Host-side plan of one build: sizes, hints and validation, from host data only.

Everything here reads the host copy of ``query_start_loc`` (a numpy view of the engine's CPU
tensor) and never touches device memory: this is where the sizes that shape the output tensors
(N, T, NT) come from, so the device fill never needs a host value that depends on device data.

The hot path (``plan_step``) is a handful of cheap checks; when one of them fails,
``diagnose_step`` re-examines the input slowly and raises the precise ``ChunkMetaError``.
"""

from __future__ import annotations

import itertools
import numbers
from typing import NamedTuple

import numpy as np
import torch

from chunkmeta import native
from chunkmeta.errors import ChunkMetaError

INT32_MAX = 2**31 - 1
# Chunk sizes FLA's chunked kernels use are 16, 32 and 64; larger powers of two are allowed for
# other chunked-scan kernels. The fill uses shifts, hence powers of two.
MIN_CHUNK_SIZE = 16
MAX_CHUNK_SIZE = 4096
# The Triton fill holds one program's view of all sequences in registers.
MAX_NUM_SEQS = 1 << 16
# Up to this many sequences the plan loops in Python, where a loop over a list costs less than the
# fixed per-call overhead of the compiled helper (chunkmeta.native) or of numpy. Speed only: all
# paths agree (tests/core/test_plan.py). The host plan's timings: bench/RESULTS.md ("Where the
# host time goes").
_SMALL_BATCH = 16

_INTEGER_DTYPES = (torch.int32, torch.int64)
_NP_INTEGER_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


class Capacity(NamedTuple):
    """What a builder's buffers hold: sequences, tokens and chunk rows."""

    seqs: int
    tokens: int
    rows: int


class StepPlan(NamedTuple):
    """Host facts of one build: the prefill slice and the sizes that shape the outputs."""

    first_seq: int
    num_seqs: int
    num_tokens: int
    num_chunks: int
    max_seqlen: int
    segment: np.ndarray  # host query_start_loc[first_seq : first_seq + num_seqs + 1], not rebased


def host_address(host: np.ndarray) -> int | None:
    """The data address of a contiguous host array (for the compiled plan), else None."""
    if host.strides[0] != host.itemsize:
        return None
    return host.__array_interface__["data"][0]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` >= n: the tables' 16-byte alignment."""
    return cdiv(n, multiple) * multiple


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the kernels' lane and block counts."""
    return 1 << max(0, n - 1).bit_length()


def capacity_for(max_num_seqs: int, max_num_tokens: int, chunk_size: int) -> Capacity:
    """Validate a builder's sizes and return its capacity (chunk rows included)."""
    check_chunk_size(chunk_size)
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or not 1 <= max_num_seqs <= MAX_NUM_SEQS:
        raise ChunkMetaError(
            f"max_num_seqs={max_num_seqs!r}: must be an int in [1, {MAX_NUM_SEQS}]; "
            "pass the engine's max_num_seqs (sequences per step)."
        )
    if (
        not isinstance(max_num_tokens, int)
        or isinstance(max_num_tokens, bool)
        or not 1 <= max_num_tokens <= INT32_MAX - chunk_size
    ):
        raise ChunkMetaError(
            f"max_num_tokens={max_num_tokens!r}: must be an int in [1, {INT32_MAX - chunk_size}] "
            "(token offsets are int32); pass the engine's max_num_batched_tokens."
        )
    rows = cdiv(max_num_tokens, chunk_size) + max_num_seqs
    # rows * chunk_size < 2**32 is what lets plan_step skip an exact check for int32 wrap-around:
    # a wrapped difference adds 2**32 tokens, which then cannot fit the row capacity.
    assert rows * chunk_size < 2**32
    return Capacity(max_num_seqs, max_num_tokens, rows)


def check_chunk_size(chunk_size: int) -> None:
    ok = (
        isinstance(chunk_size, int)
        and not isinstance(chunk_size, bool)
        and MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE
        and chunk_size & (chunk_size - 1) == 0
    )
    if not ok:
        raise ChunkMetaError(
            f"chunk_size={chunk_size!r}: must be a power of two in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]; "
            "FLA's KDA uses 64 (32 allowed), GDN 16, 32 or 64."
        )


def host_array(query_start_loc_cpu) -> np.ndarray:
    """The host copy as a 1-D int32/int64 numpy array (a view, never a copy of device memory)."""
    if isinstance(query_start_loc_cpu, torch.Tensor):
        if query_start_loc_cpu.device.type != "cpu":
            raise ChunkMetaError(
                f"query_start_loc_cpu is on {query_start_loc_cpu.device}: it must be the host copy; "
                "pass the CPU tensor the scheduler already has (reading a device tensor would sync)."
            )
        if query_start_loc_cpu.dtype not in _INTEGER_DTYPES:
            raise ChunkMetaError(
                f"query_start_loc_cpu has dtype {query_start_loc_cpu.dtype}: must be torch.int32 or "
                "torch.int64; convert it once where the scheduler builds it."
            )
        check_dense("query_start_loc_cpu", query_start_loc_cpu)
        array = query_start_loc_cpu.numpy()
    elif isinstance(query_start_loc_cpu, np.ndarray):
        if query_start_loc_cpu.dtype not in _NP_INTEGER_DTYPES:
            raise ChunkMetaError(f"query_start_loc_cpu has dtype {query_start_loc_cpu.dtype}: must be int32 or int64.")
        array = query_start_loc_cpu
    else:
        raise ChunkMetaError(
            f"query_start_loc_cpu is a {type(query_start_loc_cpu).__name__}: must be a CPU torch "
            "tensor or a numpy array of int32/int64."
        )
    if array.ndim != 1 or array.shape[0] < 1:
        raise ChunkMetaError(
            f"query_start_loc_cpu has shape {tuple(array.shape)}: must be 1-D with R+1 >= 1 "
            "entries (cumulative query lengths of R requests, starting with the first offset)."
        )
    return array


def check_dense(name: str, tensor: torch.Tensor) -> None:
    """A strided (dense) tensor: the builds read its memory by address; a sparse one has none."""
    if tensor.layout is not torch.strided:
        raise ChunkMetaError(
            f"{name} has layout {tensor.layout}: must be a dense (strided) tensor; convert it once where the "
            "scheduler builds it."
        )


def check_device_tensor(query_start_loc, host_len: int, device: torch.device | None) -> None:
    """The device copy: usable dtype, 1-D, contiguous, the host copy's length, the right device."""
    if not isinstance(query_start_loc, torch.Tensor):
        raise ChunkMetaError(f"query_start_loc is a {type(query_start_loc).__name__}: must be the device torch tensor.")
    check_dense("query_start_loc", query_start_loc)
    if query_start_loc.dtype not in _INTEGER_DTYPES:
        raise ChunkMetaError(f"query_start_loc has dtype {query_start_loc.dtype}: must be torch.int32 or torch.int64.")
    if query_start_loc.dim() != 1:
        raise ChunkMetaError(f"query_start_loc has shape {tuple(query_start_loc.shape)}: must be 1-D [R+1].")
    if query_start_loc.shape[0] != host_len:
        raise ChunkMetaError(
            f"query_start_loc has {query_start_loc.shape[0]} entries but query_start_loc_cpu has "
            f"{host_len}: pass the host copy of the same tensor (same R+1 entries)."
        )
    if query_start_loc.stride(0) != 1:
        raise ChunkMetaError(
            f"query_start_loc has stride {query_start_loc.stride(0)}: must be contiguous; "
            "pass a contiguous slice (or .contiguous() once, outside the step)."
        )
    if device is not None and query_start_loc.device != device:
        raise ChunkMetaError(
            f"query_start_loc is on {query_start_loc.device} but the builder's buffers are on "
            f"{device}: build with the builder of that device."
        )


def plan_step(
    host: np.ndarray,
    first_seq: int,
    num_seqs: int | None,
    chunk_size: int,
    capacity: Capacity,
    address: int | None = None,
) -> StepPlan:
    """Sizes of one build; raises ChunkMetaError (via diagnose_step) on any bad input.

    With ``address`` (the host array's data address, from ``host_address``) the per-sequence
    pass of a large batch runs in the compiled helper (``chunkmeta.native.module()``, C compiled
    on first use) when it is available; otherwise in Python (small batches) or numpy. All three
    give the same sizes and the same errors.
    """
    num_requests = host.shape[0] - 1
    if type(first_seq) is not int:
        first_seq = index_arg("first_seq", first_seq)
    if num_seqs is None:
        num_seqs = num_requests - first_seq
    elif type(num_seqs) is not int:
        num_seqs = index_arg("num_seqs", num_seqs)
    if first_seq < 0 or num_seqs < 0 or first_seq + num_seqs > num_requests or num_seqs > capacity.seqs:
        diagnose_step(host, first_seq, num_seqs, chunk_size, capacity)
    segment = host[first_seq : first_seq + num_seqs + 1]
    start = int(segment[0])
    num_tokens = int(segment[-1]) - start
    if start < 0 or not 0 <= num_tokens <= capacity.tokens:
        diagnose_step(host, first_seq, num_seqs, chunk_size, capacity)
    shift = chunk_size.bit_length() - 1
    compiled = native.module() if num_seqs > _SMALL_BATCH and address is not None else None
    if compiled is not None:
        # one pass in C; it flags a decrease by comparing offsets, so lengths never wrap
        bad, num_chunks, max_seqlen = compiled.plan(
            address + first_seq * host.itemsize, num_seqs, host.itemsize == 8, shift
        )
        if bad:
            diagnose_step(host, first_seq, num_seqs, chunk_size, capacity)
    elif num_seqs <= _SMALL_BATCH:
        num_chunks = 0
        max_seqlen = 0
        prev = start
        for end in segment[1:].tolist():
            length = end - prev
            if length < 0:
                diagnose_step(host, first_seq, num_seqs, chunk_size, capacity)
            num_chunks += (length + chunk_size - 1) >> shift
            if length > max_seqlen:
                max_seqlen = length
            prev = end
    else:
        lengths = segment[1:] - segment[:-1]
        # A negative length shows up as a huge unsigned value. int32 differences can wrap only
        # when a value is negative; a wrap adds 2**32 tokens, so the row capacity check below
        # rejects it (capacity_for keeps rows * chunk_size < 2**32).
        max_seqlen = int(
            np.maximum.reduce(lengths.view(np.uint64 if lengths.dtype == np.int64 else np.uint32), initial=0)
        )
        if max_seqlen > num_tokens:
            diagnose_step(host, first_seq, num_seqs, chunk_size, capacity)
        lengths += chunk_size - 1  # in place: lengths is this call's own temporary
        lengths >>= shift
        num_chunks = int(np.add.reduce(lengths))
    if num_chunks > capacity.rows:
        diagnose_step(host, first_seq, num_seqs, chunk_size, capacity)
    return StepPlan(first_seq, num_seqs, num_tokens, num_chunks, max_seqlen, segment)


def write_host_cu_seqlens(step: StepPlan, out: np.ndarray) -> None:
    """The host copy of ``cu_seqlens`` into ``out`` (int32, ``len(out) - 1`` sequences): the
    slice rebased to 0, then zero-length tail sequences (the padded layout) up to the end."""
    n = step.num_seqs
    np.subtract(step.segment, step.segment[0], out=out[: n + 1], casting="unsafe")
    out[n + 1 :] = step.num_tokens


def index_arg(name: str, value) -> int:
    """An integer argument given as any integral type (numpy ints included), never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ChunkMetaError(f"{name}={value!r}: must be an int.")
    return int(value)


def diagnose_step(host: np.ndarray, first_seq: int, num_seqs: int, chunk_size: int, capacity: Capacity):
    """Find what is wrong with a step, slowly and exactly, and raise it as ChunkMetaError."""
    num_requests = host.shape[0] - 1
    if not 0 <= first_seq <= num_requests:
        raise ChunkMetaError(
            f"first_seq={first_seq!r}: must be an int in [0, {num_requests}] (the batch has "
            f"{num_requests} requests); vLLM's prefill slice starts at num_decodes."
        )
    if not 0 <= num_seqs <= num_requests - first_seq:
        raise ChunkMetaError(
            f"num_seqs={num_seqs!r}: must be an int in [0, {num_requests - first_seq}] "
            f"(requests after first_seq={first_seq}); leave it None to take the rest of the batch."
        )
    if num_seqs > capacity.seqs:
        raise ChunkMetaError(
            f"num_seqs={num_seqs} exceeds the builder's capacity of {capacity.seqs} sequences: "
            "size max_num_seqs to the engine's max_num_seqs."
        )
    values = [int(v) for v in host[first_seq : first_seq + num_seqs + 1].tolist()]
    if values[0] < 0:
        raise ChunkMetaError(f"query_start_loc_cpu[{first_seq}]={values[0]}: offsets must be >= 0.")
    for i in range(num_seqs):
        if values[i + 1] < values[i]:
            raise ChunkMetaError(
                f"query_start_loc_cpu is decreasing at index {first_seq + i + 1} "
                f"({values[i]} -> {values[i + 1]}): offsets must be non-decreasing "
                "(cumulative query lengths)."
            )
    num_tokens = values[-1] - values[0]
    if num_tokens > INT32_MAX:
        raise ChunkMetaError(
            f"the prefill slice holds {num_tokens} tokens: more than int32 can index ({INT32_MAX}); split the step."
        )
    if num_tokens > capacity.tokens:
        raise ChunkMetaError(
            f"the prefill slice holds {num_tokens} tokens, over the builder's capacity of "
            f"{capacity.tokens}: size max_num_tokens to the engine's max_num_batched_tokens."
        )
    num_chunks = sum(cdiv(b - a, chunk_size) for a, b in itertools.pairwise(values))
    if num_chunks > capacity.rows:
        raise ChunkMetaError(
            f"the prefill slice needs {num_chunks} chunk rows, over the builder's capacity of "
            f"{capacity.rows}: raise max_num_tokens or max_num_seqs."
        )
    raise AssertionError("diagnose_step found nothing wrong with a step the fast checks rejected")


def verify_host_copy(query_start_loc, query_start_loc_cpu) -> None:
    """Check that the device ``query_start_loc`` holds the host copy's values.

    Every build trusts this (reading the device copy is the sync chunkmeta exists to avoid), so
    this function synchronizes: call it off the hot path (``ChunkMetaService(audit_every=k)``
    does so every k-th step). Raises ChunkMetaError naming the first differing index.
    """
    host = host_array(query_start_loc_cpu)
    check_device_tensor(query_start_loc, host.shape[0], None)
    check_same_values("query_start_loc", query_start_loc, host)


def check_same_values(name: str, tensor: torch.Tensor, host: np.ndarray) -> None:
    """ChunkMetaError naming the first index where the device ``tensor`` and its host copy ``host``
    (the same shape) differ. Reads the device: a sync."""
    device = tensor.cpu().numpy()  # the sync, deliberately
    different = np.flatnonzero(device != host)
    if different.size:
        i = int(different[0])
        raise ChunkMetaError(
            f"{name}[{i}]={int(device[i])} on the device but {name}_cpu[{i}]={int(host[i])}: "
            "the host copy must hold the device tensor's values (copy them in the same scheduler step)."
        )


def segment_counts(positions: np.ndarray, lengths: np.ndarray, shift: int) -> np.ndarray:
    """Chunks per segment (int64) when a chunk ends at every multiple of ``1 << shift`` and at
    the segment's end, for segments of ``lengths`` tokens at ``positions``: an empty segment
    mid-chunk gets one, one on a boundary none (``chunkmeta.fill.step_fill.segment_chunks``)."""
    positions = positions.astype(np.int64, copy=False)
    lengths = lengths.astype(np.int64, copy=False)
    full = ((positions + lengths - 1) >> shift) - (positions >> shift) + 1
    empty = (positions & ((1 << shift) - 1)) != 0
    return np.where(lengths > 0, full, empty)


def row_values(name: str, values, num_rows: int) -> np.ndarray:
    """A host per-row array (``num_computed_tokens_cpu``, ``checkpoint_offsets_cpu``): 1-D int32 or
    int64 with one entry per request of the batch, all ``>= 0``."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ChunkMetaError(
                f"{name} is on {values.device}: it must be the host copy (reading a device tensor would sync)."
            )
        if values.dtype not in _INTEGER_DTYPES:
            raise ChunkMetaError(f"{name} has dtype {values.dtype}: must be torch.int32 or torch.int64.")
        check_dense(name, values)
        values = values.numpy()
    elif not isinstance(values, np.ndarray) or values.dtype not in _NP_INTEGER_DTYPES:
        raise ChunkMetaError(
            f"{name} is a {type(values).__name__}: must be a CPU torch tensor or a numpy array of int32/int64."
        )
    if values.ndim != 1 or values.shape[0] != num_rows:
        raise ChunkMetaError(
            f"{name} has shape {tuple(values.shape)}: must be 1-D with one entry per request ({num_rows}), "
            "indexed like query_start_loc's rows."
        )
    negative = np.flatnonzero(values < 0)
    if negative.size:
        i = int(negative[0])
        raise ChunkMetaError(f"{name}[{i}]={int(values[i])}: must be >= 0.")
    return values


def check_row_tensor(name: str, tensor, num_rows: int, device: torch.device) -> None:
    """The device copy of a per-row array: int32/int64, 1-D, contiguous, ``num_rows`` entries, on ``device``."""
    if not isinstance(tensor, torch.Tensor):
        raise ChunkMetaError(f"{name} is a {type(tensor).__name__}: must be the device torch tensor.")
    check_dense(name, tensor)
    if tensor.dtype not in _INTEGER_DTYPES:
        raise ChunkMetaError(f"{name} has dtype {tensor.dtype}: must be torch.int32 or torch.int64.")
    if tensor.dim() != 1 or tensor.shape[0] != num_rows or tensor.stride(0) != 1:
        raise ChunkMetaError(
            f"{name} has shape {tuple(tensor.shape)} (stride {tensor.stride()}): must be contiguous 1-D with "
            f"{num_rows} entries (one per request), the device copy of its host array."
        )
    if tensor.device != device:
        raise ChunkMetaError(f"{name} is on {tensor.device} but the builder's buffers are on {device}.")


def plain_host_tensor(tensor):
    """``(address, length, is64)`` of a plain contiguous 1-D int32/int64 CPU tensor of at least
    one entry (what the C ``oneshot_plan`` takes), else None (the general path then checks it)."""
    if (
        type(tensor) is torch.Tensor
        and tensor.is_cpu
        and tensor.dtype in _INTEGER_DTYPES
        and tensor.dim() == 1
        and tensor.shape[0] >= 1
        and tensor.stride(0) == 1
        and tensor.layout is torch.strided
    ):
        return tensor.data_ptr(), tensor.shape[0], tensor.dtype is torch.int64
    return None
