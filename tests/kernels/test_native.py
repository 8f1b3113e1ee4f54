"""ChunkMetadataBuilder's C build (chunkmeta.native's step build of one Fla table) against the
Python plan and the reference, on the host.

A CPU builder's C build does what a CUDA builder's does except the launch: every validation check,
the sizes, the host ``cu_seqlens_cpu``, the ring's claim and publish and the ``ChunkMetadata``; its
fill is the step kernel's logic in C (``cpu_fill_entry``). On a GPU the C build launches the kernel
instead (tests/core/test_gpu.py checks the device tables). Invalid input must take the general path
(which raises the precise error) and change nothing.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkmeta import ChunkMetadata, ChunkMetadataBuilder, ChunkMetaError, jit, layout, native, plan, reference
from strategies import host_offsets


def why_not_compiled() -> str:
    if not jit.enabled(native.SWITCH):
        return "CHUNKMETA_NATIVE=0"
    return jit.missing_c_toolchain() or (
        "the host build did not compile or load (tests/core/test_plan.py::test_compiled_helper_is_built_here fails)"
    )


compiled = native.module()
pytestmark = pytest.mark.skipif(compiled is None, reason=why_not_compiled())

SEQS, TOKENS = 8, 500
LAYOUTS = [None, *layout.PADS]


def build(builder, pad, qsl, qsl_cpu, first_seq=0, num_seqs=None):
    kw = dict(first_seq=first_seq, num_seqs=num_seqs)
    return builder.build(qsl, qsl_cpu, **kw) if pad is None else builder.build_padded(qsl, qsl_cpu, pad=pad, **kw)


def expected(builder, pad, host, first_seq, num_seqs):
    n = host.shape[0] - 1 - first_seq if num_seqs is None else num_seqs
    if pad is None:
        return reference.chunk_metadata(host.tolist(), 64, first_seq, n)
    pad_seq, pad_chunk = layout.padding_row(pad, SEQS)
    return reference.padded_chunk_metadata(
        host.tolist(), 64, builder.padded_num_seqs[pad], builder.capacity.rows, pad_seq, first_seq, n, pad_chunk
    )


@pytest.fixture(scope="module")
def warm_builder():
    """A CPU builder whose every layout's C build is made (by a first build of each)."""
    builder = ChunkMetadataBuilder(SEQS, TOKENS, device="cpu", backend="torch", ring_depth=2)
    for dtype in (torch.int32, torch.int64):
        q = torch.tensor([0, 5, 70], dtype=dtype)
        for pad in LAYOUTS:
            build(builder, pad, q, q)
    assert set(builder.native_kernel.values()) == {"c"}, builder.native_kernel
    return builder


@settings(max_examples=400, deadline=None)
@given(host=host_offsets(max_seqs=12), pad=st.sampled_from(LAYOUTS), data=st.data())
def test_c_build_matches_the_plan(warm_builder, host, pad, data):
    builder = warm_builder
    first_seq = data.draw(st.integers(-1, host.shape[0]))
    num_seqs = data.draw(st.one_of(st.none(), st.integers(0, host.shape[0]), st.sampled_from([2**63 - 1, 2**64])))
    tensor = torch.from_numpy(host)
    good = torch.tensor([0, 5, 70], dtype=tensor.dtype)
    newest = build(builder, pad, good, good)  # a live result to keep
    before = builder.builds - 1
    try:
        plan.plan_step(host, first_seq, num_seqs, 64, builder.capacity, None)
    except ChunkMetaError:
        with pytest.raises(ChunkMetaError):
            build(builder, pad, tensor, tensor, first_seq, num_seqs)
        assert builder.builds == before + 1 and newest.is_live  # nothing changed
        return
    md = build(builder, pad, tensor, tensor, first_seq, num_seqs)
    ref = expected(builder, pad, host, first_seq, num_seqs)
    assert type(md) is ChunkMetadata and md.generation == builder.builds == before + 2
    assert (md.num_seqs, md.num_tokens, md.num_chunks, md.padding) == (
        ref.num_seqs,
        ref.num_tokens,
        ref.num_chunks,
        pad,
    )
    assert md.cu_seqlens.tolist() == ref.cu_seqlens == md.cu_seqlens_cpu.tolist()
    assert md.chunk_offsets.tolist() == ref.chunk_offsets
    assert [tuple(r) for r in md.chunk_indices.tolist()] == ref.chunk_indices


