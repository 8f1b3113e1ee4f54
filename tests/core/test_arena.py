"""The one-shot's arena: every slice it hands out is new memory, sized and typed as the tables
need, also across block changes, batches larger than a block and concurrent callers."""

import threading

import numpy as np
import pytest
import torch

from chunkmeta.arena import Arena


def spans(outputs):
    """Each output's byte range, per table kind."""
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in outputs]


def assert_disjoint(ranges):
    ranges = sorted(r for r in ranges if r[1] > r[0])
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert end <= start, ranges


@pytest.mark.parametrize("indices_dtype", [torch.int32, torch.int64])
def test_slices_are_typed_sized_and_never_handed_out_twice(indices_dtype):
    arena = Arena(-1, indices_dtype, block_entries=16)
    rng = np.random.default_rng(3)
    kept = []
    for _ in range(200):
        n, nt = int(rng.integers(0, 12)), int(rng.integers(0, 20))
        if rng.random() < 0.05:
            n, nt = 40, 70  # larger than a block: blocks of its own
        offsets, cu, indices, cu_cpu = out = arena.take(n, nt)
        assert offsets.dtype == torch.int64 and offsets.shape == (n + 1,)
        assert cu.dtype == torch.int32 and cu.shape == (n + 1,)
        assert indices.dtype == indices_dtype and indices.shape == (nt, 2)
        assert cu_cpu.dtype == torch.int32 and cu_cpu.shape == (n + 1,) and cu_cpu.device.type == "cpu"
        assert all(t.is_contiguous() for t in out)
        assert all(t.data_ptr() % 16 == 0 for t in out)  # as the first build's, which compiled the fill
        kept.append(out)
    assert arena.blocks_made > 4 * 4  # the blocks ran out many times
    for kind in range(4):  # every slice still alive is its own memory
        assert_disjoint([span for out in kept for span in spans(out)[kind : kind + 1]])


def test_a_result_keeps_its_block_alive():
    arena = Arena(-1, torch.int32, block_entries=8)
    first = arena.take(3, 3)
    with torch.inference_mode():  # as a fill writes them (tables are inference tensors)
        for t in first:
            t.fill_(7)
        for _ in range(20):  # many blocks later, the first block was dropped by the arena
            for t in arena.take(5, 6):
                t.fill_(-1)
    assert all((t == 7).all() for t in first)


def test_slices_are_inference_tensors_that_refuse_writes_outside_inference_mode():
    """chunkmeta.ring.TABLE_MEMORY: the tables' memory is made in inference mode (cheap views);
    outside it, an in-place write to a handed-out table raises instead of overwriting it."""
    for t in Arena(-1, torch.int32, block_entries=8).take(3, 3):
        assert t.is_inference() and not t.requires_grad
        with pytest.raises(RuntimeError, match="inference tensor"):
            t.fill_(1)


def test_concurrent_takes_get_disjoint_slices():
    arena = Arena(-1, torch.int32, block_entries=64)
    results = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def work(out):
        start.wait()
        for i in range(300):
            out.append(arena.take(i % 7, i % 11))

    threads = [threading.Thread(target=work, args=(out,)) for out in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outs = [out for chunk in results for out in chunk]
    assert len(outs) == 1200
    for kind in range(4):
        assert_disjoint([spans(out)[kind] for out in outs])
