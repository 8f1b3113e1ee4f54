"""One forward's chunk tables for SGLang's linear-attention backends, built by the core.

Layouts (``ForwardTables.layout``)
  ``"exact"``    ``extend_seq_lens_cpu`` is there (SGLang's own test: not None, one entry per row,
                 no two-batch-overlap parent): FLA's layout, ``[NT, 2]`` rows (the vendored
                 helpers' bit for bit, unless a zero-length row precedes a non-empty one: they
                 renumber the sequences after it, chunkmeta keeps the ``cu_seqlens`` index the
                 kernels read bounds and states by; docs/sglang.md), by one
                 ``StepTablesBuilder`` launch that also writes GDN's causal-conv1d
                 ``conv_block_table`` (``chunkmeta.tables.Conv(paired=True)``: SGLang's int32
                 ``[tot, 2]`` ``(row, block)`` pairs), served where SGLang's own rule would build it.
  ``"bounded"``  no trusted host lengths (gpu_only batches, two-batch-overlap children): the host
                 knows N (``batch_size``: ``query_start_loc`` has N+1 entries) and an upper bound
                 T on the tokens (``sizing.token_bound``), not the lengths, so not NT. The core's
                 ``build_bounded`` sizes the rows from N and T
                 (``chunkmeta.layout.chunk_row_bound``) and the device finds the real NT.
  ``"graph"``    a forward inside a CUDA graph (the split hooks): the core's ``GraphBuild``,
                 capacity-shaped static tables rewritten in place by the captured launch.
  Padding rows are ``(0, PAST_END_CHUNK)`` (``pad="past_end"``): SGLang's own convention
  (``srt/layers/attention/linear/kda_prefill_graph.py``, ``_PAD_CHUNK = 1 << 20``), a chunk past
  the end of sequence 0, on which every varlen FLA chunk kernel does nothing (its
  ``i_t * BT >= T`` guard or boundary checks). ``cu_seqlens`` stays SGLang's own tensor, so the
  sequence count the kernels see, and the state indices they read, are unchanged. The core writes
  every table; the adapter only hands SGLang's tensors over and reads host ints.

DP padding keeps the real ``query_start_loc`` (padded rows are zero-length, at the tail) and pads
only the token count, which the bounded layout's bound may then exceed: still a bound.
"""

from __future__ import annotations

import logging
import re
import time

import attrs
import numpy as np
import torch

from chunkmeta import layout
from chunkmeta.errors import ChunkMetaError
from chunkmeta.graph import GraphBuild
from chunkmeta.integrations.fla import FlaRouter, patch_fla
from chunkmeta.integrations.plugin import keeps_engine_path
from chunkmeta.integrations.sglang import sizing
from chunkmeta.integrations.sglang.routing import Provider
from chunkmeta.metadata import ChunkMetadata
from chunkmeta.service import ChunkMetaService
from chunkmeta.step_builder import StepTablesBuilder
from chunkmeta.tables import Conv, Fla

logger = logging.getLogger(__name__)

ENV_VAR = "CHUNKMETA_SGLANG"  # the opt-in (wiring.ENV_VAR); 0 turns chunkmeta off
CHUNK_SIZE = 64  # SGLang's KDA and GDN chunked prefill both use FLA's 64-token chunks
PAD = "past_end"  # SGLang's padding rows, (0, chunkmeta.layout.PAST_END_CHUNK)
# Other chunk sizes SGLang's vendored FLA asks prepare_chunk_indices for: GDN's chunk_fwd_o uses
# BT = min(64, max(16, next_pow2(T))), T the tokens it is given, so BT < 64 only when T < 64 and then
# BT >= T >= every sequence's length: each non-empty sequence is one chunk at BT and at 64, and the
# 64-token tables are BT's too (``ForwardTables.with_chunk_size``). That holds for every T.
SMALL_CHUNK_SIZES = (32, 16)
ACTIVE_DEVICES = ("cuda", "cpu")  # NPU/XPU backends run other kernels: stay out of their way
# SGLang's GDN builds a conv_block_table only when the rectangular (rows, max blocks) grid holds more
# than this many times the blocks there are ("a 4x ratio means over 75% of its blocks do no work"):
# sglang/srt/layers/attention/linear/gdn_backend.py:604-608 (GDNAttnBackend._init_prefill_conv_block_table,
# SGLang 0.5.23).
CONV_TABLE_GRID_RATIO = 4


