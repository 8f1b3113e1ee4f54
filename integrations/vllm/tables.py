"""Which step tables a vLLM builder gets from its one ``StepTablesBuilder``, and their vLLM fields.

One builder per vLLM metadata builder (sized from the scheduler config: ``max_num_seqs`` rows,
``max_num_batched_tokens`` tokens, CUDA-graph padding rows included), one launch per step:

* GDN family (``GDNAttentionMetadataBuilder``, Kimi-K3's): ``fla`` (the prefill slice that
  ``_build_chunk_metadata`` receives: decodes peeled off, rebased), ``fla_batch`` (every non-spec
  row: the ``cu_seqlens`` that Kimi-Linear, Kimi-K3, GLM5-next, OLMo-Hybrid and Bailing-V3 pass),
  ``conv`` (the causal-conv1d tables over the non-spec rows, as vLLM builds them there).
* Mamba family (Mamba1, Mamba2, ShortConv): ``conv`` over the prefill rows; Mamba2 adds ``ssd``,
  its SSD chunk tables (chunks on absolute positions, checkpoint boundaries in align mode).
"""

from __future__ import annotations

import attrs
import torch

from chunkmeta import tables
from chunkmeta.errors import ChunkMetaError
from chunkmeta.metadata import ChunkMetadata, ConvBlocks, Mamba2Chunks
from chunkmeta.step_builder import StepTablesBuilder

# vllm.third_party.flash_linear_attention.ops.utils.FLA_CHUNK_SIZE: every FLA caller uses it.
FLA_CHUNK_SIZE = 64
# causal_conv1d_fn's BLOCK_M: compute_causal_conv1d_metadata fills nums_dict for 8 only.
CONV_BLOCK_M = 8
# A vLLM builder builds once per step (DBO micro-batches have builders of their own), and only
# that step's forward reads the tables. On one stream the next fill queues after that forward,
# so the GPU side is safe at any depth; four slots also keep a step's tables intact while the
# host runs up to three steps ahead (async scheduling).
RING_DEPTH = 4
CUTEDSL = "cutedsl"


@attrs.frozen
class Serves:
    """The tables one vLLM builder class takes from chunkmeta."""

    fla: bool = False  # GDN family: the hook's tables, and fla_batch for the router
    conv: bool = False
    ssd: bool = False  # Mamba2


def specs(serves: Serves, *, prefill_backend: str | None = None, mamba_chunk_size: int | None = None) -> dict:
    """The ``StepTablesBuilder`` table specs for ``serves``. CuteDSL GDN reads int32
    ``chunk_offsets``, which the fill writes as such (no cast per step)."""
    out = {}
    if serves.fla:
        offsets = torch.int32 if prefill_backend == CUTEDSL else torch.int64
        # no fresh cu_seqlens objects: vLLM's layers and the router see vLLM's own tensors only
        out["fla"] = tables.Fla(FLA_CHUNK_SIZE, rows="prefill", offsets_dtype=offsets, fresh_cu_seqlens=False)
        out["fla_batch"] = tables.Fla(FLA_CHUNK_SIZE, rows="batch", fresh_cu_seqlens=False)
    if serves.conv:
        # GDN's conv runs over the non-spec rows (the batch slice here); Mamba's over the prefill
        # rows, which its build is handed as a whole query_start_loc (the batch slice again).
        out["conv"] = tables.Conv(rows="batch", block_m=CONV_BLOCK_M)
    if serves.ssd:
        try:
            out["ssd"] = tables.Mamba2(mamba_chunk_size, checkpoints=True)
        except ChunkMetaError as exc:
            raise ChunkMetaError(f"the model's Mamba2 chunk size (the builder's chunk_size): {exc}") from None
    return out


def step_builder(vllm_config, device, table_specs: dict) -> StepTablesBuilder:
    """The builder of one vLLM metadata builder; a limit chunkmeta cannot hold is named by vLLM's
    own setting (the scheduler config's, the ``vllm serve`` flags)."""
    scheduler = vllm_config.scheduler_config
    try:
        return StepTablesBuilder(
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
            tables=table_specs,
            device=device,
            ring_depth=RING_DEPTH,
        )
    except ChunkMetaError as exc:
        raise ChunkMetaError(
            f"sized from vLLM's max_num_seqs={scheduler.max_num_seqs!r} / max_num_batched_tokens="
            f"{scheduler.max_num_batched_tokens!r} (--max-num-seqs / --max-num-batched-tokens): {exc}"
        ) from None


