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


# --- causal-conv1d block tables ---------------------------------------------------------------


def test_conv_tables_decodes_and_zero_length_rows():
    r = reference.causal_conv1d_metadata([0, 1, 2, 72, 72, 202])  # 2 decodes, 70, 0, 130 tokens
    assert r.nums == [1, 1, 9, 0, 17]
    assert r.tot == 28
    assert r.batch_ptr == [0, 1] + [2] * 9 + [4] * 17
    assert r.token_chunk_offset_ptr == [0, 0] + list(range(9)) + list(range(17))
    assert len(r.padded_batch_ptr) == len(r.padded_token_chunk_offset_ptr) == 2048
    assert r.padded_batch_ptr[28:] == r.padded_token_chunk_offset_ptr[28:] == [-1] * 2020


def test_conv_tables_empty_and_past_the_minimum_capacity():
    for q in ([0], [0, 0, 0]):
        r = reference.causal_conv1d_metadata(q)
        assert (r.tot, r.batch_ptr, r.token_chunk_offset_ptr) == (0, [], [])
        assert r.padded_batch_ptr == r.padded_token_chunk_offset_ptr == [-1] * 2048
    r = reference.causal_conv1d_metadata([0, 8 * 1500 - 3])
    assert r.tot == 1500 and len(r.padded_batch_ptr) == 3000 and r.padded_batch_ptr[1499:1501] == [0, -1]


def test_sglang_conv_block_table_only_for_ragged_batches():
    assert reference.sglang_conv_block_table([]) is None
    assert reference.sglang_conv_block_table([64, 60]) is None  # 2 * 8 <= 4 * 16
    assert reference.sglang_conv_block_table([1, 1, 1, 1, 36]) is None  # 5 * 5 <= 4 * 9
    ragged = [(i, 0) for i in range(8)] + [(8, b) for b in range(10)]
    assert reference.sglang_conv_block_table([1] * 8 + [80]) == ragged  # 9 * 10 > 4 * 18
    assert reference.sglang_conv_block_table([1] * 7 + [40]) is None  # 8 * 5 <= 4 * 12, though > 3 * 12
    assert reference.sglang_conv_block_table([1] * 4 + [128]) is None  # 5 * 16 == 4 * 20: not ragged
    assert len(reference.sglang_conv_block_table([1] * 4 + [129])) == 21  # 5 * 17 > 4 * 21


# --- Mamba2 SSD chunk tables, vLLM's convention ----------------------------------------------


def mamba2(q, computed, chunk_size=8, **kw):
    return reference.mamba2_chunk_metadata(q, computed, chunk_size, **kw)


def test_mamba2_partial_first_chunk():
    r = mamba2([0, 20], [5])  # absolute positions 5..24: cut at 8, 16, 24
    assert r.cu_chunk_seqlens == [0, 3, 11, 19, 20]
    assert r.seq_idx == [0, 0, 0, 0]
    assert r.last_chunk_indices == [3]
    assert r.checkpoint_chunk_idx is None
    assert (r.num_chunks, r.has_initial_states, r.prep_initial_states) == (4, [True], True)


def test_mamba2_chunk_aligned_prefix_and_no_prefix():
    r = mamba2([0, 20, 25], [16, 0])
    assert r.cu_chunk_seqlens == [0, 8, 16, 20, 25]
    assert r.seq_idx == [0, 0, 0, 1]
    assert r.last_chunk_indices == [2, 3]
    assert r.has_initial_states == [True, False]


def test_mamba2_zero_length_rows():
    # row 1 is empty mid-chunk (one empty chunk), row 2 empty on a boundary (none: repeats row 1's)
    r = mamba2([0, 10, 10, 10, 14], [0, 3, 8, 0])
    assert r.cu_chunk_seqlens == [0, 8, 10, 10, 14]
    assert r.seq_idx == [0, 0, 1, 3]
    assert r.last_chunk_indices == [1, 2, 2, 3]
    # an empty first row on a boundary has no chunk before it
    r = mamba2([0, 0, 8], [0, 0])
    assert (r.cu_chunk_seqlens, r.seq_idx, r.last_chunk_indices) == ([0, 8], [1], [-1, 0])
    assert r.prep_initial_states is False


def test_mamba2_checkpoint_splits_the_row():
    # row 0: 5..8 | 8..9 (checkpoint after 4 tokens) | 9..16 | 16..24 | 24..25; row 1: 3..8 | 8..13
    r = mamba2([0, 20, 30], [5, 3], checkpoint_offsets=[4, 0])
    assert r.cu_chunk_seqlens == [0, 3, 4, 11, 19, 20, 25, 30]
    assert r.seq_idx == [0, 0, 0, 0, 0, 1, 1]
    assert r.last_chunk_indices == [4, 6]
    assert r.checkpoint_chunk_idx == [1, 0]
    # a checkpoint at the row's end, mid-chunk: the empty rest is a chunk; index 0 reads as "none"
    r = mamba2([0, 4], [1], checkpoint_offsets=[4])
    assert (r.cu_chunk_seqlens, r.last_chunk_indices, r.checkpoint_chunk_idx) == ([0, 4, 4], [1], [0])
    assert mamba2([0, 4], [1], checkpoint_offsets=[0]).checkpoint_chunk_idx is None