def logical_mode(forward_batch):
    """The forward mode of the rows: 0.5.23's DP padding may relabel a decode batch EXTEND
    (``logical_forward_mode`` says DECODE then); the rows are still decodes."""
    mode = getattr(forward_batch, "logical_forward_mode", None)
    return mode if mode is not None else forward_batch.forward_mode


def needs_chunk_tables(mode) -> bool:
    """A forward mode whose linear layers run FLA's chunked prefill.

    Read through SGLang's helpers, never enum values (their numbers moved between releases). EXTEND,
    MIXED (running decodes are one-token extends appended at the end: every row is a prefill row),
    SPLIT_PREFILL, DLLM_EXTEND and draft extends get tables; DECODE, IDLE, TARGET_VERIFY and a
    decode batch relabelled EXTEND by DP padding (see ``logical_mode``) get none.
    """
    if mode is None or mode.is_decode_or_idle() or mode.is_target_verify():
        return False
    try:
        return bool(mode.is_extend(include_draft_extend_v2=True))
    except TypeError:  # a ForwardMode without the flag
        return bool(mode.is_extend())


def fallback(counts: dict, warned: set, key: str, what: str) -> None:
    """Count a forward left to SGLang's own code and say so once per reason, with the fix."""
    counts["fallback"] += 1
    if key not in warned:
        warned.add(key)
        logger.warning(
            "chunkmeta: a forward has %s. Size with CHUNKMETA_SGLANG_MAX_NUM_SEQS / CHUNKMETA_SGLANG_MAX_NUM_TOKENS "
            "if this repeats.",
            what,
        )


_NUMBER = re.compile(r"0x[0-9a-fA-F]+|-?\d+")  # addresses and counts: values of one cause


def build_failed(counts: dict, causes: dict, exc: Exception, what: str) -> None:
    """Count a forward whose build raised (a ``ChunkMetaError`` for inputs the host checks did not
    catch, or a compile/launch failure) and left to SGLang's own code: one warning per kind of
    cause (numbers and addresses replaced: other values of one cause are not another warning),
    debug after. Nothing was published: a build checks its inputs before it writes, and a launch
    that failed part-way can only have written the slot of the ring's oldest build, which no
    forward still binds (each forward binds its own build)."""
    counts["fallback"] += 1
    counts["build_failed"] += 1
    cause = f"{type(exc).__name__}: " + _NUMBER.sub("N", str(exc))
    count = causes[cause] = causes.get(cause, 0) + 1
    (logger.warning if count == 1 else logger.debug)(
        "chunkmeta: a forward's build failed: %s: %s. This forward uses %s (build failures: %d; this cause: %d).",
        type(exc).__name__,
        exc,
        what,
        counts["build_failed"],
        count,
    )


def warm_up(builder: StepTablesBuilder) -> None:
    """One build of a ``[0, 1]`` step when a builder is made: the fill compiles and the host plan
    runs before the first real forward, and a fill that cannot run on this platform fails here,
    where the backend can still keep SGLang's own path. Uses one ring slot."""
    host = torch.tensor([0, 1], dtype=torch.int32)  # int32, as SGLang's query_start_loc
    rows = {}
    if builder.needs_computed:  # SglangMamba2 reads the cached prefixes
        zero = torch.zeros(1, dtype=torch.int32)
        rows = {"num_computed_tokens": zero.to(builder.device), "num_computed_tokens_cpu": zero}
    builder.build(host.to(builder.device), host, **rows)


