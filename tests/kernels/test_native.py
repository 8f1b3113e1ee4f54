"""The C build (chunkmeta.native.build) against the Python plan, on the host side.

On a GPU the C build also launches the kernel (tests/core/test_gpu.py checks the device tables); here
a fill with function 0 runs everything else: every validation check, the sizes it returns and
the host ``cu_seqlens_cpu`` it writes, and the ``ChunkMetadata`` it returns. Invalid input must
return -1 and write nothing.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkmeta import ChunkMetadata, ChunkMetaError, jit, native, plan
from strategies import host_offsets


def why_not_compiled() -> str:
    if not jit.enabled(native.SWITCH):
        return "CHUNKMETA_NATIVE=0"
    return jit.missing_c_toolchain() or (
        "the host build did not compile or load (tests/core/test_plan.py::test_compiled_helper_is_built_here fails)"
    )


compiled = native.module()
pytestmark = pytest.mark.skipif(compiled is None, reason=why_not_compiled())

CAP = plan.capacity_for(8, 500, 64)
SENTINEL = -7


def host_only_fill(cu_host: torch.Tensor, padded_seqs: int | None):
    seqs_out = -1 if padded_seqs is None else padded_seqs
    rows_out = -1 if padded_seqs is None else CAP.rows
    slots = [(0, 0, 0, cu_host[k].data_ptr()) for k in range(cu_host.shape[0])]
    return compiled.make_fill(
        0,
        256,
        4,
        0,
        6,
        CAP.seqs,
        CAP.tokens,
        CAP.rows,
        seqs_out,
        rows_out,
        0,
        0,
        slots,
        None if padded_seqs is None else "tail",
    )


class Views:
    """A builder's view caches, as the C build uses them."""

    def __init__(self):
        self.seq_cache, self.row_cache, self.asked = {}, {}, []

    def cached_views(self, slot, seqs_out, rows_out):
        self.asked.append((slot, seqs_out, rows_out))
        cu, indices, offsets, cu_cpu = (torch.zeros(k) for k in (seqs_out + 1, rows_out, seqs_out + 1, seqs_out + 1))
        self.seq_cache[(slot, seqs_out)] = (cu, offsets, cu_cpu)
        self.row_cache[(slot, rows_out)] = indices
        return cu, indices, offsets, cu_cpu


def c_build(fill, host, first_seq, num_seqs, slot, views=None, generation=5, lease=None):
    views = views or Views()
    return compiled.build(
        fill,
        plan.host_address(host),
        host.shape[0],
        host.itemsize == 8,
        first_seq,
        num_seqs,
        0,
        slot,
        0,
        generation,
        lease,
        views.seq_cache,
        views.row_cache,
        views.cached_views,
    )


@settings(max_examples=500, deadline=None)
@given(host=host_offsets(max_seqs=12), padded=st.booleans(), data=st.data())
def test_c_build_matches_the_plan(host, padded, data):
    first_seq = data.draw(st.integers(-1, host.shape[0]))
    num_seqs = data.draw(
        st.one_of(st.none(), st.integers(0, host.shape[0]), st.sampled_from([2**63 - 1, 2**64]))
    )  # int64's edge, past it
    slot = data.draw(st.integers(0, 1))
    padded_seqs = CAP.seqs + 1 if padded else None
    cu_host = torch.full((2, CAP.seqs + 2), SENTINEL, dtype=torch.int32)
    fill = host_only_fill(cu_host, padded_seqs)
    views = Views()
    result = c_build(fill, host, first_seq, num_seqs, slot, views)
    try:
        step = plan.plan_step(host, first_seq, num_seqs, 64, CAP, None)
    except ChunkMetaError:
        assert result == -1
        assert (cu_host == SENTINEL).all()  # nothing written
        assert not views.asked
        return
    assert type(result) is ChunkMetadata
    assert (result.num_seqs, result.num_tokens, result.num_chunks, result.max_seqlen) == (
        step.num_seqs,
        step.num_tokens,
        step.num_chunks,
        step.max_seqlen,
    )
    assert (result.chunk_size, result.padding, result.generation, result._slot) == (
        64,
        "tail" if padded else None,
        5,
        slot,
    )
    seqs_out = padded_seqs if padded else step.num_seqs
    rows_out = CAP.rows if padded else step.num_chunks
    cu, cu_cpu, indices, offsets = (
        result.cu_seqlens,
        result.cu_seqlens_cpu,
        result.chunk_indices,
        result.chunk_offsets,
    )
    assert views.asked == [(slot, seqs_out, rows_out)]
    cached_cu, cached_offsets, cached_cu_cpu = views.seq_cache[(slot, seqs_out)]
    assert indices is views.row_cache[(slot, rows_out)] and offsets is cached_offsets
    # cu_seqlens and cu_seqlens_cpu: new objects over the cached views' memory (FLA memoizes its
    # helpers by argument identity)
    assert cu is not cached_cu and cu.data_ptr() == cached_cu.data_ptr() and cu.shape == cached_cu.shape
    assert cu_cpu is not cached_cu_cpu and cu_cpu.data_ptr() == cached_cu_cpu.data_ptr()
    # the same sizes again: from the caches (cached_views is not asked), cu_seqlens new again
    again = c_build(fill, host, first_seq, num_seqs, slot, views)
    assert views.asked == [(slot, seqs_out, rows_out)]
    assert again.chunk_indices is indices and again.chunk_offsets is offsets
    assert again.cu_seqlens is not cu and again.cu_seqlens_cpu is not cu_cpu
    n = step.num_seqs
    expected = (step.segment - step.segment[0]).tolist()
    if padded:
        expected += [step.num_tokens] * (padded_seqs - n)
    assert cu_host[slot, : len(expected)].tolist() == expected
    assert (cu_host[slot, len(expected) :] == SENTINEL).all() and (cu_host[1 - slot] == SENTINEL).all()


