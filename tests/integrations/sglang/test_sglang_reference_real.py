"""chunkmeta.reference's Mamba2 and conv tables against SGLang 0.5.23's own functions, on CPU.

`make test-sglang`; skipped without SGLang; tests/integrations/sglang/sglang_cpu_stubs.py stands in
for torchvision. Seeded random batches (zero-length, one-token and long rows, with and without
cached prefixes) and hand-picked edge cases; the engine's function runs on CPU tensors and every
output is compared with the reference, dtypes included.

- `Mamba2Metadata._query_start_loc_to_chunk_indices_offsets` itself (on CPU its 0-d tensor loop
  runs without syncing anything).
- `Mamba2Metadata.prepare_mixed` itself, on SGLang's own `ForwardMetadata` and a duck-typed
  ForwardBatch carrying exactly the fields it reads (no radix-cache tracking).
- The GDN conv block table: `GDNAttnBackend._init_prefill_conv_block_table`, which returns early
  off CUDA, so `gdn_backend.is_cuda` is patched to True and it runs on a duck-typed backend (its
  pinned copy is off on CPU).
"""

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (make test-sglang builds a venv with it)", allow_module_level=True)

import sglang_cpu_stubs

sglang_cpu_stubs.install()  # before any SGLang import: its config modules import torchvision

from sglang.srt.layers.attention.linear import gdn_backend
from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata, Mamba2Metadata
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from chunkmeta import reference


def qsl_of(lengths):
    return [0, *np.cumsum(lengths, dtype=np.int64).tolist()]


def random_lengths(rng, chunk_size, max_rows=12):
    kinds = rng.integers(0, 4, int(rng.integers(0, max_rows + 1)))  # empty, one token, short, long
    return [[0, 1, int(rng.integers(2, 2 * chunk_size + 2)), int(rng.integers(2, 6 * chunk_size))][k] for k in kinds]


def crashes_sglang(q, chunk_size):
    """SGLang's loop writes `chunk_offsets[_s]` for every row after the first, one past its table
    when the last row is empty and starts on a physical boundary: IndexError (the reference gives
    that row no logical chunk)."""
    return len(q) > 2 and q[-1] == q[-2] and q[-1] % chunk_size == 0


EDGE = [  # (lengths, chunk size)
    ([5, 5], 8),  # SGLang's docstring example
    ([3, 17, 1, 19], 8),
    ([5, 0, 5], 8),  # an empty row mid-chunk: an empty logical chunk
    ([8, 0, 2], 8),  # an empty row on a boundary: none
    ([5, 0], 8),  # a trailing empty row mid-chunk
    ([0, 5], 8),
    ([1, 1, 1, 300], 64),  # one-token rows before a long one
    ([64, 64], 64),
    ([], 8),
    ([0], 8),
    ([8, 0], 8),  # crashes SGLang
    ([0, 0], 8),  # crashes SGLang
]


def batches(seed=0, count=300):
    yield from EDGE
    rng = np.random.default_rng(seed)
    for _ in range(count):
        chunk_size = int(rng.choice([1, 8, 16, 64, 256]))
        yield random_lengths(rng, chunk_size), chunk_size


def test_logical_chunk_indices_offsets_match_sglang():
    compared = crashed = 0
    for lengths, chunk_size in batches():
        q = qsl_of(lengths)
        qt = torch.tensor(q, dtype=torch.int32)
        if crashes_sglang(q, chunk_size):
            with pytest.raises(IndexError):
                Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(qt, chunk_size, q[-1])
            crashed += 1
            continue
        indices, offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(qt, chunk_size, q[-1])
        ref_indices, ref_offsets = reference.sglang_chunk_indices_offsets(q, chunk_size)
        assert indices.dtype == offsets.dtype == torch.int32
        assert (indices.tolist(), offsets.tolist()) == (ref_indices, ref_offsets), (lengths, chunk_size)
        compared += 1
    assert compared >= 250 and crashed >= 2


def forward_batch(lengths, prefix_lens, num_prefills):
    """The ForwardBatch fields prepare_mixed reads: rows ``[0, num_prefills)`` are the extend rows."""
    mode = ForwardMode.EXTEND if num_prefills == len(lengths) else ForwardMode.MIXED
    extend = lengths[:num_prefills]
    return SimpleNamespace(
        extend_num_tokens=sum(extend),
        logical_forward_mode=mode,
        forward_mode=mode,
        extend_seq_lens_cpu=extend,
        extend_seq_lens=torch.tensor(extend, dtype=torch.int32),
        seq_lens=torch.tensor([p + n for p, n in zip(prefix_lens, lengths, strict=True)], dtype=torch.int64),
        extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        spec_info=None,
        mamba_track_mask=None,
    )


