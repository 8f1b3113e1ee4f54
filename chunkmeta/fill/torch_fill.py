"""The device fill in vectorized torch ops: CPU tensors, and devices without Triton.

Writes exactly the entries ``chunkmeta.fill.triton_fill.chunk_metadata_kernel`` writes, for
every layout (``chunkmeta.layout``), from the device ``query_start_loc`` and host sizes only.
A row's sequence is found with ``searchsorted`` over the chunk ends, so no op's output size
depends on device values: nothing here synchronizes, and the bounded layout, whose NT the host
does not know, works as the others do.
"""

from __future__ import annotations

import torch

from chunkmeta.layout import Layout


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
