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


def cuda_activity(fn):
    """Kernels and memcpys/memsets the profiler sees on the device during fn()."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels, copies = [], []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        (copies if ("memcpy" in name or "memset" in name) else kernels).append(event.name)
    return kernels, copies


def must_not_run(engine: str, name: str):
    """A stand-in for an engine's own function that a test says is not called: it raises."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"{engine}'s own {name} ran")

    return refuse


@contextlib.contextmanager
def no_sync():
    """Any synchronizing CUDA call inside raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def assert_step_tables(step, builder, qsl, first_seq, num_seqs, computed=None, checkpoints=None):
    """Every table of a StepTables equals the reference for the batch (``qsl``: the host list;
    ``computed`` / ``checkpoints``: per-request lists), in the exact or the padded layout."""
    from chunkmeta import layout, tables

    num_requests = len(qsl) - 1
    padded = step.padded
    cap_seqs, cap_tokens = builder.capacity.seqs, builder.capacity.tokens
    assert step.names == tuple(builder.specs)
    # the prefill slice's sizes, real in the padded layout too
    assert (step.num_seqs, step.num_tokens) == (num_seqs, qsl[first_seq + num_seqs] - qsl[first_seq])
    for name, spec in builder.specs.items():
        table = step[name]
        if isinstance(spec, tables.Fla):
            first, n = (first_seq, num_seqs) if spec.rows == "prefill" else (0, num_requests)
            batch = Batch(list(qsl), first, n)
            if padded:
                rows = -(-cap_tokens // spec.chunk_size) + cap_seqs
                shape = layout.padded(builder.pad, cap_seqs, rows)
                assert_padded(table, batch, spec.chunk_size, shape.seqs_out, rows, shape.pad_seq, shape.pad_chunk)
            else:
                assert_exact(table, batch, spec.chunk_size)
            assert table.chunk_offsets.dtype == spec.offsets_dtype
        elif isinstance(spec, tables.Conv):
            first, n = (first_seq, num_seqs) if spec.rows == "prefill" else (0, num_requests)
            ref = reference.causal_conv1d_metadata(qsl[first : first + n + 1], spec.block_m)
            assert table.tot == ref.tot and table.num_rows == n
            pad = (-(-cap_tokens // spec.block_m) + cap_seqs - ref.tot) if padded else 0
            pairs = list(zip(ref.batch_ptr, ref.token_chunk_offset_ptr, strict=True))
            if spec.paired:
                assert table.batch_ptr is None and table.block_table.dtype == torch.int32
                assert [tuple(r) for r in table.block_table.cpu().tolist()] == pairs + [(-1, 0)] * pad
            else:
                assert table.block_table is None
                assert table.batch_ptr.dtype == table.token_chunk_offset_ptr.dtype == torch.int32
                assert table.batch_ptr.cpu().tolist() == ref.batch_ptr + [tables.PAD_SLOT_ID] * pad
                assert table.token_chunk_offset_ptr.cpu().tolist() == ref.token_chunk_offset_ptr + [-1] * pad
        elif isinstance(spec, tables.Mamba2):
            rows_computed = computed[first_seq : first_seq + num_seqs]
            ckpt = checkpoints[first_seq : first_seq + num_seqs] if spec.checkpoints else None
            ref = reference.mamba2_chunk_metadata(qsl, rows_computed, spec.chunk_size, first_seq, num_seqs, ckpt)
            assert (table.num_chunks, table.num_prefills, table.chunk_size) == (
                ref.num_chunks,
                num_seqs,
                spec.chunk_size,
            )
            assert table.prep_initial_states == ref.prep_initial_states
            pad = (spec._rows(cap_seqs, cap_tokens) - ref.num_chunks) if padded else 0
            seq_pad = (cap_seqs - num_seqs) if padded else 0
            tokens = ref.cu_chunk_seqlens[-1]
            assert table.cu_chunk_seqlens.cpu().tolist() == ref.cu_chunk_seqlens + [tokens] * pad
            assert table.seq_idx.cpu().tolist() == ref.seq_idx + [spec.seq_idx_pad] * pad
            assert table.last_chunk_indices.cpu().tolist() == ref.last_chunk_indices + [ref.num_chunks - 1] * seq_pad
            assert table.cu_chunk_seqlens.dtype == table.seq_idx.dtype == table.last_chunk_indices.dtype == torch.int32
            if ref.checkpoint_chunk_idx is None:
                assert table.checkpoint_chunk_idx is None
            else:
                assert table.checkpoint_chunk_idx.dtype == torch.int64
                assert table.checkpoint_chunk_idx.cpu().tolist() == ref.checkpoint_chunk_idx + [0] * seq_pad
        else:
            rows = [v - qsl[first_seq] for v in qsl[first_seq : first_seq + num_seqs + 1]]
            ref = reference.sglang_mamba2_mixed(rows, computed[first_seq : first_seq + num_seqs], spec.chunk_size)
            indices, offsets = reference.sglang_chunk_indices_offsets(rows, spec.chunk_size)
            assert (table.num_logical_chunks, table.num_prefills) == (len(indices), num_seqs)
            assert (table.num_prefill_tokens, table.prep_initial_states) == (
                ref.num_prefill_tokens,
                ref.prep_initial_states,
            )
            token_pad = (cap_tokens - ref.num_prefill_tokens) if padded else 0
            pad = (tables._ssd_rows(cap_tokens, cap_seqs, spec.chunk_size, 1) - len(indices)) if padded else 0
            seq_pad = (cap_seqs - num_seqs) if padded else 0
            assert table.seq_idx.cpu().tolist() == [ref.seq_idx[0] + [-1] * token_pad]
            assert table.chunk_indices.cpu().tolist() == indices + [-1] * pad
            assert table.chunk_offsets.cpu().tolist() == offsets + [0] * pad
            assert table.has_initial_states.dtype == torch.bool
            assert table.has_initial_states.cpu().tolist() == ref.has_initial_states + [False] * seq_pad
