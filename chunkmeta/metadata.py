"""ChunkMetadata: one step's chunk metadata, immutable, shared by every layer of the step."""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch

from chunkmeta.errors import ChunkMetaError


class Lease(Protocol):
    """Whoever owns a ChunkMetadata's buffers answers whether they still hold its values."""

    def is_live(self, slot: int, generation: int) -> bool: ...

    def retired_message(self, slot: int, generation: int) -> str: ...

    def retire(self, generation: int) -> None: ...


class Leased:
    """Liveness of a per-step object whose buffers a ``Lease`` owns (``generation``, ``_lease``
    and ``_slot`` are the object's attributes)."""

    __slots__ = ()

    @property
    def is_live(self) -> bool:
        """False once the owner has reused this object's buffers or retired its step."""
        return self._lease is None or self._lease.is_live(self._slot, self.generation)

    def check_live(self):
        """Raise ChunkMetaError if this object was retired; return it otherwise. Host-only."""
        if self._lease is not None and not self._lease.is_live(self._slot, self.generation):
            raise ChunkMetaError(self._lease.retired_message(self._slot, self.generation))
        return self

    def retire(self) -> None:
        """Retire this object and every older one of its owner (the service's strict mode)."""
        if self._lease is not None:
            self._lease.retire(self.generation)


def _tensor(instance, attribute, value):
    if not isinstance(value, torch.Tensor):
        raise ChunkMetaError(f"ChunkMetadata.{attribute.name} must be a torch.Tensor, got {type(value).__name__}.")


def _optional_tensor(instance, attribute, value):
    if value is not None:
        _tensor(instance, attribute, value)


@attrs.frozen(slots=True, eq=False, repr=False, weakref_slot=True)
class ChunkMetadata(Leased):
    """Chunk metadata of a packed prefill batch, in FLA's contract (fla-core >= 0.5.1).

    Device tensors: ``cu_seqlens`` int32 [N+1] (rebased to start at 0), ``chunk_indices`` int32
    [NT, 2] with rows ``(i, t)`` ordered by sequence then chunk (row ``r`` is
    ``chunk_offsets[i] + t``; a zero-length sequence has no rows but keeps its index ``i``),
    ``chunk_offsets`` int64 [N+1] (exclusive prefix sum of ``cdiv(len_i, chunk_size)``; int32 from a
    builder made with ``offsets_dtype=torch.int32``).
    ``cu_seqlens_cpu`` is the host copy of ``cu_seqlens``. Host ints: ``num_seqs`` (N),
    ``num_tokens`` (T), ``num_chunks`` (NT), ``chunk_size`` (C), ``max_seqlen``; hints
    ``is_aligned`` and ``single_seqlen``.

    ``padding`` is None for FLA's exact layout, or names the padding rows after the real ones
    (``chunkmeta.layout``): ``"tail"`` (they point at a zero-length tail sequence), ``"negative"``
    (``(-1, 0)``, FLA's KDA ``use_graph`` contract) or ``"past_end"`` (``(0, PAST_END_CHUNK)``,
    SGLang's). The host ints describe the real batch; rows after ``num_chunks`` are padding.

    ``bounded`` (``cu_seqlens_cpu`` is None): built without host lengths
    (``ChunkMetadataBuilder.build_bounded``); ``num_tokens``, ``num_chunks`` and ``max_seqlen``
    are then host upper bounds, and the real NT is known only on the device.

    Built by chunkmeta's builders, which validate every value first; the constructor checks only
    that the four tensors are tensors (it is on the per-step path).

    Frozen: attributes cannot be reassigned, and the builder never writes the tensors again while
    the object is live (``is_live``). Nothing here reads device memory.
    """

    cu_seqlens: torch.Tensor = attrs.field(validator=_tensor)
    cu_seqlens_cpu: torch.Tensor | None = attrs.field(validator=_optional_tensor)
    chunk_indices: torch.Tensor = attrs.field(validator=_tensor)
    chunk_offsets: torch.Tensor = attrs.field(validator=_tensor)
    chunk_size: int
    num_seqs: int
    num_tokens: int
    num_chunks: int
    max_seqlen: int
    padding: str | None = None
    generation: int = 0
    _lease: Lease | None = attrs.field(default=None, alias="lease")
    _slot: int = attrs.field(default=0, alias="slot")

    @property
    def padded(self) -> bool:
        """True for the capacity-shaped layout."""
        return self.padding is not None

    @property
    def bounded(self) -> bool:
        """Built without host lengths: the host ints are upper bounds (see the class docstring)."""
        return self.cu_seqlens_cpu is None

    @property
    def is_aligned(self) -> bool:
        """Every sequence length is a multiple of ``chunk_size`` (zero counts as one)."""
        return not self.bounded and self.num_chunks * self.chunk_size == self.num_tokens

    @property
    def single_seqlen(self) -> int | None:
        """The length of the only non-empty sequence, or None if there are zero or several."""
        # max_seqlen == T > 0 leaves no tokens for a second non-empty sequence.
        if not self.bounded and self.num_tokens > 0 and self.max_seqlen == self.num_tokens:
            return self.num_tokens
        return None

    def fla_kwargs(self) -> dict[str, Any]:
        """Keyword arguments FLA's chunked kernels take: cu_seqlens, chunk_indices, chunk_offsets."""
        return {
            "cu_seqlens": self.cu_seqlens,
            "chunk_indices": self.chunk_indices,
            "chunk_offsets": self.chunk_offsets,
        }

    def describe(self) -> str:
        """One line for logs; reads host ints only."""
        layout = f"padded-{self.padding}" if self.padded else "exact"
        if self.bounded:
            layout = f"bounded-{self.padding}"
        return (
            f"N={self.num_seqs} T={self.num_tokens} NT={self.num_chunks} C={self.chunk_size} "
            f"max_seqlen={self.max_seqlen} aligned={self.is_aligned} single_seqlen={self.single_seqlen} "
            f"layout={layout} rows={self.chunk_indices.shape[0]} device={self.cu_seqlens.device} "
            f"generation={self.generation} live={self.is_live}"
        )

    def __repr__(self) -> str:
        return f"ChunkMetadata({self.describe()})"


