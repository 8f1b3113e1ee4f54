"""The Triton step kernel's FLA entry at block sizes far below the launchers' defaults, so that
program boundaries fall everywhere: on a sequence's first chunk, inside a long sequence, right
after zero-length sequences, at the last row. On CPU this runs under Triton's interpreter;
tests/core/test_gpu.py runs the default shapes on CUDA."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkmeta import reference, tables
from chunkmeta.workloads import from_lengths
from strategies import CHUNK_SIZES, batches

pytest.importorskip("triton")

from chunkmeta.fill.step_fill import StepFill

CAPACITY = 64


def run_fill(batch, chunk_size, block_rows, padded, pad_seq=0, scan_cols=1, capacity=CAPACITY, num_warps=1):
    qsl = torch.tensor(batch.query_start_loc, dtype=torch.int64)
    ref = reference.chunk_metadata(batch.query_start_loc, chunk_size, batch.first_seq, batch.num_seqs)
    # the builder's padded sequence counts: max_num_seqs + 1 ("tail"), max_num_seqs ("negative")
    seqs_out = (capacity if pad_seq < 0 else capacity + 1) if padded else ref.num_seqs
    rows_out = ref.num_chunks + 2 * (block_rows or 256) + 3 if padded else ref.num_chunks
    # one arena: cu_seqlens, chunk_offsets, chunk_indices, each with room past its sizes. Stale
    # values from an earlier step must not leak into this one, and nothing past the sizes may
    # be written
    seq_bytes, row_bytes = 8 * (capacity + 4), 8 * (rows_out + 5)
    arena = torch.zeros(3 * seq_bytes + row_bytes, dtype=torch.uint8)
    cu = arena[:seq_bytes].view(torch.int32)[: capacity + 4]
    offsets = arena[seq_bytes : 2 * seq_bytes].view(torch.int64)
    indices = arena[2 * seq_bytes : 2 * seq_bytes + row_bytes].view(torch.int32).view(-1, 2)
    cu.fill_(7)
    cu[0] = 0
    offsets.fill_(7)
    offsets[0] = 0
    indices.fill_(99)
    entry = tables.Entry(
        tables.FLA,
        chunk_size.bit_length() - 1,
        0,
        tables.BASE_ZERO,
        tables.FLA_OFFSETS_64,
        0,
        2 * seq_bytes,
        seq_bytes,
        tables.UNUSED,
        seqs_out,
        pad_seq,
        0,
    )
    fill = StepFill(
        entries=(entry,),
        block_seqs=capacity,
        padded=padded,
        block_rows=block_rows,
        num_warps=num_warps,
        scan_cols=scan_cols,
    )
    ints = (batch.first_seq, ref.num_seqs, 0, rows_out, 0, 0, 0, 0, 0)
    fill(qsl, qsl, qsl, arena, ints)
    if padded:
        ref = reference.padded_chunk_metadata(
            batch.query_start_loc, chunk_size, seqs_out, rows_out, pad_seq, batch.first_seq, batch.num_seqs
        )
    assert cu[: seqs_out + 1].tolist() == ref.cu_seqlens
    assert offsets[: seqs_out + 1].tolist() == ref.chunk_offsets
    assert [tuple(r) for r in indices[:rows_out].tolist()] == ref.chunk_indices
    assert indices[rows_out:].eq(99).all(), "a row past num_rows was written"
    assert cu[seqs_out + 1 :].eq(7).all() and offsets[seqs_out + 1 :].eq(7).all(), "an entry past seqs_out was written"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    chunk_size=CHUNK_SIZES,
    block_rows=st.sampled_from([1, 2, 4, 16]),
    scan_cols=st.sampled_from([1, 2, 8, CAPACITY]),
)
def test_exact_layout_at_every_program_boundary(data, chunk_size, block_rows, scan_cols):
    """Every scan tile shape too: one column (a 1-D scan) up to one row of all 64 lanes."""
    batch = data.draw(batches(chunk_size, max_requests=CAPACITY, max_len=200))
    run_fill(batch, chunk_size, block_rows, padded=False, scan_cols=scan_cols)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    chunk_size=CHUNK_SIZES,
    block_rows=st.sampled_from([1, 4, 8]),
    pad_seq=st.sampled_from([-1, CAPACITY]),
    scan_cols=st.sampled_from([1, 4]),
)
def test_padded_layout_at_every_program_boundary(data, chunk_size, block_rows, pad_seq, scan_cols):
    batch = data.draw(batches(chunk_size, max_requests=CAPACITY, max_len=200))
    run_fill(batch, chunk_size, block_rows, padded=True, pad_seq=pad_seq, scan_cols=scan_cols)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_rows=st.sampled_from([1, 2, 8, 64]),
    num_warps=st.sampled_from([1, 2, 4]),
    scan_cols=st.sampled_from([1, 2]),
    padded=st.booleans(),
)
def test_three_phase_search_with_row_groups(data, block_rows, num_warps, scan_cols, padded):
    """256 lanes as 128-256 scan tile rows: the row search runs all three phases (64 coarse
    ends per row group, then the tile ends, then the keys), with the rows split into 1-4 groups."""
    batch = data.draw(batches(64, max_requests=256, max_len=100))
    run_fill(
        batch,
        64,
        block_rows,
        padded,
        pad_seq=256 if padded else 0,
        scan_cols=scan_cols,
        capacity=256,
        num_warps=num_warps,
    )


@pytest.mark.parametrize("capacity", [200, 256, 1000, 1024, 2048])
@pytest.mark.parametrize("padded, pad_seq", [(False, 0), (True, -1), (True, None)])
def test_default_launch_shapes(capacity, padded, pad_seq):
    """The launchers' own defaults (up to 512 sequences: 256-row blocks, scan tile rows 16 wide,
    16 coarse ends of one tile row each; from 1024: 512-row blocks, 4 wide, 64 coarse ends of
    4-8 tile rows each), on batches from empty to full capacity."""
    import numpy as np

    from chunkmeta.workloads import random_decode_first, workload

    pad_seq = capacity if pad_seq is None else pad_seq
    rng = np.random.default_rng(capacity)
    for batch in (
        workload(capacity, 40 * capacity, seed=1),
        workload(capacity - 1, 3000, seed=2),
        random_decode_first(rng, capacity, 20 * capacity),
        from_lengths([]),
    ):
        run_fill(batch, 64, None, padded, pad_seq, scan_cols=None, capacity=capacity, num_warps=None)
