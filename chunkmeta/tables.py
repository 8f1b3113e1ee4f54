"""What a step builder is asked for: the table sets, and where each lives in a ring slot.

An engine names, once, the tables its layers read (``StepTablesBuilder(tables={name: spec})``):

``Fla``          FLA's ``cu_seqlens`` / ``chunk_indices`` / ``chunk_offsets`` of a slice: the
                 prefill rows, or the whole batch (``rows="batch"``: vLLM's Kimi-Linear and
                 Kimi-K3 layers pass ``non_spec_query_start_loc``, decodes included).
``Conv``         the causal-conv1d ``(row, 8-token block)`` tables (vLLM's ``batch_ptr`` /
                 ``token_chunk_offset_ptr``, or SGLang's paired ``conv_block_table``).
``Mamba2``       vLLM's SSD chunk tables: physical chunks on absolute token positions.
``SglangMamba2`` SGLang's ``prepare_mixed`` tables: ``seq_idx`` per token, logical chunks.

Each spec becomes one or two kernel *entries* (``chunkmeta.fill.step_fill``) and a few regions
of the slot's arena. The values each table holds are stated by ``chunkmeta.reference``.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch

from chunkmeta import layout as _layout
from chunkmeta.errors import ChunkMetaError
from chunkmeta.metadata import StepTables
from chunkmeta.plan import check_chunk_size, round_up

SLICES = ("prefill", "batch")
# entry kinds, and where a sequence's chunks are cut: from its own first token (FLA, conv), from
# its packed position in the slice (SGLang's logical chunks), from its cached prefix (vLLM's Mamba2)
FLA, CONV, MAMBA2, LOGICAL, TOKENS = 1, 2, 3, 4, 5
BASE_ZERO, BASE_PACKED, BASE_COMPUTED = 0, 1, 2
UNUSED = -1  # an entry's region offset that it does not write
# an FLA entry's flag bits: int64 chunk_offsets; entry 0 of cu_seqlens / chunk_offsets written too
# (fresh, uninitialized outputs: the one-shot's); int64 chunk_indices (the one-shot's indices_dtype)
FLA_OFFSETS_64, FLA_WRITE_FIRST, FLA_INDICES_64 = 1, 2, 4
# an FLA entry's seqs_pad in a bounded build (ChunkMetadataBuilder.build_bounded): rows padded up
# to a host bound, sequences the slice's own
SEQS_EXACT = -1
PAD_SLOT_ID = -1  # vLLM's pad value for the conv tables' tails (v1/attention/backends/utils.py:54)
_ALIGN = 16  # every region starts 16-byte aligned (8-byte pair stores, vector loads)


class Entry(NamedTuple):
    """One kernel entry, as the compile-time tuple ``step_tables_kernel`` reads."""

    kind: int
    shift: int
    slice: int  # 0: the prefill slice, 1: the batch slice
    base: int
    flag: int  # FLA: int64 offsets; Conv: paired; Mamba2: checkpoints; logical: has_initial_states
    off0: int
    off1: int
    off2: int
    off3: int
    seqs_pad: int  # per-sequence entries written in the padded layout
    pad0: int
    pad1: int

    def packed(self, rows_pad: int) -> tuple:
        """The entry as ``chunkmeta.native``'s ``make_steps`` takes it, with the rows it writes padded."""
        e = self
        return (
            e.kind,
            e.shift,
            e.slice,
            e.base,
            e.flag,
            rows_pad,
            e.seqs_pad,
            e.off0,
            e.off1,
            e.off2,
            e.off3,
            e.pad0,
            e.pad1,
        )


class Region(NamedTuple):
    name: str
    dtype: torch.dtype
    entries: int  # capacity, in elements of dtype (pairs count as two)
    offset: int = 0  # in bytes, from the slot's start


def _check_slice(rows: str) -> None:
    if rows not in SLICES:
        raise ChunkMetaError(f"rows={rows!r}: must be one of {SLICES} (the prefill slice or the whole batch).")


