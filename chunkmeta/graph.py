"""CUDA-graph mode: a build that is captured once and replayed with a different batch each step.

A captured kernel keeps the pointers and scalars it was captured with, so everything that
changes per step must live in device memory at fixed addresses:

* the engine's static ``query_start_loc`` buffer (engines already update it in place before
  each replay);
* ``params`` = ``(first_seq, num_seqs, batch_seqs)``, int32 on the device, refreshed by
  ``prepare()`` with one 12-byte non-blocking copy from pinned host memory. The host values go
  through a ring of 1024 staging slots, so a copy still queued behind the GPU never sees its
  source overwritten;
  a CUDA event recorded once per 32 steps tells when a block of slots is free again (the host
  waits only if it runs more than 1024 steps ahead of the GPU);
* the outputs: capacity-shaped padded tables in an arena owned by the graph build, written in
  place.

The split matches engines' graph runners: ``launch()`` is the in-graph part (capture it, or call
it eagerly), ``prepare()`` the out-of-graph part (host validation, host counts, the params copy),
run before every replay. The kernel finds N, T and NT on the device, so the graph is valid for
every batch that fits the capacity. Nothing allocates or synchronizes per step.

The metadata's tensors are therefore the same objects every step. FLA memoizes helpers such as
``prepare_lens`` by argument identity, so outside the captured region they must not be called
on these tensors (or ``FLA_DISABLE_TENSOR_CACHE=1``); the eager builder hands out new
``cu_seqlens`` objects every build for this reason.
"""

from __future__ import annotations

import torch

from chunkmeta import layout as _layout
from chunkmeta import plan as _plan
from chunkmeta.errors import ChunkMetaError
from chunkmeta.fill import resolve_backend
from chunkmeta.metadata import ChunkMetadata, StepTables
from chunkmeta.step_builder import StepFacts

_EVENT_EVERY = 32  # staging slots per CUDA event


