"""The device fill in vectorized torch ops: CPU tensors, and devices without Triton.

Writes exactly the entries ``chunkmeta.fill.triton_fill.chunk_metadata_kernel`` writes.
"""

from __future__ import annotations

import torch


def fill_torch(query_start_loc: torch.Tensor, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor,
               chunk_offsets: torch.Tensor, first_seq: int, num_seqs: int, num_chunks: int, chunk_size: int,
               padded: bool = False, seqs_out: int = 0, num_rows: int = 0, pad_seq: int = 0) -> None:
    """The same fill in vectorized torch ops (CPU tensors, or devices without Triton).

    Writes the same entries as the kernel. ``num_chunks`` (NT) comes from the host plan: it sizes
    ``repeat_interleave``'s output, which is what keeps this free of a device sync.
    """
    device = query_start_loc.device
    segment = query_start_loc[first_seq: first_seq + num_seqs + 1]
    cu = segment - segment[0]
    seq_chunks = torch.div(cu[1:] - cu[:-1] + (chunk_size - 1), chunk_size, rounding_mode="floor")
    chunk_ends = torch.cumsum(seq_chunks, 0)
    cu_seqlens[1: num_seqs + 1].copy_(cu[1:])
    chunk_offsets[1: num_seqs + 1].copy_(chunk_ends)
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), seq_chunks, output_size=num_chunks)
    chunk = torch.arange(num_chunks, device=device) - (chunk_ends - seq_chunks)[seq]
    chunk_indices[:num_chunks, 0].copy_(seq)
    chunk_indices[:num_chunks, 1].copy_(chunk)
    if padded:
        cu_seqlens[num_seqs + 1: seqs_out + 1].copy_(cu[-1])
        chunk_offsets[num_seqs + 1: seqs_out + 1].fill_(num_chunks)
        chunk_indices[num_chunks:num_rows, 0].fill_(pad_seq)
        chunk_indices[num_chunks:num_rows, 1].fill_(0)
