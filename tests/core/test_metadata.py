"""ChunkMetadata is a frozen value: no attribute can be set, nothing reads device memory."""

import attrs
import pytest
import torch

from checks import tensors_for
from chunkmeta import ChunkMetadata, build_chunk_metadata
from chunkmeta.workloads import from_lengths


def _md():
    return build_chunk_metadata(*tensors_for(from_lengths([0, 64, 100])))


def test_cannot_be_mutated():
    md = _md()
    for name in ("cu_seqlens", "chunk_indices", "num_chunks", "num_seqs", "chunk_size", "generation"):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(md, name, 0)
    with pytest.raises((AttributeError, attrs.exceptions.FrozenInstanceError)):
        md.new_field = 1  # slotted: no new attributes either
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        del md.num_tokens


def test_hints():
    md = _md()
    assert md.max_seqlen == 100 and not md.is_aligned and md.single_seqlen is None
    aligned = build_chunk_metadata(*tensors_for(from_lengths([0, 128, 0])))
    assert aligned.is_aligned and aligned.single_seqlen == 128


def test_fla_kwargs_are_the_tensors_themselves():
    md = _md()
    kw = md.fla_kwargs()
    assert set(kw) == {"cu_seqlens", "chunk_indices", "chunk_offsets"}
    assert kw["chunk_indices"] is md.chunk_indices


def test_repr_reads_host_ints_only():
    md = _md()
    text = repr(md)
    assert "N=3 T=164 NT=3 C=64" in text and "layout=exact" in text
    assert md.describe() in text


def test_validators_reject_non_tensors():
    with pytest.raises(ValueError):
        ChunkMetadata([0], torch.zeros(1), torch.zeros(0, 2), torch.zeros(1), 64, 0, 0, 0, 0)
