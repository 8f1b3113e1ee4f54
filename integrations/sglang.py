"""SGLang adapter: chunkmeta's chunk tables for SGLang's KDA and GDN linear-attention backends.

SGLang's linear-attention backends (``KDAAttnBackend``: Kimi-Linear, Kimi-K3; ``GDNAttnBackend``:
Qwen3-Next, Qwen3.5) build ``forward_metadata.query_start_loc`` on the device once per forward and
hand it to the vendored FLA kernels as ``cu_seqlens``; FLA then derives the chunk tables inside the
first layer with ``prepare_chunk_indices`` (a ``.tolist()``: one host<->device sync per forward, the
hang in sglang #33846). This module subclasses those backends so that each forward builds its tables
once, on the device, from the ``query_start_loc`` the backend already made plus host data in the
``ForwardBatch``, and every layer of the forward gets them:

* KDA, SGLang >= 0.5.22 on CUDA: ``chunk_indices=`` / ``chunk_offsets=`` are added to the
  backend's ``kernel_dispatcher.extend(...)`` call (the Triton kernel forwards them to ``chunk_kda``);
* GDN, KDA before 0.5.22, and KDA on ROCm: a ``FlaRouter`` over SGLang's vendored FLA package
  answers its ``prepare_chunk_indices`` / ``prepare_chunk_offsets`` calls for this forward's
  ``query_start_loc`` (every other call runs FLA's own). On ROCm an injected ``chunk_indices`` would
  switch off SGLang's gfx950 KDA prefill kernel, which it takes only when none is passed.

Both consumers key on the identity of the backend's ``query_start_loc`` tensor, so tables can never
reach a kernel of another forward, of another backend, or of SGLang's own KDA prefill-graph path
(which passes tables of its own).

Layouts (``ForwardTables.layout``)
  ``"exact"``    ``extend_seq_lens_cpu`` is there (SGLang's own test: not None, one entry per row,
                 no two-batch-overlap parent): FLA's layout, ``[NT, 2]`` rows, bit for bit.
  ``"bounded"``  no trusted host lengths (gpu_only batches, two-batch-overlap children): the host
                 knows N (``batch_size``: ``query_start_loc`` has N+1 entries) and an upper bound
                 T on the tokens (``logical_num_tokens``, else ``extend_num_tokens``, which DP
                 padding inflates but never below the real count, else the input token count),
                 not the lengths, so not NT. The rows are ``min(T, floor((T + N (C-1)) / C))``
                 (``chunk_row_bound``: a bound for every split of T tokens into N sequences;
                 ``cdiv(T, C)`` is not), filled on the device, which finds the real NT; rows past
                 it are padding. Device memory is never read on the host.
  ``"graph"``    a forward inside a CUDA graph (the split hooks): capacity-shaped static tables,
                 rewritten in place by the captured in-graph launch.
  Padding rows are ``(0, PAST_END_CHUNK)``: SGLang's own convention (``kda_prefill_graph.py``), a
  chunk past the end of sequence 0, on which every varlen FLA chunk kernel does nothing (its
  ``i_t * BT >= T`` guard or boundary checks). ``cu_seqlens`` stays SGLang's own tensor, so the
  sequence count the kernels see, and the state indices they read, are unchanged.

Forward modes (SGLang's helpers; never enum values): EXTEND, MIXED (running decodes are one-token
extends appended at the end: every row is a prefill row), SPLIT_PREFILL, DLLM_EXTEND and draft
extends with linear metadata get tables; DECODE, IDLE, TARGET_VERIFY, and a decode batch relabelled
EXTEND by data-parallel padding (``logical_forward_mode``) get none. DP padding keeps the real
``query_start_loc`` (padded rows are zero-length, at the tail) and pads only the token count.

CUDA-graph hooks (the generation is detected from the base class when the subclass is made):
  * split (SGLang >= 0.5.13): ``init_forward_metadata_out_graph(fb, in_capture)`` is the host side
    (``GraphBuild.prepare``: validation, host counts, a params copy) and
    ``init_forward_metadata_in_graph(fb)`` the captured side (``GraphBuild.launch`` and the padding
    fix-up: static shapes, in place, no sync). Decode-phase graphs (DECODE/IDLE/TARGET_VERIFY) get
    no tables. In SGLang <= 0.5.23 the linear backends' base raises for extend batches in these
    hooks (only the experimental full prefill graph would send one), so the graph layout serves a
    base that supports them; the base's error is passed through unchanged.
  * legacy (SGLang <= 0.5.12): ``init_forward_metadata_capture_cuda_graph`` /
    ``..._replay_cuda_graph`` carry no extend lengths, and the base supports only decode and
    verify there: tables are cleared.

``install()`` / ``uninstall()`` swap the backend classes where SGLang's backend selection imports
them (``attn_backend_wrapper`` imports them inside the function body). SGLang runs its scheduler in
spawned processes, so use the ``sglang.srt.plugins`` entry point ``sglang_plugin`` (opt-in:
``CHUNKMETA_SGLANG=1``), which SGLang calls in every process.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import numbers
import os
import pkgutil
import threading
import weakref
from importlib import metadata as _importlib_metadata

import attrs
import numpy as np
import torch

from chunkmeta.batch import StepBatch
from chunkmeta.errors import ChunkMetaError
from chunkmeta.graph import GraphBuild
from chunkmeta.integrations.kda import FlaRouter, patch_fla
from chunkmeta.metadata import ChunkMetadata
from chunkmeta.service import ChunkMetaService

logger = logging.getLogger(__name__)

CHUNK_SIZE = 64  # SGLang's KDA and GDN chunked prefill both use FLA's 64-token chunks
# Chunk index of padding rows: past the end of any sequence (64 << 20 tokens), so FLA's varlen
# chunk kernels return on their `i_t * BT >= T` guard. SGLang's KDA prefill graph uses the same.
PAST_END_CHUNK = 1 << 20
SUPPORTED_VERSIONS = ((0, 5, 9), (0, 5, 23))  # tested interfaces, inclusive
# Other chunk sizes SGLang's vendored FLA asks prepare_chunk_indices for (GDN's chunk_fwd_o uses
# BT = min(64, max(16, next_pow2(T)))): served only when every sequence fits one chunk of that size.
_SMALL_CHUNK_SIZES = (32, 16)
_ACTIVE_DEVICES = ("cuda", "cpu")  # NPU/XPU backends run other kernels: stay out of their way

# Where each backend class lives, newest layout first (0.5.11 moved them; 0.5.9/0.5.10 named KDA
# "KimiLinearAttnBackend"), and where FLA is vendored (moved to kernels/ in 0.5.16).
_TARGETS = {
    "kda": (("srt.layers.attention.linear.kda_backend", "KDAAttnBackend"),
            ("srt.layers.attention.hybrid_linear_attn_backend", "KimiLinearAttnBackend")),
    "gdn": (("srt.layers.attention.linear.gdn_backend", "GDNAttnBackend"),
            ("srt.layers.attention.hybrid_linear_attn_backend", "GDNAttnBackend")),
}
_FLA_PACKAGES = ("kernels.ops.attention.fla", "srt.layers.attention.fla")


# -- sizes -------------------------------------------------------------------------------------

def chunk_row_bound(num_seqs: int, num_tokens: int, chunk_size: int = CHUNK_SIZE) -> int:
    """The most chunk rows ``num_seqs`` sequences holding at most ``num_tokens`` tokens can need.

    ``NT = sum_i cdiv(len_i, C) <= sum_i (len_i + C - 1) / C <= (T + N (C - 1)) / C``; NT is an
    integer, so ``NT <= floor((T + N (C - 1)) / C)`` (reached when every length is 1 mod C), and a
    row holds at least one token, so ``NT <= T``. ``cdiv(T, C)`` alone is not a bound (two
    one-token sequences need two rows); ``cdiv(T, C) + N`` is, but looser by up to N rows.
    """
    if num_seqs <= 0 or num_tokens <= 0:
        return 0
    return min(num_tokens, (num_tokens + num_seqs * (chunk_size - 1)) // chunk_size)


def _int(value) -> int | None:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ChunkMetaError(f"{name}={raw!r}: must be a positive int (or unset, to size from the server args).")
    return value


def backend_capacity(model_runner) -> tuple[int, int]:
    """``(max_num_seqs, max_num_tokens)`` of one forward of ``model_runner``.

    Sequences: the most of ``model_runner.max_running_requests``, ``server_args.max_running_requests``
    and ``req_to_token_pool.size`` (a forward never holds more requests than the pool). Tokens: one
    scheduled prefill batch holds at most ``max(chunked_prefill_size, max_prefill_tokens)`` tokens
    (the model's ``context_len`` instead of the chunk size when chunked prefill is off: the first
    request of a batch may exceed ``max_prefill_tokens``), plus one token per running request that
    a MIXED batch appends. DP padding pads to the largest rank's count, which obeys the same bound.
    ``CHUNKMETA_SGLANG_MAX_NUM_SEQS`` / ``CHUNKMETA_SGLANG_MAX_NUM_TOKENS`` override either.
    """
    server_args = getattr(model_runner, "server_args", None)
    pool = getattr(model_runner, "req_to_token_pool", None)
    seqs = [_int(getattr(model_runner, "max_running_requests", None)),
            _int(getattr(server_args, "max_running_requests", None)),
            _int(getattr(pool, "size", None))]
    max_num_seqs = _env_int("CHUNKMETA_SGLANG_MAX_NUM_SEQS") or max((s for s in seqs if s and s > 0), default=0)
    if not max_num_seqs:
        raise ChunkMetaError(
            f"model_runner={type(model_runner).__name__}: found no max_running_requests or req_to_token_pool.size "
            "to size chunk tables from; set CHUNKMETA_SGLANG_MAX_NUM_SEQS."
        )
    chunked = _int(getattr(server_args, "chunked_prefill_size", None))
    context = (_int(getattr(getattr(model_runner, "model_config", None), "context_len", None))
               or _int(getattr(server_args, "context_length", None)))
    per_batch = [_int(getattr(server_args, "max_prefill_tokens", None)),
                 chunked if chunked and chunked > 0 else context]
    max_num_tokens = _env_int("CHUNKMETA_SGLANG_MAX_NUM_TOKENS")
    if max_num_tokens is None:
        prefill = max((t for t in per_batch if t and t > 0), default=0)
        if not prefill:
            raise ChunkMetaError(
                "server_args has no chunked_prefill_size, max_prefill_tokens or context length to size chunk "
                "tables from; set CHUNKMETA_SGLANG_MAX_NUM_TOKENS."
            )
        max_num_tokens = prefill + max_num_seqs
    return max_num_seqs, max_num_tokens


# -- what one forward's layers get ---------------------------------------------------------------

@attrs.frozen(slots=True, eq=False, repr=False)
class ForwardTables:
    """One forward's chunk tables, keyed by the backend's own ``query_start_loc`` tensor.

    ``query_start_loc`` is what SGLang passes FLA as ``cu_seqlens`` (int32 ``[N+1]``), so it is the
    ``cu_seqlens`` here too; ``chunk_indices`` int32 ``[num_rows, 2]`` and ``chunk_offsets`` int64
    ``[>= N+1]`` follow FLA's contract (``chunk_offsets[i]`` is sequence i's first row). For
    ``"bounded"`` and ``"graph"`` rows past the real count are ``(0, PAST_END_CHUNK)``.
    ``max_seqlen`` is a host upper bound on any sequence's length (exact for ``"exact"`` and
    ``"graph"``). ``metadata`` is the core's ChunkMetadata behind the tables (None for
    ``"bounded"``), whose liveness ``check_live`` checks.

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
    metadata: ChunkMetadata | None = None

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.query_start_loc

    @property
    def padding(self) -> str | None:
        return None if self.layout == "exact" else "past_end"

    def check_live(self) -> "ForwardTables":
        if self.metadata is not None:
            self.metadata.check_live()
        return self

    def with_chunk_size(self, chunk_size: int) -> "ForwardTables | None":
        """The same tables under a smaller chunk size, when every sequence fits one chunk of it
        (each non-empty sequence is then one row at both sizes: the tables are identical)."""
        if chunk_size == self.chunk_size:
            return self
        if chunk_size < self.chunk_size and self.max_seqlen <= chunk_size:
            return attrs.evolve(self, chunk_size=chunk_size)
        return None

    def __repr__(self) -> str:
        return (f"ForwardTables(layout={self.layout} rows={self.num_rows} C={self.chunk_size} "
                f"max_seqlen<={self.max_seqlen} N={self.query_start_loc.shape[0] - 1})")