@attrs.frozen(slots=True, eq=False, repr=False)
class ForwardTables:
    """One forward's chunk tables, keyed by the backend's own ``query_start_loc`` tensor.

    ``query_start_loc`` is what SGLang passes FLA as ``cu_seqlens`` (int32 ``[N+1]``), so it is the
    ``cu_seqlens`` here too; ``chunk_indices`` int32 ``[num_rows, 2]`` and ``chunk_offsets`` int64
    ``[>= N+1]`` follow FLA's contract (``chunk_offsets[i]`` is sequence i's first row). For
    ``"bounded"`` and ``"graph"`` rows past the real count are ``(0, PAST_END_CHUNK)``.
    ``max_seqlen`` is a host upper bound on any sequence's length (exact for ``"exact"`` and
    ``"graph"``). ``metadata`` is the core's ChunkMetadata behind the tables, whose liveness
    ``check_live`` checks.

    Exposes the ChunkMetadata fields ``FlaRouter`` reads (``cu_seqlens``, ``chunk_size``,
    ``padding``, ``check_live``), so the router can serve it.
    """

    query_start_loc: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_size: int
    layout: str
    num_rows: int
    max_seqlen: int
    metadata: ChunkMetadata

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.query_start_loc

    @property
    def padding(self) -> str | None:
        return None if self.layout == "exact" else PAD

    def check_live(self) -> ForwardTables:
        self.metadata.check_live()
        return self

    def with_chunk_size(self, chunk_size: int) -> ForwardTables | None:
        """The same tables under a smaller chunk size, when every sequence fits one chunk of it
        (each non-empty sequence is then one row at both sizes: the tables are identical)."""
        if chunk_size == self.chunk_size:
            return self
        if chunk_size < self.chunk_size and self.max_seqlen <= chunk_size:
            return attrs.evolve(self, chunk_size=chunk_size)
        return None

    def __repr__(self) -> str:
        return (
            f"ForwardTables(layout={self.layout} rows={self.num_rows} C={self.chunk_size} "
            f"max_seqlen<={self.max_seqlen} N={self.query_start_loc.shape[0] - 1})"
        )


_OWN_PATH = "SGLang's own path (FLA derives its chunk tables, one sync; GDN's conv table is SGLang's)"


@attrs.frozen(slots=True)
class _GraphEntry:
    """Graph mode for one static ``query_start_loc`` buffer (SGLang keeps one per batch size)."""

    graph: GraphBuild
    # The graph's chunk_offsets has an entry per capacity sequence; FLA reads it by the rows of
    # SGLang's static query_start_loc, whose padding rows are zero-length tails. Made once: the
    # static tensors never move.
    chunk_offsets: torch.Tensor