def test_mamba2_one_token_rows_and_decode_first_slice():
    q = [0, 1, 2, 22, 23, 24]  # 2 decodes (not in the slice), a 20-token prefill, 2 one-token rows
    r = mamba2(q, [5, 30, 8], first_seq=2)
    assert r.cu_chunk_seqlens == [0, 3, 11, 19, 20, 21, 22]
    assert r.seq_idx == [0, 0, 0, 0, 1, 2]
    assert r.last_chunk_indices == [3, 4, 5]


def test_mamba2_empty_batch():
    for q, first in (([0], 0), ([0, 1, 2], 2)):
        r = mamba2(q, [], first_seq=first)
        assert (r.cu_chunk_seqlens, r.seq_idx, r.last_chunk_indices) == ([0], [], [])
        assert (r.checkpoint_chunk_idx, r.num_chunks, r.prep_initial_states) == (None, 0, False)


def test_mamba2_rejects_bad_host_data():
    import pytest

    for computed, kw in (
        ([1, 2], {}),
        ([-1], {}),
        ([0], {"checkpoint_offsets": [5]}),
        ([0], {"checkpoint_offsets": []}),
    ):
        with pytest.raises(ValueError):
            mamba2([0, 4], computed, **kw)


# --- Mamba2 SSD tables, SGLang's convention ---------------------------------------------------


def test_sglang_logical_chunks():
    f = reference.sglang_chunk_indices_offsets
    assert f([0, 5, 10], 8) == ([0, 0, 1], [0, 5, 0])  # SGLang's docstring example
    assert f([0, 3, 20, 21, 40], 8) == ([0, 0, 1, 2, 2, 2, 3, 4], [0, 3, 0, 0, 4, 5, 0, 0])
    assert f([0, 5, 5, 10], 8) == ([0, 0, 0, 1], [0, 5, 5, 0])  # empty row mid-chunk: an empty chunk
    assert f([0, 8, 8, 10], 8) == ([0, 1], [0, 0])  # empty row on a boundary: none
    assert f([0], 8) == ([], [])


def test_sglang_prepare_mixed_without_and_with_prefixes():
    r = reference.sglang_mamba2_mixed([0, 5, 10], [0, 0], 8)
    assert r.seq_idx == [[0] * 5 + [1] * 5]
    assert (r.chunk_indices, r.chunk_offsets, r.prep_initial_states) == (None, None, False)
    assert (r.has_initial_states, r.num_prefills, r.num_prefill_tokens) == ([False, False], 2, 10)
    r = reference.sglang_mamba2_mixed([0, 5, 10], [0, 3], 8)
    assert (r.chunk_indices, r.chunk_offsets, r.has_initial_states) == ([0, 0, 1], [0, 5, 0], [False, True])


def test_sglang_prepare_mixed_one_token_rows_and_decodes():
    r = reference.sglang_mamba2_mixed([0, 1, 2, 12], [4, 9, 0], 8)  # one-token extends with prefixes
    assert (r.chunk_indices, r.chunk_offsets) == ([0, 0, 0, 1], [0, 1, 2, 0])
    # decodes after the extend rows: in has_initial_states, not in seq_idx or prep_initial_states
    r = reference.sglang_mamba2_mixed([0, 5, 10, 11, 12], [0, 0, 7, 9], 8, num_prefills=2)
    assert r.seq_idx == [[0] * 5 + [1] * 5] and r.chunk_indices is None
    assert r.has_initial_states == [False, False, True, True] and r.prep_initial_states is False
    r = reference.sglang_mamba2_mixed([0], [], 8)
    assert (r.seq_idx, r.chunk_indices, r.num_prefills, r.num_prefill_tokens) == ([[]], None, 0, 0)


# --- invariants --------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CHUNK_SIZES = st.sampled_from([1, 2, 8, 16, 64, 256])


@st.composite
def prefill_rows(draw, max_rows=12, max_len=300):
    """(query_start_loc, computed, checkpoint_offsets or None, chunk_size) with zero-length rows,
    one-token rows, chunk-aligned and unaligned prefixes."""
    chunk_size = draw(CHUNK_SIZES)
    lengths = draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, max_len)), max_size=max_rows))
    computed = [
        draw(st.one_of(st.just(0), st.integers(0, 4).map(lambda k: k * chunk_size), st.integers(0, 1000)))
        for _ in lengths
    ]
    checkpoints = None
    if draw(st.booleans()):
        checkpoints = [draw(st.integers(0, n)) if draw(st.booleans()) else 0 for n in lengths]
    q = [0]
    for n in lengths:
        q.append(q[-1] + n)
    return q, computed, checkpoints, chunk_size


