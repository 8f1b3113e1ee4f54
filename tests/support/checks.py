"""Assertions shared by the test modules: a ChunkMetadata against the reference oracle, and the
no-sync check for GPU tests."""

import contextlib
import itertools

import torch

from chunkmeta import reference
from chunkmeta.workloads import Batch


def as_lists(md):
    """Device tensors to lists (tests only: this reads device memory)."""
    return (
        md.cu_seqlens.cpu().tolist(),
        [tuple(row) for row in md.chunk_indices.cpu().tolist()],
        md.chunk_offsets.cpu().tolist(),
    )


def assert_dtypes(md, device):
    assert md.cu_seqlens.dtype == torch.int32
    assert md.cu_seqlens_cpu.dtype == torch.int32
    assert md.chunk_indices.dtype == torch.int32
    assert md.chunk_offsets.dtype == torch.int64
    assert md.cu_seqlens_cpu.device.type == "cpu"
    for t in (md.cu_seqlens, md.chunk_indices, md.chunk_offsets):
        assert t.device.type == torch.device(device).type
    assert md.chunk_indices.dim() == 2 and md.chunk_indices.shape[1] == 2
    assert md.chunk_indices.is_contiguous() and md.cu_seqlens.is_contiguous() and md.chunk_offsets.is_contiguous()


def assert_exact(md, batch: Batch, chunk_size: int):
    """md equals reference.chunk_metadata for the batch: values, dtypes, shapes, host ints."""
    ref = reference.chunk_metadata(batch.query_start_loc, chunk_size, batch.first_seq, batch.num_seqs)
    cu, indices, offsets = as_lists(md)
    assert cu == ref.cu_seqlens
    assert indices == ref.chunk_indices
    assert offsets == ref.chunk_offsets
    assert md.cu_seqlens_cpu.tolist() == ref.cu_seqlens
    assert tuple(md.chunk_indices.shape) == (ref.num_chunks, 2)
    assert (md.num_seqs, md.num_tokens, md.num_chunks, md.max_seqlen) == (
        ref.num_seqs,
        ref.num_tokens,
        ref.num_chunks,
        ref.max_seqlen,
    )
    assert md.chunk_size == chunk_size and not md.padded
    lengths = [b - a for a, b in itertools.pairwise(ref.cu_seqlens)]
    assert md.is_aligned == all(n % chunk_size == 0 for n in lengths)
    non_empty = [n for n in lengths if n]
    assert md.single_seqlen == (non_empty[0] if len(non_empty) == 1 else None)


def assert_padded(
    md, batch: Batch, chunk_size: int, padded_num_seqs: int, num_rows: int, pad_seq: int, pad_chunk: int = 0
):
    """md equals the padded reference: real rows first, then (pad_seq, pad_chunk); zero-length
    tails; and padding rows that no FLA kernel reads tokens for."""
    ref = reference.padded_chunk_metadata(
        batch.query_start_loc,
        chunk_size,
        padded_num_seqs,
        num_rows,
        pad_seq,
        batch.first_seq,
        batch.num_seqs,
        pad_chunk,
    )
    cu, indices, offsets = as_lists(md)
    assert cu == ref.cu_seqlens
    assert indices == ref.chunk_indices
    assert offsets == ref.chunk_offsets
    assert md.padded
    if md.bounded:
        assert md.cu_seqlens_cpu is None and md.num_seqs == ref.num_seqs and md.num_chunks >= ref.num_chunks
        assert md.num_tokens >= ref.num_tokens and md.max_seqlen >= ref.max_seqlen
    else:
        assert md.cu_seqlens_cpu.tolist() == ref.cu_seqlens
        assert (md.num_seqs, md.num_tokens, md.num_chunks) == (ref.num_seqs, ref.num_tokens, ref.num_chunks)
    if len(indices) > ref.num_chunks:
        assert_harmless_padding(cu, pad_seq, pad_chunk, chunk_size, md.num_seqs)


def assert_harmless_padding(cu, pad_seq: int, pad_chunk: int, chunk_size: int, num_seqs: int):
    """A padding row points at a zero-length sequence, at a chunk past the end of its sequence,
    or is (-1, 0) (FLA KDA's use_graph rows): never at tokens of a real sequence."""
    if pad_seq < 0:
        assert (pad_seq, pad_chunk) == (-1, 0)
    elif pad_chunk == 0:  # a zero-length sequence of the padded cu_seqlens
        assert pad_seq >= num_seqs and cu[pad_seq] == cu[pad_seq + 1]
    else:
        assert pad_chunk * chunk_size >= cu[pad_seq + 1] - cu[pad_seq]


def tensors_for(batch: Batch, device="cpu", dtype=torch.int32):
    qsl_cpu = torch.tensor(batch.query_start_loc, dtype=dtype)
    return qsl_cpu.to(device), qsl_cpu


@contextlib.contextmanager
def no_sync():
    """Any synchronizing CUDA call inside raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
