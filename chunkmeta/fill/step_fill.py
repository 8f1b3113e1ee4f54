"""Every table of a step in one Triton launch, beside its launcher.

A step's tables (``chunkmeta.tables``) are *entries* of one kernel: entry ``j`` owns a range of
programs, sized by its rows, and writes its tables into the regions of one arena (a ring slot, or
a one-shot's block; the byte offsets of every region are compile-time constants). Every entry is
a walk over the sequences of a slice of ``query_start_loc``: each sequence is cut into chunks, and
each program finds the sequence and chunk of its rows by one prefix scan and row search
(``chunkmeta.fill.row_search``). What differs between entries is where a sequence's chunks are
cut (its *base*, the position of its first token) and what a row stores. FLA's tables are one
such entry (``fla_tables``), for the step builder, ``ChunkMetadataBuilder`` and the one-shot.

Importing this module imports triton, so builders import it on first use: that lets a CPU process
set ``TRITON_INTERPRET=1`` as late as its first Triton build.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from chunkmeta.fill.row_search import find_rows, scan_counts, seq_lanes, store_pairs
from chunkmeta.plan import next_pow2

MAX_ENTRIES = 6


@triton.jit
def segment_chunks(pos, length, SHIFT: tl.constexpr):
    """Chunks a segment of ``length`` tokens starting at position ``pos`` is cut into, when a chunk
    ends at every multiple of ``1 << SHIFT`` and at the segment's end. An empty segment that
    starts mid-chunk still gets one (empty) chunk; one on a boundary gets none."""
    mid = (pos & ((1 << SHIFT) - 1)) != 0
    return tl.where(length > 0, ((pos + length - 1) >> SHIFT) - (pos >> SHIFT) + 1, mid.to(tl.int32))


@triton.jit
def _row_geometry(pos, length, checkpoint, chunk, SHIFT: tl.constexpr, CHECKPOINTS: tl.constexpr):
    """Chunk ``chunk`` of a sequence at ``pos`` with ``length`` tokens: ``(start, end)`` positions,
    with the checkpoint (``checkpoint > 0`` tokens in) cutting it into two segments; and the
    chunks of the first segment (the checkpoint's chunk is the last of them)."""
    first_len = length
    first_chunks = segment_chunks(pos, length, SHIFT)
    if CHECKPOINTS:
        split = checkpoint > 0
        first_len = tl.where(split, checkpoint, length)
        first_chunks = tl.where(split, segment_chunks(pos, checkpoint, SHIFT), first_chunks)
        second = chunk >= first_chunks
        pos = tl.where(second, pos + checkpoint, pos)
        length = tl.where(second, length - checkpoint, first_len)
        chunk = tl.where(second, chunk - first_chunks, chunk)
    else:
        length = first_len
    first_boundary = pos >> SHIFT
    start = tl.where(chunk == 0, pos, (first_boundary + chunk) << SHIFT)
    end = tl.minimum((first_boundary + chunk + 1) << SHIFT, pos + length)
    return start, end


@triton.jit
def _walk_entry(
    query_start_loc,
    num_computed_tokens,
    checkpoint_offsets,
    arena,
    first_seq,
    num_seqs,
    num_rows,
    pid,
    num_programs,
    KIND: tl.constexpr,
    SHIFT: tl.constexpr,
    BASE: tl.constexpr,
    FLAG: tl.constexpr,
    OFF0: tl.constexpr,
    OFF1: tl.constexpr,
    OFF2: tl.constexpr,
    OFF3: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    PAD0: tl.constexpr,
    PAD1: tl.constexpr,
    PADDED: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    SCAN_COLS: tl.constexpr,
    LOG2_SCAN_COLS: tl.constexpr,
    LOG2_BLOCK_SEQS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
):
    """One program's share of a conv1d, Mamba2 or SGLang entry (the fields of a
    ``chunkmeta.tables.Entry``; Triton 3.6 passes no tuple to a jit function). Rows are ordered
    by sequence then chunk with no gaps; in the padded layout rows in ``[count, num_rows)`` hold
    the entry's pad values and sequences in ``[N, SEQS_PAD)`` repeat the last one's
    per-sequence values."""
    CHECKPOINTS: tl.constexpr = (KIND == 3) and (FLAG != 0)

    seqs = seq_lanes(BLOCK_SEQS, SCAN_COLS)
    real_seq = seqs < num_seqs
    qsl = query_start_loc + first_seq
    base = tl.load(qsl)
    starts = tl.load(qsl + seqs, mask=real_seq, other=0)
    lengths = tl.load(qsl + 1 + seqs, mask=real_seq, other=0) - starts
    if BASE == 0:
        pos = tl.zeros_like(starts)
    elif BASE == 1:
        pos = starts - base
    else:
        pos = tl.load(num_computed_tokens + first_seq + seqs, mask=real_seq, other=0)
    checkpoint = tl.zeros_like(starts)
    first_chunks = segment_chunks(pos, lengths, SHIFT)
    seq_chunks = first_chunks
    if CHECKPOINTS:
        checkpoint = tl.load(checkpoint_offsets + first_seq + seqs, mask=real_seq, other=0)
        split = checkpoint > 0
        first_chunks = tl.where(split, segment_chunks(pos, checkpoint, SHIFT), first_chunks)
        seq_chunks = tl.where(
            split, first_chunks + segment_chunks(pos + checkpoint, lengths - checkpoint, SHIFT), seq_chunks
        )
    seq_chunks = tl.where(real_seq, seq_chunks, 0).to(tl.int32)
    chunk_ends, tile_ends, num_chunks = scan_counts(seq_chunks)

    # per-sequence tables: each program stores its share of the sequences
    seqs_out = SEQS_PAD if PADDED else num_seqs
    share = (seqs_out + num_programs - 1) // num_programs
    mine = (seqs >= pid * share) & (seqs < pid * share + share) & (seqs < seqs_out)
    if KIND == 3:  # last_chunk_indices (int32), checkpoint_chunk_idx (int64)
        last = tl.where(real_seq, chunk_ends, num_chunks) - 1
        tl.store((arena + OFF2).to(tl.pointer_type(tl.int32)) + seqs, last, mask=mine)
        if CHECKPOINTS:
            mark = tl.where(real_seq & (checkpoint > 0), chunk_ends - seq_chunks + first_chunks - 1, 0)
            tl.store((arena + OFF3).to(tl.pointer_type(tl.int64)) + seqs, mark.to(tl.int64), mask=mine)
    if KIND == 4:
        if FLAG != 0:  # has_initial_states (bool)
            computed = tl.load(num_computed_tokens + first_seq + seqs, mask=real_seq, other=0)
            tl.store((arena + OFF2).to(tl.pointer_type(tl.int8)) + seqs, (computed > 0).to(tl.int8), mask=mine)

    keys = tl.reshape(tl.where(real_seq, chunk_ends, 2147483647), [BLOCK_SEQS])
    rows, seq, seq_start = find_rows(
        keys, tile_ends, pid * BLOCK_ROWS, BLOCK_ROWS, ROW_GROUPS, LOG2_BLOCK_SEQS - LOG2_SCAN_COLS, LOG2_SCAN_COLS
    )
    chunk = rows - seq_start
    real_row = rows < num_chunks
    in_table = rows < num_rows
    if KIND == 2:  # (row, block) pairs: one int32 [rows, 2] table, or two int32 [rows] tables
        seq = tl.where(real_row, seq, PAD0)
        chunk = tl.where(real_row, chunk, PAD1)
        if FLAG != 0:
            store_pairs(arena + OFF0, rows, seq, chunk, num_rows)
        else:
            tl.store((arena + OFF0).to(tl.pointer_type(tl.int32)) + rows, seq, mask=in_table)
            tl.store((arena + OFF1).to(tl.pointer_type(tl.int32)) + rows, chunk, mask=in_table)
    elif KIND == 5:  # a row per token: its sequence
        tl.store((arena + OFF0).to(tl.pointer_type(tl.int32)) + rows, tl.where(real_row, seq, PAD0), mask=in_table)
    else:
        # the row's sequence, read again by row (a gather from L2, not from the lanes)
        row_start = tl.load(qsl + seq, mask=real_row, other=0)
        row_len = tl.load(qsl + seq + 1, mask=real_row, other=0) - row_start
        if BASE == 1:
            row_pos = row_start - base
        else:
            row_pos = tl.load(num_computed_tokens + first_seq + seq, mask=real_row, other=0)
        row_checkpoint = tl.zeros_like(row_pos)
        if CHECKPOINTS:
            row_checkpoint = tl.load(checkpoint_offsets + first_seq + seq, mask=real_row, other=0)
        # int64: a chunk's next boundary may lie past int32 when a request ends near 2^31 tokens
        start, end = _row_geometry(
            row_pos.to(tl.int64),
            row_len.to(tl.int64),
            row_checkpoint.to(tl.int64),
            chunk.to(tl.int64),
            SHIFT,
            CHECKPOINTS,
        )
        if KIND == 3:  # cu_chunk_seqlens[r + 1] (packed token offsets), seq_idx[r]
            num_tokens = tl.load(qsl + num_seqs) - base
            chunk_end = tl.where(real_row, row_start - base + end - row_pos, num_tokens).to(tl.int32)
            tl.store((arena + OFF0).to(tl.pointer_type(tl.int32)) + 1 + rows, chunk_end, mask=in_table)
            tl.store((arena + OFF1).to(tl.pointer_type(tl.int32)) + rows, tl.where(real_row, seq, PAD0), mask=in_table)
        else:  # SGLang's logical chunks: the physical chunk and the offset in it of the first token
            chunk_index = tl.where(real_row, start >> SHIFT, PAD0).to(tl.int32)
            chunk_offset = tl.where(real_row, start & ((1 << SHIFT) - 1), PAD1).to(tl.int32)
            tl.store((arena + OFF0).to(tl.pointer_type(tl.int32)) + rows, chunk_index, mask=in_table)
            tl.store((arena + OFF1).to(tl.pointer_type(tl.int32)) + rows, chunk_offset, mask=in_table)


@triton.jit
def fla_tables(
    query_start_loc,
    cu_seqlens,
    chunk_indices,
    chunk_offsets,
    first_seq,
    num_seqs,
    num_rows,
    seqs_out,
    pad_seq,
    pid,
    num_programs,
    CHUNK_SHIFT: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    SCAN_COLS: tl.constexpr,
    LOG2_SCAN_COLS: tl.constexpr,
    LOG2_BLOCK_SEQS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
    PADDED: tl.constexpr,
    PAD_CHUNK: tl.constexpr,
    WRITE_FIRST: tl.constexpr,
    INDICES_64: tl.constexpr,
):
    """Program ``pid`` of ``num_programs``' share of an FLA entry: ``cu_seqlens[1 : seqs_out + 1]``,
    ``chunk_offsets[1 : seqs_out + 1]`` and ``chunk_indices[0 : num_rows]`` of the slice
    ``query_start_loc[first_seq : first_seq + num_seqs + 1]`` (entry 0 of the first two too with
    WRITE_FIRST: fresh, uninitialized outputs).

    Every program scans the per-sequence chunk counts itself (``BLOCK_SEQS >= num_seqs`` lanes,
    scanned as a [BLOCK_SEQS / SCAN_COLS, SCAN_COLS] tile) instead of waiting on another
    program, so there is no inter-program dependency; ``BLOCK_ROWS >= BLOCK_SEQS / 8`` bounds
    the redundant scans by the row work. A row's sequence is the number of sequences whose
    chunks end at or before it (``find_rows``), then ``t = row - chunk_offsets[seq]``: rows are
    parallel, with no loop over a sequence's chunks.

    Invariants callers rely on: rows are ordered by sequence then chunk with no gaps; a
    zero-length sequence keeps its index and gets no rows; with PADDED, rows in ``[NT,
    num_rows)`` are ``(pad_seq, PAD_CHUNK)`` and sequences in ``(N, seqs_out]`` repeat the last
    offset (zero-length tails). Token counts fit int32 (host-validated)."""
    seqs = seq_lanes(BLOCK_SEQS, SCAN_COLS)
    real_seq = seqs < num_seqs
    qsl = query_start_loc + first_seq
    base = tl.load(qsl)
    ends = tl.load(qsl + 1 + seqs, mask=real_seq, other=0)
    starts = tl.load(qsl + seqs, mask=real_seq, other=0)
    seq_chunks = ((ends - starts + ((1 << CHUNK_SHIFT) - 1)) >> CHUNK_SHIFT).to(tl.int32)
    # chunk_offsets[i + 1]
    chunk_ends, tile_ends, num_chunks = scan_counts(seq_chunks)

    # cu_seqlens[1:] and chunk_offsets[1:]: each program stores its share of the sequences
    # (every program has them all), so no program carries all N stores: at thousands of
    # sequences that was faster than program 0 storing them all (bench/RESULTS.md, kernel sweeps)
    share = (seqs_out + num_programs - 1) // num_programs
    mine = (seqs >= pid * share) & (seqs < pid * share + share) & (seqs < seqs_out)
    seq_ends = ends - base
    offset_ends = chunk_ends
    # the exact layout has seqs_out == num_seqs: no tail, so no NT (its reduction costs three
    # barriers, and the compiler drops it when nothing here uses it)
    if PADDED:  # tail sequences repeat (T, NT); the last entry may lie past the BLOCK_SEQS lanes
        num_tokens = tl.load(qsl + num_seqs) - base
        seq_ends = tl.where(real_seq, seq_ends, num_tokens)
        offset_ends = tl.where(real_seq, offset_ends, num_chunks)
        if pid == 0:
            tl.store(cu_seqlens + seqs_out, num_tokens.to(tl.int32))
            tl.store(chunk_offsets + seqs_out, num_chunks.to(tl.int64))
    tl.store(cu_seqlens + 1 + seqs, seq_ends.to(tl.int32), mask=mine)
    tl.store(chunk_offsets + 1 + seqs, offset_ends.to(tl.int64), mask=mine)
    if WRITE_FIRST:  # fresh (uninitialized) outputs: the one-shot allocates without a memset launch
        if pid == 0:
            tl.store(cu_seqlens, 0)
            tl.store(chunk_offsets, 0)

    keys = tl.reshape(tl.where(real_seq, chunk_ends, 2147483647), [BLOCK_SEQS])
    rows, seq, seq_start = find_rows(
        keys, tile_ends, pid * BLOCK_ROWS, BLOCK_ROWS, ROW_GROUPS, LOG2_BLOCK_SEQS - LOG2_SCAN_COLS, LOG2_SCAN_COLS
    )
    chunk = rows - seq_start
    if PADDED:
        real_row = rows < num_chunks
        seq = tl.where(real_row, seq, pad_seq)
        chunk = tl.where(real_row, chunk, PAD_CHUNK)
    if INDICES_64:  # int64 [num_rows, 2] (the ROCm Kimi-K3 helper's dtype for int64 cu_seqlens)
        wide = chunk_indices.to(tl.pointer_type(tl.int64)) + 2 * rows
        tl.store(wide, seq.to(tl.int64), mask=rows < num_rows)
        tl.store(wide + 1, chunk.to(tl.int64), mask=rows < num_rows)
    else:
        store_pairs(chunk_indices, rows, seq, chunk, num_rows)


@triton.jit
def _entry(
    query_start_loc,
    num_computed_tokens,
    checkpoint_offsets,
    arena,
    first_seq,
    num_seqs,
    num_rows,
    pid,
    num_programs,
    KIND: tl.constexpr,
    SHIFT: tl.constexpr,
    BASE: tl.constexpr,
    FLAG: tl.constexpr,
    OFF0: tl.constexpr,
    OFF1: tl.constexpr,
    OFF2: tl.constexpr,
    OFF3: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    PAD0: tl.constexpr,
    PAD1: tl.constexpr,
    PADDED: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    SCAN_COLS: tl.constexpr,
    LOG2_SCAN_COLS: tl.constexpr,
    LOG2_BLOCK_SEQS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
):
    if KIND == 1:
        # FLAG's bits (chunkmeta.tables.FLA_*): int64 chunk_offsets, entry 0 written, int64 chunk_indices
        OFFSETS: tl.constexpr = tl.int64 if (FLAG & 1) != 0 else tl.int32
        WRITE_FIRST: tl.constexpr = (FLAG & 2) != 0
        INDICES_64: tl.constexpr = (FLAG & 4) != 0
        # runtime values, as fla_tables takes them (Triton 3.6 passes no bare ints to a jit function);
        # a SEQS_PAD below 0 (a bounded build: padded rows, the slice's own sequences) pads no sequence
        seqs_out = num_seqs * 0 + SEQS_PAD if PADDED and SEQS_PAD >= 0 else num_seqs
        pad_seq = num_seqs * 0 + PAD0
        fla_tables(
            query_start_loc,
            (arena + OFF0).to(tl.pointer_type(tl.int32)),
            (arena + OFF1).to(tl.pointer_type(tl.int32)),
            (arena + OFF2).to(tl.pointer_type(OFFSETS)),
            first_seq,
            num_seqs,
            num_rows,
            seqs_out,
            pad_seq,
            pid,
            num_programs,
            SHIFT,
            BLOCK_SEQS,
            SCAN_COLS,
            LOG2_SCAN_COLS,
            LOG2_BLOCK_SEQS,
            BLOCK_ROWS,
            ROW_GROUPS,
            PADDED,
            PAD1,
            WRITE_FIRST,
            INDICES_64,
        )
    else:
        _walk_entry(
            query_start_loc,
            num_computed_tokens,
            checkpoint_offsets,
            arena,
            first_seq,
            num_seqs,
            num_rows,
            pid,
            num_programs,
            KIND,
            SHIFT,
            BASE,
            FLAG,
            OFF0,
            OFF1,
            OFF2,
            OFF3,
            SEQS_PAD,
            PAD0,
            PAD1,
            PADDED,
            BLOCK_SEQS,
            SCAN_COLS,
            LOG2_SCAN_COLS,
            LOG2_BLOCK_SEQS,
            BLOCK_ROWS,
            ROW_GROUPS,
        )


@triton.jit
def _pick(j: tl.constexpr, a, b, c, d, e, f):
    if j == 0:
        return a
    elif j == 1:
        return b
    elif j == 2:
        return c
    elif j == 3:
        return d
    elif j == 4:
        return e
    else:
        return f


@triton.jit(
    do_not_specialize=["first_seq", "num_seqs", "batch_seqs", "rows0", "rows1", "rows2", "rows3", "rows4", "rows5"],
    do_not_specialize_on_alignment=[
        "query_start_loc",
        "num_computed_tokens",
        "checkpoint_offsets",
        "arena",
        "step_params",
    ],
)
def step_tables_kernel(
    query_start_loc,  # *i32|*i64 [R+1], device
    num_computed_tokens,  # *i32|*i64 [R], device (any pointer when no entry reads it)
    checkpoint_offsets,  # *i32|*i64 [R], device (any pointer when no entry reads it)
    arena,  # *i8: one ring slot, every entry's regions at the byte offsets in ENTRIES
    step_params,  # *i32 [3] = (first_seq, num_seqs, batch_seqs); read only when PARAMS_ON_DEVICE
    first_seq,  # the prefill slice
    num_seqs,
    batch_seqs,  # the batch slice: requests [0, batch_seqs)
    rows0,  # rows each entry writes (its count in the exact layout, its capacity in the padded one)
    rows1,
    rows2,
    rows3,
    rows4,
    rows5,
    ENTRIES: tl.constexpr,  # a tuple of chunkmeta.tables.Entry tuples, at most MAX_ENTRIES
    PADDED: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    SCAN_COLS: tl.constexpr,
    LOG2_SCAN_COLS: tl.constexpr,
    LOG2_BLOCK_SEQS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
    PARAMS_ON_DEVICE: tl.constexpr,  # graph mode (chunkmeta.graph.StepGraphBuild): slices from step_params
):
    """Every table of one step.

    Grid: ``(sum_j max(1, cdiv(rows_j, BLOCK_ROWS)),)``: entry ``j`` owns the next
    ``max(1, cdiv(rows_j, BLOCK_ROWS))`` programs (at least one, for its per-sequence tables).
    Programs of different entries share nothing, so the launch has no inter-program dependency;
    each program scans its slice's ``BLOCK_SEQS >= N`` lanes itself, as FLA's kernel does.
    Token counts and positions fit int32 (host-validated).
    """
    pid = tl.program_id(0)
    if PARAMS_ON_DEVICE:
        first_seq = tl.load(step_params)
        num_seqs = tl.load(step_params + 1)
        batch_seqs = tl.load(step_params + 2)
    start = 0
    for j in tl.static_range(len(ENTRIES)):
        rows = _pick(j, rows0, rows1, rows2, rows3, rows4, rows5)
        programs = tl.maximum((rows + BLOCK_ROWS - 1) // BLOCK_ROWS, 1)
        if (pid >= start) & (pid < start + programs):
            if ENTRIES[j][2] == 0:
                slice_first = first_seq
                slice_seqs = num_seqs
            else:
                slice_first = first_seq * 0
                slice_seqs = batch_seqs
            _entry(
                query_start_loc,
                num_computed_tokens,
                checkpoint_offsets,
                arena,
                slice_first,
                slice_seqs,
                rows,
                pid - start,
                programs,
                ENTRIES[j][0],
                ENTRIES[j][1],
                ENTRIES[j][3],
                ENTRIES[j][4],
                ENTRIES[j][5],
                ENTRIES[j][6],
                ENTRIES[j][7],
                ENTRIES[j][8],
                ENTRIES[j][9],
                ENTRIES[j][10],
                ENTRIES[j][11],
                PADDED,
                BLOCK_SEQS,
                SCAN_COLS,
                LOG2_SCAN_COLS,
                LOG2_BLOCK_SEQS,
                BLOCK_ROWS,
                ROW_GROUPS,
            )
        start = start + programs


class StepFill:
    """Launches ``step_tables_kernel`` for one builder's entries and layout.

    The first launch per input dtypes goes through Triton's JIT with tensors and compiles; it
    keeps the compiled kernel, and later launches (CUDA only) call that kernel's launcher directly
    with plain ints, skipping the JIT's per-call argument binding and cache lookup (tens of
    microseconds of host time; ``CHUNKMETA_FAST_LAUNCH=0`` keeps the JIT path). Every scalar is
    excluded from specialization, so one compiled kernel serves every step. ``plain_kernel``
    hands the compiled kernel to ``chunkmeta.native``, whose C build launches it with no Python
    in between.
    """

    def __init__(
        self,
        *,
        entries: tuple,
        block_seqs: int,
        padded: bool,
        params_on_device: bool = False,
        block_rows: int | None = None,
        num_warps: int | None = None,
        scan_cols: int | None = None,
    ):
        if not 1 <= len(entries) <= MAX_ENTRIES:
            raise ValueError(f"a step has 1..{MAX_ENTRIES} kernel entries, got {len(entries)}")
        self.entries = tuple(tuple(e) for e in entries)
        self.block_seqs = next_pow2(max(block_seqs, 2))
        # the fastest or tied shapes of the H200 kernel sweeps (kernel_sweep records in
        # bench/results/runs.jsonl): 256-row programs up to 512 sequences, 512-row ones from 1024;
        # 4 warps up to 256 sequences, 8 up to 2048, 16 above; scan tile rows 4 wide from 1024
        # sequences, 16 wide below. block_seqs / 8 keeps the redundant per-program scans within
        # 8x the row work. The overrides: tests/kernels/test_kernel.py's program boundaries
        self.block_rows = block_rows or max(256 if self.block_seqs <= 512 else 512, self.block_seqs // 8)
        self.num_warps = num_warps or (4 if self.block_seqs <= 256 else 8 if self.block_seqs <= 2048 else 16)
        scan_cols = min(scan_cols or (4 if self.block_seqs >= 1024 else 16), self.block_seqs)
        self.constexprs = dict(
            ENTRIES=self.entries,
            PADDED=padded,
            BLOCK_SEQS=self.block_seqs,
            SCAN_COLS=scan_cols,
            LOG2_SCAN_COLS=scan_cols.bit_length() - 1,
            LOG2_BLOCK_SEQS=self.block_seqs.bit_length() - 1,
            BLOCK_ROWS=self.block_rows,
            ROW_GROUPS=min(self.num_warps, self.block_rows),
            PARAMS_ON_DEVICE=params_on_device,
        )
        self._constexpr_values = tuple(self.constexprs.values())
        self._device_index = -1
        self._launchers = {}  # input dtypes -> (callable, function, fixed leading arguments)
        self._kernels = {}  # input dtypes -> compiled kernel

    def plain_kernel(self, dtypes):
        """``(function handle, num_warps, shared bytes)`` for ``chunkmeta.native``'s step build
        (``plain_launch``), or None."""
        return plain_launch(self._kernels.get(dtypes))

    def grid(self, rows: tuple[int, ...]) -> int:
        return sum(max(1, -(-r // self.block_rows)) for r in rows)

    def launch(self, dtypes, pointers: tuple[int, int, int, int, int], ints: tuple[int, ...]) -> bool:
        """Fast launch with data pointers as ints; False (nothing launched) if not available.
        ``ints``: ``(first_seq, num_seqs, batch_seqs, rows0 .. rows5)``."""
        launcher = self._launchers.get(dtypes)
        if launcher is None or torch._C._cuda_getDevice() != self._device_index:
            return False
        call, function, fixed = launcher
        call(
            self.grid(ints[3 : 3 + len(self.entries)]),
            1,
            1,
            torch._C._cuda_getCurrentRawStream(self._device_index),
            function,
            *fixed,
            *pointers,
            *ints,
            *self._constexpr_values,
        )
        return True

    def __call__(
        self, query_start_loc, num_computed_tokens, checkpoint_offsets, arena, ints: tuple[int, ...], params=None
    ) -> None:
        """Launch through the JIT with tensors (works everywhere, including the interpreter), on
        the current stream of the tensors' device whichever device is current."""
        dtypes = (query_start_loc.dtype, num_computed_tokens.dtype, checkpoint_offsets.dtype)
        params = query_start_loc if params is None else params  # unread unless PARAMS_ON_DEVICE
        pointers = (
            query_start_loc.data_ptr(),
            num_computed_tokens.data_ptr(),
            checkpoint_offsets.data_ptr(),
            arena.data_ptr(),
            params.data_ptr(),
        )
        if self.launch(dtypes, pointers, ints):
            return
        grid = (self.grid(ints[3 : 3 + len(self.entries)]),)
        device = query_start_loc.device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            kernel = step_tables_kernel[grid](
                query_start_loc,
                num_computed_tokens,
                checkpoint_offsets,
                arena,
                params,
                *ints,
                num_warps=self.num_warps,
                **self.constexprs,
            )
        if dtypes not in self._launchers and query_start_loc.is_cuda and _fast_launch_enabled():
            self._kernels[dtypes] = kernel
            launcher = _direct_launcher(kernel)
            if launcher is not None:
                self._launchers[dtypes] = launcher
            self._device_index = device.index


def _fast_launch_enabled() -> bool:
    """The direct launcher path: on unless disabled, or unless a launch hook (a profiler such as
    Triton's proton) is installed, since the direct path skips the hooks."""
    if os.environ.get("CHUNKMETA_FAST_LAUNCH", "1") == "0" or os.environ.get("TRITON_INTERPRET"):
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # Triton < 3.4 keeps the hook on CompiledKernel
        return getattr(triton.compiler.CompiledKernel, "launch_enter_hook", None) is None
    hook = knobs.runtime.launch_enter_hook
    # Triton 3.6 wraps hooks in a HookChain, empty unless something registered one.
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def plain_launch(kernel):
    """``(function handle, num_warps, shared bytes)`` of a compiled Triton kernel when a plain
    ``cuLaunchKernel`` launches it as Triton would (one CTA per program, no cooperative/PDL
    launch, no scratch buffers); else None."""
    if kernel is None:
        return None
    meta = kernel.metadata
    plain = (
        getattr(meta, "num_ctas", 1) == 1
        and not getattr(meta, "launch_cooperative_grid", False)
        and not getattr(meta, "launch_pdl", False)
        and getattr(meta, "global_scratch_size", 0) == 0
        and getattr(meta, "profile_scratch_size", 0) == 0
        and _needs_no_scratch(getattr(kernel, "run", None))
        and getattr(kernel, "function", None)
    )
    return (kernel.function, meta.num_warps, meta.shared) if plain else None


def _needs_no_scratch(run) -> bool:
    """Whether Triton's launcher for a kernel allocates no scratch buffers (an unknown launcher,
    without the attributes, counts as needing them)."""
    return getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0


def _direct_launcher(kernel):
    """How to launch a compiled kernel without the JIT: ``(callable, function, fixed args)``.

    The compiled kernel's ``run(grid0, grid1, grid2, stream, function, packed_metadata,
    launch_metadata, enter_hook, exit_hook, *args)`` is Triton's own launch entry (3.3 and
    later). On Triton 3.6's ``CudaLauncher`` that Python wrapper only adds the cooperative/PDL
    flags and two scratch buffers before calling its C ``launch``; when the kernel uses no
    scratch, calling ``launch`` directly saves microseconds per build. Any other launcher
    shape keeps ``run``. None when the kernel lacks what either needs.
    """
    import inspect

    run = getattr(kernel, "run", None)
    packed = getattr(kernel, "packed_metadata", None)
    if run is None or packed is None:
        return None
    launch = getattr(run, "launch", None)
    try:
        wrapper = list(inspect.signature(type(run).__call__).parameters)
    except (TypeError, ValueError):
        wrapper = []
    if (
        launch is not None
        and wrapper == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
        and _needs_no_scratch(run)
    ):
        fixed = (run.launch_cooperative_grid, run.launch_pdl, None, None, packed, None, None, None)
        return launch, kernel.function, fixed
    return run, kernel.function, (packed, None, None, None)