def mixed_batches():
    yield [5, 5], [0, 0], 2, 8  # no cached prefix: no logical chunk tables
    yield [5, 5], [0, 3], 2, 8
    yield [1, 1, 10], [4, 9, 0], 3, 8  # one-token extends with prefixes
    yield [5, 5, 1, 1], [0, 0, 7, 9], 2, 8  # decodes after the extend rows
    yield [5, 0, 5], [2, 0, 0], 3, 8
    yield [], [], 0, 8
    rng = np.random.default_rng(1)
    for _ in range(200):
        chunk_size = int(rng.choice([1, 8, 16, 64, 256]))
        lengths = random_lengths(rng, chunk_size)
        prefix_lens = [
            [0, int(rng.integers(1, 4)) * chunk_size, int(rng.integers(1, 4 * chunk_size))][int(rng.integers(0, 3))]
            for _ in lengths
        ]
        num_prefills = len(lengths) - int(rng.integers(0, min(3, len(lengths)) + 1))
        yield lengths, prefix_lens, num_prefills, chunk_size


def test_prepare_mixed_matches_sglang():
    compared = 0
    for lengths, prefix_lens, num_prefills, chunk_size in mixed_batches():
        q = qsl_of(lengths)
        ref = reference.sglang_mamba2_mixed(q, prefix_lens, chunk_size, num_prefills=num_prefills)
        if ref.prep_initial_states and crashes_sglang(q[: num_prefills + 1], chunk_size):
            continue  # covered above
        qt = torch.tensor(q, dtype=torch.int32)
        meta = ForwardMetadata(query_start_loc=qt, mamba_cache_indices=torch.zeros(len(lengths), dtype=torch.int32))
        got = Mamba2Metadata.prepare_mixed(meta, chunk_size, forward_batch(lengths, prefix_lens, num_prefills))
        case = (lengths, prefix_lens, num_prefills, chunk_size)
        mixed = got.mixed_metadata
        assert (got.num_prefills, got.num_prefill_tokens) == (ref.num_prefills, ref.num_prefill_tokens), case
        assert got.num_decodes == len(lengths) - num_prefills, case
        assert got.query_start_loc.tolist() == q[: num_prefills + 1], case
        assert mixed.seq_idx.dtype == torch.int32 and mixed.seq_idx.tolist() == ref.seq_idx, case
        assert mixed.has_initial_states.dtype == torch.bool, case
        assert mixed.has_initial_states.tolist() == ref.has_initial_states, case
        assert mixed.prep_initial_states == ref.prep_initial_states, case
        if ref.chunk_indices is None:
            assert mixed.chunk_indices is None and mixed.chunk_offsets is None, case
        else:
            assert mixed.chunk_indices.dtype == mixed.chunk_offsets.dtype == torch.int32
            assert mixed.chunk_indices.tolist() == ref.chunk_indices, case
            assert mixed.chunk_offsets.tolist() == ref.chunk_offsets, case
        compared += 1
    assert compared >= 190


def test_gdn_conv_block_table_matches_sglang(monkeypatch):
    monkeypatch.setattr(gdn_backend, "is_cuda", lambda: True)
    assert gdn_backend.CAUSAL_CONV1D_FWD_BLOCK_M == reference.CONV_BLOCK_M
    rng = np.random.default_rng(2)
    cases = [[], [64, 60], [1, 1, 1, 1, 36], [1] * 8 + [80], [1] * 7 + [40], [1] * 4 + [128], [1] * 4 + [129]]
    cases += [[0, 0, 1, 200]]
    cases += [random_lengths(rng, 64, max_rows=40) for _ in range(200)]
    built = 0
    for lengths in cases:
        q = torch.tensor(qsl_of(lengths), dtype=torch.int32)
        backend = SimpleNamespace(
            forward_metadata=SimpleNamespace(query_start_loc=q, conv_block_table=None), mis_metadata=None, device="cpu"
        )
        batch = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND, tbo_parent_token_range=None, extend_seq_lens_cpu=lengths
        )
        gdn_backend.GDNAttnBackend._init_prefill_conv_block_table(backend, batch)
        table = backend.forward_metadata.conv_block_table
        ref = reference.sglang_conv_block_table(lengths)
        if ref is None:
            assert table is None, lengths
        else:
            assert table.dtype == torch.int32 and table.shape == (len(ref), 2), lengths
            assert [tuple(pair) for pair in table.tolist()] == ref, lengths
            # the same pairs as vLLM's tables over the same rows
            conv = reference.causal_conv1d_metadata(q.tolist())
            assert ref == list(zip(conv.batch_ptr, conv.token_chunk_offset_ptr, strict=True))
            built += 1
    assert built >= 20
