"""chunkmeta.reference's conv1d and Mamba2 SSD tables against vLLM 0.33.0's own functions, on CPU.

`make test-vllm`; skipped without vLLM. Seeded random batches (decodes first, then prefill rows of
zero, one and many tokens, chunk-aligned and unaligned prefixes, checkpoints) and hand-picked edge
cases; the engine's function is called on CPU tensors and every output is compared with the
reference, dtypes included.

- Conv tables: `compute_causal_conv1d_metadata` itself (it takes the CPU `query_start_loc` and a
  device; on CPU its pinned staging is off and its copies are plain).
- Mamba2 SSD tables: the builder's `build` needs a whole model config, so this calls the piece of it
  that makes the tables, `BaseMambaAttentionMetadataBuilder._build_chunk_metadata_tensors`, on a
  builder made without `__init__` and duck-typed metadata carrying exactly the fields it reads
  (`seq_lens_cpu_upper_bound`, `query_start_loc_cpu`, `query_start_loc`; `num_prefills`,
  `num_reqs`, `num_decode_tokens`). It derives each prefill row's computed tokens from the
  sequence lengths, slices and rebases the prefill rows, runs `_compute_chunk_metadata`, and makes
  the device tensors, `checkpoint_chunk_idx`'s "0 = none" and None included.
"""

import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform

mamba2_attn = pytest.importorskip("vllm.v1.attention.backends.mamba2_attn")
backend_utils = pytest.importorskip("vllm.v1.attention.backends.utils")

from chunkmeta import reference

CPU = torch.device("cpu")


def qsl_of(lengths):
    return [0, *np.cumsum(lengths, dtype=np.int64).tolist()]


def random_batch(rng, chunk_size):
    """(decode lengths, prefill lengths, prefill computed tokens, checkpoint offsets or None)."""
    decodes = [1] * int(rng.integers(0, 5))
    num_prefills = int(rng.integers(0, 9))
    kinds = rng.integers(0, 4, num_prefills)  # empty, one token, short, long
    lengths = [[0, 1, int(rng.integers(2, 2 * chunk_size + 2)), int(rng.integers(2, 6 * chunk_size))][k] for k in kinds]
    computed = [
        [0, int(rng.integers(0, 5)) * chunk_size, int(rng.integers(0, 4 * chunk_size))][int(rng.integers(0, 3))]
        for _ in lengths
    ]
    checkpoints = None
    if num_prefills and rng.random() < 0.4:
        checkpoints = [int(rng.integers(0, n + 1)) if rng.random() < 0.6 else 0 for n in lengths]
    return decodes, lengths, computed, checkpoints


EDGE_BATCHES = [  # (decodes, prefill lengths, computed, checkpoints), chunk size 8
    ([], [20], [5], None),  # partial first chunk
    ([], [20, 25], [16, 0], None),  # chunk-aligned prefix
    ([1, 1], [10, 0, 0, 4], [0, 3, 8, 0], None),  # zero-length rows mid-chunk and on a boundary
    ([], [0, 8], [0, 0], None),  # an empty first row on a boundary: last chunk -1
    ([], [20, 10], [5, 3], [4, 0]),  # a checkpoint
    ([], [4], [1], [4]),  # a checkpoint at the row's end
    ([1], [20, 1, 1], [5, 30, 8], None),  # one-token rows among prefills
    ([1, 1, 1], [], [], None),  # decodes only: empty prefill slice
    ([], [], [], None),  # empty batch
]


def random_batches(seed=0, count=300):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        chunk_size = int(rng.choice([1, 8, 16, 64, 256]))
        yield (*random_batch(rng, chunk_size), chunk_size)


def all_batches():
    yield from ((*batch, 8) for batch in EDGE_BATCHES)
    yield from random_batches()


def vllm_ssd_tables(decodes, lengths, computed, checkpoints, chunk_size):
    builder = object.__new__(mamba2_attn.Mamba2AttentionMetadataBuilder)
    qsl = torch.tensor(qsl_of(decodes + lengths), dtype=torch.int32)
    seq_lens = torch.tensor(
        [1] * len(decodes) + [c + n for c, n in zip(computed, lengths, strict=True)], dtype=torch.int64
    )
    m = SimpleNamespace(seq_lens_cpu_upper_bound=seq_lens, query_start_loc_cpu=qsl, query_start_loc=qsl.clone())
    common = SimpleNamespace(
        num_prefills=len(lengths), num_reqs=len(decodes) + len(lengths), num_decode_tokens=len(decodes)
    )
    return builder._build_chunk_metadata_tensors(chunk_size, common, m, checkpoints)


