"""chunkmeta equals fla-core's own prepare_chunk_indices / prepare_chunk_offsets (values and dtypes).

fla-core 0.6.0 is a test dependency; FLA's helpers are plain torch ops on CPU tensors.
"""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checks import tensors_for
from chunkmeta import ChunkMetadataBuilder, build_chunk_metadata
from chunkmeta.workloads import from_lengths
from strategies import CHUNK_SIZES, batches

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FLA warns that it falls back to CPU on a machine without a GPU
    fla_index = pytest.importorskip("fla.ops.utils.index")


def fla_metadata(batch, chunk_size):
    """What FLA derives itself from the rebased device cu_seqlens (a fresh tensor: FLA caches
    results by tensor identity)."""
    q = batch.query_start_loc
    cu = torch.tensor(
        [q[batch.first_seq + i] - q[batch.first_seq] for i in range(batch.num_seqs + 1)], dtype=torch.int32
    )
    return cu, fla_index.prepare_chunk_indices(cu, chunk_size), fla_index.prepare_chunk_offsets(cu, chunk_size)


def assert_same_as_fla(md, batch, chunk_size):
    cu, indices, offsets = fla_metadata(batch, chunk_size)
    for ours, theirs in ((md.cu_seqlens, cu), (md.chunk_indices, indices), (md.chunk_offsets, offsets)):
        assert ours.dtype == theirs.dtype
        assert ours.shape == theirs.shape
        assert torch.equal(ours.cpu(), theirs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk_size=CHUNK_SIZES)
def test_equals_fla(backend, data, chunk_size):
    batch = data.draw(batches(chunk_size))
    builder = ChunkMetadataBuilder(64, 64 * 700, chunk_size=chunk_size, device="cpu", backend=backend)
    md = builder.build(*tensors_for(batch), first_seq=batch.first_seq, num_seqs=batch.num_seqs)
    assert_same_as_fla(md, batch, chunk_size)


@pytest.mark.parametrize(
    "lengths", [[128, 256], [128, 257], [300], [1, 64, 65, 129], [0, 64], [0, 0], [], [200_000], [0, 5, 0, 200_000, 0]]
)
def test_equals_fla_on_named_cases(lengths):
    batch = from_lengths(lengths)
    for backend in ("torch", "triton"):
        md = build_chunk_metadata(*tensors_for(batch), backend=backend)
        assert_same_as_fla(md, batch, 64)
