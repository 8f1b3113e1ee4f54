"""A drop-in for the ROCm Kimi-K3 helper ``vllm.models.kimi_k3.amd.kda_metadata.prepare_chunk_metadata_device``."""

from __future__ import annotations

import torch

from chunkmeta.builder import build_chunk_metadata
from chunkmeta.errors import ChunkMetaError


def prepare_chunk_metadata_device(
    cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for ``vllm.models.kimi_k3.amd.kda_metadata.prepare_chunk_metadata_device``.

    Same signature and outputs: ``chunk_indices`` ``[NT, 2]`` in ``cu_seqlens``' dtype (exact
    NT, true sequence indices), ``chunk_offsets`` int64 ``[N+1]``, fresh tensors on
    ``cu_seqlens``' device; sizes from ``cu_seqlens_cpu`` only (no sync). chunkmeta's fill is
    parallel over chunks where vLLM 0.33.0's kernel loops over each sequence's chunks.
    ``chunk_size`` must be a power of two in [16, 4096] (FLA uses 64).
    """
    try:
        metadata = build_chunk_metadata(
            cu_seqlens, cu_seqlens_cpu, chunk_size=chunk_size, indices_dtype=_indices_dtype(cu_seqlens)
        )
    except ChunkMetaError as exc:
        # The core names its inputs query_start_loc(_cpu); here they are cu_seqlens(_cpu).
        raise ChunkMetaError(str(exc).replace("query_start_loc", "cu_seqlens")) from None
    return metadata.chunk_indices, metadata.chunk_offsets


def _indices_dtype(cu_seqlens) -> torch.dtype:
    """``chunk_indices``' dtype: ``cu_seqlens``' (the fill writes it, so there is no cast per
    call); int32 for anything else, which the core then refuses with its own message."""
    dtype = getattr(cu_seqlens, "dtype", None)
    return torch.int64 if dtype == torch.int64 else torch.int32