def test_c_build_rejects_a_slot_outside_the_ring():
    cu_host = torch.zeros(2, CAP.seqs + 2, dtype=torch.int32)
    host = np.array([0, 5], dtype=np.int32)
    assert c_build(host_only_fill(cu_host, None), host, 0, None, 2) == -1


@pytest.mark.parametrize(
    "first_seq, num_seqs",
    [(True, None), (np.int64(0), None), (0.0, None), (0, False), (0, np.int32(1)), (0, -1), (0, 1.0)],
)
def test_c_build_leaves_non_int_or_negative_arguments_to_the_general_path(first_seq, num_seqs):
    """Only exact ints (and None for num_seqs), num_seqs >= 0, are taken; the general path checks
    the rest."""
    cu_host = torch.full((2, CAP.seqs + 2), SENTINEL, dtype=torch.int32)
    assert c_build(host_only_fill(cu_host, None), np.array([0, 5], dtype=np.int32), first_seq, num_seqs, 0) == -1
    assert (cu_host == SENTINEL).all()


def test_c_built_metadata_is_a_frozen_chunk_metadata():
    """The object the C build makes behaves as the constructor's: frozen, leased, printable."""
    import attrs

    class Lease:
        live = True

        def is_live(self, slot, generation):
            return self.live

        def retired_message(self, slot, generation):
            return f"retired {slot} {generation}"

    cu_host = torch.zeros(2, CAP.seqs + 2, dtype=torch.int32)
    lease = Lease()
    md = c_build(
        host_only_fill(cu_host, None), np.array([3, 3, 70, 200], dtype=np.int64), 0, None, 1, generation=9, lease=lease
    )
    assert (md.num_seqs, md.num_tokens, md.num_chunks, md.max_seqlen, md.generation) == (3, 197, 5, 130, 9)
    assert md.is_live and md.check_live() is md and "N=3 T=197 NT=5" in repr(md)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        md.num_seqs = 4
    lease.live = False
    with pytest.raises(ChunkMetaError, match="retired 1 9"):
        md.check_live()


def test_cpu_builders_do_not_use_the_c_launch():
    """The C launch is for CUDA builders; CPU builders keep the torch fill."""
    from chunkmeta import ChunkMetadataBuilder

    builder = ChunkMetadataBuilder(4, 256, device="cpu")
    assert builder.c_build is None and builder.native_kernel == {}


class CountingNative:
    """The extension, counting the C builds that ran."""

    def __init__(self, module):
        self.module = module
        self.builds = 0

    def build(self, *args):
        self.builds += 1
        return self.module.build(*args)

    def make_fill(self, *args):
        return self.module.make_fill(*args)


