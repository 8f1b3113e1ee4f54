"""The chunkmeta builders: vLLM GDN-family metadata builders whose chunk-metadata hook chunkmeta serves.

``GDNAttentionMetadataBuilder.build()`` (``vllm/v1/attention/backends/gdn_attn.py``) calls, once
per step and only when the batch has prefills, ``_build_chunk_metadata(prefill_query_start_loc,
prefill_query_start_loc_cpu, device) -> (chunk_indices, chunk_offsets)`` on the prefill slice
(rebased to start at 0, decodes peeled off the front, trailing zero-length padding rows possibly
left in). Its default derives the tables on the host from the CPU copy and copies them over; the
ROCm Kimi-K3 builder (``vllm/models/kimi_k3/amd/kda_metadata.py``) allocates fresh tensors and
runs a serial per-sequence kernel. Here the hook is one device launch into a persistent builder's
ring buffers: no sync, no host->device copy.
"""

from __future__ import annotations

import threading
import types

import torch

from chunkmeta.builder import ChunkMetadataBuilder
from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations.vllm.interface import logger
from chunkmeta.metadata import ChunkMetadata

# vllm.third_party.flash_linear_attention.ops.utils.FLA_CHUNK_SIZE: every builder hook uses it.
FLA_CHUNK_SIZE = 64
# A vLLM builder builds once per step (DBO micro-batches have builders of their own), and only
# that step's forward reads the tables. On one stream the next fill queues after that forward,
# so the GPU side is safe at any depth; four slots also keep a step's tables intact while the
# host runs up to three steps ahead (async scheduling).
RING_DEPTH = 4
# gdn_prefill_backend values whose build() never calls the hook: FlashInfer reads cu_seqlens
# itself, AITER FlyDSL brings its own metadata. chunkmeta allocates nothing for them.
HOOKLESS_BACKENDS = frozenset({"flashinfer", "aiter_flydsl"})
CUTEDSL = "cutedsl"


def builder_for_config(vllm_config, device, prefill_backend: str | None = None) -> ChunkMetadataBuilder:
    """A persistent ChunkMetadataBuilder for one vLLM builder, sized to the scheduler's limits.

    vLLM's runners size their ``query_start_loc`` buffer to ``max_num_seqs + 1`` entries and
    their token buffers to ``max_num_batched_tokens`` (CUDA-graph padding included), so every
    prefill slice fits. For CuteDSL GDN the fill writes ``chunk_offsets`` as int32 itself.
    """
    scheduler = vllm_config.scheduler_config
    return ChunkMetadataBuilder(
        scheduler.max_num_seqs,
        scheduler.max_num_batched_tokens,
        chunk_size=FLA_CHUNK_SIZE,
        device=device,
        ring_depth=RING_DEPTH,
        offsets_dtype=torch.int32 if prefill_backend == CUTEDSL else torch.int64,
    )


def warm_up(builder: ChunkMetadataBuilder) -> None:
    """One build when vLLM creates its builder: the fill kernel (Triton) and the host plan compile
    at startup rather than in the first request's step, and a fill that cannot run on this
    platform shows up here, where the builder can still keep vLLM's own path. Uses one ring slot."""
    query_start_loc_cpu = torch.tensor([0, 1], dtype=torch.int32)  # int32, as vLLM's
    builder.build(query_start_loc_cpu.to(builder.device), query_start_loc_cpu)