def _logical_mode(forward_batch):
    # 0.5.23: DP padding may relabel a decode batch EXTEND; the rows are still decodes.
    mode = getattr(forward_batch, "logical_forward_mode", None)
    return mode if mode is not None else forward_batch.forward_mode


def needs_chunk_tables(mode) -> bool:
    """A forward mode whose linear layers run FLA's chunked prefill (SGLang's helpers only)."""
    if mode is None or mode.is_decode_or_idle() or mode.is_target_verify():
        return False
    try:
        return bool(mode.is_extend(include_draft_extend_v2=True))
    except TypeError:  # a ForwardMode without the flag
        return bool(mode.is_extend())


def _trusted_extend_lens(forward_batch, num_rows: int):
    """``extend_seq_lens_cpu`` when SGLang itself trusts it for this batch, else None: present, one
    entry per row, and not a two-batch-overlap child (the same test as MambaAttnBackendBase)."""
    lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
    if lens is None or len(lens) != num_rows:
        return None
    if getattr(forward_batch, "tbo_parent_token_range", None) is not None:
        return None
    return lens


def _token_bound(forward_batch, forward_metadata) -> int | None:
    """A host upper bound on the tokens of the forward, without reading device memory.

    ``forward_metadata.logical_num_tokens`` first (SGLang >= 0.5.21 sets it on every extend: the sum
    of the host lengths, or its own read of ``query_start_loc[-1]``); then ``extend_num_tokens``
    (the real count, or under DP padding the padded count, still an upper bound); then the number
    of input tokens (a host shape: every token the kernels see is one of them).
    """
    for value in (getattr(forward_metadata, "logical_num_tokens", None),
                  getattr(forward_batch, "extend_num_tokens", None)):
        value = _int(value)
        if value is not None and value >= 0:
            return value
    input_ids = getattr(forward_batch, "input_ids", None)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() >= 1:
        return int(input_ids.shape[0])
    return None


