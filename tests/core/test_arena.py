"""The one-shot's arena: every slice it hands out is new memory, sized and typed as the tables
need and laid out as the step kernel's one-shot entry writes them, also across block changes,
batches larger than a block and concurrent callers."""

import threading

import numpy as np
import pytest
import torch

from chunkmeta import tables
from chunkmeta.arena import Arena


def take(arena, n, nt, indices_dtype=torch.int32, region=False):
    """What the one-shot takes for N = n, NT = nt (its 16-lane bucket up to 16 sequences)."""
    layout = tables.one_shot_layout(64, max(16, 1 << max(n - 1, 0).bit_length()), indices_dtype)
    wide = indices_dtype == torch.int64
    return arena.take(n, nt, layout.offsets_at, layout.indices_at, wide, region=region), layout


def spans(outputs):
    """Each output's byte range, per table kind."""
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in outputs]


def assert_disjoint(ranges):
    ranges = sorted(r for r in ranges if r[1] > r[0])
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert end <= start, ranges


@pytest.mark.parametrize("indices_dtype", [torch.int32, torch.int64])
def test_slices_are_typed_sized_and_never_handed_out_twice(indices_dtype):
    arena = Arena(-1, block_bytes=512, host_entries=16)
    rng = np.random.default_rng(3)
    kept = []
    for _ in range(200):
        n, nt = int(rng.integers(0, 12)), int(rng.integers(0, 20))
        if rng.random() < 0.05:
            n, nt = 40, 70  # larger than a block: blocks of its own
        (offsets, cu, indices, cu_cpu, region), layout = take(arena, n, nt, indices_dtype, region=True)
        out = offsets, cu, indices, cu_cpu
        # one region for the device tables, at the entry's offsets (the launch's one address)
        assert region.data_ptr() == cu.data_ptr()
        assert offsets.data_ptr() == cu.data_ptr() + layout.offsets_at
        assert nt == 0 or indices.data_ptr() == cu.data_ptr() + layout.indices_at  # (an empty one has none)
        assert indices.data_ptr() + indices.numel() * indices.element_size() <= region.data_ptr() + region.numel()
        assert offsets.dtype == torch.int64 and offsets.shape == (n + 1,)
        assert cu.dtype == torch.int32 and cu.shape == (n + 1,)
        assert indices.dtype == indices_dtype and indices.shape == (nt, 2)
        assert cu_cpu.dtype == torch.int32 and cu_cpu.shape == (n + 1,) and cu_cpu.device.type == "cpu"
        assert all(t.is_contiguous() for t in out)
        assert all(t.data_ptr() % 16 == 0 for t in out)  # as the first build's, which compiled the fill
        kept.append(out)
    assert arena.blocks_made > 4 * 4  # the blocks ran out many times
    # every slice still alive is its own memory
    assert_disjoint([span for out in kept for span in spans(out)[:3]])
    assert_disjoint([spans(out)[3] for out in kept])


def test_a_result_keeps_its_block_alive():
    arena = Arena(-1, block_bytes=256, host_entries=8)
    first, _ = take(arena, 3, 3)
    with torch.inference_mode():  # as a fill writes them (tables are inference tensors)
        for t in first:
            t.fill_(7)
        for _ in range(20):  # many blocks later, the first block was dropped by the arena
            for t in take(arena, 5, 6)[0]:
                t.fill_(-1)
    assert all((t == 7).all() for t in first)


def test_slices_are_inference_tensors_that_refuse_writes_outside_inference_mode():
    """chunkmeta.ring.TABLE_MEMORY: the tables' memory is made in inference mode (cheap views);
    outside it, an in-place write to a handed-out table raises instead of overwriting it."""
    for t in take(Arena(-1, block_bytes=256, host_entries=8), 3, 3)[0]:
        assert t.is_inference() and not t.requires_grad
        with pytest.raises(RuntimeError, match="inference tensor"):
            t.fill_(1)


def test_concurrent_takes_get_disjoint_slices():
    arena = Arena(-1, block_bytes=2048, host_entries=64)
    results = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def work(out):
        start.wait()
        for i in range(300):
            out.append(take(arena, i % 7, i % 11)[0])

    threads = [threading.Thread(target=work, args=(out,)) for out in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outs = [out for chunk in results for out in chunk]
    assert len(outs) == 1200
    assert_disjoint([span for out in outs for span in spans(out)[:3]])
    assert_disjoint([spans(out)[3] for out in outs])