def test_mamba2_ssd_tables_match_vllm():
    count = 0
    for decodes, lengths, computed, checkpoints, chunk_size in all_batches():
        case = (decodes, lengths, computed, checkpoints, chunk_size)
        cu, seq_idx, last, ckpt = vllm_ssd_tables(*case)
        ref = reference.mamba2_chunk_metadata(
            qsl_of(decodes + lengths), computed, chunk_size, first_seq=len(decodes), checkpoint_offsets=checkpoints
        )
        assert (cu.dtype, seq_idx.dtype, last.dtype) == (torch.int32,) * 3, case
        assert cu.tolist() == ref.cu_chunk_seqlens, case
        assert seq_idx.tolist() == ref.seq_idx, case
        assert last.tolist() == ref.last_chunk_indices, case
        if ref.checkpoint_chunk_idx is None:
            assert ckpt is None, case
        else:
            assert ckpt.dtype == torch.int64 and ckpt.tolist() == ref.checkpoint_chunk_idx, case
        count += 1
    assert count >= 300


def test_mamba2_compute_chunk_metadata_on_an_empty_batch():
    cu, seq_idx, last, ckpt = mamba2_attn.Mamba2AttentionMetadataBuilder._compute_chunk_metadata(
        8, 0, torch.zeros(0, dtype=torch.int64), torch.tensor([0], dtype=torch.int32), None
    )
    ref = reference.mamba2_chunk_metadata([0], [], 8)
    assert (cu, seq_idx, last, ckpt) == (ref.cu_chunk_seqlens, ref.seq_idx, ref.last_chunk_indices, [])


def test_mamba2_prefill_cpu_metadata_gives_the_computed_tokens_and_initial_states():
    """`build`'s `prep_initial_states` is `any(computed > 0)` over what `_prefill_cpu_metadata` gives."""
    builder = object.__new__(mamba2_attn.Mamba2AttentionMetadataBuilder)
    for decodes, lengths, computed, _, chunk_size in random_batches(seed=1, count=100):
        qsl = torch.tensor(qsl_of(decodes + lengths), dtype=torch.int32)
        seq_lens = torch.tensor(
            [1] * len(decodes) + [c + n for c, n in zip(computed, lengths, strict=True)], dtype=torch.int64
        )
        m = SimpleNamespace(seq_lens_cpu_upper_bound=seq_lens, query_start_loc_cpu=qsl)
        got_computed, got_qsl = builder._prefill_cpu_metadata(
            m, len(decodes) + len(lengths), len(lengths), len(decodes)
        )
        ref = reference.mamba2_chunk_metadata(qsl.tolist(), computed, chunk_size, first_seq=len(decodes))
        assert got_qsl.tolist() == reference.chunk_metadata(qsl.tolist(), chunk_size, first_seq=len(decodes)).cu_seqlens
        assert (got_computed > 0).tolist() == ref.has_initial_states
        assert bool((got_computed > 0).any()) == ref.prep_initial_states


def test_mamba2_exported_varlen_helper_is_the_packed_start_case():
    """`compute_varlen_chunk_metadata` chunks on packed positions: the reference with each row's
    computed tokens at its packed start (rows of at least one token; it gives -1 to empty ones)."""
    rng = np.random.default_rng(2)
    for _ in range(200):
        chunk_size = int(rng.choice([1, 8, 64, 256]))
        q = qsl_of(rng.integers(1, 4 * chunk_size + 2, int(rng.integers(1, 9))).tolist())
        cu, last, seq_idx = mamba2_attn.compute_varlen_chunk_metadata(torch.tensor(q, dtype=torch.int32), chunk_size)
        ref = reference.mamba2_chunk_metadata(q, q[:-1], chunk_size)
        assert (cu.tolist(), seq_idx.tolist(), last.tolist()) == (
            ref.cu_chunk_seqlens,
            ref.seq_idx,
            ref.last_chunk_indices,
        ), (q, chunk_size)


CONV_EDGE = [[], [0], [0, 0], [1, 1, 70, 0, 130], [8, 9, 7, 16], [0, 0, 300], [8 * 1500 - 3], [1] * 1100 + [0] * 3]


def conv_batches():
    yield from CONV_EDGE
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        kinds = rng.integers(0, 4, n)
        yield [[0, 1, int(rng.integers(2, 40)), int(rng.integers(40, 3000))][k] for k in kinds]


def test_causal_conv1d_tables_match_vllm():
    for lengths in conv_batches():
        q = qsl_of(lengths)
        nums_dict, batch_ptr, offset_ptr = backend_utils.compute_causal_conv1d_metadata(
            torch.tensor(q, dtype=torch.int32), device=CPU
        )
        ref = reference.causal_conv1d_metadata(q)
        d = nums_dict[reference.CONV_BLOCK_M]
        assert list(nums_dict) == [reference.CONV_BLOCK_M]
        assert d["nums"].tolist() == ref.nums, lengths
        assert d["tot"] == d["mlist_len"] == ref.tot, lengths
        assert d["mlist"].tolist() == ref.batch_ptr and d["offsetlist"].tolist() == ref.token_chunk_offset_ptr
        assert batch_ptr.dtype == offset_ptr.dtype == torch.int32
        assert batch_ptr.tolist() == ref.padded_batch_ptr, lengths
        assert offset_ptr.tolist() == ref.padded_token_chunk_offset_ptr, lengths
        assert d["batch_ptr"] is batch_ptr and d["token_chunk_offset_ptr"] is offset_ptr
        assert backend_utils.PAD_SLOT_ID == reference.PAD_SLOT_ID