def cutedsl_layout(metadata: ChunkMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables in CuteDSL GDN's layout (``gdn_chunk_cutedsl.prepare_metadata_cutedsl``).

    CuteDSL takes int32 ``chunk_indices [UB, 2]`` with any ``UB >= NT`` (it sizes its workspaces
    from ``UB`` and never reads rows past ``NT``) and int32 ``chunk_offsets [N+1]`` whose last
    entry, the real ``NT``, its persistent kernels read on the device. vLLM's own ``UB`` is a
    worst case from the host token count; chunkmeta knows ``NT`` exactly, so ``UB = NT``: every
    row is real and the workspaces are no larger than needed. The offsets come int32 from the
    fill (``builder_for_config``): no cast per step.
    """
    if metadata.chunk_offsets.dtype != torch.int32:
        raise ChunkMetaError("CuteDSL GDN reads int32 chunk_offsets: build with offsets_dtype=torch.int32.")
    return metadata.chunk_indices, metadata.chunk_offsets


class ChunkmetaBuilderMixin:
    """Goes in front of a vLLM GDN-family metadata builder; replaces only ``_build_chunk_metadata``.

    Use through ``chunkmeta_builder_class(base)`` (which ``install()`` does). ``self.chunkmeta``
    is this builder's ``ChunkMetadataBuilder`` (None where the hook keeps vLLM's own path: a
    prefill backend that never calls it, or limits chunkmeta cannot hold).
    ``self.chunkmeta_fallbacks`` counts steps served by vLLM's own path instead.
    """

    _chunkmeta_reuse_block_table = False  # set by chunkmeta_builder_class for the stock GDN builder

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        self.chunkmeta: ChunkMetadataBuilder | None = None
        self.chunkmeta_fallbacks = 0
        if self._chunkmeta_reuse_block_table:
            self._restore_block_table_reuse(vllm_config, device)
        prefill_backend = getattr(self, "gdn_prefill_backend", None)
        if prefill_backend in HOOKLESS_BACKENDS:
            logger.info(
                "chunkmeta: gdn_prefill_backend=%r builds no FLA chunk metadata; nothing to do", prefill_backend
            )
            return
        try:
            chunkmeta = builder_for_config(vllm_config, device, prefill_backend)
            warm_up(chunkmeta)
        except Exception as exc:  # noqa: BLE001  limits it cannot hold, or a fill that fails on this platform
            logger.warning(
                "chunkmeta: %s keeps vLLM's own chunk metadata: %s: %s", type(self).__name__, type(exc).__name__, exc
            )
        else:
            self.chunkmeta = chunkmeta

    def _restore_block_table_reuse(self, vllm_config, device) -> None:
        # vLLM turns MRV2's metadata reuse across KV-cache groups off for any subclass
        # (`type(self) is GDNAttentionMetadataBuilder`), because KDA subclasses keep per-group
        # checkpoint state. A chunkmeta GDN builder differs from the stock one only in the chunk
        # tables, which are batch-level like the rest, so it opts back in on the same
        # conditions as the stock builder; otherwise every group would build every step.
        if getattr(vllm_config, "use_v2_model_runner", False) and torch.device(device).type == "cuda":
            self.supports_update_block_table = True
            self.mamba_aligned_state_indices = None

    @staticmethod
    def _check_chunk_metadata_override(builder_cls, backend):
        # vLLM refuses a builder that overrides the hook under "aiter_flydsl" (whose build()
        # never calls it, so the override would be silently lost). chunkmeta has nothing to do
        # there and stands aside (see __init__) instead of stopping vLLM's startup; the wrapped
        # builder's own check still applies to the wrapped builder.
        base = wrapped_builder(builder_cls)
        check = getattr(base, "_check_chunk_metadata_override", None)
        if check is not None:
            check(base, backend)

    def _build_chunk_metadata(self, prefill_query_start_loc, prefill_query_start_loc_cpu, device):
        builder = self.chunkmeta
        if builder is None:
            return super()._build_chunk_metadata(prefill_query_start_loc, prefill_query_start_loc_cpu, device)
        try:
            # Sizes come from the host copy; the device copy is read only by the fill.
            metadata = builder.build(prefill_query_start_loc, prefill_query_start_loc_cpu)
        except ChunkMetaError as exc:
            # Validation runs before anything is written, so vLLM's own path is still exact.
            self.chunkmeta_fallbacks += 1
            (logger.warning if self.chunkmeta_fallbacks == 1 else logger.debug)(
                "chunkmeta: %s This step uses vLLM's own chunk metadata (fallback %d).",
                exc,
                self.chunkmeta_fallbacks,
            )
            return super()._build_chunk_metadata(prefill_query_start_loc, prefill_query_start_loc_cpu, device)
        if getattr(self, "gdn_prefill_backend", None) == CUTEDSL:
            return cutedsl_layout(metadata)
        chunk_indices = metadata.chunk_indices
        if chunk_indices.dtype != prefill_query_start_loc.dtype:
            # vLLM's helpers give chunk_indices the dtype of cu_seqlens (int32 in every runner).
            chunk_indices = chunk_indices.to(prefill_query_start_loc.dtype)
        return chunk_indices, metadata.chunk_offsets


def wrapped_builder(cls: type) -> type:
    """The vLLM builder a chunkmeta builder class wraps: the class after the mixin in its MRO."""
    mro = cls.__mro__
    return mro[mro.index(ChunkmetaBuilderMixin) + 1]


_CLASSES: dict[tuple[type, bool], type] = {}
_CLASSES_LOCK = threading.Lock()


def chunkmeta_builder_class(base: type, *, reuse_block_table: bool = False) -> type:
    """``ChunkmetaBuilderMixin`` in front of ``base`` (one class per base: vLLM groups layers
    and reuses metadata by builder type)."""
    if issubclass(base, ChunkmetaBuilderMixin):
        return base
    key = (base, reuse_block_table)
    with _CLASSES_LOCK:
        cls = _CLASSES.get(key)
        if cls is None:

            def body(namespace):
                namespace.update(
                    __module__=__name__,
                    __doc__=f"vLLM's {base.__name__} with its FLA chunk metadata built by chunkmeta.",
                    _chunkmeta_reuse_block_table=reuse_block_table,
                )

            cls = types.new_class(f"Chunkmeta{base.__name__}", (ChunkmetaBuilderMixin, base), exec_body=body)
            _CLASSES[key] = cls
    return cls