@pytest.mark.parametrize(
    "first_seq, num_seqs",
    [(True, None), (np.int64(0), None), (0.0, None), (0, False), (0, np.int32(1)), (0, -1), (0, 1.0)],
)
def test_odd_arguments_take_the_general_path(warm_builder, first_seq, num_seqs):
    """Only exact ints (and None for num_seqs), num_seqs >= 0, are taken by the C build; the
    general path checks the rest, as it would have."""
    q = torch.tensor([0, 5], dtype=torch.int32)
    try:
        want = plan.plan_step(q.numpy(), first_seq, num_seqs, 64, warm_builder.capacity, None)
    except (ChunkMetaError, TypeError):
        with pytest.raises(ChunkMetaError):
            warm_builder.build(q, q, first_seq=first_seq, num_seqs=num_seqs)
        return
    assert warm_builder.build(q, q, first_seq=first_seq, num_seqs=num_seqs).num_seqs == want.num_seqs


def test_results_are_frozen_leased_and_fresh_where_fla_needs_it():
    """The objects the C build makes: frozen and leased by the ring; cu_seqlens / cu_seqlens_cpu
    new objects every build (FLA memoizes its helpers by argument identity), the rest views."""
    import attrs

    builder = ChunkMetadataBuilder(SEQS, TOKENS, device="cpu", ring_depth=2)
    q = torch.tensor([3, 3, 70, 200], dtype=torch.int64)
    first = builder.build(q, q)
    again, last = builder.build(q, q), builder.build(q, q)
    assert (last.num_seqs, last.num_tokens, last.num_chunks, last.max_seqlen, last.generation) == (3, 197, 5, 130, 3)
    assert last.cu_seqlens is not first.cu_seqlens and last.cu_seqlens_cpu is not first.cu_seqlens_cpu
    assert last.cu_seqlens.data_ptr() == first.cu_seqlens.data_ptr()  # ring_depth 2: the same slot
    assert not first.is_live and again.is_live and last.check_live() is last and "N=3 T=197 NT=5" in repr(last)
    with pytest.raises(ChunkMetaError, match="rebuilt by build 3"):
        first.check_live()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        last.num_seqs = 4


def test_a_failed_launch_turns_the_c_build_off_for_that_layout(monkeypatch):
    """A C build whose launch fails (a CUresult) takes the general path, and so do that
    layout's later builds: a kernel that cannot launch is not retried every step."""
    builder = ChunkMetadataBuilder(SEQS, TOKENS, device="cpu")
    q = torch.tensor([0, 5, 70, 70, 200], dtype=torch.int32)
    builder.build(q, q)  # makes the exact layout's C build
    steps = builder.step_builder()
    returned = []

    class FailingOnce:
        def __getattr__(self, name):
            return getattr(compiled, name)

        def step(self, *args):
            made = 700 if not returned else compiled.step(*args)  # CUDA_ERROR_ILLEGAL_ADDRESS, say
            returned.append(made)
            return made

    monkeypatch.setattr(steps, "_native", FailingOnce())
    ref = reference.chunk_metadata(q.tolist(), 64)
    for _ in range(3):
        md = builder.build(q, q)
        assert [tuple(r) for r in md.chunk_indices.tolist()] == ref.chunk_indices
    assert returned == [700, -1, -1]  # then no capsule for that layout: the general path
    assert builder.native_kernel[(None, torch.int32)] is None
