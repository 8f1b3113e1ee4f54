"""The subclasses of SGLang's KDA, GDN and Mamba2 backends that build tables once per forward.

SGLang's backends (``KDAAttnBackend``: Kimi-Linear, Kimi-K3; ``GDNAttnBackend``: Qwen3-Next,
Qwen3.5; ``srt/layers/attention/linear/``) build ``forward_metadata.query_start_loc`` on the device
once per forward and hand it to the vendored FLA kernels as ``cu_seqlens``; FLA then derives the
chunk tables inside the first layer with ``prepare_chunk_indices`` (a ``.tolist()``: one
host<->device sync per forward, the hang in sglang #33846). The subclasses build them once, from
that ``query_start_loc`` plus host data in the ``ForwardBatch`` (``tables.BackendChunkMeta``), for
every layer of the forward. GDN's causal-conv1d ``conv_block_table`` comes from the same build
(``_GdnConvHooks``). Mamba2 (``Mamba2AttnBackend``: Nemotron-H, Falcon-H1, Granite-MoE-Hybrid) gets
``Mamba2Metadata.prepare_mixed``'s tables from one build (``mamba2.Mamba2ChunkMeta``). Every kind's
radix-cache conv tracking indices are bounded by a host token count (``tracking``).

CUDA-graph hooks (the generation is detected from the base class when the subclass is made):
  * split (SGLang >= 0.5.13): ``init_forward_metadata_out_graph(fb, in_capture)`` is the host side
    (``GraphBuild.prepare``: validation, host counts, a params copy) and
    ``init_forward_metadata_in_graph(fb)`` the captured side (``GraphBuild.launch``: static shapes,
    in place, no sync). Decode-phase graphs (DECODE/IDLE/TARGET_VERIFY) get no tables. In SGLang
    <= 0.5.23 the linear backends' base raises for extend batches in these hooks (only the
    experimental full prefill graph would send one), so the graph layout serves a base that
    supports them; the base's error is passed through unchanged.
  * legacy (SGLang <= 0.5.12): ``init_forward_metadata_capture_cuda_graph`` /
    ``..._replay_cuda_graph`` carry no extend lengths, and the base supports only decode and
    verify there: tables are cleared.
  * Mamba2: its split hooks serve decode and verify only (``_replay_metadata`` raises for an
    extend, so SGLang 0.5.23's full prefill graph cannot send one); its breakable prefill graph
    calls the eager ``init_forward_metadata`` before each replay (the Mamba2 layers run as eager
    breaks), which is where the tables are built. So Mamba2 needs no graph hooks of its own.
"""

from __future__ import annotations

import sys

import torch

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations.fla import FlaRouter, vendored_router
from chunkmeta.integrations.sglang import tracking
from chunkmeta.integrations.sglang.mamba2 import Mamba2ChunkMeta
from chunkmeta.integrations.sglang.routing import add_tables_to_dispatcher, chunk_kda_takes_tables
from chunkmeta.integrations.sglang.tables import BackendChunkMeta

KINDS = ("kda", "gdn", "mamba2")
FLA_KINDS = ("kda", "gdn")


class _EagerHooks:
    """Eager entry: the base builds ``forward_metadata`` (and its device ``query_start_loc``); then
    this forward's tables are built from it."""

    _chunkmeta_router: FlaRouter | None = None
    _chunkmeta_kwargs: bool = False
    _chunkmeta_conv_block_m: int | None = None
    chunkmeta: BackendChunkMeta | None = None

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.chunkmeta = BackendChunkMeta.for_backend(
            self, model_runner, self._chunkmeta_router, conv_block_m=self._chunkmeta_conv_block_m
        )
        if self.chunkmeta is not None and self._chunkmeta_kwargs:
            add_tables_to_dispatcher(self)

    def init_forward_metadata(self, forward_batch):
        chunks = self.chunkmeta
        if chunks is None:
            return super().init_forward_metadata(forward_batch)
        chunks.clear()
        chunks.eager_depth += 1  # AttentionBackend's default eager entry calls the graph hooks
        try:
            super().init_forward_metadata(forward_batch)
        finally:
            chunks.eager_depth -= 1
        chunks.bind_eager(forward_batch, self.forward_metadata)


