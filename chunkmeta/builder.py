"""ChunkMetadataBuilder: one step's chunk tables from a host plan and one device fill.

A build reads as: **accept** the input tensors (types, shapes, devices; cached by identity),
**plan** from the host copy (sizes and every value check, ``chunkmeta.plan``), **claim** the
next ring slot (``chunkmeta.ring``), **launch** the fill of the layout (``chunkmeta.layout``)
into it, and **publish** the slot's generation with the immutable ``ChunkMetadata``.

On a CUDA builder the whole host side of a build runs in one C call once a layout's kernel is
known (``chunkmeta.native.CBuild``, ``c_build``); the Python path below is the general one:
the first build of each layout (which compiles the Triton kernel), other current devices, bad
input (for the precise error) and machines without the C build.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from chunkmeta import arena as _arena
from chunkmeta import layout as _layout
from chunkmeta import native
from chunkmeta import plan as _plan
from chunkmeta.errors import ChunkMetaError
from chunkmeta.fill.torch_fill import fill_torch
from chunkmeta.metadata import ChunkMetadata
from chunkmeta.ring import Ring

BACKENDS = ("auto", "triton", "torch")
PADS = _layout.PADS
_INT_DTYPES = (torch.int32, torch.int64)


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
    loaded = sys.modules.get("chunkmeta.fill.triton_fill")
    if loaded is None and "triton" not in sys.modules:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    from chunkmeta.fill import triton_fill

    return type(triton_fill.chunk_metadata_kernel).__name__ == "InterpretedFunction"


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


class ChunkMetadataBuilder:
    """Builds one step's ``ChunkMetadata`` into persistent buffers, with no host<->device sync.

    ``build`` gives FLA's exact layout (tensors sized N+1 / NT); ``build_padded`` the
    capacity-shaped layout whose shapes never change (for CUDA graphs and static-shape callers);
    ``build_bounded`` a layout for callers without host lengths (rows from an upper bound).
    Results stay valid for ``ring_depth - 1`` later builds (``chunkmeta.ring``).
    ``offsets_dtype``: ``chunk_offsets``' dtype, int64 (FLA's contract) or int32 (CuteDSL GDN's),
    written by the fill itself: no consumer needs a cast per step.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        *,
        chunk_size: int = 64,
        device: torch.device | str,
        backend: str = "auto",
        ring_depth: int = 4,
        offsets_dtype: torch.dtype = torch.int64,
    ):
        self.capacity = _plan.capacity_for(max_num_seqs, max_num_tokens, chunk_size)
        if offsets_dtype not in _INT_DTYPES:
            raise ChunkMetaError(
                f"offsets_dtype={offsets_dtype!r}: must be torch.int64 (FLA's chunk_offsets) or torch.int32 "
                "(CuteDSL GDN's)."
            )
        if not isinstance(ring_depth, int) or isinstance(ring_depth, bool) or not 1 <= ring_depth <= 64:
            raise ChunkMetaError(f"ring_depth={ring_depth!r}: must be an int in [1, 64].")
        self.device = resolve_device(device)
        self.chunk_size = chunk_size
        self.ring_depth = ring_depth
        self.backend = resolve_backend(backend, self.device)
        self.ring = Ring(ring_depth, self.capacity, self.device, offsets_dtype)
        self._params = torch.zeros(2, dtype=torch.int32, device=self.device)  # unused by eager fills
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._triton_fills: dict[tuple, object] = {}  # (padded, pad_chunk) -> TritonFill
        # Identity caches: engines pass the same persistent tensors step after step, so their
        # type/shape checks and the torch->numpy view are done once per tensor, not per step.
        self._last_cpu = None
        self._last_cpu_array = None
        self._last_cpu_address = None
        self._last_cpu_len = -1
        self._last_cpu_is64 = False
        self._last_dev = None
        self._last_dev_len = -1
        # The C build: made for a layout after its first Triton launch compiled the kernel.
        module = native.cuda_launcher() if self.backend == "triton" and self.device.type == "cuda" else None
        self.c_build = (
            None
            if module is None
            else native.CBuild(module, self.ring, chunk_size, self._device_index, self._params.data_ptr())
        )

    # -- public ---------------------------------------------------------------------------

    @property
    def builds(self) -> int:
        """Number of builds so far (the generation of the newest ChunkMetadata)."""
        return self.ring.generation

    @property
    def native_kernel(self) -> dict[tuple, str | None]:
        """Which kernel the C build launches per ``(pad, query_start_loc dtype)``: ``"cuda"``,
        ``"triton"``, or None (it cannot launch either, or a launch failed); no key before a
        layout's first build, and empty without the C build."""
        return {} if self.c_build is None else self.c_build.kernel

    @property
    def padded_num_seqs(self) -> dict[str, int]:
        """Sequences in the padded layout's cu_seqlens, per pad mode (cu_seqlens has one more entry)."""
        return {pad: _layout.padded_num_seqs(pad, self.capacity.seqs) for pad in PADS}

    def build(
        self, query_start_loc: torch.Tensor, query_start_loc_cpu, *, first_seq: int = 0, num_seqs: int | None = None
    ) -> ChunkMetadata:
        """FLA's exact layout for requests ``[first_seq, first_seq + num_seqs)`` of the batch."""
        return self._build_step(query_start_loc, query_start_loc_cpu, first_seq, num_seqs, None)

    def build_padded(
        self,
        query_start_loc: torch.Tensor,
        query_start_loc_cpu,
        *,
        first_seq: int = 0,
        num_seqs: int | None = None,
        pad: str = "tail",
    ) -> ChunkMetadata:
        """The capacity-shaped layout (``chunkmeta.layout``): ``cu_seqlens`` / ``chunk_offsets``
        padded with zero-length tail sequences, ``chunk_indices`` with padding rows after every
        real row.

        ``pad="tail"``: padding rows ``(max_num_seqs, 0)``, the reserved zero-length tail sequence
        (``cu_seqlens`` has ``max_num_seqs + 2`` entries) — harmless to every FLA kernel.
        ``pad="negative"``: ``(-1, 0)``, ``max_num_seqs + 1`` entries — FLA's KDA ``use_graph=True``.
        ``pad="past_end"``: ``(0, PAST_END_CHUNK)``, ``max_num_seqs + 1`` entries — SGLang's.
        """
        _layout.check_pad(pad, PADS, self.capacity.tokens, self.chunk_size)
        return self._build_step(query_start_loc, query_start_loc_cpu, first_seq, num_seqs, pad)

    def build_bounded(
        self, query_start_loc: torch.Tensor, *, max_num_tokens: int, num_seqs: int | None = None, pad: str = "past_end"
    ) -> ChunkMetadata:
        """The tables of ``query_start_loc``'s first ``num_seqs`` requests (default: all) when the
        host knows no lengths, only that they hold at most ``max_num_tokens`` tokens.

        ``chunk_indices`` has ``chunkmeta.layout.chunk_row_bound(N, max_num_tokens, C)`` rows (a
        bound on NT from host sizes alone); the device finds the real NT and writes padding rows
        (``pad``: ``"past_end"`` or ``"negative"``) after it. ``cu_seqlens`` / ``chunk_offsets``
        are exact (``[N+1]``); ``cu_seqlens_cpu`` is None (``md.bounded``), and ``num_tokens`` /
        ``num_chunks`` / ``max_seqlen`` are the bounds. ``max_num_tokens`` is trusted: a smaller
        bound than the real count truncates the rows (nothing is written past them).
        """
        _layout.check_pad(pad, _layout.BOUNDED_PADS, self.capacity.tokens, self.chunk_size)
        # anything but a 1-D tensor fails the checks before the length one
        is_1d = isinstance(query_start_loc, torch.Tensor) and query_start_loc.dim() == 1
        length = query_start_loc.shape[0] if is_1d else -1
        _plan.check_device_tensor(query_start_loc, length, self.device)
        n = length - 1 if num_seqs is None else _plan.index_arg("num_seqs", num_seqs)
        if not 0 <= n < length:
            raise ChunkMetaError(f"num_seqs={n}: must be in [0, {length - 1}] (query_start_loc has {length} entries).")
        if n > self.capacity.seqs:
            raise ChunkMetaError(
                f"num_seqs={n} exceeds the builder's capacity of {self.capacity.seqs} sequences: "
                "size max_num_seqs to the engine's max_num_seqs."
            )
        tokens = _plan.index_arg("max_num_tokens", max_num_tokens)
        if not 0 <= tokens <= self.capacity.tokens:
            raise ChunkMetaError(
                f"max_num_tokens={tokens}: must be in [0, {self.capacity.tokens}] (the builder's token capacity); "
                "pass the host bound on this step's tokens."
            )
        shape = _layout.bounded(pad, n, tokens, self.chunk_size)
        slot, generation = self.ring.claim()
        cu, indices, offsets, _ = self.ring.views(slot, shape.seqs_out, shape.rows_out)
        self._launch(query_start_loc, slot, (cu, indices, offsets), 0, n, shape, True)
        self.ring.publish(slot, generation)
        return ChunkMetadata(
            cu,
            None,
            indices,
            offsets,
            self.chunk_size,
            n,
            tokens,
            shape.rows_out,
            tokens,
            pad,
            generation,
            self.ring,
            slot,
        )

    def plan(self, query_start_loc_cpu, *, first_seq: int = 0, num_seqs: int | None = None) -> _plan.StepPlan:
        """The host plan of a build (sizes, hints, every value check) without building."""
        host = _plan.host_array(query_start_loc_cpu)
        return _plan.plan_step(host, first_seq, num_seqs, self.chunk_size, self.capacity, _plan.host_address(host))

    # -- accept -----------------------------------------------------------------------------

    def _accept(self, query_start_loc, query_start_loc_cpu) -> None:
        """Check the input tensors (type, dtype, shape, device, contiguity) and cache what the
        plan needs. Engines pass either the same tensors every step (checked once, then by
        identity) or fresh prefix views of persistent buffers (checked here with a few tensor
        attributes; the numpy view the Python plan needs is made only if it runs). Anything
        else takes the full checks, which raise ChunkMetaError. Values are checked by the plan."""
        host = query_start_loc_cpu
        # data_ptr too: a tensor given new storage in place (set_, .data =) keeps its identity,
        # and the C build reads the cached address
        if (
            host is not self._last_cpu
            or host.shape[0] != self._last_cpu_len
            or (self._last_cpu_array is None and host.data_ptr() != self._last_cpu_address)
        ):
            if (
                type(host) is torch.Tensor
                and host.is_cpu
                and host.layout is torch.strided
                and host.dtype in _INT_DTYPES
                and host.dim() == 1
                and host.shape[0] >= 1
                and host.stride(0) == 1
            ):
                self._last_cpu_array = None
                self._last_cpu_address = host.data_ptr()
                self._last_cpu_len = host.shape[0]
                self._last_cpu_is64 = host.dtype is torch.int64
            else:
                array = _plan.host_array(host)
                self._last_cpu_array, self._last_cpu_len = array, array.shape[0]
                self._last_cpu_address = _plan.host_address(array)
                self._last_cpu_is64 = array.dtype.itemsize == 8
            self._last_cpu = host
        device = query_start_loc
        if (
            device is not self._last_dev
            or device.shape[0] != self._last_dev_len
            or self._last_cpu_len != self._last_dev_len
        ):
            self._last_dev = None  # until the new tensor passes
            if not (
                type(device) is torch.Tensor
                and device.is_cuda
                and device.get_device() == self._device_index
                and device.layout is torch.strided
                and device.dtype in _INT_DTYPES
                and device.dim() == 1
                and device.shape[0] == self._last_cpu_len
                and device.stride(0) == 1
            ):
                _plan.check_device_tensor(device, self._last_cpu_len, self.device)
            self._last_dev, self._last_dev_len = device, device.shape[0]

    # -- plan -------------------------------------------------------------------------------

    def _plan(self, first_seq, num_seqs) -> _plan.StepPlan:
        if self._last_cpu_array is None:  # a tensor accepted without its numpy view
            self._last_cpu_array = _plan.host_array(self._last_cpu)
        return _plan.plan_step(
            self._last_cpu_array, first_seq, num_seqs, self.chunk_size, self.capacity, self._last_cpu_address
        )

    def _shape(self, pad: str | None, num_seqs: int, num_chunks: int) -> _layout.Layout:
        """What a build writes: the batch's own sizes in the exact layout, the capacity's in a padded one."""
        if pad is None:
            return _layout.exact(num_seqs, num_chunks)
        return _layout.padded(pad, self.capacity.seqs, self.capacity.rows)

    # -- claim, launch, publish ---------------------------------------------------------------

    def _build_step(self, query_start_loc, query_start_loc_cpu, first_seq, num_seqs, pad) -> ChunkMetadata:
        """Accept, then the C build if it can take the step, else plan and build in Python."""
        self._accept(query_start_loc, query_start_loc_cpu)
        metadata = self._build_c(query_start_loc, first_seq, num_seqs, pad)
        if metadata is None:
            metadata = self._build(query_start_loc, self._plan(first_seq, num_seqs), pad)
        return metadata

    def _build_c(self, query_start_loc, first_seq, num_seqs, pad) -> ChunkMetadata | None:
        """The whole build in one C call on accepted tensors, or None when the general path must
        run (see ``chunkmeta.native.CBuild.build``)."""
        if self.c_build is None or self._last_cpu_address is None:
            return None
        return self.c_build.build(
            pad, query_start_loc, self._last_cpu_address, self._last_cpu_len, self._last_cpu_is64, first_seq, num_seqs
        )

    def _build(self, query_start_loc: torch.Tensor, step: _plan.StepPlan, pad: str | None) -> ChunkMetadata:
        # Validation is done: from here on nothing can fail on bad input.
        n = step.num_seqs
        shape = self._shape(pad, n, step.num_chunks)
        slot, generation = self.ring.claim()
        cu, indices, offsets, cu_cpu = self.ring.views(slot, shape.seqs_out, shape.rows_out)
        launched = self._launch(
            query_start_loc, slot, (cu, indices, offsets), step.first_seq, n, shape, pad is not None
        )
        if launched and self.c_build is not None and not self.c_build.has_layout(pad, query_start_loc.dtype):
            self._make_c_fill(pad, query_start_loc.dtype, shape)
        _plan.write_host_cu_seqlens(step, self.ring.cu_seqlens_cpu_np[slot, : shape.seqs_out + 1])
        self.ring.publish(slot, generation)
        return ChunkMetadata(
            cu,
            cu_cpu,
            indices,
            offsets,
            self.chunk_size,
            n,
            step.num_tokens,
            step.num_chunks,
            step.max_seqlen,
            pad,
            generation,
            self.ring,
            slot,
        )

    def _launch(
        self, query_start_loc, slot: int, tables, first_seq: int, num_seqs: int, shape: _layout.Layout, padded: bool
    ) -> bool:
        """Queue the fill of ``shape`` into ring slot ``slot`` (``tables``: its sized views);
        False if there was nothing to write. ``padded``: rows past NT may be asked for (the
        kernel then finds NT itself)."""
        if not (shape.seqs_out or shape.rows_out):
            return False  # entry 0 of cu_seqlens / chunk_offsets is always 0
        with self.ring.writing(slot):
            return self._fill_slot(query_start_loc, slot, tables, first_seq, num_seqs, shape, padded)

    def _fill_slot(self, query_start_loc, slot, tables, first_seq, num_seqs, shape, padded) -> bool:
        cu, indices, offsets = tables
        if self.backend == "torch":
            fill_torch(query_start_loc, cu, indices, offsets, first_seq, num_seqs, self.chunk_size, shape)
            return True
        fill = self._triton_fill(padded, shape.pad_chunk)
        cu_ptr, indices_ptr, offsets_ptr, _ = self.ring.pointers(slot)
        args = (first_seq, num_seqs, shape.rows_out, shape.seqs_out, shape.pad_seq)
        if not fill.launch(
            query_start_loc.dtype,
            query_start_loc.data_ptr(),
            self._params.data_ptr(),
            cu_ptr,
            indices_ptr,
            offsets_ptr,
            *args,
        ):
            fill(query_start_loc, self._params, cu, indices, offsets, *args)
        return True

    def _triton_fill(self, padded: bool, pad_chunk: int):
        fill = self._triton_fills.get((padded, pad_chunk))
        if fill is None:
            from chunkmeta.fill.triton_fill import TritonFill  # imports triton: see chunkmeta.fill.triton_fill

            fill = TritonFill(
                chunk_size=self.chunk_size,
                block_seqs=self.capacity.seqs,
                padded=padded,
                params_on_device=False,
                pad_chunk=pad_chunk,
            )
            self._triton_fills[(padded, pad_chunk)] = fill
        return fill

    def _make_c_fill(self, pad, dtype, shape: _layout.Layout) -> None:
        """After the first Triton launch of a layout: the C build's constants for it, with the
        kernels it may launch, best first: the CUDA C fill (``chunkmeta.fill.cuda_fill``, when
        NVRTC compiles it), then the Triton kernel that launch compiled."""
        from chunkmeta.fill.cuda_fill import CudaFill

        padded = pad is not None
        candidates = []
        cuda = CudaFill(
            chunk_size=self.chunk_size,
            block_seqs=self.capacity.seqs,
            padded=padded,
            pad_chunk=shape.pad_chunk,
            offsets_dtype=self.ring.chunk_offsets.dtype,
        )
        kernel = cuda.kernel(dtype, self.device)
        if kernel is not None:
            candidates.append(("cuda", (kernel[0], cuda.block_rows, kernel[1], kernel[2])))
        fill = self._triton_fill(padded, shape.pad_chunk)
        triton_kernel = fill.plain_kernel(dtype)
        if triton_kernel is not None:
            candidates.append(("triton", (triton_kernel[0], fill.block_rows, triton_kernel[1], triton_kernel[2])))
        # the exact layout's sizes are per build: -1 tells the C build to use N and NT
        fixed = shape if padded else _layout.Layout(-1, -1, 0, 0)
        self.c_build.add_layout(pad, dtype, fixed, candidates)


