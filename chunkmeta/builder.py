"""ChunkMetadataBuilder: persistent buffers, a host plan and one device fill per build.

Buffers (allocated once, on the builder's device, in ``ring_depth`` slots):

* ``cu_seqlens``  int32 ``[ring_depth, max_num_seqs + 2]``
* ``chunk_offsets`` int64 ``[ring_depth, max_num_seqs + 2]``
* ``chunk_indices`` int32 ``[ring_depth, cdiv(max_num_tokens, C) + max_num_seqs, 2]``
* ``cu_seqlens_cpu`` int32 ``[ring_depth, max_num_seqs + 2]`` on the host

(``+ 2``: the padded layout reserves one zero-length tail sequence for padding rows; each slot
is rounded up to a 16-byte multiple.)

The ring rule: build ``k`` writes slot ``k % ring_depth`` and returns views of it. The object
returned by build ``k`` keeps its values through builds ``k+1 .. k+ring_depth-1``; build
``k+ring_depth`` reuses its slot and retires it (``is_live`` turns False, ``check_live`` raises).
On one CUDA stream the GPU side is safe at any depth (the next fill is queued after every kernel
already queued that reads the slot); the depth bounds how long the *host* may hold an object and
still queue work that reads it. See the README's "Integrating with a scheduler".
"""

from __future__ import annotations

import importlib.util

import torch

from chunkmeta import native
from chunkmeta import plan as _plan
from chunkmeta.errors import ChunkMetaError
from chunkmeta.metadata import ChunkMetadata
from chunkmeta.fill.torch_fill import fill_torch

BACKENDS = ("auto", "triton", "torch")
_INT_DTYPES = (torch.int32, torch.int64)
PADS = ("tail", "negative")
_VIEW_CACHE_LIMIT = 16384  # entries per view cache (a view is ~1-2 KB of host memory)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ChunkMetaError(f"backend={backend!r}: must be one of {BACKENDS}.")
    has_triton = importlib.util.find_spec("triton") is not None
    if backend == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if backend == "triton" and not has_triton:
        raise ChunkMetaError("backend='triton' needs the triton package; use backend='torch'.")
    return backend