class _GdnConvHooks:
    """GDN's ``conv_block_table`` from the forward's build, where SGLang would make one.

    SGLang's ``_init_prefill_conv_block_table`` runs inside the base's ``init_forward_metadata``,
    before this forward's build: it only records whether SGLang would build the table (a host
    rule over ``extend_seq_lens_cpu``, ``tables.wants_conv_block_table``); the table is bound after
    the build. A forward chunkmeta does not build for gets SGLang's own."""

    def _init_prefill_conv_block_table(self, forward_batch) -> None:
        chunks = self.chunkmeta
        if chunks is None or not chunks.eager_depth:
            return super()._init_prefill_conv_block_table(forward_batch)
        self.forward_metadata.conv_block_table = None
        chunks.conv_wanted = chunks.wants_conv_block_table(
            forward_batch,
            self.forward_metadata,
            on_cuda=sys.modules[type(self).chunkmeta_base.__module__].is_cuda(),
            mis=getattr(self, "mis_metadata", None) is not None,
        )
        return None

    def init_forward_metadata(self, forward_batch):
        if self.chunkmeta is not None:
            self.chunkmeta.conv_wanted = False
        super().init_forward_metadata(forward_batch)
        chunks = self.chunkmeta
        if chunks is None or not chunks.conv_wanted:
            return
        chunks.conv_wanted = False
        blocks = chunks.conv_blocks
        if blocks is not None:
            self.forward_metadata.conv_block_table = blocks.block_table
            chunks.counts["conv"] += 1
        else:  # no build this forward (a fallback): SGLang's own table
            super()._init_prefill_conv_block_table(forward_batch)


class _TrackHooks:
    """Radix-cache conv tracking bounded by the host token count (``tracking``), where the host
    lengths and the host-made tracked rows are there; SGLang's own code otherwise."""

    def _init_track_conv_indices(self, query_start_loc, forward_batch, track_mask_indices=None):
        num_tokens = tracking.host_num_tokens(forward_batch, query_start_loc)
        aligned = forward_batch.mamba_track_aligned_lens() if track_mask_indices is not None else None
        if num_tokens is None or aligned is None:
            return super()._init_track_conv_indices(query_start_loc, forward_batch, track_mask_indices)
        return tracking.track_conv_indices(
            query_start_loc, aligned, track_mask_indices, self.conv_states_shape[-1], num_tokens
        )


class _Mamba2Hooks:
    """Mamba2's eager entry: the base's ``_forward_metadata``, then ``prepare_mixed``'s tables from
    one build (``Mamba2ChunkMeta.prepare``), or SGLang's ``prepare_mixed`` where that returns None."""

    chunkmeta: Mamba2ChunkMeta | None = None

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.chunkmeta = Mamba2ChunkMeta.for_backend(self, model_runner)

    def init_forward_metadata(self, forward_batch):
        chunks = self.chunkmeta
        if chunks is None:
            return super().init_forward_metadata(forward_batch)
        # resolved per call, as SGLang's own method resolves it: a patched class is the one used
        metadata_cls = sys.modules[type(self).chunkmeta_base.__module__].Mamba2Metadata
        metadata = self._forward_metadata(forward_batch)
        chunk_size = self.mamba_chunk_size
        made = chunks.prepare(metadata_cls, metadata, chunk_size, forward_batch)
        if made is None:
            made = metadata_cls.prepare_mixed(metadata, chunk_size, forward_batch)
        self.forward_metadata = made


class _SplitGraphHooks:
    """SGLang >= 0.5.13: out_graph is the host side (outside capture), in_graph the captured side."""

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        chunks = self.chunkmeta
        graph_call = chunks is not None and not chunks.eager_depth
        if graph_call:
            chunks.clear()
        super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if graph_call:
            chunks.bind_graph(forward_batch, self.forward_metadata, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        super().init_forward_metadata_in_graph(forward_batch)
        chunks = self.chunkmeta
        if chunks is not None and not chunks.eager_depth:
            chunks.launch_graph()


class _LegacyGraphHooks:
    """SGLang <= 0.5.12: these hooks carry no extend lengths and serve decode-phase graphs only."""

    def init_forward_metadata_capture_cuda_graph(
        self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
    ):
        if self.chunkmeta is not None:
            self.chunkmeta.clear()
        super().init_forward_metadata_capture_cuda_graph(
            bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
        )

    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info, seq_lens_cpu
    ):
        if self.chunkmeta is not None:
            self.chunkmeta.clear()
        super().init_forward_metadata_replay_cuda_graph(
            bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info, seq_lens_cpu
        )