# -- FLA routing -------------------------------------------------------------------------------

class VendoredFlaRouter(FlaRouter):
    """FlaRouter for SGLang's vendored FLA, whose ``prepare_chunk_indices(cu_seqlens, chunk_size)``
    takes no ``cu_seqlens_cpu``: calls that are not ours fall through with FLA's own signature.

    ``misses`` counts calls with one of our ``cu_seqlens`` at a chunk size we do not serve (FLA
    then derives that table itself, with its sync).
    """

    def __init__(self, package: str):
        super().__init__(package, package + ".index", require=lambda: _import_fla(package))
        self.misses = 0

    def _chunk_indices(self, cu_seqlens, chunk_size, cu_seqlens_cpu=None):
        if cu_seqlens_cpu is None and self._lookup(cu_seqlens, chunk_size) is None:
            self._count_miss(cu_seqlens)
            return self._originals["prepare_chunk_indices"](cu_seqlens, chunk_size)
        return super()._chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu)

    def _chunk_offsets(self, cu_seqlens, chunk_size):
        if self._lookup(cu_seqlens, chunk_size) is None:
            self._count_miss(cu_seqlens)
        return super()._chunk_offsets(cu_seqlens, chunk_size)

    def _count_miss(self, cu_seqlens) -> None:
        for provider in self._services:
            tables = getattr(provider, "tables", None)  # other services may share this router
            if tables is not None and tables.query_start_loc is cu_seqlens:
                self.misses += 1
                return