class ChunkMetadataBuilder:
    """Builds one step's ``ChunkMetadata`` into persistent buffers, with no host<->device sync.

    ``build`` gives FLA's exact layout (tensors sized N+1 / NT); ``build_padded`` gives the
    capacity-shaped layout whose shapes never change (for CUDA graphs and static-shape callers).
    """

    def __init__(self, max_num_seqs: int, max_num_tokens: int, *, chunk_size: int = 64,
                 device: torch.device | str, backend: str = "auto", ring_depth: int = 4):
        self.capacity = _plan.capacity_for(max_num_seqs, max_num_tokens, chunk_size)
        if not isinstance(ring_depth, int) or isinstance(ring_depth, bool) or not 1 <= ring_depth <= 64:
            raise ChunkMetaError(f"ring_depth={ring_depth!r}: must be an int in [1, 64].")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ChunkMetaError(f"device={device!r}: not a torch device ({exc}).") from None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.chunk_size = chunk_size
        self.ring_depth = ring_depth
        self.backend = resolve_backend(backend, device)

        cap = self.capacity
        # Entry 0 of cu_seqlens and chunk_offsets is 0 in every slot and never written again.
        # Slot strides are rounded up to 16 bytes: every slot starts as aligned as the first,
        # which the compiled kernel (specialized on the first launch's pointers) relies on.
        self._cu = torch.zeros(ring_depth, _round_up(cap.seqs + 2, 4), dtype=torch.int32, device=device)
        self._offsets = torch.zeros(ring_depth, _round_up(cap.seqs + 2, 2), dtype=torch.int64, device=device)
        self._indices = torch.zeros(ring_depth, _round_up(cap.rows, 2), 2, dtype=torch.int32, device=device)
        self._cu_cpu = torch.zeros(ring_depth, cap.seqs + 2, dtype=torch.int32)
        self._cu_cpu_np = self._cu_cpu.numpy()
        self._params = torch.zeros(2, dtype=torch.int32, device=device)  # unused by eager fills
        self._params_ptr = self._params.data_ptr()
        self._slot_ptrs = [(self._cu[k].data_ptr(), self._indices[k].data_ptr(), self._offsets[k].data_ptr())
                           for k in range(ring_depth)]

        self._fills: dict[bool, object] = {}
        # Output views, cached by sequence count and by row count (a view costs a microsecond
        # or more to make; steps repeat sequence counts far more often than row counts); each
        # cache is cleared when it reaches _VIEW_CACHE_LIMIT. cu_seqlens and cu_seqlens_cpu are
        # handed out as new objects every build all the same (a detach() of the cached view, a
        # third of a slice's cost): FLA memoizes its helpers (prepare_lens,
        # prepare_chunk_indices, ...) by argument identity, so a reused object would get an
        # earlier step's answer.
        self._seq_views: dict[tuple, tuple] = {}  # (slot, seqs_out) -> (cu_seqlens, chunk_offsets, cu_seqlens_cpu)
        self._row_views: dict[tuple, torch.Tensor] = {}  # (slot, rows_out) -> chunk_indices
        self._slot_buffers = [(self._cu[k], self._indices[k], self._offsets[k], self._cu_cpu[k])
                              for k in range(ring_depth)]
        self._slot_generation = [0] * ring_depth
        self._retired_through = 0  # generations <= this were retired explicitly (retire())
        self._builds = 0
        # Identity caches: engines pass the same persistent tensors step after step, so their
        # type/shape checks and the torch->numpy view are done once per tensor, not per step.
        self._last_cpu = None
        self._last_cpu_array = None
        self._last_cpu_address = None
        self._last_cpu_len = -1
        self._last_cpu_is64 = False
        self._last_dev = None
        self._last_dev_len = -1
        # The C build (chunkmeta.native) per (pad, query_start_loc dtype), made after the first
        # Triton launch of that layout compiled the kernel; False where it cannot be used.
        self._native = native.cuda_launcher() if self.backend == "triton" and device.type == "cuda" else None
        self._native_fills: dict[tuple, object] = {}
        # which kernel the C build launches per (pad, dtype), set at the end of a layout's first
        # build: "cuda", "triton", or None (it cannot launch either, or a launch failed); no key
        # before that build or without the C build
        self.native_kernel: dict[tuple, str | None] = {}
        self._device_index = device.index if device.type == "cuda" else -1

    # -- public ---------------------------------------------------------------------------

    @property
    def builds(self) -> int:
        """Number of builds so far (the generation of the newest ChunkMetadata)."""
        return self._builds

    @property
    def padded_num_seqs(self) -> dict[str, int]:
        """Sequences in the padded layout's cu_seqlens, per pad mode (cu_seqlens has one more entry)."""
        return {"tail": self.capacity.seqs + 1, "negative": self.capacity.seqs}

    def build(self, query_start_loc: torch.Tensor, query_start_loc_cpu, *, first_seq: int = 0,
              num_seqs: int | None = None) -> ChunkMetadata:
        """FLA's exact layout for requests ``[first_seq, first_seq + num_seqs)`` of the batch."""
        self._accept(query_start_loc, query_start_loc_cpu)
        metadata = self._build_native(query_start_loc, first_seq, num_seqs, None)
        if metadata is None:
            metadata = self._build(query_start_loc, self._plan(first_seq, num_seqs), None)
        return metadata

    def build_padded(self, query_start_loc: torch.Tensor, query_start_loc_cpu, *, first_seq: int = 0,
                     num_seqs: int | None = None, pad: str = "tail") -> ChunkMetadata:
        """The capacity-shaped layout: cu_seqlens/chunk_offsets padded with zero-length tail
        sequences, chunk_indices with padding rows after every real row.

        ``pad="tail"``: padding rows are ``(max_num_seqs, 0)``, the reserved zero-length tail
        sequence (``cu_seqlens`` has ``max_num_seqs + 2`` entries) — harmless to every FLA kernel.
        ``pad="negative"``: padding rows are ``(-1, 0)`` and ``cu_seqlens`` has
        ``max_num_seqs + 1`` entries — FLA's KDA ``use_graph=True`` contract.
        """
        if pad not in PADS:
            raise ChunkMetaError(f"pad={pad!r}: must be one of {PADS}.")
        self._accept(query_start_loc, query_start_loc_cpu)
        metadata = self._build_native(query_start_loc, first_seq, num_seqs, pad)
        if metadata is None:
            metadata = self._build(query_start_loc, self._plan(first_seq, num_seqs), pad)
        return metadata

    def is_live(self, slot: int, generation: int) -> bool:
        return self._slot_generation[slot] == generation and generation > self._retired_through

    def retire(self, generation: int) -> None:
        self._retired_through = max(self._retired_through, generation)

    def retired_message(self, slot: int, generation: int) -> str:
        if generation <= self._retired_through:
            return (f"ChunkMetadata of build {generation} is retired: its step ended (the service's strict "
                    "mode). Use the open step's metadata (service.current).")
        return (
            f"ChunkMetadata of build {generation} is retired: its ring slot {slot} was rebuilt by build "
            f"{self._slot_generation[slot]} (ring_depth={self.ring_depth}). Use the current step's "
            "metadata, or raise ring_depth if the host must hold more steps."
        )

    # -- internals ------------------------------------------------------------------------

    def _accept(self, query_start_loc, query_start_loc_cpu) -> None:
        """Check the input tensors (type, dtype, shape, device, contiguity) and cache what the
        plan needs. Engines pass either the same tensors every step (checked once, then by
        identity) or fresh prefix views of persistent buffers (checked here with a few tensor
        attributes; the numpy view the Python plan needs is made only if it runs). Anything
        else takes the full checks, which raise ChunkMetaError. Values are checked by the plan."""
        host = query_start_loc_cpu
        # data_ptr too: a tensor given new storage in place (set_, .data =) keeps its identity,
        # and the C build reads the cached address
        if (host is not self._last_cpu or host.shape[0] != self._last_cpu_len
                or (self._last_cpu_array is None and host.data_ptr() != self._last_cpu_address)):
            if (type(host) is torch.Tensor and host.is_cpu and host.layout is torch.strided
                    and host.dtype in _INT_DTYPES and host.dim() == 1 and host.shape[0] >= 1 and host.stride(0) == 1):
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
        if device is not self._last_dev or device.shape[0] != self._last_dev_len or self._last_cpu_len != self._last_dev_len:
            self._last_dev = None  # until the new tensor passes
            if not (type(device) is torch.Tensor and device.is_cuda and device.get_device() == self._device_index
                    and device.layout is torch.strided and device.dtype in _INT_DTYPES and device.dim() == 1
                    and device.shape[0] == self._last_cpu_len and device.stride(0) == 1):
                _plan.check_device_tensor(device, self._last_cpu_len, self.device)
            self._last_dev, self._last_dev_len = device, device.shape[0]

    def _plan(self, first_seq, num_seqs) -> _plan.StepPlan:
        if self._last_cpu_array is None:  # a tensor accepted without its numpy view
            self._last_cpu_array = _plan.host_array(self._last_cpu)
        return _plan.plan_step(self._last_cpu_array, first_seq, num_seqs, self.chunk_size, self.capacity,
                               self._last_cpu_address)

    def _build_native(self, query_start_loc, first_seq, num_seqs, pad) -> ChunkMetadata | None:
        """The whole build in one C call (plan, checks, the ChunkMetadata, launch, host copy) on
        accepted tensors, or None when the general path must run: a kernel not compiled yet,
        another current device, any invalid input (re-planned there for the precise error) or a
        failed launch (re-launched there through Triton, which raises if it fails too; the C
        build is then off for that layout)."""
        fill = self._native_fills.get((pad, query_start_loc.dtype))
        if not fill or self._last_cpu_address is None or torch._C._cuda_getDevice() != self._device_index:
            return None
        generation = self._builds + 1
        slot = generation % self.ring_depth
        metadata = self._native.build(fill, self._last_cpu_address, self._last_cpu_len, self._last_cpu_is64,
                                      first_seq, num_seqs, query_start_loc.data_ptr(), slot,
                                      torch._C._cuda_getCurrentRawStream(self._device_index), generation, self,
                                      self._seq_views, self._row_views, self._cached_views)
        if type(metadata) is int:
            if metadata > 0:  # a CUresult: the launch failed. This layout takes the general path from now on
                self._native_fills[(pad, query_start_loc.dtype)] = False
                self.native_kernel[(pad, query_start_loc.dtype)] = None
            return None
        self._builds = generation
        self._slot_generation[slot] = generation
        return metadata

    def _out_shape(self, pad, num_seqs: int, num_chunks: int) -> tuple[int, int, int]:
        """(sequences, rows, padding rows' sequence) a build writes: the batch's own sizes in the
        exact layout, the capacity in a padded one."""
        if pad is None:
            return num_seqs, num_chunks, 0
        return self.padded_num_seqs[pad], self.capacity.rows, -1 if pad == "negative" else self.capacity.seqs

    def _publish(self, slot, generation, views, num_seqs, num_tokens, num_chunks, max_seqlen, pad) -> ChunkMetadata:
        """Record a finished build in its ring slot and return its metadata."""
        self._builds = generation
        self._slot_generation[slot] = generation
        cu, indices, offsets, cu_cpu = views
        return ChunkMetadata(cu, cu_cpu, indices, offsets, self.chunk_size, num_seqs, num_tokens, num_chunks,
                             max_seqlen, pad, generation, self, slot)

    def _views_for(self, slot: int, seqs_out: int, rows_out: int) -> tuple:
        """``(cu_seqlens, chunk_indices, chunk_offsets, cu_seqlens_cpu)`` of a ring slot sized to
        one build, with new ``cu_seqlens`` objects (see ``__init__``)."""
        cu, indices, offsets, cu_cpu = self._cached_views(slot, seqs_out, rows_out)
        return cu.detach(), indices, offsets, cu_cpu.detach()

    def _cached_views(self, slot: int, seqs_out: int, rows_out: int) -> tuple:
        """The same four views from the two caches, made (one slice each) on a miss."""
        cu, indices, offsets, cu_cpu = self._slot_buffers[slot]
        seq_views = self._seq_views.get((slot, seqs_out))
        if seq_views is None:
            if len(self._seq_views) >= _VIEW_CACHE_LIMIT:
                self._seq_views.clear()
            seq_views = (cu[: seqs_out + 1], offsets[: seqs_out + 1], cu_cpu[: seqs_out + 1])
            self._seq_views[(slot, seqs_out)] = seq_views
        rows = self._row_views.get((slot, rows_out))
        if rows is None:
            if len(self._row_views) >= _VIEW_CACHE_LIMIT:
                self._row_views.clear()
            rows = self._row_views[(slot, rows_out)] = indices[:rows_out]
        return seq_views[0], rows, seq_views[1], seq_views[2]

    def _make_native_fill(self, fill, pad, dtype) -> None:
        """After the first Triton launch of a layout: the C build's constants, if it can launch
        one of the two kernels."""
        made, kind = None, None
        for kind, shape in self._native_kernels(fill, pad, dtype):
            function, block_rows, num_warps, shared = shape
            # the exact layout's sizes are per build: -1 tells the C build to use N and NT
            seqs_out, rows_out, pad_seq = self._out_shape(pad, -1, -1)
            slots = [ptrs + (self._cu_cpu[k].data_ptr(),) for k, ptrs in enumerate(self._slot_ptrs)]
            made = self._native.make_fill(function, block_rows, num_warps, shared, self.chunk_size.bit_length() - 1,
                                          self.capacity.seqs, self.capacity.tokens, self.capacity.rows, seqs_out,
                                          rows_out, pad_seq, self._params_ptr, slots, pad)
            if made:
                break
        self._native_fills[(pad, dtype)] = made or False
        self.native_kernel[(pad, dtype)] = kind if made else None

    def _native_kernels(self, fill, pad, dtype):
        """``(name, (function, block_rows, num_warps, shared bytes))`` the C build may launch, best
        first: the CUDA C fill (``chunkmeta.fill.cuda_fill``, when NVRTC compiles it), then the Triton
        kernel the first build compiled."""
        from chunkmeta.fill.cuda_fill import CudaFill

        cuda = CudaFill(chunk_size=self.chunk_size, block_seqs=self.capacity.seqs, padded=pad is not None)
        kernel = cuda.kernel(dtype, self.device)
        if kernel is not None:
            yield "cuda", (kernel[0], cuda.block_rows, kernel[1], kernel[2])
        shape = fill.plain_kernel(dtype)
        if shape is not None:
            yield "triton", (shape[0], fill.block_rows, shape[1], shape[2])

    def _fill_for(self, padded: bool):
        fill = self._fills.get(padded)
        if fill is None:
            from chunkmeta.fill.triton_fill import TritonFill  # imports triton: see chunkmeta.fill.triton_fill

            fill = TritonFill(chunk_size=self.chunk_size, block_seqs=self.capacity.seqs, padded=padded,
                              params_on_device=False)
            self._fills[padded] = fill
        return fill

    def _build(self, query_start_loc: torch.Tensor, step: _plan.StepPlan, pad: str | None) -> ChunkMetadata:
        # Validation is done: from here on nothing can fail on bad input.
        generation = self._builds + 1
        slot = generation % self.ring_depth
        n, nt = step.num_seqs, step.num_chunks
        seqs_out, rows_out, pad_seq = self._out_shape(pad, n, nt)
        views = self._views_for(slot, seqs_out, rows_out)
        cu, indices, offsets, _ = views

        if n or pad is not None:
            if self.backend == "triton":
                fill = self._fills.get(pad is not None) or self._fill_for(pad is not None)
                cu_ptr, indices_ptr, offsets_ptr = self._slot_ptrs[slot]
                dtype = query_start_loc.dtype
                if not fill.launch(dtype, query_start_loc.data_ptr(), self._params_ptr, cu_ptr, indices_ptr,
                                   offsets_ptr, step.first_seq, n, rows_out, seqs_out, pad_seq):
                    fill(query_start_loc, self._params, cu, indices, offsets, step.first_seq, n, rows_out,
                         seqs_out, pad_seq)
                if self._native is not None and (pad, dtype) not in self._native_fills:
                    self._make_native_fill(fill, pad, dtype)
            else:
                fill_torch(query_start_loc, cu, indices, offsets, step.first_seq, n, nt, self.chunk_size,
                           padded=pad is not None, seqs_out=seqs_out, num_rows=rows_out, pad_seq=pad_seq)
        _plan.write_host_cu_seqlens(step, self._cu_cpu_np[slot, : seqs_out + 1])
        return self._publish(slot, generation, views, n, step.num_tokens, nt, step.max_seqlen, pad)


