"""The subclasses of SGLang's KDA and GDN linear-attention backends that build tables once per forward.

SGLang's backends (``KDAAttnBackend``: Kimi-Linear, Kimi-K3; ``GDNAttnBackend``: Qwen3-Next,
Qwen3.5; ``srt/layers/attention/linear/``) build ``forward_metadata.query_start_loc`` on the device
once per forward and hand it to the vendored FLA kernels as ``cu_seqlens``; FLA then derives the
chunk tables inside the first layer with ``prepare_chunk_indices`` (a ``.tolist()``: one
host<->device sync per forward, the hang in sglang #33846). The subclasses build them once, from
that ``query_start_loc`` plus host data in the ``ForwardBatch`` (``tables.BackendChunkMeta``), for
every layer of the forward.

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
"""

from __future__ import annotations

import torch

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations.fla import FlaRouter, vendored_router
from chunkmeta.integrations.sglang.routing import add_tables_to_dispatcher, chunk_kda_takes_tables
from chunkmeta.integrations.sglang.tables import BackendChunkMeta

KINDS = ("kda", "gdn")


class _EagerHooks:
    """Eager entry: the base builds ``forward_metadata`` (and its device ``query_start_loc``); then
    this forward's tables are built from it."""

    _chunkmeta_router: FlaRouter | None = None
    _chunkmeta_kwargs: bool = False
    chunkmeta: BackendChunkMeta | None = None

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.chunkmeta = BackendChunkMeta.for_backend(self, model_runner, self._chunkmeta_router)
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
        "init_forward_metadata_capture_cuda_graph (<= 0.5.12); pass SGLang's KDA/GDN backend class."
    )


def _is_hip() -> bool:
    return getattr(torch.version, "hip", None) is not None


_CLASSES: dict[tuple, type] = {}


def chunkmeta_backend(
    base: type, *, kind: str, fla_package: str | None = None, table_kwargs: bool | None = None
) -> type:
    """The subclass of SGLang backend ``base`` that builds chunk tables once per forward.

    ``kind``: ``"kda"`` or ``"gdn"``. ``fla_package``: the vendored FLA package whose helpers a
    router answers (None: no routing). ``table_kwargs``: add ``chunk_indices``/``chunk_offsets`` to
    ``kernel_dispatcher.extend`` (None: for KDA when the vendored ``chunk_kda`` takes them, except on
    ROCm, where they would turn off SGLang's gfx950 prefill kernel; the router serves it there). The
    hook generation is read from ``base`` here, once. The same arguments give the same class.
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
    mixins = [_EagerHooks, _SplitGraphHooks if generation == "split" else _LegacyGraphHooks]
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
            "_chunkmeta_router": vendored_router(fla_package) if fla_package else None,
            "_chunkmeta_kwargs": table_kwargs,
            "chunkmeta_base": base,
            "chunkmeta_kind": kind,
            "chunkmeta_hooks": generation,
        },
    )
    _CLASSES[key] = cls
    return cls
