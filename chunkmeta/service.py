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
"""

from __future__ import annotations

import contextlib
import threading
import time

import attrs
import numpy as np
import torch

from chunkmeta.batch import StepBatch
from chunkmeta.builder import ChunkMetadataBuilder
from chunkmeta.errors import ChunkMetaError
from chunkmeta.graph import GraphBuild
from chunkmeta.metadata import ChunkMetadata
from chunkmeta.plan import verify_host_copy


@attrs.frozen(slots=True)
class ServiceStats:
    """A snapshot of the service's counters (host data only)."""

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


class ChunkMetaService:
    """Owns a ``ChunkMetadataBuilder`` and serves one ``ChunkMetadata`` per engine step."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        *,
        chunk_size: int = 64,
        device: torch.device | str,
        backend: str = "auto",
        ring_depth: int = 4,
        strict: bool = False,
        stats_window: int = 1024,
        audit_every: int = 0,
    ):
        self.builder = ChunkMetadataBuilder(
            max_num_seqs, max_num_tokens, chunk_size=chunk_size, device=device, backend=backend, ring_depth=ring_depth
        )
        self.strict = strict
        # audit_every > 0: every k-th step also checks the device query_start_loc against the host
        # copy (a sync: a debugging aid, off by default); see plan.verify_host_copy.
        self.audit_every = audit_every
        self._current: ChunkMetadata | None = None
        self._current_step_id: int | None = None
        self._graph: GraphBuild | None = None
        self._graph_steps = 0
        # host ns per build, and sizes, over a window (written in place: cheap enough to leave on)
        self._window = np.zeros((stats_window, 4), dtype=np.int64)
        self._recorded = 0
        self._thread: int | None = None  # the thread that drives steps (set on first use)

    # -- the step lifecycle ---------------------------------------------------------------

    def begin_step(self, batch: StepBatch) -> ChunkMetadata:
        """Build the step's metadata and make it ``current``. Raises if a step is open."""
        self._check_thread()
        if self._current is not None:
            raise ChunkMetaError(
                f"begin_step while step {self._describe_open()} is open: call end_step() first "
                "(or use the step() context manager)."
            )
        if self.audit_every and self._recorded % self.audit_every == 0:
            verify_host_copy(batch.query_start_loc, batch.query_start_loc_cpu)
        start = time.perf_counter_ns()
        metadata = self.builder.build(
            batch.query_start_loc, batch.query_start_loc_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs
        )
        self._record(time.perf_counter_ns() - start, metadata)
        return self._open(metadata, batch.step_id)

    @property
    def current(self) -> ChunkMetadata:
        """The open step's metadata; raises if no step is open."""
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

    def check(self, metadata: ChunkMetadata) -> ChunkMetadata:
        """Return ``metadata`` if it is the open step's; raise if it is retired or foreign."""
        if metadata is self._current:
            return metadata
        if self._current is None:
            raise ChunkMetaError(
                f"ChunkMetadata of build {metadata.generation} used with no open step: it was retired at "
                "end_step(); use the current step's metadata."
            )
        raise ChunkMetaError(
            f"ChunkMetadata of build {metadata.generation} is not the open step's "
            f"(build {self._current.generation}): it is retired or from another service."
        )

    # -- CUDA-graph mode ------------------------------------------------------------------

    def graph(self, query_start_loc: torch.Tensor, *, pad: str = "tail") -> GraphBuild:
        """Enable graph mode over the engine's static ``query_start_loc`` buffer (once)."""
        if self._graph is not None:
            if self._graph.query_start_loc is not query_start_loc or self._graph.pad != pad:
                raise ChunkMetaError("graph mode is already enabled with another buffer or pad mode.")
            return self._graph
        self._graph = GraphBuild(self.builder, query_start_loc, pad=pad)
        return self._graph

    def capture_step(self) -> ChunkMetadata:
        """Capture-time hook: queue the capturable fill; returns the static padded metadata."""
        return self._require_graph().launch()

    def begin_graph_step(self, batch: StepBatch) -> ChunkMetadata:
        """Replay-time hook: host side of a graph step (validate, stage params), then open the step.

        ``batch.query_start_loc`` must be the static buffer given to ``graph()`` (the engine has
        written this step's values into it); replay the graph after this call.
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
        metadata = graph.prepare(batch.query_start_loc_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs)
        self._record(time.perf_counter_ns() - start, metadata)
        self._graph_steps += 1
        return self._open(metadata, batch.step_id)

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> ServiceStats:
        count = min(self._recorded, self._window.shape[0])
        rows = self._window[:count]
        cap = self.builder.capacity
        last = self._window[(self._recorded - 1) % self._window.shape[0]] if count else np.zeros(4, np.int64)
        host_us = rows[:, 0] / 1e3
        return ServiceStats(
            builds=self._recorded,
            graph_steps=self._graph_steps,
            host_us_p50=float(np.percentile(host_us, 50)) if count else float("nan"),
            host_us_p99=float(np.percentile(host_us, 99)) if count else float("nan"),
            window=count,
            last_num_seqs=int(last[1]),
            last_num_tokens=int(last[2]),
            last_num_chunks=int(last[3]),
            seqs_use=float(rows[:, 1].max() / cap.seqs) if count else 0.0,
            tokens_use=float(rows[:, 2].max() / cap.tokens) if count else 0.0,
            rows_use=float(rows[:, 3].max() / cap.rows) if count else 0.0,
            staging_waits=self._graph.staging_waits if self._graph is not None else 0,
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

    def _open(self, metadata: ChunkMetadata, step_id: int | None) -> ChunkMetadata:
        self._current = metadata
        self._current_step_id = step_id
        return metadata

    def _record(self, host_ns: int, metadata: ChunkMetadata) -> None:
        row = self._window[self._recorded % self._window.shape[0]]
        row[0] = host_ns
        row[1] = metadata.num_seqs
        row[2] = metadata.num_tokens
        row[3] = metadata.num_chunks
        self._recorded += 1

    def _require_graph(self) -> GraphBuild:
        if self._graph is None:
            raise ChunkMetaError("graph mode is not enabled: call service.graph(query_start_loc_buffer) first.")
        return self._graph

    def _describe_open(self) -> str:
        step = f" (engine step {self._current_step_id})" if self._current_step_id is not None else ""
        return f"{self._current.generation}{step}"
