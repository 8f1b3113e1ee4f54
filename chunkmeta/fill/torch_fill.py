"""The device fill in vectorized torch ops: CPU tensors, and devices without Triton.

Writes exactly what ``chunkmeta.fill.step_fill.step_tables_kernel``'s entries write, for every
layout (``chunkmeta.layout``), from the device ``query_start_loc`` and host sizes only.
A row's sequence is found with ``searchsorted`` over the chunk ends, so no op's output size
depends on device values: nothing here synchronizes, and the bounded layout, whose NT the host
does not know, works as the others do.
"""

from __future__ import annotations

import torch

from chunkmeta.layout import Layout
from chunkmeta.tables import BASE_PACKED, BASE_ZERO, CONV, FLA, FLA_WRITE_FIRST, LOGICAL, MAMBA2, TOKENS


@torch.inference_mode()  # it writes tables, which are inference tensors (chunkmeta.ring.TABLE_MEMORY)
def fill_torch(
    query_start_loc: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor,
    first_seq: int,
    num_seqs: int,
    chunk_size: int,
    layout: Layout,
) -> None:
    """Fill ``layout.seqs_out`` sequences and ``layout.rows_out`` rows of the three tables."""
    device = query_start_loc.device
    n, seqs_out, rows_out = num_seqs, layout.seqs_out, layout.rows_out
    segment = query_start_loc[first_seq : first_seq + n + 1].to(torch.int64)
    cu = segment - segment[0]
    seq_chunks = torch.div(cu[1:] - cu[:-1] + (chunk_size - 1), chunk_size, rounding_mode="floor")
    chunk_ends = torch.cumsum(seq_chunks, 0)
    cu_seqlens[1 : n + 1].copy_(cu[1:])
    chunk_offsets[1 : n + 1].copy_(chunk_ends)
    # T and NT as 1-element device tensors (expand, never .item(): no sync)
    num_tokens = cu[-1:]
    num_chunks = chunk_ends[-1:] if n else torch.zeros(1, dtype=torch.int64, device=device)
    if seqs_out > n:  # zero-length tail sequences repeat (T, NT)
        cu_seqlens[n + 1 : seqs_out + 1].copy_(num_tokens.expand(seqs_out - n))
        chunk_offsets[n + 1 : seqs_out + 1].copy_(num_chunks.expand(seqs_out - n))
    if rows_out == 0:
        return
    rows = torch.arange(rows_out, dtype=torch.int64, device=device)
    if n:
        # the number of sequences whose chunks end at or before the row
        seq = torch.searchsorted(chunk_ends, rows, right=True)
        first_row = (chunk_ends - seq_chunks)[seq.clamp(max=n - 1)]
        chunk = rows - first_row
    else:
        seq = chunk = rows
    real = rows < num_chunks
    chunk_indices[:rows_out, 0].copy_(torch.where(real, seq, layout.pad_seq))
    chunk_indices[:rows_out, 1].copy_(torch.where(real, chunk, layout.pad_chunk))


def segment_chunks_torch(positions: torch.Tensor, lengths: torch.Tensor, shift: int) -> torch.Tensor:
    """``chunkmeta.fill.step_fill.segment_chunks`` in torch ops (int64)."""
    full = ((positions + lengths - 1) >> shift) - (positions >> shift) + 1
    mid = (positions & ((1 << shift) - 1)) != 0
    return torch.where(lengths > 0, full, mid.to(torch.int64))


