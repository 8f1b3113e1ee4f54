"""The one-shot build: fresh outputs from the arena (``chunkmeta.arena``), one launch writing
every entry, a kernel per bucket of sequences compiled once per process (the Triton kernel
under the interpreter on CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checks import assert_exact, tensors_for
from chunkmeta import build_chunk_metadata, reference
from chunkmeta import builder as builder_module
from chunkmeta.fill.triton_fill import TritonFill
from chunkmeta.workloads import from_lengths
from strategies import CHUNK_SIZES, batches, host_offsets


@settings(max_examples=25, deadline=None)
@given(data=CHUNK_SIZES.flatmap(lambda c: batches(c, max_requests=12).map(lambda b: (c, b))))
def test_triton_one_shot_equals_reference(data):
    chunk_size, batch = data
    qsl, qsl_cpu = tensors_for(batch)
    md = build_chunk_metadata(
        qsl, qsl_cpu, chunk_size=chunk_size, first_seq=batch.first_seq, num_seqs=batch.num_seqs, backend="triton"
    )
    assert_exact(md, batch, chunk_size)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_int64_indices(backend):
    batch = from_lengths([1, 0, 130, 64, 5])
    qsl, qsl_cpu = tensors_for(batch, dtype=torch.int64)
    md = build_chunk_metadata(qsl, qsl_cpu, chunk_size=64, backend=backend, indices_dtype=torch.int64)
    ref = reference.chunk_metadata(batch.query_start_loc, 64)
    assert md.chunk_indices.dtype == torch.int64 and md.chunk_indices.shape == (ref.num_chunks, 2)
    assert [tuple(r) for r in md.chunk_indices.tolist()] == ref.chunk_indices
    assert md.chunk_offsets.tolist() == ref.chunk_offsets and md.cu_seqlens.tolist() == ref.cu_seqlens


def test_write_first_fills_fresh_memory():
    """The one-shot's outputs are not zeroed (arena memory): the fill itself writes entry 0."""
    qsl = torch.tensor([0, 3, 100], dtype=torch.int32)
    fill = TritonFill(chunk_size=64, block_seqs=16, padded=False, params_on_device=False, write_first=True)
    cu = torch.full((3,), -7, dtype=torch.int32)
    offsets = torch.full((3,), -7, dtype=torch.int64)
    indices = torch.full((3, 2), -7, dtype=torch.int32)
    fill(qsl, qsl, cu, indices, offsets, 0, 2, 3, 2, 0)
    assert cu.tolist() == [0, 3, 100] and offsets.tolist() == [0, 1, 3]
    assert indices.tolist() == [[0, 0], [1, 0], [1, 1]]


def test_results_stay_exact_while_later_builds_run(monkeypatch):
    """Each result owns its memory: later one-shots, past several of the arena's blocks, leave it
    as it was built."""
    from chunkmeta import arena

    monkeypatch.setitem(arena._ARENAS, (-1, 0, torch.int32), arena.Arena(-1, torch.int32, block_entries=24))
    batches = [from_lengths(lengths) for lengths in ([5], [70, 1, 0, 3], [130], [1] * 9, [64, 65], [0, 0, 7])] * 4
    kept = [build_chunk_metadata(*tensors_for(b), backend="triton") for b in batches]
    assert arena._ARENAS[(-1, 0, torch.int32)].blocks_made > 4
    for md, batch in zip(kept, batches, strict=True):
        assert_exact(md, batch, 64)


def test_general_path_without_the_compiled_host_build(monkeypatch):
    """After a CUDA one-shot, the fills' table holds None where the C launch is off; without the
    extension the one-shot still takes the general path (the C one is never asked)."""
    from chunkmeta import native

    monkeypatch.setattr(native, "module", lambda: None)
    monkeypatch.setitem(builder_module._ONE_SHOT_C, (64, 16, torch.int32, torch.int32), None)
    batch = from_lengths([5, 65])
    assert_exact(build_chunk_metadata(*tensors_for(batch), backend="triton"), batch, 64)


def test_kernel_compiled_once_per_bucket():
    builder_module._ONE_SHOT_FILLS.clear()
    for lengths in ([5], [5, 6, 7], [1] * 16, [9] * 17, [3] * 30):
        batch = from_lengths(lengths)
        build_chunk_metadata(*tensors_for(batch), backend="triton")
    # 1, 3 and 16 sequences share the 16-lane bucket, 17 and 30 the 32-lane one
    assert sorted(key[1] for key in builder_module._ONE_SHOT_FILLS) == [16, 32]


def test_bad_indices_dtype():
    qsl, qsl_cpu = tensors_for(from_lengths([4]))
    with pytest.raises(ValueError, match="indices_dtype=torch.float32"):
        build_chunk_metadata(qsl, qsl_cpu, indices_dtype=torch.float32)


@settings(max_examples=300, deadline=None)
@given(host=host_offsets(max_seqs=40), first=st.integers(0, 3), num_seqs=st.none() | st.integers(0, 40))
def test_c_plan_agrees_with_the_plan(host, first, num_seqs):
    """The one-shot's C plan (used on CUDA) takes exactly the steps the Python plan takes, with
    the same sizes and host copy, and refuses the rest (which the general path then diagnoses)."""
    from chunkmeta import native, plan

    module = native.module()
    if module is None:
        pytest.skip("no compiled host build here")
    widest = plan.Capacity(plan.MAX_NUM_SEQS, plan.INT32_MAX - 64, plan.INT32_MAX // 64)
    tensor = torch.from_numpy(host)
    n = host.shape[0] - 1 - first if num_seqs is None else num_seqs
    cu = torch.full((max(n, 0) + 1,), -7, dtype=torch.int32)
    out = module.oneshot_plan(*plan.plain_host_tensor(tensor), first, num_seqs, 6, cu.data_ptr(), cu.shape[0])
    try:
        step = plan.plan_step(host, first, num_seqs, 64, widest)
    except ValueError:
        assert out == -1
        return
    assert out == (step.num_seqs, step.num_tokens, step.num_chunks, step.max_seqlen)
    assert cu.tolist() == (step.segment - step.segment[0]).tolist()
