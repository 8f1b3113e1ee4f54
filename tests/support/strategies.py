"""Hypothesis strategies for engine-like batches (shared by the test modules)."""

from hypothesis import strategies as st

from chunkmeta.workloads import Batch, from_lengths

CHUNK_SIZES = st.sampled_from([16, 32, 64])


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
