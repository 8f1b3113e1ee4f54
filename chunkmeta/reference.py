"""The test oracle: FLA's chunk metadata contract, written as plainly as possible.

Lists in, lists out, loops only. Nothing here is fast and nothing here is clever; every other
implementation is checked against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Reference(NamedTuple):
    cu_seqlens: list[int]
    chunk_indices: list[tuple[int, int]]
    chunk_offsets: list[int]
    num_seqs: int
    num_tokens: int
    num_chunks: int
    max_seqlen: int


def chunk_metadata(
    query_start_loc: Sequence[int], chunk_size: int, first_seq: int = 0, num_seqs: int | None = None
) -> Reference:
    """FLA's (>= 0.5.1) cu_seqlens / chunk_indices / chunk_offsets for one prefill slice."""
    query_start_loc = [int(v) for v in query_start_loc]
    if num_seqs is None:
        num_seqs = len(query_start_loc) - 1 - first_seq
    start = query_start_loc[first_seq]
    cu_seqlens = [query_start_loc[first_seq + i] - start for i in range(num_seqs + 1)]

    chunk_indices = []
    chunk_offsets = [0]
    for i in range(num_seqs):
        length = cu_seqlens[i + 1] - cu_seqlens[i]
        num_chunks = (length + chunk_size - 1) // chunk_size
        for t in range(num_chunks):
            chunk_indices.append((i, t))
        chunk_offsets.append(chunk_offsets[-1] + num_chunks)

    lengths = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(num_seqs)]
    return Reference(
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
        num_seqs=num_seqs,
        num_tokens=cu_seqlens[-1],
        num_chunks=len(chunk_indices),
        max_seqlen=max(lengths, default=0),
    )


def padded_chunk_metadata(
    query_start_loc: Sequence[int],
    chunk_size: int,
    padded_num_seqs: int,
    padded_num_rows: int,
    pad_seq: int,
    first_seq: int = 0,
    num_seqs: int | None = None,
    pad_chunk: int = 0,
) -> Reference:
    """The padded layouts (CUDA graphs, and bounded rows): the exact metadata, then zero-length
    tail sequences up to ``padded_num_seqs`` and padding rows ``(pad_seq, pad_chunk)`` up to
    ``padded_num_rows``."""
    exact = chunk_metadata(query_start_loc, chunk_size, first_seq, num_seqs)
    tail = padded_num_seqs - exact.num_seqs
    rows = padded_num_rows - exact.num_chunks
    return exact._replace(
        cu_seqlens=exact.cu_seqlens + [exact.num_tokens] * tail,
        chunk_indices=exact.chunk_indices + [(pad_seq, pad_chunk)] * rows,
        chunk_offsets=exact.chunk_offsets + [exact.num_chunks] * tail,
    )
