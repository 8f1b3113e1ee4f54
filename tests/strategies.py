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