def warm_up(builder: StepTablesBuilder) -> None:
    """One build when vLLM creates its builder: the fill kernel and the host plan compile at
    startup rather than in the first request's step, and a fill that cannot run on this platform
    shows up here, where the builder can still keep vLLM's own path. Uses one ring slot."""
    qsl_cpu = torch.tensor([0, 1], dtype=torch.int32)  # int32, as vLLM's
    rows = {}
    if builder.needs_computed:
        zero = torch.zeros(1, dtype=torch.int32)
        rows.update(num_computed_tokens=zero.to(builder.device), num_computed_tokens_cpu=zero)
        if builder.needs_checkpoints:
            rows.update(checkpoint_offsets=zero.to(builder.device), checkpoint_offsets_cpu=zero)
    builder.build(qsl_cpu.to(builder.device), qsl_cpu, **rows)


def fla_fields(metadata: ChunkMetadata, query_start_loc: torch.Tensor, prefill_backend: str | None):
    """``(chunk_indices, chunk_offsets)`` as ``_build_chunk_metadata`` returns them.

    CuteDSL takes int32 ``chunk_indices [UB, 2]`` with any ``UB >= NT`` (it sizes its workspaces
    from ``UB`` and never reads rows past ``NT``) and int32 ``chunk_offsets [N+1]`` whose last
    entry, the real ``NT``, its persistent kernels read on the device: chunkmeta knows ``NT``
    exactly, so ``UB = NT``. Elsewhere vLLM's helpers give ``chunk_indices`` the dtype of
    ``cu_seqlens`` (int32 in every runner) and int64 offsets.
    """
    if prefill_backend == CUTEDSL:
        if metadata.chunk_offsets.dtype != torch.int32:
            raise ChunkMetaError("CuteDSL GDN reads int32 chunk_offsets: build with offsets_dtype=torch.int32.")
        return metadata.chunk_indices, metadata.chunk_offsets
    chunk_indices = metadata.chunk_indices
    if chunk_indices.dtype != query_start_loc.dtype:
        chunk_indices = chunk_indices.to(query_start_loc.dtype)
    return chunk_indices, metadata.chunk_offsets


def conv_fields(conv: ConvBlocks) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """``(nums_dict, batch_ptr, token_chunk_offset_ptr)`` as ``compute_causal_conv1d_metadata``
    returns them, for ``causal_conv1d_fn`` (model_executor/layers/mamba/ops/causal_conv1d.py).

    Its grid is ``nums_dict[8]["tot"]`` and its kernel reads ``batch_ptr`` /
    ``token_chunk_offset_ptr`` at ``pid < tot`` only, so the tables are exactly ``tot`` long (vLLM
    allocates ``2 * max(1024, tot)`` filled with ``PAD_SLOT_ID``). It looks up ``mlist``,
    ``mlist_len`` and ``offsetlist`` but uses them only when ``batch_ptr`` is None, so they name
    the same device tables (vLLM's are pinned host copies of them); ``nums`` is never read and
    is left out (vLLM's is a host tensor of per-row block counts: a host computation per step).
    """
    if conv.batch_ptr is None:
        raise ChunkMetaError("vLLM's causal_conv1d_fn reads two tables: build Conv(paired=False).")
    batch_ptr, offsets = conv.batch_ptr, conv.token_chunk_offset_ptr
    entry = {
        "tot": conv.tot,
        "mlist": batch_ptr,
        "mlist_len": conv.tot,
        "offsetlist": offsets,
        "batch_ptr": batch_ptr,
        "token_chunk_offset_ptr": offsets,
    }
    return {conv.block_m: entry}, batch_ptr, offsets


def ssd_fields(ssd: Mamba2Chunks) -> tuple:
    """``(cu_chunk_seqlen_p, seq_idx_p, last_chunk_indices_p, checkpoint_chunk_idx)`` as
    ``_build_chunk_metadata_tensors`` returns them (int32, int32, int32, int64 or None)."""
    return ssd.cu_chunk_seqlens, ssd.seq_idx, ssd.last_chunk_indices, ssd.checkpoint_chunk_idx
