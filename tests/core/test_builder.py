"""Every backend and entry point equals the reference (and therefore FLA's contract)."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chunkmeta
from checks import assert_dtypes, assert_exact, assert_padded, tensors_for
from chunkmeta import ChunkMetadataBuilder, ChunkMetaError, build_chunk_metadata, layout
from chunkmeta.workloads import from_lengths, random_decode_first, workload
from strategies import CHUNK_SIZES, batches

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk_size=CHUNK_SIZES, dtype=st.sampled_from([torch.int32, torch.int64]))
def test_one_shot_equals_reference(backend, data, chunk_size, dtype):
    batch = data.draw(batches(chunk_size))
    qsl, qsl_cpu = tensors_for(batch, dtype=dtype)
    md = build_chunk_metadata(
        qsl, qsl_cpu, chunk_size=chunk_size, first_seq=batch.first_seq, num_seqs=batch.num_seqs, backend=backend
    )
    assert_dtypes(md, "cpu")
    assert_exact(md, batch, chunk_size)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk_size=CHUNK_SIZES)
def test_builder_equals_reference(backend, data, chunk_size):
    builder = ChunkMetadataBuilder(64, 64 * 700, chunk_size=chunk_size, device="cpu", backend=backend)
    for _ in range(3):  # several steps through one builder: slots rotate
        batch = data.draw(batches(chunk_size))
        qsl, qsl_cpu = tensors_for(batch)
        md = builder.build(qsl, qsl_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs)
        assert_exact(md, batch, chunk_size)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pad", layout.PADS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk_size=CHUNK_SIZES)
def test_padded_layout_equals_reference(backend, pad, data, chunk_size):
    builder = ChunkMetadataBuilder(48, 48 * 600, chunk_size=chunk_size, device="cpu", backend=backend)
    batch = data.draw(batches(chunk_size))
    qsl, qsl_cpu = tensors_for(batch)
    md = builder.build_padded(qsl, qsl_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs, pad=pad)
    padded_num_seqs = builder.padded_num_seqs[pad]
    assert md.padding == pad and padded_num_seqs == (49 if pad == "tail" else 48)
    assert tuple(md.chunk_indices.shape) == (builder.capacity.rows, 2)
    assert md.cu_seqlens.shape[0] == padded_num_seqs + 1 == md.chunk_offsets.shape[0]
    assert_padded(md, batch, chunk_size, padded_num_seqs, builder.capacity.rows, *layout.padding_row(pad, 48))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pad", layout.PADS)
def test_padded_layout_at_full_sequence_capacity(backend, pad):
    """N == max_num_seqs, a power of two: the tail mode's extra entry lies past the kernel's
    sequence lanes, and the reserved tail sequence is still there for padding rows."""
    builder = ChunkMetadataBuilder(4, 400, device="cpu", backend=backend)
    for batch in (from_lengths([10, 64, 65, 1]), from_lengths([0, 0, 0, 0]), from_lengths([], first_seq=0)):
        qsl, qsl_cpu = tensors_for(batch)
        md = builder.build_padded(qsl, qsl_cpu, pad=pad)
        assert_padded(md, batch, 64, builder.padded_num_seqs[pad], builder.capacity.rows, *layout.padding_row(pad, 4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pad", layout.BOUNDED_PADS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk_size=CHUNK_SIZES)
def test_bounded_layout_equals_reference(backend, pad, data, chunk_size):
    """No host lengths: rows from the host bound, the real tables first, padding after them."""
    builder = ChunkMetadataBuilder(48, 48 * 600, chunk_size=chunk_size, device="cpu", backend=backend)
    lengths = data.draw(st.lists(st.integers(0, 3 * chunk_size), max_size=48))
    batch = from_lengths(lengths)
    slack = data.draw(st.integers(0, 48 * 600 - batch.num_tokens))
    qsl, _ = tensors_for(batch)
    md = builder.build_bounded(qsl, max_num_tokens=batch.num_tokens + slack, pad=pad)
    rows = layout.chunk_row_bound(len(lengths), batch.num_tokens + slack, chunk_size)
    assert md.bounded and md.padding == pad and tuple(md.chunk_indices.shape) == (rows, 2)
    assert (md.num_tokens, md.num_chunks, md.max_seqlen) == (batch.num_tokens + slack, rows, batch.num_tokens + slack)
    assert md.generation == builder.builds == 1 and md.is_live
    pad_seq, pad_chunk = layout.padding_row(pad, len(lengths))
    assert_padded(md, batch, chunk_size, len(lengths), rows, pad_seq, pad_chunk)


def test_chunk_row_bound_is_the_most_rows_any_split_needs():
    """The bounded layout's row count is exactly the most chunk rows any split of at most T
    tokens into N sequences needs (by exhaustive search over small cases): a bound, and no looser."""
    for c in (16, 32):
        most = {0: [0] * (3 * c + 6)}  # most[n][t]: the most rows n sequences of t tokens in all need
        for n in range(1, 6):
            most[n] = [max(-(-k // c) + most[n - 1][t - k] for k in range(t + 1)) for t in range(3 * c + 6)]
            for t in range(3 * c + 6):
                assert layout.chunk_row_bound(n, t, c) == max(most[n][: t + 1]), (n, t, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounded_build_rejects_bad_input_and_changes_nothing(backend):
    builder = ChunkMetadataBuilder(4, 256, device="cpu", backend=backend)
    qsl, _ = tensors_for(from_lengths([3, 70, 0]))
    kept = builder.build_bounded(qsl, max_num_tokens=73)
    cases = [
        (dict(max_num_tokens=257), "max_num_tokens=257"),
        (dict(max_num_tokens=-1), "max_num_tokens=-1"),
        (dict(max_num_tokens=1.5), "max_num_tokens=1.5"),
        (dict(max_num_tokens=73, num_seqs=4), "num_seqs=4"),
        (dict(max_num_tokens=73, pad="tail"), "pad='tail'"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(ChunkMetaError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
            builder.build_bounded(qsl, **kwargs)
    with pytest.raises(ChunkMetaError, match="query_start_loc"):
        builder.build_bounded(qsl.tolist(), max_num_tokens=73)
    with pytest.raises(ChunkMetaError, match="exceeds the builder's capacity"):
        builder.build_bounded(tensors_for(from_lengths([1] * 5))[0], max_num_tokens=5)
    assert builder.builds == 1 and kept.is_live


def test_past_end_rows_are_refused_where_a_sequence_can_reach_them():
    big = ChunkMetadataBuilder(2, layout.PAST_END_CHUNK * 16 + 1, chunk_size=16, device="cpu")
    qsl, qsl_cpu = tensors_for(from_lengths([5]))
    with pytest.raises(ChunkMetaError, match="PAST_END_CHUNK"):
        big.build_padded(qsl, qsl_cpu, pad="past_end")
    with pytest.raises(ChunkMetaError, match="PAST_END_CHUNK"):
        big.build_bounded(qsl, max_num_tokens=5)
    assert big.build_padded(qsl, qsl_cpu, pad="negative").num_chunks == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_thousands_of_sequences_and_a_long_prompt(backend):
    rng = np.random.default_rng(1)
    cases = [
        workload(4096, 300_000, seed=2),
        from_lengths([200_000]),
        from_lengths([0, 200_000, 0, 5]),
        random_decode_first(rng, 3000, 100_000),
    ]
    for batch in cases:
        qsl, qsl_cpu = tensors_for(batch)
        md = build_chunk_metadata(qsl, qsl_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs, backend=backend)
        assert_exact(md, batch, 64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_edges(backend):
    """Row blocks crossing program boundaries, N at the kernel's block width, empty slices."""
    builder = ChunkMetadataBuilder(16, 16 * 2000, chunk_size=16, device="cpu", backend=backend)
    cases = [
        from_lengths([16 * 1100]),  # 1100 rows: two row programs
        from_lengths([16 * 1023 + 1, 15]),  # a sequence straddling rows 1023/1024
        from_lengths([1] * 16),  # N == max_num_seqs
        from_lengths([0] * 16),  # all zero-length: no rows, offsets all 0
        from_lengths([3, 4], first_seq=2),  # empty slice at the end
        from_lengths([], first_seq=0),  # no requests at all
    ]
    for batch in cases:
        qsl, qsl_cpu = tensors_for(batch)
        md = builder.build(qsl, qsl_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs)
        assert_exact(md, batch, 16)


