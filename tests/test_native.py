"""The C build (chunkmeta.native.build) against the Python plan, on the host side.

On a GPU the C build also launches the kernel (tests/test_gpu.py checks the device tables); here
a fill with function 0 runs everything else: every validation check, the sizes it returns and
the host ``cu_seqlens_cpu`` it writes. Invalid input must return -1 and write nothing.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkmeta import ChunkMetaError, native, plan

compiled = native.module()
pytestmark = pytest.mark.skipif(compiled is None, reason="no C compiler / Python headers")

CAP = plan.capacity_for(8, 500, 64)
SENTINEL = -7


def host_only_fill(cu_host: torch.Tensor, padded_seqs: int | None):
    seqs_out = -1 if padded_seqs is None else padded_seqs
    rows_out = -1 if padded_seqs is None else CAP.rows
    slots = [(0, 0, 0, cu_host[k].data_ptr()) for k in range(cu_host.shape[0])]
    return compiled.make_fill(0, 256, 4, 0, 6, CAP.seqs, CAP.tokens, CAP.rows, seqs_out, rows_out, 0, 0, slots)


@settings(max_examples=400, deadline=None)
@given(
    lengths=st.lists(st.integers(-2, 200), min_size=0, max_size=12),
    start=st.sampled_from([0, 3, -1]),
    dtype=st.sampled_from([np.int32, np.int64]),
    padded=st.booleans(),
    data=st.data(),
)
def test_c_build_matches_the_plan(lengths, start, dtype, padded, data):
    host = np.array([start] + [start + int(v) for v in np.cumsum(lengths)], dtype=dtype)
    first_seq = data.draw(st.integers(-1, len(lengths) + 1))
    num_seqs = data.draw(st.one_of(st.none(), st.integers(0, len(lengths) + 1)))
    slot = data.draw(st.integers(0, 1))
    padded_seqs = CAP.seqs + 1 if padded else None
    cu_host = torch.full((2, CAP.seqs + 2), SENTINEL, dtype=torch.int32)
    fill = host_only_fill(cu_host, padded_seqs)
    result = compiled.build(fill, plan.host_address(host), host.shape[0], host.itemsize == 8, first_seq,
                            -1 if num_seqs is None else num_seqs, 0, slot, 0)
    try:
        step = plan.plan_step(host, first_seq, num_seqs, 64, CAP, None)
    except ChunkMetaError:
        assert result == -1
        assert (cu_host == SENTINEL).all()  # nothing written
        return
    assert result == (step.num_seqs, step.num_tokens, step.num_chunks, step.max_seqlen)
    n = step.num_seqs
    expected = (step.segment - step.segment[0]).tolist()
    if padded:
        expected += [step.num_tokens] * (padded_seqs - n)
    assert cu_host[slot, : len(expected)].tolist() == expected
    assert (cu_host[slot, len(expected):] == SENTINEL).all() and (cu_host[1 - slot] == SENTINEL).all()


def test_c_build_rejects_a_slot_outside_the_ring():
    cu_host = torch.zeros(2, CAP.seqs + 2, dtype=torch.int32)
    host = np.array([0, 5], dtype=np.int32)
    assert compiled.build(host_only_fill(cu_host, None), plan.host_address(host), 2, False, 0, -1, 0, 2, 0) == -1


def test_cpu_builders_do_not_use_the_c_launch():
    """The C launch is for CUDA builders; CPU builders keep the torch fill."""
    from chunkmeta import ChunkMetadataBuilder

    builder = ChunkMetadataBuilder(4, 256, device="cpu")
    assert builder._native is None
