"""ChunkMetadataBuilder: one step's FLA chunk tables, as a step builder of one ``Fla`` table.

FLA's ``cu_seqlens`` / ``chunk_indices`` / ``chunk_offsets`` are one entry of the step kernel
(``chunkmeta.tables.Fla``), so this builder is a face of ``chunkmeta.StepTablesBuilder``: one
step builder per padding its caller asks for (the exact layout reads none), all writing one ring,
each returning the table's ``ChunkMetadata`` itself (``single``). A build is the step builder's:
**accept** the tensors, **plan** from the host copy, **claim** a ring slot, **launch** one fill,
**publish** (in one C call where the extension loads, ``chunkmeta.native``). What is this
builder's own is its API, kept for engines that read FLA's tables only, and the bounded layout
(no host lengths).
"""

from __future__ import annotations

import torch

from chunkmeta import layout as _layout
from chunkmeta import plan as _plan
from chunkmeta import results as _results
from chunkmeta import tables as _tables
from chunkmeta.errors import ChunkMetaError
from chunkmeta.fill import BACKENDS, resolve_backend, resolve_device
from chunkmeta.metadata import ChunkMetadata
from chunkmeta.one_shot import build_chunk_metadata
from chunkmeta.step_builder import StepTablesBuilder

__all__ = ["BACKENDS", "ChunkMetadataBuilder", "build_chunk_metadata", "resolve_backend", "resolve_device"]

PADS = _layout.PADS
_NAME = "fla"  # the one table's name in the step builders


class ChunkMetadataBuilder:
    """Builds one step's ``ChunkMetadata`` into persistent buffers, with no host<->device sync.

    ``build`` gives FLA's exact layout (tensors sized N+1 / NT); ``build_padded`` the
    capacity-shaped layout whose shapes never change (for CUDA graphs and static-shape callers);
    ``build_bounded`` a layout for callers without host lengths (rows from an upper bound).
    Results stay valid for ``ring_depth - 1`` later builds of any layout (``chunkmeta.ring``).
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
        if offsets_dtype not in (torch.int32, torch.int64):
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
        self._spec = _tables.Fla(chunk_size, offsets_dtype=offsets_dtype)
        self._sizes = (max_num_seqs, max_num_tokens)
        self._steps: dict[str, StepTablesBuilder] = {}  # pad -> its step builder (one ring)
        self._exact = self._steps_for("tail")  # the exact layout reads no padding

    # -- public ---------------------------------------------------------------------------

    @property
    def ring(self):
        """The ring every layout's builds write (``chunkmeta.ring.TableRing``)."""
        return self._exact.ring

    @property
    def builds(self) -> int:
        """Number of builds so far (the generation of the newest ChunkMetadata)."""
        return self.ring.generation

    @property
    def native_kernel(self) -> dict[tuple, str | None]:
        """What the C build does per ``(pad, query_start_loc dtype)`` (pad None: the exact layout)
        once that layout has been built: ``"cuda"`` / ``"triton"`` (the kernel it launches),
        ``"c"`` (a CPU builder's C fill), ``"host"`` (its host side; the fill launches from
        Python), or None (the general path)."""
        made = {}
        for pad, steps in self._steps.items():
            for (padded, dtype, *_), kernel in steps.c_build.items():
                if padded or steps is self._exact:
                    made[(pad if padded else None, dtype)] = kernel
        return made

    @property
    def padded_num_seqs(self) -> dict[str, int]:
        """Sequences in the padded layout's cu_seqlens, per pad mode (cu_seqlens has one more entry)."""
        return {pad: _layout.padded_num_seqs(pad, self.capacity.seqs) for pad in PADS}

    def build(
        self, query_start_loc: torch.Tensor, query_start_loc_cpu, *, first_seq: int = 0, num_seqs: int | None = None
    ) -> ChunkMetadata:
        """FLA's exact layout for requests ``[first_seq, first_seq + num_seqs)`` of the batch."""
        return self._exact.build(query_start_loc, query_start_loc_cpu, first_seq=first_seq, num_seqs=num_seqs)

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
        steps = self.step_builder(pad)
        return steps.build(query_start_loc, query_start_loc_cpu, first_seq=first_seq, num_seqs=num_seqs, padded=True)

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
        # validated: from here on nothing fails on bad input
        rows = _layout.chunk_row_bound(n, tokens, self.chunk_size)
        steps = self.step_builder(pad)
        slot, generation = steps.fill_bounded(query_start_loc, n, (rows,))
        cu, indices, offsets = (region.offset for region in steps.layout.regions[_NAME].values())
        view = self.ring.make_view
        return ChunkMetadata(
            view(slot, cu, n + 1, _results.FLAT).data,  # a new object: FLA memoizes by identity
            None,
            view(slot, indices, rows, _results.PAIRS),
            view(slot, offsets, n + 1, _results.FLAT),
            self.chunk_size,
            n,
            tokens,
            rows,
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

    def step_builder(self, pad: str = "tail") -> StepTablesBuilder:
        """The step builder of ``pad``'s padded layout (made on first use; ``GraphBuild`` captures
        its fill)."""
        return self._steps.get(pad) or self._steps_for(pad)

    def _steps_for(self, pad: str) -> StepTablesBuilder:
        _layout.check_pad(pad, PADS, self.capacity.tokens, self.chunk_size)
        steps = StepTablesBuilder(
            *self._sizes,
            tables={_NAME: self._spec},
            device=self.device,
            backend=self.backend,
            ring_depth=self.ring_depth,
            pad=pad,
            single=True,
            share_ring_with=self._steps.get("tail"),
        )
        self._steps[pad] = steps
        return steps