class _PrefillGraphHooks:
    """SGLang >= 0.5.22 KDA: its breakable prefill graph runs on tables of its own; ours step aside."""

    def init_prefill_graph_metadata(self, forward_batch):
        if self.chunkmeta is not None:
            self.chunkmeta.clear()
        return super().init_prefill_graph_metadata(forward_batch)

    def refresh_prefill_graph_metadata(self, meta, forward_batch):
        if self.chunkmeta is not None:
            self.chunkmeta.clear()
        return super().refresh_prefill_graph_metadata(meta, forward_batch)


def _defines(base: type, name: str) -> bool:
    return callable(getattr(base, name, None))


def hook_generation(base: type) -> str:
    """``"split"`` (out_graph/in_graph, SGLang >= 0.5.13) or ``"legacy"`` (capture/replay)."""
    if _defines(base, "init_forward_metadata_out_graph"):
        return "split"
    if _defines(base, "init_forward_metadata_capture_cuda_graph"):
        return "legacy"
    raise ChunkMetaError(
        f"base={base.__qualname__}: has neither init_forward_metadata_out_graph (SGLang >= 0.5.13) nor "
        "init_forward_metadata_capture_cuda_graph (<= 0.5.12); pass SGLang's KDA/GDN/Mamba2 backend class."
    )


def _is_hip() -> bool:
    return getattr(torch.version, "hip", None) is not None


_CLASSES: dict[tuple, type] = {}


def _conv_block_m(base: type) -> int | None:
    """GDN's causal-conv1d block size (``CAUSAL_CONV1D_FWD_BLOCK_M`` where its module has one),
    or None: the backend builds no ``conv_block_table`` (SGLang < 0.5.22, the fake)."""
    if not _defines(base, "_init_prefill_conv_block_table"):
        return None
    module = sys.modules.get(base.__module__)
    block_m = getattr(module, "CAUSAL_CONV1D_FWD_BLOCK_M", None)
    return block_m if isinstance(block_m, int) and callable(getattr(module, "is_cuda", None)) else None


def chunkmeta_backend(
    base: type, *, kind: str, fla_package: str | None = None, table_kwargs: bool | None = None
) -> type:
    """The subclass of SGLang backend ``base`` that builds chunk tables once per forward.

    ``kind``: ``"kda"``, ``"gdn"`` or ``"mamba2"``. ``fla_package``: the vendored FLA package whose
    helpers a router answers (None: no routing; Mamba2 has none). ``table_kwargs``: add
    ``chunk_indices``/``chunk_offsets`` to ``kernel_dispatcher.extend`` (None: for KDA when the
    vendored ``chunk_kda`` takes them, except on ROCm, where they would turn off SGLang's gfx950
    prefill kernel; the router serves it there). The hook generation is read from ``base`` here,
    once. The same arguments give the same class.
    """
    if kind not in KINDS:
        raise ChunkMetaError(f"kind={kind!r}: must be one of {KINDS}.")
    if not isinstance(base, type):
        raise ChunkMetaError(f"base={base!r}: must be SGLang's backend class.")
    if table_kwargs is None:
        table_kwargs = kind == "kda" and not _is_hip() and chunk_kda_takes_tables(fla_package)
    key = (base, kind, fla_package, table_kwargs)
    cls = _CLASSES.get(key)
    if cls is not None:
        return cls
    generation = hook_generation(base)
    track = [_TrackHooks] if _defines(base, "_init_track_conv_indices") else []
    conv_block_m = _conv_block_m(base) if kind == "gdn" else None
    if kind == "mamba2":
        mixins = [_Mamba2Hooks, *track]
    else:
        mixins = [_GdnConvHooks] if conv_block_m else []
        mixins += [_EagerHooks, *track, _SplitGraphHooks if generation == "split" else _LegacyGraphHooks]
        if generation == "split" and _defines(base, "init_forward_metadata_capture_cuda_graph"):
            mixins.append(_LegacyGraphHooks)
        if _defines(base, "refresh_prefill_graph_metadata") and _defines(base, "init_prefill_graph_metadata"):
            mixins.append(_PrefillGraphHooks)
    cls = type(base)(
        f"ChunkMeta{base.__name__}",
        (*mixins, base),
        {  # type(base): SGLang's are ABCs
            "__module__": __name__,
            "__doc__": f"SGLang's {base.__qualname__} with chunkmeta's chunk tables (hooks: {generation}).",
            "_chunkmeta_router": vendored_router(fla_package) if fla_package and kind != "mamba2" else None,
            "_chunkmeta_kwargs": table_kwargs,
            "_chunkmeta_conv_block_m": conv_block_m,
            "chunkmeta_base": base,
            "chunkmeta_kind": kind,
            "chunkmeta_hooks": generation,
        },
    )
    _CLASSES[key] = cls
    return cls
