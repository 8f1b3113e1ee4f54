"""The oracle itself, on hand-checked examples (DESIGN.md and TensorRT-LLM #18064's cases)."""

from chunkmeta import reference
from chunkmeta.workloads import from_lengths


def ref(lengths, chunk_size=64):
    return reference.chunk_metadata(from_lengths(lengths).query_start_loc, chunk_size)


def test_zero_length_sequence_keeps_its_index():
    r = ref([0, 64])
    assert r.cu_seqlens == [0, 0, 64]
    assert r.chunk_indices == [(1, 0)]
    assert r.chunk_offsets == [0, 0, 1]


def test_trt_llm_cases():
    assert ref([128, 256]).chunk_indices == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert ref([128, 257]).chunk_offsets == [0, 2, 7]
    assert ref([300]).chunk_indices == [(0, t) for t in range(5)]
    r = ref([1, 64, 65, 129])
    assert r.chunk_offsets == [0, 1, 2, 4, 7]
    assert r.chunk_indices == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    assert (r.num_tokens, r.num_chunks, r.max_seqlen) == (259, 7, 129)


def test_empty_batches():
    for lengths in ([], [0], [0, 0, 0]):
        r = ref(lengths)
        assert r.chunk_indices == []
        assert r.chunk_offsets == [0] * (len(lengths) + 1)
        assert r.num_chunks == 0


def test_slice_is_rebased():
    q = [5, 6, 7, 70, 200]  # two decodes, then prefills of 63 and 130 tokens
    r = reference.chunk_metadata(q, 64, first_seq=2)
    assert r.cu_seqlens == [0, 63, 193]
    assert r.chunk_indices == [(0, 0), (1, 0), (1, 1), (1, 2)]


def test_padded_layout():
    r = reference.padded_chunk_metadata([0, 64, 65], 64, padded_num_seqs=4, padded_num_rows=5, pad_seq=3)
    assert r.cu_seqlens == [0, 64, 65, 65, 65]
    assert r.chunk_offsets == [0, 1, 2, 2, 2]
    assert r.chunk_indices == [(0, 0), (1, 0), (3, 0), (3, 0), (3, 0)]
    assert r.num_chunks == 2


def test_workload_lengths_are_at_least_one_and_sum_to_the_tokens():
    """The benchmark's batches: valid at every tokens-per-sequence ratio, down to one."""
    import numpy as np
    import pytest

    from chunkmeta.workloads import split_tokens

    for num_seqs, num_tokens in [(1, 5), (2047, 3000), (4096, 4096), (1000, 1001), (128, 4096), (1024, 65536)]:
        lengths = split_tokens(np.random.default_rng(2), num_seqs, num_tokens)
        assert len(lengths) == num_seqs and sum(lengths) == num_tokens and min(lengths) >= 1
    with pytest.raises(ValueError):
        split_tokens(np.random.default_rng(0), 10, 9)