def _frozen_tables(cls):
    return attrs.frozen(slots=True, eq=False)(cls)


@_frozen_tables
class ConvBlocks:
    """The causal-conv1d block tables of a slice (``chunkmeta.tables.Conv``): ``tot`` (a host
    int, the conv kernel's grid) ``(row, block)`` pairs, ordered by row then block, as vLLM's two
    int32 tables ``batch_ptr`` / ``token_chunk_offset_ptr`` or SGLang's int32 ``[tot, 2]``
    ``block_table`` (the other form is None). Padded: capacity rows, ``PAD_SLOT_ID`` / ``(-1, 0)``
    after ``tot``."""

    batch_ptr: torch.Tensor | None
    token_chunk_offset_ptr: torch.Tensor | None
    block_table: torch.Tensor | None
    tot: int
    block_m: int
    num_rows: int


@_frozen_tables
class Mamba2Chunks:
    """vLLM's Mamba2 SSD chunk tables (``chunkmeta.tables.Mamba2``; values:
    ``chunkmeta.reference.mamba2_chunk_metadata``): ``cu_chunk_seqlens`` int32 ``[nchunks + 1]``,
    ``seq_idx`` int32 ``[nchunks]``, ``last_chunk_indices`` int32 ``[num_prefills]``,
    ``checkpoint_chunk_idx`` int64 ``[num_prefills]`` or None (no row has a checkpoint), host
    ``num_chunks`` and ``prep_initial_states``. Padded: capacity-shaped, chunks after
    ``num_chunks`` are empty with ``seq_idx`` the spec's ``seq_idx_pad`` (-1 by default)."""

    cu_chunk_seqlens: torch.Tensor
    seq_idx: torch.Tensor
    last_chunk_indices: torch.Tensor
    checkpoint_chunk_idx: torch.Tensor | None
    chunk_size: int
    num_chunks: int
    num_prefills: int
    prep_initial_states: bool


@_frozen_tables
class SglangMamba2Chunks:
    """SGLang's ``prepare_mixed`` tables (``chunkmeta.tables.SglangMamba2``; values:
    ``chunkmeta.reference.sglang_mamba2_mixed``): ``seq_idx`` int32 ``[1, T]``, the logical
    ``chunk_indices`` / ``chunk_offsets`` int32 ``[num_logical_chunks]`` (built whatever
    ``prep_initial_states`` says: SGLang passes None where no row has a prefix), and
    ``has_initial_states`` bool ``[num_prefills]`` on the device."""

    seq_idx: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    has_initial_states: torch.Tensor
    chunk_size: int
    num_logical_chunks: int
    num_prefills: int
    num_prefill_tokens: int
    prep_initial_states: bool


class _TablesByName(Leased):
    """A ``StepTables``' instance ``__dict__``: its tables dict (``__attrs_post_init__``, and the
    C result executor of ``chunkmeta.results``), so that ``step.<name>`` is a plain attribute
    lookup. Through ``__getattr__`` (a failed lookup, then two Python frames) a table took
    ~0.65 µs on the development CPU where a slot takes ~0.03, and an engine's layers may each
    read one."""

    __slots__ = ("__dict__",)


@attrs.frozen(slots=True, eq=False, repr=False, weakref_slot=True)
class StepTables(_TablesByName):
    """Every table one step asked for (``chunkmeta.StepTablesBuilder``), by the names the engine
    gave them: ``step["fla"]`` or ``step.fla``. Frozen, like ``ChunkMetadata``; the tables share
    one ring slot, so they are live (``is_live``) together. ``num_seqs`` / ``num_tokens``: the
    prefill slice's requests and tokens (vLLM's ``num_prefills`` / ``num_prefill_tokens``), the
    real ones in the padded layout too."""

    _tables: dict
    padded: bool
    generation: int
    _lease: Lease | None = attrs.field(default=None, alias="lease")
    _slot: int = attrs.field(default=0, alias="slot")
    num_seqs: int = 0
    num_tokens: int = 0

    def __attrs_post_init__(self):
        object.__setattr__(self, "__dict__", self._tables)  # step.<name> (_TablesByName)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tables)

    def __getitem__(self, name: str):
        table = self._tables.get(name)
        if table is None:
            raise ChunkMetaError(
                f"no table {name!r} in this step: the builder was made for {tuple(self._tables)}; "
                "name it in StepTablesBuilder(tables=...) to have it built."
            )
        return table

    def __getattr__(self, name: str):  # only where __dict__ lacks the name (the tables are in it)
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except ChunkMetaError as exc:
            raise AttributeError(str(exc)) from None

    def __repr__(self) -> str:
        return f"StepTables({', '.join(self._tables)}; generation={self.generation} live={self.is_live})"