def _import_fla(package: str) -> None:
    # The router patches the modules loaded when it installs: load every kernel module first.
    root = importlib.import_module(package)
    for info in pkgutil.iter_modules(getattr(root, "__path__", [])):
        if info.name.startswith("bench"):  # benchmark scripts shipped inside the package
            continue
        try:
            importlib.import_module(f"{package}.{info.name}")
        except Exception as exc:  # noqa: BLE001  a module SGLang never loads here keeps FLA's helpers
            logger.debug("chunkmeta: %s.%s not loaded: %s", package, info.name, exc)


_ROUTERS: dict[str, VendoredFlaRouter] = {}
_ROUTERS_LOCK = threading.Lock()


def fla_router(package: str) -> VendoredFlaRouter:
    """The process-wide router over one vendored FLA package (one per package: it patches modules)."""
    with _ROUTERS_LOCK:
        router = _ROUTERS.get(package)
        if router is None:
            router = _ROUTERS[package] = VendoredFlaRouter(package)
        return router


class _Provider:
    """Serves one chunk size of a backend's current tables to the router (the service side
    ``FlaRouter`` reads: ``in_step`` and ``current``). Holds the backend's state weakly, so a
    dropped backend answers nothing and frees its buffers."""

    __slots__ = ("_chunks", "chunk_size")

    def __init__(self, chunks: "BackendChunkMeta", chunk_size: int):
        self._chunks = weakref.ref(chunks)
        self.chunk_size = chunk_size

    @property
    def tables(self) -> ForwardTables | None:
        chunks = self._chunks()
        return None if chunks is None else chunks.tables

    @property
    def in_step(self) -> bool:
        chunks = self._chunks()
        return chunks is not None and self.chunk_size in chunks._served

    @property
    def current(self) -> ForwardTables:
        return self._chunks()._served[self.chunk_size]


# -- one backend instance's state ----------------------------------------------------------------

@attrs.define(slots=True)
class _GraphEntry:
    """Graph mode for one static ``query_start_loc`` buffer (SGLang keeps one per batch size)."""

    graph: GraphBuild
    chunk_indices: torch.Tensor  # [capacity rows, 2] static: the in-graph fix-up writes it
    chunk_offsets: torch.Tensor  # static view of the graph's offsets, [N_static + 1]


