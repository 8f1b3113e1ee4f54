"""The Triton device functions every entry of the step kernel shares: the sequence lanes and
their prefix scan, the row search over the chunk ends, and the paired row stores
(``chunkmeta/csrc/row_search.h`` is the CUDA C twin's).

Importing this module imports triton (see ``chunkmeta.fill.step_fill``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def seq_lanes(BLOCK_SEQS: tl.constexpr, SCAN_COLS: tl.constexpr):
    """The sequence lanes as a [BLOCK_SEQS / SCAN_COLS, SCAN_COLS] tile, scanned along its rows,
    then the row totals down the tile: at thousands of sequences that is faster than one 1-D
    scan (the TritonFill defaults cite the sweep)."""
    return tl.arange(0, BLOCK_SEQS // SCAN_COLS)[:, None] * SCAN_COLS + tl.arange(0, SCAN_COLS)[None, :]


@triton.jit
def scan_counts(seq_chunks):
    """Inclusive prefix sums of the per-lane counts of a ``seq_lanes`` tile: ``(chunk_ends,
    tile_ends, total)``; ``tile_ends`` are the tile rows' last ends (the row search's coarse keys)."""
    tile_chunks = tl.sum(seq_chunks, 1)
    tile_ends = tl.cumsum(tile_chunks, 0)
    chunk_ends = tl.cumsum(seq_chunks, 1) + (tile_ends - tile_chunks)[:, None]
    return chunk_ends, tile_ends, tl.sum(tile_chunks, 0)


@triton.jit
def store_pairs(table, rows, first, second, num_rows):
    """Rows of an int32 ``[num_rows, 2]`` table (8-byte aligned): one 8-byte store per row
    (``first`` in the low word, ``second`` in the high word: little-endian int32 pairs),
    coalesced across the warp, instead of two strided 4-byte stores."""
    row = (first.to(tl.int64) & 0xFFFFFFFF) | (second.to(tl.int64) << 32)
    tl.store(table.to(tl.pointer_type(tl.int64)) + rows, row, mask=rows < num_rows)


@triton.jit
def _lift(source, pos, found, rows, span: tl.constexpr, rounds: tl.constexpr, axis: tl.constexpr):
    """``rounds`` rounds of binary lifting over the sorted ``source`` from positions ``pos``:
    move ``pos`` up by span/2, span/4, ... wherever that entry is still at or before the row,
    and keep the last such entry in ``found``."""
    for k in tl.static_range(rounds):
        step = span >> (k + 1)
        probe = tl.gather(source, pos + (step - 1), axis)
        below = probe <= rows
        pos = tl.where(below, pos + step, pos)
        found = tl.where(below, probe, found)
    return pos, found


@triton.jit
def find_rows(
    keys,
    tile_ends,
    first_row,
    BLOCK_ROWS: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
    LOG2_TILES: tl.constexpr,
    LOG2_COLS: tl.constexpr,
):
    """Rows ``first_row + [0, BLOCK_ROWS)`` with the sequence of each and that sequence's first
    row: binary lifting over the sorted chunk ends ``keys`` [TILES * COLS], in three phases of
    decreasing grain.

    Triton stages the source of every ``tl.gather`` through shared memory again (a store per
    element and two barriers per gather), unless the gather is warp-local. So the first rounds
    search at most 64 coarse ends with the rows as [groups, cols], one copy of the coarse ends
    per group, which lets Triton keep each group in one warp: shuffles, no shared memory
    (ROW_GROUPS is the warp count; cols never exceeds the coarse ends, a shape Triton 3.6
    cannot make warp-local). The next rounds search each scan tile row's last end
    ``tile_ends`` [TILES] (= keys[COLS - 1 :: COLS]), the last ones the keys themselves. A
    row's sequence starts at the last entry found at or before it, so no final gather."""
    LOG2_COARSE: tl.constexpr = min(LOG2_TILES, 6)
    coarse: tl.constexpr = 1 << LOG2_COARSE
    per_coarse: tl.constexpr = (1 << LOG2_TILES) >> LOG2_COARSE
    cols: tl.constexpr = min(BLOCK_ROWS // ROW_GROUPS, coarse)
    groups: tl.constexpr = BLOCK_ROWS // cols
    rows = first_row + tl.arange(0, groups)[:, None] * cols + tl.arange(0, cols)[None, :]
    coarse_ends = tl.max(tl.reshape(tile_ends, [coarse, per_coarse]), 1)
    found = tl.zeros(rows.shape, dtype=tl.int32)
    pos, found = _lift(
        tl.broadcast_to(coarse_ends[None, :], [groups, coarse]), found, found, rows, coarse, LOG2_COARSE, 1
    )
    rows = tl.reshape(rows, [BLOCK_ROWS])
    found = tl.reshape(found, [BLOCK_ROWS])
    tile = tl.reshape(pos * per_coarse, [BLOCK_ROWS])
    tile, found = _lift(tile_ends, tile, found, rows, per_coarse, LOG2_TILES - LOG2_COARSE, 0)
    seq, found = _lift(keys, tile << LOG2_COLS, found, rows, 1 << LOG2_COLS, LOG2_COLS, 0)
    return rows, seq, found