class BackendChunkMeta:
    """One backend instance's chunk metadata: a ``ChunkMetaService`` for exact builds, its builder's
    bounded builds, a ``GraphBuild`` per static ``query_start_loc``, and the current forward's tables.

    ``tables`` is bound by every ``init_forward_metadata*`` call and cleared when a forward needs
    none, so nothing from an earlier forward can be served (consumers also match the tensor).
    ``served`` maps each chunk size the router may answer for to the tables at that size.
    """

    def __init__(
        self,
        *,
        device,
        max_num_seqs: int,
        max_num_tokens: int,
        router: FlaRouter | None = None,
        ring_depth: int = 4,
        conv_block_m: int | None = None,
    ):
        # bounded and graph builds (no host lengths, static buffers)
        self.service = ChunkMetaService(
            max_num_seqs, max_num_tokens, chunk_size=CHUNK_SIZE, device=device, ring_depth=ring_depth
        )
        self.device = self.service.builder.device
        self.capacity = self.service.builder.capacity
        # exact builds: every table of the forward in one launch
        specs = {"fla": Fla(CHUNK_SIZE)}
        if conv_block_m is not None:
            specs["conv"] = Conv(rows="batch", block_m=conv_block_m, paired=True)
        self.steps = StepTablesBuilder(max_num_seqs, max_num_tokens, tables=specs, device=device, ring_depth=ring_depth)
        warm_up(self.steps)  # raises here, where for_backend can still keep SGLang's path
        self._host_qsl_t = torch.zeros(self.capacity.seqs + 1, dtype=torch.int32)
        self.conv_block_m = conv_block_m
        self.conv_blocks = None  # this forward's ConvBlocks (GDN, exact builds), or None
        self.conv_wanted = False  # SGLang would build a conv_block_table for this forward
        self.tables: ForwardTables | None = None
        self.served: dict[int, ForwardTables] = {}
        self._host_qsl = np.zeros(self.capacity.seqs + 1, dtype=np.int64)  # host query_start_loc scratch
        self._graphs: dict[int, tuple[torch.Tensor, _GraphEntry]] = {}
        self._graph_pending: GraphBuild | None = None
        self.eager_depth = 0  # >0 while the base's eager entry runs (it may call the graph hooks)
        self.counts = {
            "exact": 0,
            "bounded": 0,
            "graph": 0,
            "none": 0,
            "fallback": 0,
            "build_failed": 0,
            "kwargs": 0,
            "conv": 0,
        }
        self._exact_ns: list[int] = []  # host time of the last exact builds
        self._warned: set[str] = set()
        self._causes: dict[str, int] = {}  # build failures per normalised cause
        # A builder too large for (0, PAST_END_CHUNK) rows (a sequence could reach that chunk) gets
        # no padded layouts; its forwards without host lengths, and graph extends, keep SGLang's path.
        self._no_padding: str | None = None
        try:
            layout.check_pad(PAD, layout.PADS, self.capacity.tokens, CHUNK_SIZE)
        except ChunkMetaError as exc:
            self._no_padding = str(exc)
        else:  # the bounded fill, warmed up as the exact one
            one = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
            self.service.builder.build_bounded(one, num_seqs=1, max_num_tokens=1, pad=PAD)
        self._patches = []
        if router is not None:
            self._patches = [patch_fla(Provider(self, size), router) for size in (CHUNK_SIZE, *SMALL_CHUNK_SIZES)]
        self.router = router

    @classmethod
    def for_backend(
        cls, backend, model_runner, router: FlaRouter | None, conv_block_m: int | None = None
    ) -> BackendChunkMeta | None:
        """Sized from the runner; None (the backend stays stock) on devices chunkmeta does not serve,
        and where sizing, the limits or the fill's warm-up fail (one warning: the backend must be
        made whatever chunkmeta finds, or SGLang cannot start)."""
        device = torch.device(getattr(backend, "device", None) or model_runner.device)
        if device.type not in ACTIVE_DEVICES:
            logger.info("chunkmeta: %s on %s keeps SGLang's own chunk metadata", type(backend).__name__, device)
            return None
        try:
            max_num_seqs, max_num_tokens = sizing.backend_capacity(model_runner)
            return cls(
                device=device,
                max_num_seqs=max_num_seqs,
                max_num_tokens=max_num_tokens,
                router=router,
                conv_block_m=conv_block_m,
            )
        except Exception as exc:  # noqa: BLE001  sizing or limits it cannot hold, or a fill that fails here
            keeps_engine_path(logger, f"{type(backend).__name__} keeps SGLang's own chunk metadata", exc, ENV_VAR)
            return None

    # -- binding -------------------------------------------------------------------------

    def clear(self) -> None:
        if self.service.in_step:
            self.service.end_step()
        self.tables = None
        self.served = {}
        self.conv_blocks = None
        self._graph_pending = None

    def _bind(self, tables: ForwardTables) -> ForwardTables:
        self.tables = tables
        served = {CHUNK_SIZE: tables}
        for size in SMALL_CHUNK_SIZES:
            small = tables.with_chunk_size(size)
            if small is not None:
                served[size] = small
        self.served = served
        self.counts[tables.layout] += 1
        return tables

    def bind_eager(self, forward_batch, forward_metadata) -> ForwardTables | None:
        """After the base's eager ``init_forward_metadata``: this forward's tables, or None."""
        self.clear()
        qsl = getattr(forward_metadata, "query_start_loc", None)
        if qsl is None or not needs_chunk_tables(logical_mode(forward_batch)):
            self.counts["none"] += 1
            return None
        num_rows = qsl.shape[0] - 1
        lens = sizing.trusted_extend_lens(forward_batch, num_rows)
        if lens is not None:
            return self._bind_exact(qsl, lens)
        return self._bind_bounded(qsl, num_rows, sizing.token_bound(forward_batch, forward_metadata))

    def _bind_exact(self, qsl: torch.Tensor, lens) -> ForwardTables | None:
        n = len(lens)
        if n > self.capacity.seqs:
            return self._fallback("seqs", f"{n} sequences, over the capacity of {self.capacity.seqs}")
        host = self._host_qsl[: n + 1]
        if n:
            np.cumsum(lens, out=host[1:])
        if host[n] > self.capacity.tokens:
            return self._fallback("tokens", f"{int(host[n])} tokens, over the capacity of {self.capacity.tokens}")
        host_t = self._host_qsl_t[: n + 1]
        host_t.numpy()[:] = host
        # All rows are prefill rows (MIXED decodes are one-token extends): the whole batch is the slice.
        start = time.perf_counter_ns()
        try:
            step = self.steps.build(qsl, host_t)
        except Exception as exc:  # noqa: BLE001  bad inputs the host checks missed, or a compile/launch failure
            return self._build_failed(exc)
        self._exact_ns.append(time.perf_counter_ns() - start)
        if len(self._exact_ns) > 1024:
            del self._exact_ns[:512]
        md = step.fla
        self.conv_blocks = step["conv"] if self.conv_block_m is not None else None
        return self._bind(
            ForwardTables(
                qsl, md.chunk_indices, md.chunk_offsets, CHUNK_SIZE, "exact", md.num_chunks, md.max_seqlen, md
            )
        )

    def _bind_bounded(self, qsl: torch.Tensor, n: int, token_bound: int | None) -> ForwardTables | None:
        if token_bound is None:
            return self._fallback("bound", "no host token count (extend_num_tokens, input_ids) to bound the rows")
        if self._no_padding is not None:
            return self._fallback("padding", self._no_padding)
        if n > self.capacity.seqs or token_bound > self.capacity.tokens:
            return self._fallback(
                "capacity",
                f"{n} sequences / {token_bound} tokens, over the capacity of "
                f"{self.capacity.seqs} / {self.capacity.tokens}",
            )
        # In the builder's ring, like the exact builds: one build per forward, so a forward's
        # tables stay intact for ring_depth - 1 later forwards (the service's ring rule).
        try:
            md = self.service.builder.build_bounded(qsl, num_seqs=n, max_num_tokens=token_bound, pad=PAD)
        except Exception as exc:  # noqa: BLE001  as in _bind_exact
            return self._build_failed(exc)
        return self._bind(
            ForwardTables(
                qsl, md.chunk_indices, md.chunk_offsets, CHUNK_SIZE, "bounded", md.num_chunks, md.max_seqlen, md
            )
        )

    def wants_conv_block_table(self, forward_batch, forward_metadata, *, on_cuda: bool, mis: bool) -> bool:
        """Whether SGLang's GDN ``_init_prefill_conv_block_table`` would build a table for this
        forward (host data only): on CUDA, an EXTEND or MIXED batch without multi-item scoring or
        a two-batch-overlap parent, host lengths for every row, and a rectangular
        ``(rows, max blocks)`` grid over ``CONV_TABLE_GRID_RATIO`` times the blocks there are. Where
        it would not, none is served either: the conv kernel then takes its rectangular grid, as in
        SGLang."""
        if self.conv_block_m is None or not on_cuda or mis:
            return False
        if getattr(forward_batch.forward_mode, "name", None) not in ("EXTEND", "MIXED"):
            return False
        if getattr(forward_batch, "tbo_parent_token_range", None) is not None:
            return False
        lens = forward_batch.extend_seq_lens_cpu
        if lens is None or len(lens) != forward_metadata.query_start_loc.shape[0] - 1 or not len(lens):
            return False
        blocks = [-(-int(n) // self.conv_block_m) for n in lens]
        return len(blocks) * max(blocks) > CONV_TABLE_GRID_RATIO * sum(blocks)

    def _fallback(self, key: str, why: str) -> None:
        # Serving goes on with FLA's own derivation (correct, with its sync): an optimization must
        # never take the server down.
        return fallback(self.counts, self._warned, key, f"{why}; FLA derives its chunk tables itself (one sync)")

    def _build_failed(self, exc: Exception) -> None:
        # the forward goes on as SGLang's own: FLA derives the tables, SGLang builds its conv table
        return build_failed(self.counts, self._causes, exc, _OWN_PATH)

    # -- graph mode (split hooks) ---------------------------------------------------------

    def bind_graph(self, forward_batch, forward_metadata, in_capture: bool) -> ForwardTables | None:
        """Host side of a graph forward, after the base's ``init_forward_metadata_out_graph``."""
        self.clear()
        qsl = getattr(forward_metadata, "query_start_loc", None)
        if qsl is None or not needs_chunk_tables(logical_mode(forward_batch)):
            self.counts["none"] += 1
            return None
        if self._no_padding is not None:
            return self._fallback("padding", self._no_padding)
        entry = self._graph_entry(qsl, in_capture)
        graph = entry.graph
        static_rows = qsl.shape[0] - 1
        lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if lens is None:
            if not in_capture:
                raise ChunkMetaError(
                    "extend_seq_lens_cpu=None in a CUDA-graph extend replay: the host lengths stage the "
                    "replayed build; the graph runner must keep them on the ForwardBatch it passes."
                )
            lens = [0] * static_rows  # the capture run's outputs are discarded; the launch is what counts
        n = len(lens)
        if n > static_rows:
            raise ChunkMetaError(
                f"extend_seq_lens_cpu has {n} entries but the static query_start_loc holds {static_rows} rows: "
                "the graph runner's buffers are smaller than the batch."
            )
        host = self._host_qsl[: n + 1]
        if n:
            np.cumsum(lens, out=host[1:])
        # Validates against the capacity (raises before anything is staged), stages (0, n) for the
        # captured launch; rows past the static buffer's real ones must be zero-length (SGLang's are).
        md = graph.prepare(host, num_seqs=n)
        self._graph_pending = graph
        return self._bind(
            ForwardTables(
                qsl, md.chunk_indices, entry.chunk_offsets, CHUNK_SIZE, "graph", graph.num_rows, md.max_seqlen, md
            )
        )

    def _graph_entry(self, qsl: torch.Tensor, in_capture: bool) -> _GraphEntry:
        found = self._graphs.get(id(qsl))
        if found is not None and found[0] is qsl:
            return found[1]
        if not in_capture:
            raise ChunkMetaError(
                "a CUDA-graph extend replay with a query_start_loc buffer chunkmeta did not see at capture: "
                "install chunkmeta (CHUNKMETA_SGLANG=1 / install()) before SGLang captures its graphs."
            )
        if qsl.shape[0] - 1 > self.capacity.seqs:
            raise ChunkMetaError(
                f"a CUDA graph captured for {qsl.shape[0] - 1} requests, over chunkmeta's capacity of "
                f"{self.capacity.seqs}: set CHUNKMETA_SGLANG_MAX_NUM_SEQS to the largest graph batch size."
            )
        # Capacity-shaped rows: every batch the capacity admits fits whichever graph replays (graphs of
        # several token buckets may share one static query_start_loc).
        graph = GraphBuild(self.service.builder, qsl, pad=PAD)
        entry = _GraphEntry(graph, graph.metadata.chunk_offsets[: qsl.shape[0]])
        self._graphs[id(qsl)] = (qsl, entry)  # keeps the buffer alive: its id stays unique
        return entry

    def launch_graph(self) -> None:
        """The in-graph side: queue the core's captured fill, which writes every table and its padding
        rows. Static shapes, in place, no allocation, no sync: safe to capture."""
        if self._graph_pending is not None:
            self._graph_pending.launch()

    # -- consumers -----------------------------------------------------------------------

    def add_table_kwargs(self, query_start_loc, kwargs: dict) -> None:
        """For ``kernel_dispatcher.extend``: add this forward's tables when the call is this
        forward's (same ``query_start_loc``) and brings none of its own (SGLang's KDA prefill graph
        passes its own)."""
        tables = self.tables
        if tables is None or query_start_loc is not tables.query_start_loc:
            return
        if "chunk_indices" in kwargs or "chunk_offsets" in kwargs:
            return
        tables.check_live()
        kwargs["chunk_indices"] = tables.chunk_indices
        kwargs["chunk_offsets"] = tables.chunk_offsets
        self.counts["kwargs"] += 1

    def stats(self) -> dict:
        """Counters (host data only): forwards per layout, fallbacks (``build_failed`` of them: a
        build raised; ``fallback_causes``: those per normalised cause), injected calls, router hits
        and misses (process-wide), and the host-time percentiles of the last exact builds."""
        out = dict(self.counts)
        if self._exact_ns:
            p50, p99 = np.percentile(self._exact_ns, [50, 99]) / 1e3
        else:
            p50 = p99 = 0.0
        out.update(exact_host_us_p50=float(p50), exact_host_us_p99=float(p99), fallback_causes=dict(self._causes))
        if self.router is not None:
            out.update(router_hits=self.router.hits, router_misses=self.router.misses)
        return out

    def close(self) -> None:
        """Stop serving FLA calls (unregisters from the router)."""
        self.clear()
        for patch in self._patches:
            patch.uninstall()
        self._patches = []