# The one-shot's fills, compiled once per process: (chunk_size, lanes, indices dtype) -> TritonFill
_ONE_SHOT_FILLS: dict[tuple, object] = {}
# ... and their C launches: (chunk_size, lanes, indices dtype, query_start_loc dtype) -> capsule or False
_ONE_SHOT_C: dict[tuple, object] = {}


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
    fills them, every entry included (no memset); its kernel is compiled once per process per
    power-of-two bucket of sequences. A one-shot captured into a CUDA graph allocates them
    instead, from the graph's pool. ``indices_dtype=torch.int64`` writes ``chunk_indices`` as int64 (the ROCm
    Kimi-K3 helper's contract for int64 ``cu_seqlens``), outside FLA's int32 contract.
    For a step loop, keep a ``ChunkMetadataBuilder`` instead: it allocates once.
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
    backend = resolve_backend(backend, device)
    # Validate against the widest sizes one build supports, then size the buffers to the batch.
    widest = _plan.Capacity(_plan.MAX_NUM_SEQS, _plan.INT32_MAX - chunk_size, _plan.INT32_MAX // chunk_size)
    step = _plan.plan_step(host, first_seq, num_seqs, chunk_size, widest, _plan.host_address(host))
    n, nt = step.num_seqs, step.num_chunks
    if backend == "torch":  # its fill skips entry 0 of cu_seqlens / chunk_offsets: zeroed memory
        offsets, cu, indices, cu_cpu = _one_shot_tensors(n, nt, indices_dtype, device, zeroed=True)
    else:
        offsets, cu, indices, cu_cpu = _one_shot_outputs(device, n, nt, indices_dtype)
    _plan.write_host_cu_seqlens(step, cu_cpu.numpy())
    shape = _layout.exact(n, nt)
    if backend == "torch":
        fill_torch(query_start_loc, cu, indices, offsets, step.first_seq, n, chunk_size, shape)
    else:
        key = _one_shot_key(chunk_size, n, indices_dtype)
        fill = _ONE_SHOT_FILLS.get(key)
        if fill is None:
            from chunkmeta.fill.triton_fill import TritonFill

            fill = _ONE_SHOT_FILLS[key] = TritonFill(
                chunk_size=chunk_size,
                block_seqs=key[1],
                padded=False,
                params_on_device=False,
                write_first=True,
                indices_dtype=indices_dtype,
            )
        args = (step.first_seq, n, nt, n, 0)
        if not fill.launch(
            query_start_loc.dtype,
            query_start_loc.data_ptr(),
            query_start_loc.data_ptr(),  # params: unread (host params)
            cu.data_ptr(),
            indices.data_ptr(),
            offsets.data_ptr(),
            *args,
        ):
            fill(query_start_loc, query_start_loc, cu, indices, offsets, *args)
        c_key = (*key, query_start_loc.dtype)
        if query_start_loc.is_cuda and c_key not in _ONE_SHOT_C:  # the launch above compiled the kernel
            _ONE_SHOT_C[c_key] = _one_shot_capsule(fill, query_start_loc.dtype, chunk_size)
    return ChunkMetadata(
        cu, cu_cpu, indices, offsets, chunk_size, n, step.num_tokens, nt, step.max_seqlen, None, 0, None, 0
    )


def _one_shot_key(chunk_size: int, num_seqs: int, indices_dtype) -> tuple:
    """A one-shot fill's key: its kernel is compiled once per process per power-of-two bucket."""
    return chunk_size, _plan.next_pow2(max(num_seqs, 16)), indices_dtype


def _one_shot_tensors(num_seqs: int, num_chunks: int, indices_dtype, device, zeroed: bool):
    """``(chunk_offsets, cu_seqlens, chunk_indices, cu_seqlens_cpu)``, as ``chunkmeta.arena``'s
    ``take`` hands them out, for a one-shot that allocates them (the torch fill, which needs them
    zeroed, and a one-shot being captured into a CUDA graph): the device tables in one allocation
    of int32 words, chunk_offsets int64 ``[N+1]`` | chunk_indices ``[NT, 2]`` | cu_seqlens int32
    ``[N+1]``, and the host ``cu_seqlens_cpu`` int32 ``[N+1]``, never zeroed (the host copy
    writes every entry).
    In that order every device table starts aligned to its dtype, and the split gives each its
    exact size: four tensor calls for them (each costs about a microsecond of host time)."""
    words_per_index = 1 if indices_dtype == torch.int32 else 2
    allocate = torch.zeros if zeroed else torch.empty
    sizes = (2 * (num_seqs + 1), 2 * num_chunks * words_per_index, num_seqs + 1)
    # inference tensors, as every table (chunkmeta.ring.TABLE_MEMORY); a dtype view outside
    # inference mode would be a normal tensor again
    with torch.inference_mode():
        words = allocate(sum(sizes), dtype=torch.int32, device=device)
        offsets, indices, cu = words.split(sizes)
        if indices_dtype != torch.int32:
            indices = indices.view(indices_dtype)
        cu_cpu = torch.empty(num_seqs + 1, dtype=torch.int32)
        return offsets.view(torch.int64), cu, indices.view(num_chunks, 2), cu_cpu


def _one_shot_capsule(fill, dtype, chunk_size):
    """The C launch of a one-shot fill once its kernel is compiled, or None (no C launch here)."""
    module = native.cuda_launcher()
    kernel = fill.plain_kernel(dtype)
    if module is None or kernel is None:
        return None
    function, num_warps, shared = kernel
    cap = _plan.MAX_NUM_SEQS
    return module.make_fill(
        function,
        fill.block_rows,
        num_warps,
        shared,
        chunk_size.bit_length() - 1,
        cap,
        _plan.INT32_MAX - chunk_size,
        _plan.INT32_MAX // chunk_size,
        -1,
        -1,
        0,
        0,
        [(0, 0, 0, 0)],
        None,
    )


def _one_shot_outputs(device: torch.device, num_seqs: int, num_chunks: int, indices_dtype):
    """``(chunk_offsets, cu_seqlens, chunk_indices, cu_seqlens_cpu)`` for a one-shot's Triton
    fill (which writes every entry): views from the arena of the current stream, or, on a stream
    being captured into a CUDA graph, fresh allocations (``chunkmeta.arena`` says why)."""
    if device.type != "cuda":
        return _arena.arena(-1, 0, indices_dtype).take(num_seqs, num_chunks)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        if torch.cuda.is_current_stream_capturing():
            return _one_shot_tensors(num_seqs, num_chunks, indices_dtype, device, zeroed=False)
        stream = torch.cuda.current_stream(index).cuda_stream
        return _arena.arena(index, stream, indices_dtype).take(num_seqs, num_chunks)


def _one_shot_c(query_start_loc, query_start_loc_cpu, chunk_size, first_seq, num_seqs, backend, indices_dtype):
    """The one-shot's whole host side in one C call (``chunkmeta.native``'s ``oneshot``) once a
    fill for it is compiled and launchable from C; None where the general path must run (first
    calls, bad input, CPU tensors, another current device, a stream being captured)."""
    if (backend != "auto" and backend != "triton") or not _ONE_SHOT_C or indices_dtype not in _INT_DTYPES:
        return None  # no CUDA one-shot ran yet: nothing is compiled (and CUDA may be uninitialized)
    module = native.module()
    if module is None:  # _ONE_SHOT_C then holds None entries only
        return None
    device = torch._C._cuda_getDevice()
    if torch._C._cuda_isCurrentStreamCapturing():
        return None
    stream = torch._C._cuda_getCurrentRawStream(device)
    made = module.oneshot(
        _ONE_SHOT_C,
        _arena.arena(device, stream, indices_dtype),
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