def host_only_builder(monkeypatch, native_module, layouts):
    """A CPU builder whose C build (``native_module``) runs for ``layouts`` as on CUDA, with a
    host-only fill (function 0: nothing is launched); the device calls it makes are faked."""
    from chunkmeta import ChunkMetadataBuilder, layout

    builder = ChunkMetadataBuilder(8, 2000, device="cpu", backend="torch")
    builder.c_build = native.CBuild(native_module, builder.ring, 64, device_index=0, params_ptr=0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    host_only = [("triton", (0, 256, 4, 0))]  # function 0: the host side alone
    for pad in layouts:
        cap = builder.capacity
        shape = layout.Layout(-1, -1, 0, 0) if pad is None else layout.padded(pad, cap.seqs, cap.rows)
        builder.c_build.add_layout(pad, torch.int32, shape, host_only)
    return builder


def test_builder_hot_path_on_the_host(monkeypatch):
    """ChunkMetadataBuilder's C-build path (used on CUDA after the first build of a layout),
    driven on the CPU with host-only fills: the Python around the C call — sizes, host
    cu_seqlens_cpu, tensor shapes, ring generations, fallback on bad input — against the
    reference. (The device tables are not written without a launch; tests/core/test_gpu.py checks
    them on a GPU.)"""
    from chunkmeta import layout, reference
    from chunkmeta.workloads import random_decode_first

    counting = CountingNative(compiled)
    layouts = [None, "tail", "negative", "past_end"]
    builder = host_only_builder(monkeypatch, counting, layouts)
    rng = np.random.default_rng(3)
    kept = []
    for k in range(30):
        batch = random_decode_first(rng, 8, 1500)
        pad = layouts[k % len(layouts)]
        qsl_cpu = torch.tensor(batch.query_start_loc, dtype=torch.int32)
        qsl = qsl_cpu.clone()
        kw = dict(first_seq=batch.first_seq, num_seqs=batch.num_seqs)
        md = builder.build(qsl, qsl_cpu, **kw) if pad is None else builder.build_padded(qsl, qsl_cpu, pad=pad, **kw)
        if pad is None:
            ref = reference.chunk_metadata(batch.query_start_loc, 64, batch.first_seq, batch.num_seqs)
            assert tuple(md.chunk_indices.shape) == (ref.num_chunks, 2)
        else:
            pad_seq, pad_chunk = layout.padding_row(pad, builder.capacity.seqs)
            ref = reference.padded_chunk_metadata(
                batch.query_start_loc,
                64,
                builder.padded_num_seqs[pad],
                builder.capacity.rows,
                pad_seq,
                batch.first_seq,
                batch.num_seqs,
                pad_chunk,
            )
            assert tuple(md.chunk_indices.shape) == (builder.capacity.rows, 2)
        assert md.cu_seqlens_cpu.tolist() == ref.cu_seqlens
        assert md.cu_seqlens.shape[0] == md.chunk_offsets.shape[0] == len(ref.cu_seqlens)
        assert (md.num_seqs, md.num_tokens, md.num_chunks, md.padding) == (
            ref.num_seqs,
            ref.num_tokens,
            ref.num_chunks,
            pad,
        )
        assert md.generation == builder.builds == k + 1
        # new cu_seqlens objects every build (FLA memoizes its helpers by argument identity)
        assert all(md.cu_seqlens is not old.cu_seqlens and md.cu_seqlens_cpu is not old.cu_seqlens_cpu for old in kept)
        kept.append(md)
    assert counting.builds == 30
    assert [md.is_live for md in kept[-builder.ring_depth - 1 :]] == [False] + [True] * builder.ring_depth
    # bad input: the C build refuses, the general path raises, nothing changes
    bad_cpu = torch.tensor([0, 10, 5], dtype=torch.int32)
    with pytest.raises(ChunkMetaError, match="decreasing"):
        builder.build(bad_cpu.clone(), bad_cpu)
    assert counting.builds == 31 and builder.builds == 30 and kept[-1].is_live


def test_failed_launch_turns_the_c_build_off_for_that_layout(monkeypatch):
    """A C build whose launch fails (a CUresult) takes the general path, and so do that
    layout's later builds: a kernel that cannot launch is not retried every step."""
    from chunkmeta import reference

    class FailingLaunch(CountingNative):
        def build(self, *args):
            self.builds += 1
            return 700  # CUDA_ERROR_ILLEGAL_ADDRESS, say

    failing = FailingLaunch(compiled)
    builder = host_only_builder(monkeypatch, failing, [None])
    assert builder.native_kernel[(None, torch.int32)] == "triton"
    qsl_cpu = torch.tensor([0, 5, 70, 70, 200], dtype=torch.int32)
    for _ in range(3):
        md = builder.build(qsl_cpu.clone(), qsl_cpu)
        ref = reference.chunk_metadata(qsl_cpu.tolist(), 64)
        assert md.chunk_indices.tolist() == [list(r) for r in ref.chunk_indices]
    assert failing.builds == 1
    assert builder.native_kernel[(None, torch.int32)] is None