class BackendChunkMeta:
    """One backend instance's chunk metadata: a ``ChunkMetaService`` for exact builds, graph builds
    per static ``query_start_loc``, the bounded fill, and the tables of the current forward.

    ``tables`` is bound by every ``init_forward_metadata*`` call and cleared when a forward needs
    none, so nothing from an earlier forward can be served (consumers also match the tensor).
    """

    def __init__(self, *, device, max_num_seqs: int, max_num_tokens: int, router: FlaRouter | None = None,
                 ring_depth: int = 4):
        self.service = ChunkMetaService(max_num_seqs, max_num_tokens, chunk_size=CHUNK_SIZE, device=device,
                                        ring_depth=ring_depth)
        self.device = self.service.builder.device
        self.capacity = self.service.builder.capacity
        self.tables: ForwardTables | None = None
        self._served: dict[int, ForwardTables] = {}
        self._host_qsl = np.zeros(self.capacity.seqs + 1, dtype=np.int64)  # host query_start_loc scratch
        self._graphs: dict[int, tuple[torch.Tensor, _GraphEntry]] = {}
        self._graph_pending: _GraphEntry | None = None
        self._bounded_fill = None
        self._pad_row = torch.tensor([[0, PAST_END_CHUNK]], dtype=torch.int32, device=self.device)
        self._no_params = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.eager_depth = 0  # >0 while the base's eager entry runs (it may call the graph hooks)
        self.counts = {"exact": 0, "bounded": 0, "graph": 0, "none": 0, "fallback": 0, "kwargs": 0}
        self._warned: set[str] = set()
        self._patches = []
        if router is not None:
            self._patches = [patch_fla(_Provider(self, size), router) for size in (CHUNK_SIZE, *_SMALL_CHUNK_SIZES)]
        self.router = router

    @classmethod
    def for_backend(cls, backend, model_runner, router: FlaRouter | None) -> "BackendChunkMeta | None":
        """Sized from the runner; None (the backend stays stock) on devices chunkmeta does not serve."""
        device = torch.device(getattr(backend, "device", None) or model_runner.device)
        if device.type not in _ACTIVE_DEVICES:
            logger.info("chunkmeta: %s on %s keeps SGLang's own chunk metadata", type(backend).__name__, device)
            return None
        max_num_seqs, max_num_tokens = backend_capacity(model_runner)
        return cls(device=device, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, router=router)

    # -- binding -------------------------------------------------------------------------

    def clear(self) -> None:
        if self.service.in_step:
            self.service.end_step()
        self.tables = None
        self._served = {}
        self._graph_pending = None

    def _bind(self, tables: ForwardTables) -> ForwardTables:
        self.tables = tables
        served = {CHUNK_SIZE: tables}
        for size in _SMALL_CHUNK_SIZES:
            small = tables.with_chunk_size(size)
            if small is not None:
                served[size] = small
        self._served = served
        self.counts[tables.layout] += 1
        return tables

    def bind_eager(self, forward_batch, forward_metadata) -> ForwardTables | None:
        """After the base's eager ``init_forward_metadata``: this forward's tables, or None."""
        self.clear()
        qsl = getattr(forward_metadata, "query_start_loc", None)
        if qsl is None or not needs_chunk_tables(_logical_mode(forward_batch)):
            self.counts["none"] += 1
            return None
        num_rows = qsl.shape[0] - 1
        lens = _trusted_extend_lens(forward_batch, num_rows)
        if lens is not None:
            return self._bind_exact(qsl, lens)
        return self._bind_bounded(qsl, num_rows, _token_bound(forward_batch, forward_metadata))

    def _bind_exact(self, qsl: torch.Tensor, lens) -> ForwardTables | None:
        n = len(lens)
        if n > self.capacity.seqs:
            return self._fallback("seqs", f"{n} sequences, over the capacity of {self.capacity.seqs}")
        host = self._host_qsl[: n + 1]
        if n:
            np.cumsum(lens, out=host[1:])
        if host[n] > self.capacity.tokens:
            return self._fallback("tokens", f"{int(host[n])} tokens, over the capacity of {self.capacity.tokens}")
        # All rows are prefill rows (MIXED decodes are one-token extends): the whole batch is the slice.
        md = self.service.begin_step(StepBatch.all_prefill(qsl, host))
        return self._bind(ForwardTables(qsl, md.chunk_indices, md.chunk_offsets, CHUNK_SIZE, "exact",
                                        md.num_chunks, md.max_seqlen, md))

    def _bind_bounded(self, qsl: torch.Tensor, n: int, token_bound: int | None) -> ForwardTables | None:
        if token_bound is None:
            return self._fallback("bound", "no host token count (extend_num_tokens, input_ids) to bound the rows")
        rows = chunk_row_bound(n, token_bound)
        if n > self.capacity.seqs or token_bound > self.capacity.tokens:
            return self._fallback("capacity", f"{n} sequences / {token_bound} tokens, over the capacity of "
                                              f"{self.capacity.seqs} / {self.capacity.tokens}")
        fill = self._fill()
        if fill is None:
            return self._fallback("triton", "the bounded layout needs Triton to fill on the device")
        # Sized to this forward; the caching allocator keeps freed blocks stream-ordered, so a later
        # forward cannot overwrite them before this forward's kernels have read them.
        cu = torch.zeros(n + 1, dtype=torch.int32, device=self.device)  # scratch: FLA gets SGLang's own
        offsets = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
        raw = torch.empty(rows, 2, dtype=torch.int32, device=self.device)
        # The kernel finds T and NT on the device: rows [NT, rows) come out as (-1, 0).
        fill(qsl, self._no_params, cu, raw, offsets, 0, n, rows, n, -1)
        indices = torch.where(raw[:, :1] < 0, self._pad_row, raw)
        return self._bind(ForwardTables(qsl, indices, offsets, CHUNK_SIZE, "bounded", rows, token_bound))

    def _fill(self):
        if self._bounded_fill is None and importlib.util.find_spec("triton") is not None:
            from chunkmeta.fill.triton_fill import TritonFill

            self._bounded_fill = TritonFill(chunk_size=CHUNK_SIZE, block_seqs=self.capacity.seqs, padded=True,
                                            params_on_device=False)
        return self._bounded_fill

    def _fallback(self, key: str, why: str) -> None:
        # Serving goes on with FLA's own derivation (correct, with its sync): an optimization must
        # never take the server down. Say so once per reason, with the fix.
        self.counts["fallback"] += 1
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(
                "chunkmeta: a forward has %s; FLA derives its chunk tables itself (one sync). Size with "
                "CHUNKMETA_SGLANG_MAX_NUM_SEQS / CHUNKMETA_SGLANG_MAX_NUM_TOKENS if this repeats.", why)
        return None

    # -- graph mode (split hooks) ---------------------------------------------------------

    def bind_graph(self, forward_batch, forward_metadata, in_capture: bool) -> ForwardTables | None:
        """Host side of a graph forward, after the base's ``init_forward_metadata_out_graph``."""
        self.clear()
        qsl = getattr(forward_metadata, "query_start_loc", None)
        if qsl is None or not needs_chunk_tables(_logical_mode(forward_batch)):
            self.counts["none"] += 1
            return None
        entry = self._graph_entry(qsl, in_capture)
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
        md = entry.graph.prepare(host, num_seqs=n)
        self._graph_pending = entry
        return self._bind(ForwardTables(qsl, entry.chunk_indices, entry.chunk_offsets, CHUNK_SIZE, "graph",
                                        entry.graph.num_rows, md.max_seqlen, md))

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
        graph = GraphBuild(self.service.builder, qsl, pad="negative")
        entry = _GraphEntry(graph, torch.empty(graph.num_rows, 2, dtype=torch.int32, device=self.device),
                            graph.metadata.chunk_offsets[: qsl.shape[0]])
        self._graphs[id(qsl)] = (qsl, entry)  # keeps the buffer alive: its id stays unique
        return entry

    def launch_graph(self) -> None:
        """The in-graph side: queue the fill and turn padding rows into SGLang's (0, PAST_END_CHUNK).
        Static shapes, in place, no allocation of outputs, no sync: safe to capture."""
        entry = self._graph_pending
        if entry is None:
            return
        entry.graph.launch()
        raw = entry.graph.metadata.chunk_indices
        torch.where(raw[:, :1] < 0, self._pad_row, raw, out=entry.chunk_indices)

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
        """Counters (host data only): forwards per layout, fallbacks, injected calls, router hits
        and misses (process-wide), and the service's host-time percentiles of exact builds."""
        out = dict(self.counts)
        service = self.service.stats()
        out.update(exact_host_us_p50=service.host_us_p50, exact_host_us_p99=service.host_us_p99)
        if self.router is not None:
            out.update(router_hits=self.router.hits, router_misses=self.router.misses)
        return out

    def close(self) -> None:
        """Stop serving FLA calls (unregisters from the router)."""
        self.clear()
        for patch in self._patches:
            patch.uninstall()
        self._patches = []


