"""Hypothesis strategies for engine-like batches (shared by the test modules)."""

import numpy as np
import torch
from hypothesis import strategies as st

from chunkmeta import tables
from chunkmeta.workloads import Batch, from_lengths

CHUNK_SIZES = st.sampled_from([16, 32, 64])
# Step-table sets with every kind of entry, chunk sizes that differ between tables, in two
# builders (a launch holds six entries)
STEP_SPECS = {
    "fla": tables.Fla(64),
    "fla_batch": tables.Fla(32, rows="batch", offsets_dtype=torch.int32),
    "conv": tables.Conv(),
    "mamba2": tables.Mamba2(chunk_size=32, checkpoints=True),
    "sglang": tables.SglangMamba2(chunk_size=16),
}
STEP_SPECS_B = {
    "conv_pairs": tables.Conv(rows="prefill", paired=True),
    "mamba2": tables.Mamba2(chunk_size=16, seq_idx_pad=2),  # a mixed-step bucket's padding
    "fla": tables.Fla(16, rows="batch"),
}


@st.composite
def lengths_around(draw, chunk_size: int, max_len: int = 600):
    """A sequence length biased to the cases that break chunk math: 0, 1, kC-1, kC, kC+1."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.sampled_from([0, 1]))
    if kind == 1:
        k = draw(st.integers(1, max(1, max_len // chunk_size)))
        return k * chunk_size + draw(st.integers(-1, 1))
    return draw(st.integers(0, max_len))


@st.composite
def batches(draw, chunk_size: int, max_requests: int = 40, max_len: int = 600) -> Batch:
    """Decode-first batches: decodes (length 1) first, then the prefill slice; sometimes a
    num_seqs shorter than the rest, and a query_start_loc that does not start at 0."""
    num_decodes = draw(st.integers(0, 5))
    prefills = draw(st.lists(lengths_around(chunk_size, max_len), min_size=0, max_size=max_requests))
    trailing = draw(st.lists(st.integers(0, 3), max_size=2))  # requests after the slice
    start = draw(st.sampled_from([0, 0, 3, 1000]))
    batch = from_lengths([1] * num_decodes + prefills + trailing, first_seq=num_decodes, start=start)
    return batch._replace(num_seqs=len(prefills))


@st.composite
def host_offsets(draw, max_seqs: int = 80):
    """A host ``query_start_loc`` as a numpy int32/int64 array, valid or not: mostly small steps
    (-3..300, so decreases and negative starts occur), sometimes a jump to an extreme of the
    dtype (where differences wrap around in fixed-width arithmetic)."""
    import numpy as np

    dtype = draw(st.sampled_from([np.int32, np.int64]))
    info = np.iinfo(dtype)
    extremes = [int(info.min), int(info.max), int(info.max) - 1, -1, int(info.max) // 2 + 1]
    value = draw(st.sampled_from([0, 5, -2]))
    values = [value]
    for _ in range(draw(st.integers(0, max_seqs))):
        if draw(st.integers(0, 9)) == 0:
            value = draw(st.sampled_from(extremes))
        else:
            value = min(int(info.max), max(int(info.min), value + draw(st.integers(-3, 300))))
        values.append(value)
    return np.array(values, dtype=dtype)


def random_step(rng, max_seqs: int, max_tokens: int):
    """A decode-first step: decodes, then prefills with lengths of every kind (0, 1, around
    chunk multiples, long), computed tokens (0, chunk-aligned, any) and checkpoint offsets."""
    decodes = int(rng.integers(0, max(1, max_seqs // 4)))
    prefills = int(rng.integers(0, max_seqs - decodes + 1))
    budget = max_tokens - decodes
    kinds = rng.integers(0, 4, size=prefills)
    lengths = np.where(
        kinds == 0,
        rng.integers(0, 2, size=prefills),
        np.where(kinds == 1, 64 * rng.integers(1, 8, size=prefills) + rng.integers(-1, 2, size=prefills), 0),
    )
    lengths = np.where(kinds >= 2, rng.integers(0, max(1, 2 * budget // max(1, prefills)), size=prefills), lengths)
    lengths = np.maximum(lengths, 0)
    while lengths.sum() > budget:
        lengths //= 2
    all_lengths = [1] * decodes + lengths.tolist()
    qsl = [0, *np.cumsum(all_lengths).tolist()]
    rows = len(all_lengths)
    computed = np.where(
        rng.integers(0, 3, size=rows) == 0, 256 * rng.integers(0, 8, size=rows), rng.integers(0, 5000, size=rows)
    )
    computed = np.where(rng.integers(0, 4, size=rows) == 0, 0, computed).tolist()
    checkpoints = [int(rng.integers(0, n + 1)) if n and rng.integers(0, 3) == 0 else 0 for n in all_lengths]
    return qsl, decodes, prefills, computed, checkpoints