@settings(max_examples=300, deadline=None)
@given(prefill_rows())
def test_mamba2_invariants(case):
    q, computed, checkpoints, cs = case
    r = reference.mamba2_chunk_metadata(q, computed, cs, checkpoint_offsets=checkpoints)
    cu, n = r.cu_chunk_seqlens, len(q) - 1
    assert cu[0] == 0 and cu[-1] == q[-1] and len(cu) == r.num_chunks + 1 == len(r.seq_idx) + 1
    assert all(cu[k] <= cu[k + 1] for k in range(r.num_chunks))
    assert r.seq_idx == sorted(r.seq_idx) and len(r.last_chunk_indices) == n
    ckpt = checkpoints or [0] * n
    for k in range(r.num_chunks):
        i = r.seq_idx[k]
        assert q[i] <= cu[k] <= cu[k + 1] <= q[i + 1]  # within one row
        start = computed[i] + cu[k] - q[i]  # absolute positions
        end = computed[i] + cu[k + 1] - q[i]
        if end > start:
            assert start // cs == (end - 1) // cs  # never across an absolute chunk boundary
        ends_row_or_checkpoint = cu[k + 1] in (q[i + 1], q[i] + ckpt[i])
        assert end % cs == 0 or ends_row_or_checkpoint  # no needless cut
        if end == start:  # an empty chunk only finishes a partial chunk at a segment's end
            assert start % cs != 0 and ends_row_or_checkpoint
    last = -1
    for i in range(n):
        mine = [k for k in range(r.num_chunks) if r.seq_idx[k] == i]
        if mine:
            assert mine == list(range(mine[0], mine[-1] + 1)) and mine[0] == last + 1  # contiguous
            last = mine[-1]
        assert r.last_chunk_indices[i] == last
        if q[i + 1] > q[i] and not ckpt[i]:  # one chunk per absolute chunk the row touches
            assert len(mine) == (computed[i] + q[i + 1] - q[i] - 1) // cs - computed[i] // cs + 1
    if any(ckpt):
        for i in range(n):
            if ckpt[i]:
                assert cu[r.checkpoint_chunk_idx[i] + 1] == q[i] + ckpt[i]
                assert r.seq_idx[r.checkpoint_chunk_idx[i]] == i
            else:
                assert r.checkpoint_chunk_idx[i] == 0
    else:
        assert r.checkpoint_chunk_idx is None
    assert r.has_initial_states == [c > 0 for c in computed]


@settings(max_examples=300, deadline=None)
@given(prefill_rows())
def test_conv_invariants(case):
    q = case[0]
    r = reference.causal_conv1d_metadata(q)
    n = len(q) - 1
    assert r.nums == [-(-(q[i + 1] - q[i]) // 8) for i in range(n)] and r.tot == sum(r.nums)
    pairs = list(zip(r.batch_ptr, r.token_chunk_offset_ptr, strict=True))
    assert pairs == sorted(pairs) and len(set(pairs)) == r.tot  # by row then block, no repeats
    for i in range(n):
        assert [b for row, b in pairs if row == i] == list(range(r.nums[i]))
    for row, b in pairs:
        assert q[row] + 8 * b < q[row + 1]  # every block starts inside its row
    assert len(r.padded_batch_ptr) == 2 * max(1024, r.tot) and r.padded_batch_ptr[: r.tot] == r.batch_ptr
    assert set(r.padded_batch_ptr[r.tot :]) <= {-1} and set(r.padded_token_chunk_offset_ptr[r.tot :]) <= {-1}


@settings(max_examples=300, deadline=None)
@given(prefill_rows())
def test_sglang_logical_chunk_invariants(case):
    q, _, _, cs = case
    indices, offsets = reference.sglang_chunk_indices_offsets(q, cs)
    # SGLang's own count: the physical chunks plus one per row boundary inside a physical chunk
    assert len(indices) == len(offsets) == -(-q[-1] // cs) + sum(1 for b in q[1:-1] if b % cs)
    starts = [p * cs + o for p, o in zip(indices, offsets, strict=True)]
    assert starts == sorted(starts) and all(0 <= o < cs for o in offsets)
    assert sorted(set(starts)) == sorted({b for b in q[:-1] if b < q[-1] or b % cs} | set(range(0, q[-1], cs)))
    # for non-empty rows, the vLLM chunks of rows whose prefix is their packed start
    if all(q[i + 1] > q[i] for i in range(len(q) - 1)):
        r = reference.mamba2_chunk_metadata(q, q[:-1], cs)
        assert [(c // cs, c % cs) for c in r.cu_chunk_seqlens[:-1]] == list(zip(indices, offsets, strict=True))