# -- the backend subclasses ------------------------------------------------------------------------

class _EagerHooks:
    """Eager entry: the base builds ``forward_metadata`` (and its device ``query_start_loc``); then
    this forward's tables are built from it."""

    _chunkmeta_router: FlaRouter | None = None
    _chunkmeta_kwargs: bool = False
    chunkmeta: BackendChunkMeta | None = None

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.chunkmeta = BackendChunkMeta.for_backend(self, model_runner, self._chunkmeta_router)
        if self.chunkmeta is not None and self._chunkmeta_kwargs:
            _add_tables_to_dispatcher(self)

    def init_forward_metadata(self, forward_batch):
        chunks = self.chunkmeta
        if chunks is None:
            return super().init_forward_metadata(forward_batch)
        chunks.clear()
        chunks.eager_depth += 1  # AttentionBackend's default eager entry calls the graph hooks
        try:
            super().init_forward_metadata(forward_batch)
        finally:
            chunks.eager_depth -= 1
        chunks.bind_eager(forward_batch, self.forward_metadata)


class _SplitGraphHooks:
    """SGLang >= 0.5.13: out_graph is the host side (outside capture), in_graph the captured side."""

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        chunks = self.chunkmeta
        graph_call = chunks is not None and not chunks.eager_depth
        if graph_call:
            chunks.clear()
        super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if graph_call:
            chunks.bind_graph(forward_batch, self.forward_metadata, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        super().init_forward_metadata_in_graph(forward_batch)
        chunks = self.chunkmeta
        if chunks is not None and not chunks.eager_depth:
            chunks.launch_graph()


class _LegacyGraphHooks:
    """SGLang <= 0.5.12: these hooks carry no extend lengths and serve decode-phase graphs only."""

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        if self.chunkmeta is not None:
            self.chunkmeta.clear()
        super().init_forward_metadata_capture_cuda_graph(bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                         forward_mode, spec_info)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        if self.chunkmeta is not None:
            self.chunkmeta.clear()
        super().init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                        forward_mode, spec_info, seq_lens_cpu)