@torch.inference_mode()
def fill_entry_torch(
    entry,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    checkpoint_offsets: torch.Tensor,
    regions: tuple,
    first_seq: int,
    num_seqs: int,
    num_rows: int,
    padded: bool,
) -> None:
    """One entry of ``chunkmeta.fill.step_fill.step_tables_kernel``, writing what it writes
    (``regions``: the entry's region tensors at ``off0 .. off3``, None where unused)."""
    kind, shift, _, base_kind, flag, _, _, _, _, seqs_pad, pad0, pad1 = entry
    n = num_seqs
    seqs_out = seqs_pad if padded and seqs_pad >= 0 else n  # below 0: a bounded build's (SEQS_EXACT)
    if kind == FLA:
        cu, indices, offsets = regions[0], regions[1].view(-1, 2), regions[2]
        fill_torch(
            query_start_loc, cu, indices, offsets, first_seq, n, 1 << shift, Layout(seqs_out, num_rows, pad0, pad1)
        )
        if flag & FLA_WRITE_FIRST:
            cu[0] = 0
            offsets[0] = 0
        return
    device = query_start_loc.device
    segment = query_start_loc[first_seq : first_seq + n + 1].to(torch.int64)
    lengths = segment[1:] - segment[:-1]
    if base_kind == BASE_ZERO:
        positions = torch.zeros_like(lengths)
    elif base_kind == BASE_PACKED:
        positions = segment[:-1] - segment[0]
    else:
        positions = num_computed_tokens[first_seq : first_seq + n].to(torch.int64)
    first_chunks = segment_chunks_torch(positions, lengths, shift)
    counts = first_chunks
    checkpoints = kind == MAMBA2 and flag
    if checkpoints:
        checkpoint = checkpoint_offsets[first_seq : first_seq + n].to(torch.int64)
        split = checkpoint > 0
        first_chunks = torch.where(split, segment_chunks_torch(positions, checkpoint, shift), first_chunks)
        counts = torch.where(
            split, first_chunks + segment_chunks_torch(positions + checkpoint, lengths - checkpoint, shift), counts
        )
    chunk_ends = torch.cumsum(counts, 0)
    num_chunks = chunk_ends[-1:] if n else torch.zeros(1, dtype=torch.int64, device=device)
    tail = seqs_out - n
    if kind == MAMBA2:
        last = regions[2]
        last[:n].copy_(chunk_ends - 1)
        last[n:seqs_out].copy_((num_chunks - 1).expand(tail))
        if checkpoints:
            marks = torch.where(split, chunk_ends - counts + first_chunks - 1, 0)
            regions[3][:n].copy_(marks)
            regions[3][n:seqs_out].zero_()
    if kind == LOGICAL and flag:
        regions[2][:n].copy_(num_computed_tokens[first_seq : first_seq + n] > 0)
        regions[2][n:seqs_out].zero_()
    if num_rows == 0:
        return
    rows = torch.arange(num_rows, dtype=torch.int64, device=device)
    real = rows < num_chunks
    if n:
        seq = torch.searchsorted(chunk_ends, rows, right=True).clamp(max=n - 1)
        chunk = rows - (chunk_ends - counts)[seq]
    else:
        seq = chunk = torch.zeros_like(rows)
    if kind == CONV:
        if flag:
            table = regions[0].view(-1, 2)
            table[:num_rows, 0].copy_(torch.where(real, seq, pad0))
            table[:num_rows, 1].copy_(torch.where(real, chunk, pad1))
        else:
            regions[0][:num_rows].copy_(torch.where(real, seq, pad0))
            regions[1][:num_rows].copy_(torch.where(real, chunk, pad1))
        return
    if kind == TOKENS:
        regions[0][:num_rows].copy_(torch.where(real, seq, pad0))
        return
    if n == 0:
        row_pos = row_len = row_start = chunk
    else:
        row_start = segment[:-1][seq] - segment[0]
        row_len = lengths[seq]
        row_pos = positions[seq]
    if checkpoints and n:
        row_checkpoint = checkpoint[seq]
        row_first = first_chunks[seq]
        second = (row_checkpoint > 0) & (chunk >= row_first)
        seg_pos = torch.where(second, row_pos + row_checkpoint, row_pos)
        seg_len = torch.where(
            second, row_len - row_checkpoint, torch.where(row_checkpoint > 0, row_checkpoint, row_len)
        )
        seg_chunk = torch.where(second, chunk - row_first, chunk)
    else:
        seg_pos, seg_len, seg_chunk = row_pos, row_len, chunk
    boundary = seg_pos >> shift
    start = torch.where(seg_chunk == 0, seg_pos, (boundary + seg_chunk) << shift)
    end = torch.minimum((boundary + seg_chunk + 1) << shift, seg_pos + seg_len)
    if kind == MAMBA2:
        num_tokens = segment[-1:] - segment[0]
        regions[0][1 : num_rows + 1].copy_(torch.where(real, row_start + end - row_pos, num_tokens))
        regions[1][:num_rows].copy_(torch.where(real, seq, pad0))
    else:
        regions[0][:num_rows].copy_(torch.where(real, start >> shift, pad0))
        regions[1][:num_rows].copy_(torch.where(real, start & ((1 << shift) - 1), pad1))