def _fla_rows(tokens: int, seqs: int, chunk_size: int) -> int:
    return -(-tokens // chunk_size) + seqs


@attrs.frozen
class Fla:
    """FLA's chunk tables (``chunkmeta.ChunkMetadata``) of the prefill slice or the whole batch.

    ``fresh_cu_seqlens``: every build hands out new ``cu_seqlens`` / ``cu_seqlens_cpu`` objects,
    as FLA needs when they are passed to its kernels (it memoizes its helpers by tensor identity:
    a reused object would get another step's tables). False: the ring's cached views, one fewer
    tensor object each per build, for a consumer that never passes them to FLA (the vLLM adapter
    hands FLA vLLM's own ``query_start_loc`` tensors)."""

    chunk_size: int = 64
    rows: str = "prefill"
    offsets_dtype: torch.dtype = torch.int64
    fresh_cu_seqlens: bool = True

    def __attrs_post_init__(self):
        check_chunk_size(self.chunk_size)
        _check_slice(self.rows)
        if self.offsets_dtype not in (torch.int32, torch.int64):
            raise ChunkMetaError(f"offsets_dtype={self.offsets_dtype!r}: must be torch.int64 or torch.int32.")
        if type(self.fresh_cu_seqlens) is not bool:
            raise ChunkMetaError(f"fresh_cu_seqlens={self.fresh_cu_seqlens!r}: must be True or False.")

    needs_computed = False

    def regions(self, seqs: int, tokens: int) -> list[Region]:
        return [
            Region("cu_seqlens", torch.int32, seqs + 2),
            Region("chunk_indices", torch.int32, 2 * _fla_rows(tokens, seqs, self.chunk_size)),
            Region("chunk_offsets", self.offsets_dtype, seqs + 2),
        ]

    def entry_rows(self, seqs: int, tokens: int) -> list[int]:
        return [_fla_rows(tokens, seqs, self.chunk_size)]

    def entries(self, regions: dict[str, Region], seqs: int, tokens: int, pad: str) -> list[Entry]:
        shape = _layout.padded(pad, seqs, _fla_rows(tokens, seqs, self.chunk_size))
        return [
            Entry(
                FLA,
                self.chunk_size.bit_length() - 1,
                SLICES.index(self.rows),
                BASE_ZERO,
                FLA_OFFSETS_64 if self.offsets_dtype == torch.int64 else 0,
                regions["cu_seqlens"].offset,
                regions["chunk_indices"].offset,
                regions["chunk_offsets"].offset,
                UNUSED,
                shape.seqs_out,
                shape.pad_seq,
                shape.pad_chunk,
            )
        ]


@attrs.frozen
class Conv:
    """The causal-conv1d block tables: ``(row, block)`` for every ``block_m``-token block of every
    row of the slice, ordered by row then block. ``paired=False``: vLLM's two int32 tables
    (``batch_ptr``, ``token_chunk_offset_ptr``, padded with ``PAD_SLOT_ID``); ``paired=True``:
    SGLang's int32 ``[tot, 2]`` ``conv_block_table`` (padding rows ``(-1, 0)``)."""

    rows: str = "batch"
    block_m: int = 8
    paired: bool = False

    def __attrs_post_init__(self):
        _check_slice(self.rows)
        if self.block_m not in (1, 2, 4, 8, 16, 32, 64):
            raise ChunkMetaError(f"block_m={self.block_m!r}: must be a power of two up to 64 (vLLM's is 8).")

    needs_computed = False

    def regions(self, seqs: int, tokens: int) -> list[Region]:
        rows = _fla_rows(tokens, seqs, self.block_m)
        if self.paired:
            return [Region("block_table", torch.int32, 2 * rows)]
        return [Region("batch_ptr", torch.int32, rows), Region("token_chunk_offset_ptr", torch.int32, rows)]

    def entry_rows(self, seqs: int, tokens: int) -> list[int]:
        return [_fla_rows(tokens, seqs, self.block_m)]

    def entries(self, regions: dict[str, Region], seqs: int, tokens: int, pad: str) -> list[Entry]:
        shift = self.block_m.bit_length() - 1
        if self.paired:
            table = regions["block_table"].offset
            return [Entry(CONV, shift, SLICES.index(self.rows), BASE_ZERO, 1, table, UNUSED, UNUSED, UNUSED, 0, -1, 0)]
        first, second = regions["batch_ptr"].offset, regions["token_chunk_offset_ptr"].offset
        slice_ = SLICES.index(self.rows)
        return [Entry(CONV, shift, slice_, BASE_ZERO, 0, first, second, UNUSED, UNUSED, 0, PAD_SLOT_ID, PAD_SLOT_ID)]


def _ssd_rows(tokens: int, seqs: int, chunk_size: int, segments_per_row: int) -> int:
    """A bound on the chunks of ``seqs`` rows cut into ``segments_per_row`` segments each: a
    segment of ``L`` tokens at any position has at most ``cdiv(L, C) + 1`` chunks, and
    ``sum cdiv(L_i, C) <= T / C + segments`` (``chunkmeta.layout.chunk_row_bound``)."""
    segments = seqs * segments_per_row
    return tokens // chunk_size + 2 * segments + 1


@attrs.frozen
class Mamba2:
    """vLLM's Mamba2 SSD chunk tables of the prefill slice (``reference.mamba2_chunk_metadata``):
    chunks cut on absolute positions, so each build takes the rows' computed-token counts;
    ``checkpoints=True`` also takes each row's checkpoint offset (0 = none). ``seq_idx_pad``: the
    ``seq_idx`` of a padded layout's padding chunks (empty chunks). vLLM's SSD chunk scan reads
    ``initial_states[seq_idx]`` of every chunk, padding ones too (ssd_chunk_scan.py:258-277), so
    a capacity-shaped step that passes initial states pads with a row it has (its last), not -1."""

    chunk_size: int = 256
    checkpoints: bool = False
    seq_idx_pad: int = -1

    def __attrs_post_init__(self):
        check_chunk_size(self.chunk_size)
        if not isinstance(self.seq_idx_pad, int) or isinstance(self.seq_idx_pad, bool) or self.seq_idx_pad < -1:
            raise ChunkMetaError(f"seq_idx_pad={self.seq_idx_pad!r}: an int, -1 or a row of the slice.")

    needs_computed = True
    rows = "prefill"

    def _rows(self, seqs: int, tokens: int) -> int:
        return _ssd_rows(tokens, seqs, self.chunk_size, 2 if self.checkpoints else 1)

    def regions(self, seqs: int, tokens: int) -> list[Region]:
        rows = self._rows(seqs, tokens)
        regions = [
            Region("cu_chunk_seqlens", torch.int32, rows + 1),
            Region("seq_idx", torch.int32, rows),
            Region("last_chunk_indices", torch.int32, seqs),
        ]
        if self.checkpoints:
            regions.append(Region("checkpoint_chunk_idx", torch.int64, seqs))
        return regions

    def entry_rows(self, seqs: int, tokens: int) -> list[int]:
        return [self._rows(seqs, tokens)]

    def entries(self, regions: dict[str, Region], seqs: int, tokens: int, pad: str) -> list[Entry]:
        ckpt = regions["checkpoint_chunk_idx"].offset if self.checkpoints else UNUSED
        return [
            Entry(
                MAMBA2,
                self.chunk_size.bit_length() - 1,
                0,
                BASE_COMPUTED,
                int(self.checkpoints),
                regions["cu_chunk_seqlens"].offset,
                regions["seq_idx"].offset,
                regions["last_chunk_indices"].offset,
                ckpt,
                seqs,
                self.seq_idx_pad,
                0,
            )
        ]


@attrs.frozen
class SglangMamba2:
    """SGLang's ``prepare_mixed`` tables of the extend rows (the prefill slice;
    ``reference.sglang_mamba2_mixed``): ``seq_idx`` ``[1, T]``, the logical chunks and
    ``has_initial_states`` (from each build's computed-token counts, the extend prefix lengths)."""

    chunk_size: int = 64

    def __attrs_post_init__(self):
        check_chunk_size(self.chunk_size)

    needs_computed = True
    rows = "prefill"

    def entry_rows(self, seqs: int, tokens: int) -> list[int]:
        return [tokens, _ssd_rows(tokens, seqs, self.chunk_size, 1)]

    def regions(self, seqs: int, tokens: int) -> list[Region]:
        rows = _ssd_rows(tokens, seqs, self.chunk_size, 1)
        return [
            Region("seq_idx", torch.int32, tokens),
            Region("chunk_indices", torch.int32, rows),
            Region("chunk_offsets", torch.int32, rows),
            Region("has_initial_states", torch.bool, seqs),
        ]

    def entries(self, regions: dict[str, Region], seqs: int, tokens: int, pad: str) -> list[Entry]:
        return [
            Entry(TOKENS, 0, 0, BASE_ZERO, 0, regions["seq_idx"].offset, UNUSED, UNUSED, UNUSED, 0, -1, 0),
            Entry(
                LOGICAL,
                self.chunk_size.bit_length() - 1,
                0,
                BASE_PACKED,
                1,
                regions["chunk_indices"].offset,
                regions["chunk_offsets"].offset,
                regions["has_initial_states"].offset,
                UNUSED,
                seqs,
                -1,
                0,
            ),
        ]


SPECS = (Fla, Conv, Mamba2, SglangMamba2)


class OneShotLayout(NamedTuple):
    """Where a one-shot's FLA tables lie in its block (``chunkmeta.one_shot``): ``cu_seqlens``
    int32 at 0, ``chunk_offsets`` int64 at ``offsets_at``, ``chunk_indices`` last, at
    ``indices_at`` (bytes), so that a block sized to the batch holds every row; the entry that
    writes them, for ``seqs`` sequences at most."""

    entry: Entry
    offsets_at: int
    indices_at: int


def one_shot_layout(chunk_size: int, seqs: int, indices_dtype: torch.dtype) -> OneShotLayout:
    offsets_at = round_up(4 * (seqs + 1), _ALIGN)
    indices_at = offsets_at + round_up(8 * (seqs + 1), _ALIGN)
    flag = FLA_OFFSETS_64 | FLA_WRITE_FIRST | (FLA_INDICES_64 if indices_dtype == torch.int64 else 0)
    entry = Entry(FLA, chunk_size.bit_length() - 1, 0, BASE_ZERO, flag, 0, indices_at, offsets_at, UNUSED, 0, 0, 0)
    return OneShotLayout(entry, offsets_at, indices_at)


def bounded_entries(entries: tuple[Entry, ...]) -> tuple[Entry, ...]:
    """A padded layout's entries as a bounded build writes them (``SEQS_EXACT``)."""
    return tuple(e._replace(seqs_pad=SEQS_EXACT) if e.kind == FLA else e for e in entries)


class SlotLayout(NamedTuple):
    """Where every table of a builder lives in a slot: ``regions[name][field]``, the kernel's
    entries (in the order of ``owners``: the table name of each entry), and the slot's size."""

    regions: dict[str, dict[str, Region]]
    entries: tuple[Entry, ...]
    owners: tuple[str, ...]
    rows_pad: tuple[int, ...]  # rows each entry writes in the padded layout (its capacity)
    slot_bytes: int


def slot_layout(specs: dict, seqs: int, tokens: int, pad: str) -> SlotLayout:
    """Lay every spec's regions out in one slot, 16-byte aligned, in the order given."""
    offset = 0
    regions: dict[str, dict[str, Region]] = {}
    entries: list[Entry] = []
    owners: list[str] = []
    rows_pad: list[int] = []
    for name, spec in specs.items():
        placed = {}
        for region in spec.regions(seqs, tokens):
            placed[region.name] = region._replace(offset=offset)
            nbytes = region.entries * region.dtype.itemsize
            offset += round_up(max(nbytes, 1), _ALIGN)
        regions[name] = placed
        for entry, rows in zip(spec.entries(placed, seqs, tokens, pad), spec.entry_rows(seqs, tokens), strict=True):
            entries.append(entry)
            owners.append(name)
            rows_pad.append(rows)
    return SlotLayout(regions, tuple(entries), tuple(owners), tuple(rows_pad), offset)


def check_specs(tables) -> dict:
    if not isinstance(tables, dict) or not tables:
        raise ChunkMetaError(
            "tables must be a non-empty dict of name -> spec (chunkmeta.tables.Fla, Conv, Mamba2, SglangMamba2)."
        )
    for name, spec in tables.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ChunkMetaError(f"table name {name!r}: must be a Python identifier not starting with '_'.")
        if hasattr(StepTables, name):  # step.<name> would be that attribute, not the table
            raise ChunkMetaError(
                f"table name {name!r} is a StepTables attribute: step.{name} would be that attribute, not the "
                "table; choose another name."
            )
        if not isinstance(spec, SPECS):
            raise ChunkMetaError(
                f"tables[{name!r}] is a {type(spec).__name__}: must be a chunkmeta.tables spec "
                "(Fla, Conv, Mamba2 or SglangMamba2)."
            )
    return dict(tables)
