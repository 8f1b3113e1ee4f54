"""ChunkMetaService: the in-process service an engine calls around each step.

The engine's scheduler/model runner opens a step with its batch, every linear-attention layer of
the step reads the same ``ChunkMetadata`` from ``current``, and the step is closed when the
forward has been queued. This replaces FLA's identity cache on ``cu_seqlens`` (which hands out
stale metadata when an engine reuses a buffer in place) with an explicit lifecycle.

Lifecycle rules
  * ``begin_step`` while a step is open raises (a step must be ended first);
  * ``current`` with no open step raises;
  * metadata of an ended step is *retired*: ``check()`` raises for it, and with ``strict=True``
    the object itself turns dead (``md.is_live`` False, ``md.check_live()`` raises — which the
    adapters call), by a host generation counter, never a device read.

The ring rule (async scheduling): building step i+1 while step i's kernels still run on the
same stream writes a different ring slot, so step i's metadata is intact. With ``ring_depth``
D, a step's metadata stays intact for D-1 later builds; keep D above the number of steps the
host can have in flight (default 4; async scheduling needs 2).

Threads: a service serves one thread (the first that opens a step); a call from another thread
raises ``ChunkMetaError`` (``adopt_thread()`` hands it over). Services share nothing, so one per
thread (or per model, or per stream) is safe.

CUDA-graph mode: ``graph(query_start_loc_buffer)`` makes a ``GraphBuild`` over the engine's
static buffer; ``capture_step()`` is the capture-time hook (queues the capturable fill),
``begin_graph_step(batch)`` the replay-time hook (host side before the engine replays).

Step tables: ``ChunkMetaService(..., tables={name: spec})`` serves a ``StepTablesBuilder``
instead: ``begin_step`` returns the step's ``StepTables`` (every table its layers read, one
launch), the batch carries the Mamba2 tables' per-request arrays (``StepBatch``'s keyword-only
fields), and graph mode is a ``StepGraphBuild``. The lifecycle, strict mode, threads, audit and
stats are the same code; only what a build is differs (``_FlaSteps`` / ``_TableSteps``).
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time

import attrs
import numpy as np
import torch

from chunkmeta import layout as _layout
from chunkmeta import plan as _plan
from chunkmeta import tables as _tables
from chunkmeta.batch import StepBatch
from chunkmeta.builder import ChunkMetadataBuilder
from chunkmeta.errors import ChunkMetaError
from chunkmeta.graph import GraphBuild, StepGraphBuild
from chunkmeta.metadata import ChunkMetadata, StepTables
from chunkmeta.plan import verify_host_copy
from chunkmeta.step_builder import StepTablesBuilder

_SIZES = 3  # a window entry's values before the rows: host ns, N, T
_FLA_CHUNK_SIZE = 64
_UNSET = object()  # chunk_size not given: the FLA-only service's default; with tables=, none


@attrs.frozen(slots=True)
class ServiceStats:
    """A snapshot of the service's counters (host data only).

    ``last_num_seqs`` / ``last_num_tokens``: the prefill slice's N and T. ``last_rows``: the rows
    of each table of the last step (the FLA-only service's one table is ``"fla"``);
    ``last_num_chunks``: their sum (the FLA-only service: NT). ``rows_use``: the fullest table's
    rows over its capacity, max over the window.
    """

    builds: int
    graph_steps: int
    host_us_p50: float
    host_us_p99: float
    window: int  # builds the percentiles cover
    last_num_seqs: int
    last_num_tokens: int
    last_num_chunks: int
    seqs_use: float  # fraction of capacity, max over the window
    tokens_use: float
    rows_use: float
    staging_waits: int
    last_rows: dict = attrs.field(factory=dict)


class _FlaSteps:
    """What a build is for the FLA-only service: one ``ChunkMetadata`` of the prefill slice."""

    def __init__(self, builder: ChunkMetadataBuilder, pad: str):
        self.builder = builder
        self.pad = pad
        self.row_names = ("fla",)
        self.row_capacity = np.array([builder.capacity.rows], dtype=np.float64)

    def build(self, batch: StepBatch) -> ChunkMetadata:
        return self.builder.build(
            batch.query_start_loc, batch.query_start_loc_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs
        )

    def make_graph(self, query_start_loc, pad, num_computed_tokens, checkpoint_offsets) -> GraphBuild:
        for name, given in (("num_computed_tokens", num_computed_tokens), ("checkpoint_offsets", checkpoint_offsets)):
            if given is not None:
                raise ChunkMetaError(
                    f"graph({name}=...): the FLA-only service's tables read no per-request arrays; make the "
                    "service with tables={...} for Mamba2 tables."
                )
        return GraphBuild(self.builder, query_start_loc, pad=pad)

    def audit(self, batch: StepBatch) -> None:
        """Nothing beyond ``query_start_loc``: the FLA tables read no per-request arrays."""

    def prepare(self, graph: GraphBuild, batch: StepBatch) -> ChunkMetadata:
        return graph.prepare(batch.query_start_loc_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs)

    def record(self, host_ns: int, metadata: ChunkMetadata) -> tuple:
        return host_ns, metadata.num_seqs, metadata.num_tokens, metadata.num_chunks


# the host int that counts each table's rows (its kernel entry's real rows)
_ROWS = {
    _tables.Fla: operator.attrgetter("num_chunks"),
    _tables.Conv: operator.attrgetter("tot"),
    _tables.Mamba2: operator.attrgetter("num_chunks"),
    _tables.SglangMamba2: operator.attrgetter("num_logical_chunks"),
}
_call = getattr(operator, "call", lambda function, arg: function(arg))  # operator.call: Python >= 3.11
_ROW_ARRAYS = (("num_computed_tokens", "needs_computed"), ("checkpoint_offsets", "needs_checkpoints"))


class _TableSteps:
    """What a build is for a service made with ``tables=``: one ``StepTables`` of every table."""

    def __init__(self, builder: StepTablesBuilder):
        self.builder = builder
        self.pad = builder.pad
        self.row_names = tuple(builder.specs)
        # in the tables' order: a StepTables holds them in its specs' order (chunkmeta.results)
        self._row_getters = tuple(_ROWS[type(spec)] for spec in builder.specs.values())
        # a table's capacity: the rows of its last entry (SglangMamba2's logical chunks)
        capacity = dict(zip(builder.layout.owners, builder.layout.rows_pad, strict=True))
        self.row_capacity = np.array([max(1, capacity[name]) for name in self.row_names], dtype=np.float64)
        # the per-request arrays the builder's tables read
        self.row_arrays = [name for name, needs in _ROW_ARRAYS if getattr(builder, needs)]
        self.graph_buffers: dict[str, torch.Tensor] = {}

    def build(self, batch: StepBatch) -> StepTables:
        return self.builder.build(
            batch.query_start_loc,
            batch.query_start_loc_cpu,
            first_seq=batch.first_seq,
            num_seqs=batch.num_seqs,
            num_computed_tokens=batch.num_computed_tokens,
            num_computed_tokens_cpu=batch.num_computed_tokens_cpu,
            checkpoint_offsets=batch.checkpoint_offsets,
            checkpoint_offsets_cpu=batch.checkpoint_offsets_cpu,
        )

    def make_graph(self, query_start_loc, pad, num_computed_tokens, checkpoint_offsets) -> StepGraphBuild:
        if pad != self.builder.pad:
            raise ChunkMetaError(
                f"graph(pad={pad!r}): the step tables' padding is the builder's ({self.builder.pad!r}); make the "
                "service with ChunkMetaService(..., tables=..., pad=...) to change it."
            )
        graph = StepGraphBuild(
            self.builder,
            query_start_loc,
            num_computed_tokens=num_computed_tokens,
            checkpoint_offsets=checkpoint_offsets,
        )
        given = {"num_computed_tokens": num_computed_tokens, "checkpoint_offsets": checkpoint_offsets}
        self.graph_buffers = {name: given[name] for name in self.row_arrays}
        return graph

    def prepare(self, graph: StepGraphBuild, batch: StepBatch) -> StepTables:
        # the captured kernel reads the static buffers it was captured with: a batch naming other
        # tensors would get tables of the buffers' values, not of its own
        for name, buffer in self.graph_buffers.items():
            if getattr(batch, name) is not buffer:
                raise ChunkMetaError(
                    f"begin_graph_step: batch.{name} is not the static buffer the graph was captured with; write "
                    f"the step's values into that buffer and pass it (and {name}_cpu, its host copy)."
                )
        return graph.prepare(
            batch.query_start_loc_cpu,
            first_seq=batch.first_seq,
            num_seqs=batch.num_seqs,
            num_computed_tokens_cpu=batch.num_computed_tokens_cpu,
            checkpoint_offsets_cpu=batch.checkpoint_offsets_cpu,
        )

    def record(self, host_ns: int, tables: StepTables) -> tuple:
        # map, not a comprehension: the record is part of every begin_step's host time
        return host_ns, tables.num_seqs, tables.num_tokens, *map(_call, self._row_getters, tables._tables.values())

    def audit(self, batch: StepBatch) -> None:
        """The per-request arrays' device copies against their host copies (a sync)."""
        for name in self.row_arrays:
            device, host = getattr(batch, name), getattr(batch, f"{name}_cpu")
            if device is None or host is None:
                continue  # the build names what is missing
            host = np.asarray(host)
            if tuple(device.shape) != host.shape:
                continue  # the build names the bad shape
            _plan.check_same_values(name, device, host)


class ChunkMetaService:
    """Owns a builder and serves one per-step object per engine step: a ``ChunkMetadata`` from
    a ``ChunkMetadataBuilder``, or with ``tables={name: spec}`` (``chunkmeta.tables``) a
    ``StepTables`` from a ``StepTablesBuilder``.

    ``chunk_size`` is the FLA-only service's (default 64; with ``tables`` each spec has its own).
    ``pad``: the step tables' padding in graph mode (``StepTablesBuilder(pad=...)``), or the
    FLA-only service's default for ``graph()`` (default ``"tail"``).
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        *,
        chunk_size: int = _UNSET,
        device: torch.device | str,
        backend: str = "auto",
        ring_depth: int = 4,
        strict: bool = False,
        stats_window: int = 1024,
        audit_every: int = 0,
        tables: dict | None = None,
        pad: str = "tail",
    ):
        window = _plan.index_arg("stats_window", stats_window)  # checked before anything is allocated
        if window < 1:
            raise ChunkMetaError(f"stats_window={stats_window!r}: must be an int >= 1 (builds the stats cover).")
        if tables is None:
            self.builder = ChunkMetadataBuilder(
                max_num_seqs,
                max_num_tokens,
                chunk_size=_FLA_CHUNK_SIZE if chunk_size is _UNSET else chunk_size,
                device=device,
                backend=backend,
                ring_depth=ring_depth,
            )
            # graph()'s default, checked now rather than at the first graph() call
            _layout.check_pad(pad, _layout.PADS, max_num_tokens, self.builder.chunk_size)
            self._steps = _FlaSteps(self.builder, pad)
        else:
            if chunk_size is not _UNSET:
                raise ChunkMetaError(
                    f"chunk_size={chunk_size!r} with tables=: each table has its own chunk size; give it in the "
                    "specs (tables.Fla(chunk_size), tables.Mamba2(chunk_size=...))."
                )
            self.builder = StepTablesBuilder(
                max_num_seqs,
                max_num_tokens,
                tables=tables,
                device=device,
                backend=backend,
                ring_depth=ring_depth,
                pad=pad,
            )
            self._steps = _TableSteps(self.builder)
        self.strict = strict
        # audit_every > 0: every k-th step also checks the device query_start_loc (and the step
        # tables' per-request arrays) against the host copies (a sync: a debugging aid, off by
        # default); see plan.verify_host_copy.
        self.audit_every = audit_every
        self._current: ChunkMetadata | StepTables | None = None
        self._current_step_id: int | None = None
        self._graph: GraphBuild | StepGraphBuild | None = None
        self._graph_args: tuple = ()
        self._graph_steps = 0
        # host ns, N, T and each table's rows per build, over a window: one tuple of host ints per
        # build, stored in a list (numpy item writes and a numpy view of the host copy took more
        # host time than the build itself); stats() turns them into an array
        self._window: list[tuple] = [()] * window
        self._recorded = 0
        self._thread: int | None = None  # the thread that drives steps (set on first use)

    # -- the step lifecycle ---------------------------------------------------------------

    def begin_step(self, batch: StepBatch) -> ChunkMetadata | StepTables:
        """Build the step's metadata (or step tables) and make it ``current``. Raises if a step is open."""
        self._check_thread()
        if self._current is not None:
            raise ChunkMetaError(
                f"begin_step while step {self._describe_open()} is open: call end_step() first "
                "(or use the step() context manager)."
            )
        if self.audit_every and self._recorded % self.audit_every == 0:
            verify_host_copy(batch.query_start_loc, batch.query_start_loc_cpu)
            self._steps.audit(batch)
        start = time.perf_counter_ns()
        metadata = self._steps.build(batch)
        self._record(time.perf_counter_ns() - start, metadata)
        return self._open(metadata, batch.step_id)

    @property
    def current(self) -> ChunkMetadata | StepTables:
        """The open step's metadata (or step tables); raises if no step is open."""
        if self._current is None:
            raise ChunkMetaError("no step is open: call begin_step(batch) before the forward pass.")
        return self._current

    @property
    def in_step(self) -> bool:
        return self._current is not None

    def end_step(self) -> None:
        """Close the open step; its metadata is retired. Raises if no step is open."""
        self._check_thread()
        if self._current is None:
            raise ChunkMetaError("end_step with no open step: every end_step needs a begin_step.")
        if self.strict:
            self._current.retire()
        self._current = None
        self._current_step_id = None

    @contextlib.contextmanager
    def step(self, batch: StepBatch):
        """``with service.step(batch) as md:`` — begin_step, then end_step even on error."""
        metadata = self.begin_step(batch)
        try:
            yield metadata
        finally:
            self.end_step()

    def check(self, metadata: ChunkMetadata | StepTables) -> ChunkMetadata | StepTables:
        """Return ``metadata`` if it is the open step's; raise if it is retired or foreign."""
        if metadata is self._current:
            return metadata
        kind = type(metadata).__name__
        if self._current is None:
            raise ChunkMetaError(
                f"{kind} of build {metadata.generation} used with no open step: it was retired at "
                "end_step(); use the current step's metadata."
            )
        raise ChunkMetaError(
            f"{kind} of build {metadata.generation} is not the open step's "
            f"(build {self._current.generation}): it is retired or from another service."
        )

    # -- CUDA-graph mode ------------------------------------------------------------------

    def graph(
        self,
        query_start_loc: torch.Tensor,
        *,
        pad: str | None = None,
        num_computed_tokens: torch.Tensor | None = None,
        checkpoint_offsets: torch.Tensor | None = None,
    ) -> GraphBuild | StepGraphBuild:
        """Enable graph mode over the engine's static ``query_start_loc`` buffer (once): a
        ``GraphBuild``, or with step tables a ``StepGraphBuild``, which also reads the static
        ``num_computed_tokens`` / ``checkpoint_offsets`` buffers where its tables need them.
        ``pad`` (default: the service's) must be the service's with step tables."""
        pad = self._steps.pad if pad is None else pad
        buffers = (query_start_loc, num_computed_tokens, checkpoint_offsets)
        if self._graph is not None:
            old_pad, old_buffers = self._graph_args
            if pad != old_pad or any(a is not b for a, b in zip(buffers, old_buffers, strict=True)):
                raise ChunkMetaError("graph mode is already enabled with another buffer or pad mode.")
            return self._graph
        self._graph = self._steps.make_graph(query_start_loc, pad, num_computed_tokens, checkpoint_offsets)
        self._graph_args = (pad, buffers)
        return self._graph

    def capture_step(self) -> ChunkMetadata | StepTables:
        """Capture-time hook: queue the capturable fill; returns the static padded metadata (or step tables)."""
        return self._require_graph().launch()

    def begin_graph_step(self, batch: StepBatch) -> ChunkMetadata | StepTables:
        """Replay-time hook: host side of a graph step (validate, stage params), then open the step.

        ``batch.query_start_loc`` (and with step tables ``batch.num_computed_tokens`` /
        ``checkpoint_offsets``, where its tables read them) must be the static buffers given to
        ``graph()`` (the engine has written this step's values into them); replay the graph after
        this call.
        """
        self._check_thread()
        graph = self._require_graph()
        if self._current is not None:
            raise ChunkMetaError(f"begin_graph_step while step {self._describe_open()} is open: end it first.")
        if batch.query_start_loc is not graph.query_start_loc:
            raise ChunkMetaError(
                "begin_graph_step: batch.query_start_loc is not the static buffer the graph was captured "
                "with; write the step's values into that buffer and pass it."
            )
        start = time.perf_counter_ns()
        metadata = self._steps.prepare(graph, batch)
        self._record(time.perf_counter_ns() - start, metadata)
        self._graph_steps += 1
        return self._open(metadata, batch.step_id)

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> ServiceStats:
        size = len(self._window)
        count = min(self._recorded, size)
        rows = np.array(self._window[:count], dtype=np.int64).reshape(count, _SIZES + len(self._steps.row_names))
        cap = self.builder.capacity
        last = rows[(self._recorded - 1) % size] if count else np.zeros(rows.shape[1], dtype=np.int64)
        host_us = rows[:, 0] / 1e3
        table_rows = last[_SIZES:]
        return ServiceStats(
            builds=self._recorded,
            graph_steps=self._graph_steps,
            host_us_p50=float(np.percentile(host_us, 50)) if count else float("nan"),
            host_us_p99=float(np.percentile(host_us, 99)) if count else float("nan"),
            window=count,
            last_num_seqs=int(last[1]),
            last_num_tokens=int(last[2]),
            last_num_chunks=int(table_rows.sum()),
            seqs_use=float(rows[:, 1].max() / cap.seqs) if count else 0.0,
            tokens_use=float(rows[:, 2].max() / cap.tokens) if count else 0.0,
            rows_use=float((rows[:, _SIZES:] / self._steps.row_capacity).max()) if count else 0.0,
            staging_waits=self._graph.staging_waits if self._graph is not None else 0,
            last_rows=dict(zip(self._steps.row_names, table_rows.tolist(), strict=True)),
        )

    def adopt_thread(self) -> None:
        """Hand the service to the calling thread (e.g. an engine that moves its step loop)."""
        if self._current is not None:
            raise ChunkMetaError("adopt_thread while a step is open: end the step on its thread first.")
        self._thread = threading.get_ident()

    # -- internals ------------------------------------------------------------------------

    def _check_thread(self) -> None:
        # One thread drives the steps: the builder's ring and the open step are unsynchronized
        # state, and two threads interleaving steps would hand one thread the other's metadata.
        ident = threading.get_ident()
        if self._thread is None:
            self._thread = ident
        elif ident != self._thread:
            raise ChunkMetaError(
                f"ChunkMetaService used from thread {ident} but it serves thread {self._thread}: a service "
                "serves one thread; create one per thread (they share nothing), or call adopt_thread() on the "
                "new thread when handing it over."
            )

    def _open(self, metadata, step_id: int | None):
        self._current = metadata
        self._current_step_id = step_id
        return metadata

    def _record(self, host_ns: int, metadata) -> None:
        self._window[self._recorded % len(self._window)] = self._steps.record(host_ns, metadata)
        self._recorded += 1

    def _require_graph(self) -> GraphBuild | StepGraphBuild:
        if self._graph is None:
            raise ChunkMetaError("graph mode is not enabled: call service.graph(query_start_loc_buffer) first.")
        return self._graph

    def _describe_open(self) -> str:
        step = f" (engine step {self._current_step_id})" if self._current_step_id is not None else ""
        return f"{self._current.generation}{step}"