def test_empty_prefill_is_empty_tensors_not_none():
    for backend in BACKENDS:
        qsl, qsl_cpu = tensors_for(from_lengths([1, 1, 1], first_seq=3))
        md = build_chunk_metadata(qsl, qsl_cpu, first_seq=3, backend=backend)
        assert md.num_seqs == 0 and md.num_chunks == 0
        assert md.cu_seqlens.tolist() == [0] and md.chunk_offsets.tolist() == [0]
        assert tuple(md.chunk_indices.shape) == (0, 2)


def test_num_seqs_defaults_to_rest_of_batch():
    batch = from_lengths([1, 1, 100, 200], first_seq=2)
    qsl, qsl_cpu = tensors_for(batch)
    md = build_chunk_metadata(qsl, qsl_cpu, first_seq=2)
    assert_exact(md, batch, 64)


def test_numpy_host_copy_is_accepted():
    batch = from_lengths([5, 70, 0, 130])
    qsl, qsl_cpu = tensors_for(batch)
    md = build_chunk_metadata(qsl, qsl_cpu.numpy())
    assert_exact(md, batch, 64)


def test_auto_backend_on_cpu_is_torch():
    builder = ChunkMetadataBuilder(4, 100, device="cpu")
    assert builder.backend == "torch"


def test_a_fill_that_fails_midway_retires_what_its_slot_held(monkeypatch):
    """A live object is never overwritten: a torch fill that raises partway through leaves the
    slot's earlier metadata dead, the other slot's live, and the builder working."""
    from chunkmeta import step_builder as step_module

    b = ChunkMetadataBuilder(4, 256, chunk_size=64, device="cpu", backend="torch", ring_depth=2)
    monkeypatch.setattr(b.step_builder(), "_c_step", None)  # the general path: the torch fill every build
    q = torch.tensor([0, 3, 200], dtype=torch.int32)
    first, second = b.build(q, q), b.build(q, q)
    fill = step_module.fill_entry_torch

    def fails(entry, query_start_loc, computed, checkpoints, regions, *args):
        with torch.inference_mode():  # as the torch fill writes (its tables are inference tensors)
            regions[0][1:].fill_(-7)  # part of the slot written (entry 0 is never written), then the failure
        raise RuntimeError("out of memory")

    monkeypatch.setattr(step_module, "fill_entry_torch", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        b.build(q, q)  # the slot of `first`
    assert not first.is_live and second.is_live
    with pytest.raises(ChunkMetaError, match="fill failed"):
        first.check_live()
    monkeypatch.setattr(step_module, "fill_entry_torch", fill)
    third = b.build(q, q)
    assert third.is_live and second.is_live
    assert third.cu_seqlens.tolist() == [0, 3, 200] and third.chunk_indices.tolist() == [
        [0, 0],
        [1, 0],
        [1, 1],
        [1, 2],
        [1, 3],
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_keeps_values_for_depth_minus_one_builds(backend):
    depth = 3
    builder = ChunkMetadataBuilder(8, 2000, device="cpu", backend=backend, ring_depth=depth)
    rng = np.random.default_rng(5)
    batches_ = [random_decode_first(rng, 8, 2000) for _ in range(3 * depth)]
    results = []
    for k, batch in enumerate(batches_):
        qsl, qsl_cpu = tensors_for(batch)
        results.append(builder.build(qsl, qsl_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs))
        # every object of the last `depth` builds still holds its own values and is live
        for j in range(max(0, k - depth + 1), k + 1):
            assert results[j].is_live
            assert_exact(results[j], batches_[j], 64)
        # older ones are retired, and say so
        for j in range(0, max(0, k - depth + 1)):
            assert not results[j].is_live
            with pytest.raises(chunkmeta.ChunkMetaError, match="retired"):
                results[j].check_live()
    assert builder.builds == len(batches_)


def test_same_host_tensor_mutated_between_steps():
    """Engines reuse one pinned host buffer: the identity cache must not serve stale values."""
    builder = ChunkMetadataBuilder(8, 4000, device="cpu")
    qsl_cpu = torch.zeros(9, dtype=torch.int32)
    qsl = torch.zeros(9, dtype=torch.int32)
    rng = np.random.default_rng(3)
    for _ in range(20):
        lengths = rng.integers(0, 300, 8)
        batch = from_lengths(lengths.tolist())
        qsl_cpu.copy_(torch.tensor(batch.query_start_loc))
        qsl.copy_(qsl_cpu)
        md = builder.build(qsl, qsl_cpu)
        assert_exact(md, batch, 64)


@pytest.mark.parametrize("pad", [None, "tail"])
def test_cu_seqlens_are_new_objects_every_build(pad):
    """FLA memoizes its helpers (prepare_lens, prepare_chunk_indices, ...) by argument identity:
    a cu_seqlens object handed out again with new contents would get an earlier step's answer.
    Same sizes in the same ring slot (builds 2 and 6 here, and 3-5) must still be new objects."""
    fla_index = pytest.importorskip("fla.ops.utils.index")
    builder = ChunkMetadataBuilder(8, 4096, device="cpu", backend="torch", ring_depth=4)
    seen = []
    for lengths in ([100, 50], [10], [10], [10], [300, 1], [7, 9]):
        batch = from_lengths(lengths)
        qsl, qsl_cpu = tensors_for(batch)
        md = builder.build(qsl, qsl_cpu) if pad is None else builder.build_padded(qsl, qsl_cpu, pad=pad)
        assert all(md.cu_seqlens is not old.cu_seqlens and md.cu_seqlens_cpu is not old.cu_seqlens_cpu for old in seen)
        seen.append(md)
        if pad is None:  # FLA's helper on the exact layout: this step's rows, not a cached step's
            rows = fla_index.prepare_chunk_indices(md.cu_seqlens, 16)
            want = chunkmeta.reference.chunk_metadata(batch.query_start_loc, 16).chunk_indices
            assert [tuple(r) for r in rows.tolist()] == want


def test_fresh_views_of_persistent_buffers_each_step():
    """Engines slice their persistent buffers every step: prefix views (accepted from tensor
    attributes, no numpy view unless the Python plan runs), and a strided host view (numpy)."""
    builder = ChunkMetadataBuilder(64, 64 * 700, device="cpu", backend="triton")
    host_buffer = torch.zeros(2 * 130, dtype=torch.int32)
    device_buffer = torch.zeros(130, dtype=torch.int32)
    rng = np.random.default_rng(7)
    for step in range(12):
        batch = random_decode_first(rng, 64, 64 * 600)
        r1 = len(batch.query_start_loc)
        values = torch.tensor(batch.query_start_loc, dtype=torch.int32)
        device_buffer[:r1] = values
        if step % 3 == 2:  # every other element of a larger buffer: not contiguous
            host_buffer[: 2 * r1 : 2] = values
            host = host_buffer[: 2 * r1 : 2]
        else:
            host_buffer[:r1] = values
            host = host_buffer[:r1]
        md = builder.build(device_buffer[:r1], host, first_seq=batch.first_seq, num_seqs=batch.num_seqs)
        assert_exact(md, batch, 64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_chunk_offsets_are_written_by_the_fill(backend):
    """offsets_dtype=torch.int32 (CuteDSL GDN's chunk_offsets): the same values in every layout."""
    builder = ChunkMetadataBuilder(8, 2000, device="cpu", backend=backend, offsets_dtype=torch.int32)
    rng = np.random.default_rng(12)
    for k in range(12):
        batch = random_decode_first(rng, 8, 1500)
        qsl, qsl_cpu = tensors_for(batch)
        kw = dict(first_seq=batch.first_seq, num_seqs=batch.num_seqs)
        md = builder.build(qsl, qsl_cpu, **kw)
        assert md.chunk_offsets.dtype == torch.int32
        assert_exact(md, batch, 64)
        pad = layout.PADS[k % 3]
        padded = builder.build_padded(qsl, qsl_cpu, pad=pad, **kw)
        assert padded.chunk_offsets.dtype == torch.int32
        assert_padded(
            padded, batch, 64, builder.padded_num_seqs[pad], builder.capacity.rows, *layout.padding_row(pad, 8)
        )
    with pytest.raises(ChunkMetaError, match="offsets_dtype"):
        ChunkMetadataBuilder(8, 2000, device="cpu", offsets_dtype=torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tables_are_inference_tensors(backend):
    """chunkmeta.ring.TABLE_MEMORY: the ring's and the one-shot's tables are inference tensors
    (their views skip autograd's tracking), and consumers read them outside inference mode too."""
    q = torch.tensor([0, 3, 200], dtype=torch.int32)
    ring = ChunkMetadataBuilder(4, 256, chunk_size=64, device="cpu", backend=backend)
    for md in (ring.build(q, q), ring.build_padded(q, q), build_chunk_metadata(q, q, backend=backend)):
        tensors = (md.cu_seqlens, md.cu_seqlens_cpu, md.chunk_indices, md.chunk_offsets)
        assert all(t.is_inference() for t in tensors)
        assert md.cu_seqlens.tolist()[:3] == [0, 3, 200] and (md.chunk_offsets + 1).tolist()[:3] == [1, 2, 6]
        with pytest.raises(RuntimeError, match="inference tensor"):
            md.chunk_indices.fill_(0)
