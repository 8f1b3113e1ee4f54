"""The one-shot build: fresh outputs from the arena (``chunkmeta.arena``), one launch of the step
kernel's FLA entry writing every entry, a kernel per bucket of sequences compiled once per
process (the Triton kernel under the interpreter on CPU), and its C build (the CPU's C fill)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checks import assert_exact, tensors_for
from chunkmeta import build_chunk_metadata, reference, tables
from chunkmeta import one_shot as one_shot_module
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


@pytest.mark.parametrize("indices_dtype", [torch.int32, torch.int64])
def test_write_first_fills_fresh_memory(indices_dtype):
    """The one-shot's outputs are not zeroed (arena memory): the fill itself writes entry 0."""
    pytest.importorskip("triton")
    from chunkmeta.fill.step_fill import StepFill

    qsl = torch.tensor([0, 3, 100], dtype=torch.int32)
    layout = tables.one_shot_layout(64, 16, indices_dtype)
    fill = StepFill(entries=(layout.entry,), block_seqs=16, padded=False)
    region = torch.full((layout.indices_at + 3 * 16,), 0xF9, dtype=torch.uint8)  # -7 in every byte
    fill(qsl, qsl, qsl, region, (0, 2, 0, 3, 0, 0, 0, 0, 0))
    cu = region[:12].view(torch.int32)
    offsets = region[layout.offsets_at : layout.offsets_at + 24].view(torch.int64)
    width = 16 if indices_dtype == torch.int64 else 8
    indices = region[layout.indices_at : layout.indices_at + 3 * width].view(indices_dtype).view(-1, 2)
    assert cu.tolist() == [0, 3, 100] and offsets.tolist() == [0, 1, 3]
    assert indices.tolist() == [[0, 0], [1, 0], [1, 1]]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_results_stay_exact_while_later_builds_run(monkeypatch, backend):
    """Each result owns its memory: later one-shots, past several of the arena's blocks, leave it
    as it was built (torch: the C build's own fill after the first)."""
    from chunkmeta import arena

    monkeypatch.setitem(arena._ARENAS, (-1, 0), arena.Arena(-1, block_bytes=512, host_entries=24))
    batches = [from_lengths(lengths) for lengths in ([5], [70, 1, 0, 3], [130], [1] * 9, [64, 65], [0, 0, 7])] * 4
    kept = [build_chunk_metadata(*tensors_for(b), backend=backend) for b in batches]
    assert arena._ARENAS[(-1, 0)].blocks_made > 4
    for md, batch in zip(kept, batches, strict=True):
        assert_exact(md, batch, 64)


def test_general_path_without_the_compiled_host_build(monkeypatch):
    """Without the extension the one-shot takes the general path (the C one is never asked),
    also where an earlier build registered its key."""
    from chunkmeta import native

    monkeypatch.setattr(native, "module", lambda: None)
    monkeypatch.setitem(one_shot_module._C["torch"], (64, 16, torch.int32, torch.int32, -1), None)
    batch = from_lengths([5, 65])
    assert_exact(build_chunk_metadata(*tensors_for(batch), backend="torch"), batch, 64)


def test_kernel_compiled_once_per_bucket():
    one_shot_module._FILLS.clear()
    for lengths in ([5], [5, 6, 7], [1] * 16, [9] * 17, [3] * 30):
        batch = from_lengths(lengths)
        build_chunk_metadata(*tensors_for(batch), backend="triton")
    # 1, 3 and 16 sequences share the 16-lane bucket, 17 and 30 the 32-lane one
    assert sorted(key[1] for key in one_shot_module._FILLS) == [16, 32]


def test_bad_indices_dtype():
    qsl, qsl_cpu = tensors_for(from_lengths([4]))
    with pytest.raises(ValueError, match="indices_dtype=torch.float32"):
        build_chunk_metadata(qsl, qsl_cpu, indices_dtype=torch.float32)


@settings(max_examples=300, deadline=None)
@given(host=host_offsets(max_seqs=40), first=st.integers(0, 3), num_seqs=st.none() | st.integers(0, 40))
def test_c_one_shot_agrees_with_the_plan(host, first, num_seqs):
    """The one-shot's C build (the CPU's: its plan, the arena, the C fill, the result) takes
    exactly the steps the Python plan takes, with the same tables, and refuses the rest (which the
    general path then diagnoses)."""
    from chunkmeta import arena, native, plan

    module = native.module()
    if module is None:
        pytest.skip("no compiled host build here")
    for dtype in (torch.int32, torch.int64):  # registers the 16-lane bucket's C build
        build_chunk_metadata(*tensors_for(from_lengths([3]), dtype=dtype), backend="torch")
    kernels = one_shot_module._C["torch"]
    assert any(kernels.values()), kernels
    tensor = torch.from_numpy(host)
    out = module.oneshot(kernels, arena.arena(-1, 0), tensor, tensor, first, num_seqs, 64, torch.int32, -1, 0)
    widest = plan.Capacity(plan.MAX_NUM_SEQS, plan.INT32_MAX - 64, plan.INT32_MAX // 64)
    try:
        step = plan.plan_step(host, first, num_seqs, 64, widest)
    except ValueError:
        assert out == -1
        return
    # the C build serves the buckets a build of this process registered: the 16-lane one above, and
    # any other an earlier test's build made (which one depends on that test's drawn batches)
    key = (64, one_shot_module._lanes(step.num_seqs), torch.int32, tensor.dtype, -1)
    if key not in kernels:  # a bucket no build registered: the general path builds it
        assert out == -1
        return
    # the tables in numpy (a valid step may hold 2^30 tokens: millions of rows)
    cu = (step.segment - step.segment[0]).astype(np.int64)
    counts = -(-np.diff(cu) // 64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    seq = np.repeat(np.arange(step.num_seqs), counts)
    assert (out.num_seqs, out.num_tokens, out.num_chunks, out.max_seqlen) == (
        step.num_seqs,
        step.num_tokens,
        step.num_chunks,
        step.max_seqlen,
    )
    assert np.array_equal(out.cu_seqlens.numpy(), cu) and np.array_equal(out.cu_seqlens_cpu.numpy(), cu)
    assert np.array_equal(out.chunk_offsets.numpy(), offsets)
    assert np.array_equal(out.chunk_indices.numpy(), np.stack([seq, np.arange(seq.size) - offsets[seq]], axis=1))