class _PrefillGraphHooks:
    """SGLang >= 0.5.22 KDA: its breakable prefill graph runs on tables of its own; ours step aside."""

    def init_prefill_graph_metadata(self, forward_batch):
        if self.chunkmeta is not None:
            self.chunkmeta.clear()
        return super().init_prefill_graph_metadata(forward_batch)

    def refresh_prefill_graph_metadata(self, meta, forward_batch):
        if self.chunkmeta is not None:
            self.chunkmeta.clear()
        return super().refresh_prefill_graph_metadata(meta, forward_batch)


def _add_tables_to_dispatcher(backend) -> None:
    dispatcher = getattr(backend, "kernel_dispatcher", None)
    if dispatcher is None or not callable(getattr(dispatcher, "extend", None)):
        return
    original = dispatcher.extend
    chunks = backend.chunkmeta

    def extend(q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kwargs):
        chunks.add_table_kwargs(query_start_loc, kwargs)
        return original(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                        query_start_loc=query_start_loc, **kwargs)

    dispatcher.extend = extend  # an instance attribute: this backend's dispatcher only


def _defines(base: type, name: str) -> bool:
    return callable(getattr(base, name, None))


def hook_generation(base: type) -> str:
    """``"split"`` (out_graph/in_graph, SGLang >= 0.5.13) or ``"legacy"`` (capture/replay)."""
    if _defines(base, "init_forward_metadata_out_graph"):
        return "split"
    if _defines(base, "init_forward_metadata_capture_cuda_graph"):
        return "legacy"
    raise ChunkMetaError(
        f"base={base.__qualname__}: has neither init_forward_metadata_out_graph (SGLang >= 0.5.13) nor "
        "init_forward_metadata_capture_cuda_graph (<= 0.5.12); pass SGLang's KDA/GDN backend class."
    )


def _is_hip() -> bool:
    return getattr(torch.version, "hip", None) is not None


def chunk_kda_takes_tables(fla_package: str | None) -> bool:
    """The vendored ``chunk_kda`` accepts ``chunk_indices`` and ``chunk_offsets`` (SGLang >= 0.5.22)."""
    if not fla_package or importlib.util.find_spec(f"{fla_package}.kda") is None:
        return False
    chunk_kda = getattr(importlib.import_module(f"{fla_package}.kda"), "chunk_kda", None)
    if chunk_kda is None:
        return False
    parameters = inspect.signature(chunk_kda).parameters
    return "chunk_indices" in parameters and "chunk_offsets" in parameters


_CLASSES: dict[tuple, type] = {}


def chunkmeta_backend(base: type, *, kind: str, fla_package: str | None = None,
                      table_kwargs: bool | None = None) -> type:
    """The subclass of SGLang backend ``base`` that builds chunk tables once per forward.

    ``kind``: ``"kda"`` or ``"gdn"``. ``fla_package``: the vendored FLA package whose helpers a
    router answers (None: no routing). ``table_kwargs``: add ``chunk_indices``/``chunk_offsets`` to
    ``kernel_dispatcher.extend`` (None: for KDA when the vendored ``chunk_kda`` takes them, except on
    ROCm, where they would turn off SGLang's gfx950 prefill kernel; the router serves it there). The
    hook generation is read from ``base`` here, once. The same arguments give the same class.
    """
    if kind not in _TARGETS:
        raise ChunkMetaError(f"kind={kind!r}: must be one of {tuple(_TARGETS)}.")
    if not isinstance(base, type):
        raise ChunkMetaError(f"base={base!r}: must be SGLang's backend class.")
    if table_kwargs is None:
        table_kwargs = kind == "kda" and not _is_hip() and chunk_kda_takes_tables(fla_package)
    key = (base, kind, fla_package, table_kwargs)
    cls = _CLASSES.get(key)
    if cls is not None:
        return cls
    generation = hook_generation(base)
    mixins = [_EagerHooks, _SplitGraphHooks if generation == "split" else _LegacyGraphHooks]
    if generation == "split" and _defines(base, "init_forward_metadata_capture_cuda_graph"):
        mixins.append(_LegacyGraphHooks)
    if _defines(base, "refresh_prefill_graph_metadata") and _defines(base, "init_prefill_graph_metadata"):
        mixins.append(_PrefillGraphHooks)
    cls = type(base)(f"ChunkMeta{base.__name__}", (*mixins, base), {  # type(base): SGLang's are ABCs
        "__module__": __name__,
        "__doc__": f"SGLang's {base.__qualname__} with chunkmeta's chunk tables (hooks: {generation}).",
        "_chunkmeta_router": fla_router(fla_package) if fla_package else None,
        "_chunkmeta_kwargs": table_kwargs,
        "chunkmeta_base": base,
        "chunkmeta_kind": kind,
        "chunkmeta_hooks": generation,
    })
    _CLASSES[key] = cls
    return cls