class ParamsStaging:
    """A step's int32 params at a fixed device address (``params``), refreshed by ``stage()``
    with one non-blocking copy from pinned host memory through ``depth`` staging slots, so a
    copy still queued behind the GPU never sees its source overwritten; a CUDA event recorded
    once per ``_EVENT_EVERY`` steps tells when a block of slots is free again (the host waits,
    counted in ``waits``, only if it runs more than ``depth`` steps ahead of the GPU)."""

    def __init__(self, width: int, device: torch.device, depth: int = 1024):
        if depth % _EVENT_EVERY or depth < 2 * _EVENT_EVERY:
            raise ChunkMetaError(
                f"staging_depth={depth}: must be a multiple of {_EVENT_EVERY}, at least {2 * _EVENT_EVERY}."
            )
        on_cuda = device.type == "cuda"
        self.params = torch.zeros(width, dtype=torch.int32, device=device)
        self._staging = torch.zeros(depth, width, dtype=torch.int32, pin_memory=on_cuda)
        self._staging_np = self._staging.numpy()
        self._staging_rows = list(self._staging)  # made once: indexing the tensor per step costs ~1 us
        # one event per block of _EVENT_EVERY slots, recorded after the block's last copy
        self._block_events = [torch.cuda.Event() if on_cuda else None for _ in range(depth // _EVENT_EVERY)]
        self._block_recorded = [False] * len(self._block_events)
        self._device_index = device.index
        self._stream = None
        self._stream_raw = None
        self.waits = 0

    def stage(self, generation: int, values) -> None:
        """Queue the copy of ``values`` into ``params`` on the current stream (step ``generation``)."""
        slot = generation % self._staging_np.shape[0]
        block = slot // _EVENT_EVERY
        event = self._block_events[block]
        if event is not None and slot % _EVENT_EVERY == 0 and self._block_recorded[block]:
            # Entering a block of slots whose copies were queued one ring ago: their event tells
            # whether they ran. Only a host more than a ring ahead of the GPU waits here.
            if not event.query():
                self.waits += 1
                event.synchronize()
            self._block_recorded[block] = False
        self._staging_np[slot] = values
        self.params.copy_(self._staging_rows[slot], non_blocking=event is not None)
        if event is not None and slot % _EVENT_EVERY == _EVENT_EVERY - 1:
            event.record(self._current_stream())
            self._block_recorded[block] = True

    def _current_stream(self) -> torch.cuda.Stream:
        """torch.cuda.current_stream(), cached by the raw stream handle (creating the Stream
        object costs microseconds per step)."""
        raw = torch._C._cuda_getCurrentRawStream(self._device_index)
        if raw != self._stream_raw:
            self._stream, self._stream_raw = torch.cuda.current_stream(self._device_index), raw
        return self._stream


class _StaticGraph:
    """What both graph modes share: capture of ``launch()``, and the lease of static tensors
    (the object of step ``k`` is live until ``prepare()`` stages step ``k+1``, whose replay
    rewrites the same tensors). Subclasses set ``_generation``, ``_retired_through``, ``_graph``."""

    def capture(self) -> torch.cuda.CUDAGraph:
        """Capture ``launch()`` in a graph of its own (for callers without a graph of their own)."""
        self.launch()  # compiles the kernel outside the capture
        torch.cuda.current_stream().synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.launch()
        self._graph = graph
        return graph

    def _check_captured(self) -> None:
        if self._graph is None:
            raise ChunkMetaError(f"{type(self).__name__}.replay() before capture(): capture the graph once first.")

    def is_live(self, slot: int, generation: int) -> bool:
        return generation == self._generation and generation > self._retired_through

    def retire(self, generation: int) -> None:
        self._retired_through = max(self._retired_through, generation)

    def retired_message(self, slot: int, generation: int) -> str:
        if generation <= self._retired_through:
            return f"graph-mode metadata of step {generation} is retired: its step ended (the service's strict mode)."
        return (
            f"graph-mode metadata of step {generation} is retired: prepare() has staged step "
            f"{self._generation}, whose replay rewrites the same static tensors."
        )


class StepGraphBuild(_StaticGraph):
    """Graph-capturable step tables (``chunkmeta.StepTablesBuilder``) for an engine's static buffers.

    Every table of ``builder``, capacity-shaped (``build(padded=True)``'s layout), written in place
    into this object's own arena by one kernel that reads ``(first_seq, num_seqs, batch_seqs)``
    from device params (``ParamsStaging``): ``launch()`` is the in-graph part, ``prepare()`` the
    host part (every check, the host counts and copies, the params copy). The engine updates its
    static ``query_start_loc`` (and ``num_computed_tokens`` / ``checkpoint_offsets`` where the
    builder's tables need them) in place before each replay; the host arrays passed to
    ``prepare()`` hold the same values.
    """

    def __init__(
        self,
        builder,
        query_start_loc: torch.Tensor,
        *,
        num_computed_tokens: torch.Tensor | None = None,
        checkpoint_offsets: torch.Tensor | None = None,
        staging_depth: int = 1024,
    ):
        from chunkmeta.ring import TableRing

        device = builder.device
        for name, tensor, wanted in (
            ("query_start_loc", query_start_loc, True),
            ("num_computed_tokens", num_computed_tokens, builder.needs_computed),
            ("checkpoint_offsets", checkpoint_offsets, builder.needs_checkpoints),
        ):
            if not wanted:
                continue
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
                raise ChunkMetaError(f"{name} must be the engine's static 1-D device buffer (the tables read it).")
            _plan.check_row_tensor(name, tensor, tensor.shape[0], device)
            # prepare() bounds a step's requests by the query_start_loc buffer only: a shorter row
            # buffer would let the captured kernel read past its end
            if tensor.shape[0] < query_start_loc.shape[0] - 1:
                raise ChunkMetaError(
                    f"{name} has {tensor.shape[0]} entries but the static query_start_loc buffer holds "
                    f"{query_start_loc.shape[0]}: size it for one entry per request of the largest batch "
                    f"({query_start_loc.shape[0] - 1})."
                )
        try:  # the kernel reads its params on the device: the Triton kernel only
            resolve_backend("triton", device)
        except ChunkMetaError as exc:
            raise ChunkMetaError(f"StepGraphBuild needs the Triton kernel: {exc}") from None
        from chunkmeta.fill.step_fill import MAX_ENTRIES, StepFill

        self.builder = self._steps = builder
        self.query_start_loc = query_start_loc
        layout = builder.layout
        self._computed = num_computed_tokens if builder.needs_computed else builder._dummy
        self._checkpoints = checkpoint_offsets if builder.needs_checkpoints else builder._dummy
        host = builder.ring.host
        self.ring = TableRing(1, layout.regions, layout.slot_bytes, device, host, builder.capacity.seqs + 2)
        self._cu_cpu_np = {name: t[0] for name, t in self.ring.host_np.items()}
        self._staged = ParamsStaging(3, device, staging_depth)
        self._fill = StepFill(
            entries=layout.entries, block_seqs=builder.capacity.seqs, padded=True, params_on_device=True
        )
        self._ints = (0, 0, 0, *layout.rows_pad, *([0] * (MAX_ENTRIES - len(layout.rows_pad))))
        self._c_plan = None  # the C build's host side for this layout (checks, counts, host copies)
        if builder._native is not None:
            self._c_plan = builder.native_steps(0, 1, 1, 0, True, [self.ring.pointer(0)], self.ring.host_pointers())
        self._graph = None
        self._generation = 0
        self._retired_through = -1
        empty = StepFacts(0, 0, 0, 0, 0, 0, 0, False, False)
        self._results = builder.results_maker(True, self.ring, self)
        self._tables = self._results(0, self._generation, (0,) * len(layout.entries), empty)

    @property
    def tables(self) -> StepTables:
        """The static tables with the host facts of the last prepared step."""
        return self._tables

    @property
    def staging_waits(self) -> int:
        return self._staged.waits

    def launch(self) -> StepTables:
        """Queue the fill on the current stream: the part to capture (or to run eagerly)."""
        self._fill(
            self.query_start_loc,
            self._computed,
            self._checkpoints,
            self.ring.arena[0],
            self._ints,
            self._staged.params,
        )
        return self._tables

    def prepare(
        self,
        query_start_loc_cpu,
        *,
        first_seq: int = 0,
        num_seqs: int | None = None,
        num_computed_tokens_cpu=None,
        checkpoint_offsets_cpu=None,
    ) -> StepTables:
        """Host side of a step: every check, the host counts and copies, the params copy."""
        builder = self._steps
        planned = self._plan_c(
            query_start_loc_cpu, first_seq, num_seqs, num_computed_tokens_cpu, checkpoint_offsets_cpu
        )
        if planned is not None:
            counts, facts = planned
        else:  # the general path: the precise error, or the step
            array = _plan.host_array(query_start_loc_cpu)
            if array.shape[0] > self.query_start_loc.shape[0]:
                raise ChunkMetaError(
                    f"query_start_loc_cpu has {array.shape[0]} entries but the static query_start_loc buffer "
                    f"holds {self.query_start_loc.shape[0]}: size the buffer for the engine's largest batch."
                )
            facts, counts, step, batch = builder.plan_host(
                array, first_seq, num_seqs, num_computed_tokens_cpu, checkpoint_offsets_cpu
            )
            builder.write_host_cu_seqlens(self._cu_cpu_np, step, batch, True)
        # validated: from here on nothing fails on bad input
        self._staged.stage(self._generation, (facts.first_seq, facts.num_seqs, facts.batch_seqs))
        self._generation += 1
        self._tables = self._results(0, self._generation, counts, facts)
        return self._tables

    def _plan_c(self, query_start_loc_cpu, first_seq, num_seqs, computed_cpu, checkpoints_cpu):
        """``(counts, StepFacts)`` from one C call (the host tensors' checks, counts, host copies:
        launch() is the kernel), or None where the general path must run (it then raises the
        precise error, or plans)."""
        if self._c_plan is None:
            return None
        builder = self._steps
        out = builder._native.step_host(
            self._c_plan,
            builder._wants,
            query_start_loc_cpu,
            self.query_start_loc.shape[0],
            first_seq,
            num_seqs,
            computed_cpu,
            checkpoints_cpu,
        )
        return None if type(out) is int else (out[0], StepFacts(*out[1]))

    def replay(self, query_start_loc_cpu, **step) -> StepTables:
        """``prepare()`` then replay the graph from ``capture()``."""
        self._check_captured()
        tables = self.prepare(query_start_loc_cpu, **step)
        self._graph.replay()
        return tables


class GraphBuild(StepGraphBuild):
    """Graph-capturable chunk metadata for one static ``query_start_loc`` buffer: the
    ``StepGraphBuild`` of ``builder``'s step builder for ``pad`` (``ChunkMetadataBuilder``'s
    tables are one ``Fla`` table), handing out its ``ChunkMetadata``.

    Sized by ``builder`` (capacity, chunk size, device); owns its own static buffers (never the
    builder's ring, whose slots move). Metadata from ``prepare()`` is live until the next
    ``prepare()``: the next replay rewrites the same tensors.
    """

    def __init__(self, builder, query_start_loc: torch.Tensor, *, pad: str = "tail", staging_depth: int = 1024):
        _layout.check_pad(pad, _layout.PADS, builder.capacity.tokens, builder.chunk_size)
        if not isinstance(query_start_loc, torch.Tensor) or query_start_loc.dim() != 1:
            raise ChunkMetaError("query_start_loc must be the engine's static 1-D device buffer.")
        _plan.check_device_tensor(query_start_loc, query_start_loc.shape[0], builder.device)
        try:  # the kernel reads its params on the device: the Triton kernel only
            resolve_backend("triton", builder.device)
        except ChunkMetaError as exc:
            raise ChunkMetaError(f"GraphBuild needs the Triton kernel: {exc}") from None
        super().__init__(builder.step_builder(pad), query_start_loc, staging_depth=staging_depth)
        self.builder = builder
        self.pad = pad
        self.chunk_size = builder.chunk_size
        self.padded_num_seqs = _layout.padded_num_seqs(pad, builder.capacity.seqs)
        self.num_rows = builder.capacity.rows

    @property
    def metadata(self) -> ChunkMetadata:
        """The static padded tensors with the host ints of the last prepared step."""
        return self.tables

    def prepare(self, query_start_loc_cpu, *, first_seq: int = 0, num_seqs: int | None = None) -> ChunkMetadata:
        """Host side of a step: validate, take the host counts, stage ``(first_seq, num_seqs)``.

        The host copy describes the same values the engine has put (or is putting, on this
        stream) into the static ``query_start_loc`` buffer; its length may be shorter than the
        buffer's.
        """
        return super().prepare(query_start_loc_cpu, first_seq=first_seq, num_seqs=num_seqs)