def build_chunk_metadata(query_start_loc: torch.Tensor, query_start_loc_cpu, *, chunk_size: int = 64,
                         first_seq: int = 0, num_seqs: int | None = None, backend: str = "auto") -> ChunkMetadata:
    """One-shot build into freshly allocated tensors (sized to this batch): no ring, always live.

    For a step loop, keep a ``ChunkMetadataBuilder`` instead: it allocates once.
    """
    if not isinstance(query_start_loc, torch.Tensor):
        raise ChunkMetaError(
            f"query_start_loc is a {type(query_start_loc).__name__}: must be the device torch tensor."
        )
    host = _plan.host_array(query_start_loc_cpu)
    _plan.check_device_tensor(query_start_loc, host.shape[0], None)
    _plan.check_chunk_size(chunk_size)
    # Validate against the widest sizes one build supports, then size the buffers to the batch.
    widest = _plan.Capacity(_plan.MAX_NUM_SEQS, _plan.INT32_MAX - chunk_size, _plan.INT32_MAX // chunk_size)
    step = _plan.plan_step(host, first_seq, num_seqs, chunk_size, widest)
    builder = ChunkMetadataBuilder(max(1, step.num_seqs), max(1, step.num_tokens), chunk_size=chunk_size,
                                   device=query_start_loc.device, backend=backend, ring_depth=1)
    return builder._build(query_start_loc, step, None)