# -- install / uninstall -----------------------------------------------------------------------

_INSTALL_LOCK = threading.Lock()
_INSTALLED: dict[str, list[tuple[object, str, type, type]]] = {}  # package -> (module, attr, original, ours)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _package_version(package: str) -> str | None:
    version = getattr(importlib.import_module(package), "__version__", None)
    if version is None:
        try:
            version = _importlib_metadata.version(package)
        except _importlib_metadata.PackageNotFoundError:
            return None
    return str(version)


def _check_version(package: str) -> None:
    version = _package_version(package)
    if version is None:
        return
    low, high = SUPPORTED_VERSIONS
    found = _version_tuple(version)
    if found[:3] < low:
        raise ChunkMetaError(
            f"{package} {version}: chunkmeta's SGLang adapter supports {'.'.join(map(str, low))} to "
            f"{'.'.join(map(str, high))} (the linear-attention backends it subclasses); upgrade SGLang."
        )
    if found[:3] > high:
        logger.warning("chunkmeta: %s %s is newer than the newest tested (%s); the hooks are checked per class.",
                       package, version, ".".join(map(str, high)))


def _find_fla(package: str) -> str | None:
    for relative in _FLA_PACKAGES:
        name = f"{package}.{relative}"
        try:
            if importlib.util.find_spec(name + ".index") is not None:
                return name
        except ModuleNotFoundError:
            continue
    return None


def _find_target(package: str, kind: str) -> tuple[object, str]:
    tried = []
    for relative, attr in _TARGETS[kind]:
        name = f"{package}.{relative}"
        tried.append(f"{name}.{attr}")
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        module = importlib.import_module(name)
        if isinstance(getattr(module, attr, None), type):
            return module, attr
    raise ChunkMetaError(
        f"package={package!r}: no {kind.upper()} backend class at {', '.join(tried)}; "
        f"chunkmeta supports SGLang {'.'.join(map(str, SUPPORTED_VERSIONS[0]))} to "
        f"{'.'.join(map(str, SUPPORTED_VERSIONS[1]))}."
    )


def install(package: str = "sglang") -> dict[str, type]:
    """Put chunkmeta's KDA and GDN backends where SGLang's backend selection finds them.

    Replaces the backend classes' module attributes (saving SGLang's); idempotent. Backends built
    afterwards in this process use chunkmeta. ``package`` is the SGLang package (tests pass a
    stand-in). Returns ``{"kda": class, "gdn": class}``.
    """
    with _INSTALL_LOCK:
        try:
            importlib.import_module(package)
        except ImportError as exc:
            raise ChunkMetaError(
                f"package={package!r} is not importable ({exc}): install SGLang "
                f"{'.'.join(map(str, SUPPORTED_VERSIONS[0]))}-{'.'.join(map(str, SUPPORTED_VERSIONS[1]))}."
            ) from None
        _check_version(package)
        fla_package = _find_fla(package)
        records = _INSTALLED.setdefault(package, [])
        installed = {}
        for kind in _TARGETS:
            module, attr = _find_target(package, kind)
            current = getattr(module, attr)
            record = next((r for r in records if r[0] is module and r[1] == attr), None)
            if record is not None and current is record[3]:
                installed[kind] = current  # already ours
                continue
            ours = chunkmeta_backend(current, kind=kind, fla_package=fla_package)
            setattr(module, attr, ours)
            if record is not None:
                records.remove(record)
            records.append((module, attr, current, ours))
            installed[kind] = ours
            logger.info("chunkmeta: %s.%s -> %s (hooks: %s)", module.__name__, attr, ours.__name__,
                        ours.chunkmeta_hooks)
        return installed


def uninstall(package: str = "sglang") -> None:
    """Restore SGLang's backend classes (idempotent). Backends already built keep chunkmeta until
    they are dropped (``backend.chunkmeta.close()`` stops one at once)."""
    with _INSTALL_LOCK:
        for module, attr, original, ours in reversed(_INSTALLED.pop(package, [])):
            if getattr(module, attr) is ours:
                setattr(module, attr, original)
            else:
                logger.warning("chunkmeta: %s.%s was replaced by someone else since install(); left as is",
                               module.__name__, attr)


def installed(package: str = "sglang") -> bool:
    return bool(_INSTALLED.get(package))


def sglang_plugin() -> None:
    """Entry point of the ``sglang.srt.plugins`` group, which SGLang runs in every process.

    Opt-in: installs only when ``CHUNKMETA_SGLANG=1``, so having chunkmeta installed changes nothing
    by itself. (``SGLANG_PLUGINS`` can restrict which plugins SGLang loads at all.)
    """
    if os.environ.get("CHUNKMETA_SGLANG", "").strip().lower() in ("1", "true", "yes", "on"):
        install()
