"""The chunkmeta builders: vLLM's hybrid metadata builders whose per-step prefill tables chunkmeta makes.

vLLM 0.33.0 builds them inside ``build()`` at three points, each overridden at that point only:

* ``GDNAttentionMetadataBuilder._build_chunk_metadata`` (FLA ``chunk_indices`` / ``chunk_offsets``
  of the prefill slice; host helpers + two H2D copies, or CuteDSL's kernel);
* ``compute_causal_conv1d_metadata`` (``v1/attention/backends/utils.py``), a module function
  that ``gdn_attn``, ``mamba_attn`` (Mamba1, Mamba2, ShortConv) and Kimi-K3 NVIDIA's
  ``kda_metadata`` call by name: its name in those modules is replaced (``wiring``) by
  ``conv_metadata``, which answers vLLM's call only inside a chunkmeta builder's ``build()``;
* ``BaseMambaAttentionMetadataBuilder._build_chunk_metadata_tensors`` (Mamba2's SSD tables: a
  Python loop per chunk and 3-4 H2D copies).

Inside a chunkmeta builder's ``build()`` each point records what vLLM asked for and returns
None for its tables; when vLLM's ``build()`` returns, one ``StepTablesBuilder`` launch makes
every table from the very tensors the metadata holds (``non_spec_query_start_loc``,
``query_start_loc_p``), and they are set on that metadata before vLLM sees it. A step chunkmeta
cannot build (over capacity, input it refuses, a fill that fails to compile or launch) gets vLLM's
own functions, called with the arguments vLLM gave: one warning per cause, counted in
``chunkmeta_stats()``.
"""

from __future__ import annotations

import re
import sys
import threading
import types
import weakref

import torch

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations.plugin import keeps_engine_path
from chunkmeta.integrations.vllm import tables as _tables
from chunkmeta.integrations.vllm.interface import ENV_VAR, logger
from chunkmeta.integrations.vllm.tables import CUTEDSL, Serves

# gdn_prefill_backend values whose build() never calls _build_chunk_metadata: FlashInfer reads
# cu_seqlens itself, AITER FlyDSL brings its own metadata. Their conv tables are still served.
HOOKLESS_BACKENDS = frozenset({"flashinfer", "aiter_flydsl"})


class _Local(threading.local):
    request = None  # the StepRequest of the chunkmeta build() running on this thread


_LOCAL = _Local()


class _PrefillFound(BaseException):
    """Raised by an overridden point when vLLM's build() of a step let through as decode-only
    (no row over one token) asks for a prefill table after all: a first one-token chunk of a
    prompt is a prefill to vLLM (``is_prefilling``). build() then runs the step as a chunkmeta
    step; vLLM's build() has changed no builder state before those points. A BaseException, so
    that no ``except Exception`` on the way swallows it."""


def _probing(builder) -> bool:
    """An overridden point of ``builder`` reached outside a chunkmeta step: only a step that
    build() let through to vLLM's as decode-only gets there (the fallback calls vLLM's own
    functions directly). Nothing is marked per step: two thread-local writes around every
    decode-only build() cost about 2 us there on the CPU machine (against vLLM's build())."""
    return isinstance(builder, ChunkmetaBuilderMixin) and builder.chunkmeta is not None


_BUILDERS: weakref.WeakSet = weakref.WeakSet()


class StepRequest:
    """What vLLM's ``build()`` asked for at the overridden points, with the arguments it gave."""

    __slots__ = ("owner", "fla", "conv", "conv_served", "ssd")

    def __init__(self, owner):
        self.owner = owner
        self.fla = None  # (prefill_query_start_loc, prefill_query_start_loc_cpu, device)
        self.conv = None  # (vLLM's function, query_start_loc_cpu, device)
        self.conv_served = False
        self.ssd = None  # (chunk_size, common, common_attn_metadata, checkpoint_offsets_p)

    @property
    def asked(self) -> bool:
        return self.fla is not None or self.conv is not None or self.ssd is not None


def _set_conv(metadata, tables) -> None:
    """The causal-conv1d fields: ``compute_causal_conv1d_metadata``'s three results."""
    metadata.nums_dict, metadata.batch_ptr, metadata.token_chunk_offset_ptr = tables


def _set_ssd(metadata, tables) -> None:
    """Mamba2's SSD fields: ``_build_chunk_metadata_tensors``'s four results."""
    metadata.cu_chunk_seqlen_p, metadata.seq_idx_p, metadata.last_chunk_indices_p, metadata.checkpoint_chunk_idx = (
        tables
    )


def _request_of(builder) -> StepRequest | None:
    request = _LOCAL.request
    return request if request is not None and request.owner is builder else None


def conv_metadata(original):
    """The stand-in for ``compute_causal_conv1d_metadata`` in a vLLM module that imported it
    (same signature): inside a chunkmeta build it records the call (None tables, set after the
    build); anywhere else, and for a builder that does not serve conv, vLLM's ``original``."""

    def compute_causal_conv1d_metadata(query_start_loc_p_cpu, *, device):
        request = _LOCAL.request
        if request is None:
            # a module function: its caller, a builder's build() (or a method of it), is the
            # builder (read on prefill steps only)
            caller = sys._getframe(1).f_locals.get("self")
            if _probing(caller) and caller._chunkmeta_serves.conv:
                raise _PrefillFound
            return original(query_start_loc_p_cpu, device=device)
        if request.conv is not None:
            return original(query_start_loc_p_cpu, device=device)
        request.conv = (original, query_start_loc_p_cpu, device)
        if not request.owner._chunkmeta_serves.conv:
            return original(query_start_loc_p_cpu, device=device)
        request.conv_served = True
        return None, None, None

    compute_causal_conv1d_metadata.__wrapped__ = original
    compute_causal_conv1d_metadata.__qualname__ = "chunkmeta.compute_causal_conv1d_metadata"
    return compute_causal_conv1d_metadata


def wrapped_builder(cls: type) -> type:
    """The vLLM builder a chunkmeta builder class wraps: the class after the mixins in its MRO."""
    mro = cls.__mro__
    return mro[mro.index(ChunkmetaBuilderMixin) + 1]


def _wrapped(cls: type) -> type | None:
    """``wrapped_builder(cls)``, or None for the mixins themselves (object follows them)."""
    base = wrapped_builder(cls)
    return None if base is object else base


class ChunkmetaBuilderMixin:
    """Goes in front of a vLLM hybrid metadata builder (``chunkmeta_builder_class``).

    ``self.chunkmeta`` is this builder's ``StepTablesBuilder`` (None where vLLM's own path stays:
    limits or a platform chunkmeta cannot serve). ``chunkmeta_stats()``: steps built, tables
    served, fallbacks per cause.
    """

    _chunkmeta_serves = Serves()
    _chunkmeta_reuse_block_table = False  # set by chunkmeta_builder_class for the stock GDN builder

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        self.chunkmeta = None
        self.chunkmeta_fallbacks = 0
        self._chunkmeta_causes: dict[str, int] = {}
        self._chunkmeta_served: dict[str, int] = {}
        self._chunkmeta_routes = None
        if self._chunkmeta_reuse_block_table:
            self._restore_block_table_reuse(vllm_config, device)
        try:
            specs = self._chunkmeta_specs(vllm_config)
            if not specs:
                return
            self.chunkmeta = _tables.step_builder(vllm_config, device, specs)
            _tables.warm_up(self.chunkmeta)
            self._chunkmeta_setup()
        except Exception as exc:  # noqa: BLE001  limits it cannot hold, or a fill that fails on this platform
            self.chunkmeta = None
            keeps_engine_path(logger, f"{type(self).__name__} keeps vLLM's own step tables", exc, ENV_VAR)
        else:
            _BUILDERS.add(self)

    def _chunkmeta_specs(self, vllm_config) -> dict:
        return _tables.specs(self._chunkmeta_serves)

    def _chunkmeta_setup(self) -> None:
        pass

    def _restore_block_table_reuse(self, vllm_config, device) -> None:
        # vLLM turns MRV2's metadata reuse across KV-cache groups off for any subclass
        # (`type(self) is GDNAttentionMetadataBuilder`), because KDA subclasses keep per-group
        # checkpoint state. A chunkmeta GDN builder differs from the stock one only in the step
        # tables, which are batch-level like the rest, so it opts back in on the same
        # conditions as the stock builder; otherwise every group would build every step.
        if getattr(vllm_config, "use_v2_model_runner", False) and torch.device(device).type == "cuda":
            self.supports_update_block_table = True
            self.mamba_aligned_state_indices = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # vLLM's build() of the builder this class wraps, called as a plain function: a super()
        # call through *args costs about 2 us a step on CPU (measured), far more than the call
        # itself, and decode-only steps must cost what vLLM's own build() does.
        base = getattr(_wrapped(cls), "build", None)
        if base is not None:
            cls._chunkmeta_vllm_build = staticmethod(base)

    # -- the step ------------------------------------------------------------------------------
    # Each family's build() has its vLLM builders' signature, so that a decode-only step (the
    # common one, and the one CUDA graphs replay, where host time is the step) goes straight to
    # vLLM's build() with the arguments as given: with no row over one token vLLM's build() asks
    # for no table, unless a row is a prompt's first one-token chunk; then the overridden point
    # it reaches raises _PrefillFound and the step reruns as a chunkmeta step. Per decode step:
    # an attribute read and a compare.

    def _chunkmeta_step(self, *args, **kwargs):
        """A step with a row over one token: vLLM's build() with the overridden points recording
        what it asks for, then one chunkmeta build serving it all."""
        metadata, request = self._chunkmeta_recorded_build(*args, **kwargs)
        if request.asked:
            self._chunkmeta_serve_or_fall_back(metadata, request)
        return metadata

    def _chunkmeta_recorded_build(self, *args, **kwargs) -> tuple[object, StepRequest]:
        """vLLM's build() with the overridden points recording what it asks for (their tables
        None on the metadata it returns), and the record."""
        request = StepRequest(self)
        outer = _LOCAL.request
        _LOCAL.request = request
        try:
            metadata = self._chunkmeta_vllm_build(self, *args, **kwargs)
        finally:
            _LOCAL.request = outer
        if self._chunkmeta_routes is not None:
            self._chunkmeta_routes.clear()
        return metadata, request

    def _chunkmeta_serve_or_fall_back(self, metadata, request: StepRequest) -> None:
        try:
            self._chunkmeta_serve(metadata, request)
        except Exception as exc:  # noqa: BLE001  input it refuses, or a fill that fails to compile / launch
            # vLLM's functions are pure in the arguments recorded: called now they give what
            # vLLM would have, and they set every field a failed serve may have set.
            self._chunkmeta_fall_back(exc)
            self._vllm_tables(metadata, request)

    def _chunkmeta_serve(self, metadata, request: StepRequest) -> None:
        raise NotImplementedError

    def _vllm_tables(self, metadata, request: StepRequest) -> None:
        if request.conv_served:
            original, query_start_loc_cpu, device = request.conv
            _set_conv(metadata, original(query_start_loc_cpu, device=device))

    def _chunkmeta_count(self, names) -> None:
        for name in names:
            self._chunkmeta_served[name] = self._chunkmeta_served.get(name, 0) + 1

    def _chunkmeta_fall_back(self, exc: Exception) -> None:
        self.chunkmeta_fallbacks += 1
        # one warning per kind of cause, whatever its values
        cause = f"{type(exc).__name__}: " + re.sub(r"-?\d+", "N", str(exc))
        count = self._chunkmeta_causes[cause] = self._chunkmeta_causes.get(cause, 0) + 1
        (logger.warning if count == 1 else logger.debug)(
            "chunkmeta: %s: %s This step uses vLLM's own step tables (fallback %d; this cause: %d).",
            type(exc).__name__,
            exc,
            self.chunkmeta_fallbacks,
            count,
        )

    def chunkmeta_stats(self) -> dict:
        """Host counters: steps chunkmeta built (warm-up excluded), tables served, fallbacks per cause."""
        builds = self.chunkmeta.builds - 1 if self.chunkmeta is not None else 0
        return {
            "active": self.chunkmeta is not None,
            "builds": builds,
            "served": dict(self._chunkmeta_served),
            "fallbacks": self.chunkmeta_fallbacks,
            "fallback_causes": dict(self._chunkmeta_causes),
        }


class GdnFamilyMixin(ChunkmetaBuilderMixin):
    """GDN-family builders: the FLA hook, the conv tables (non-spec rows) and the router's routes."""

    _chunkmeta_serves = Serves(fla=True, conv=True)

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ):
        if self.chunkmeta is None or common_attn_metadata.max_query_len <= 1:
            # the last chunkmeta step's routes stay: they answer only that step's tensor objects,
            # and vLLM's runner makes new ones every step (the next chunkmeta step replaces them)
            try:
                return self._chunkmeta_vllm_build(
                    self,
                    common_prefix_len,
                    common_attn_metadata,
                    num_accepted_tokens,
                    num_decode_draft_tokens_cpu,
                    fast_build,
                )
            except _PrefillFound:  # raised for builders with a chunkmeta only (_probing)
                pass
        return self._chunkmeta_step(
            common_prefix_len, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu, fast_build
        )

    def _chunkmeta_specs(self, vllm_config) -> dict:
        prefill_backend = getattr(self, "gdn_prefill_backend", None)
        if prefill_backend in HOOKLESS_BACKENDS:
            logger.info(
                "chunkmeta: gdn_prefill_backend=%r builds no FLA tables; chunkmeta serves the rest", prefill_backend
            )
        return _tables.specs(self._chunkmeta_serves, prefill_backend=prefill_backend)

    def _chunkmeta_setup(self) -> None:
        from chunkmeta.integrations.vllm.routing import StepRoutes

        try:
            self._chunkmeta_routes = StepRoutes()
        except ImportError as exc:  # a vLLM without its vendored FLA: nothing to route
            logger.info("chunkmeta: no FLA router for %s: %s", type(self).__name__, exc)

    @staticmethod
    def _check_chunk_metadata_override(builder_cls, backend):
        # vLLM refuses a builder that overrides the hook under "aiter_flydsl" (whose build()
        # never calls it, so the override would be silently lost). chunkmeta has no FLA tables
        # to give there and stands aside instead of stopping vLLM's startup; the wrapped
        # builder's own check still applies to the wrapped builder.
        base = wrapped_builder(builder_cls)
        check = getattr(base, "_check_chunk_metadata_override", None)
        if check is not None:
            check(base, backend)

    def _build_chunk_metadata(self, prefill_query_start_loc, prefill_query_start_loc_cpu, device):
        request = _request_of(self)
        if request is None:
            if _probing(self):
                raise _PrefillFound
            return super()._build_chunk_metadata(prefill_query_start_loc, prefill_query_start_loc_cpu, device)
        request.fla = (prefill_query_start_loc, prefill_query_start_loc_cpu, device)
        return None, None

    def _chunkmeta_serve(self, metadata, request: StepRequest) -> None:
        from chunkmeta.integrations.vllm.routing import Route

        batch_qsl = getattr(metadata, "non_spec_query_start_loc", None)
        prefill_qsl = getattr(metadata, "prefill_query_start_loc", None)
        if request.conv is not None and batch_qsl is not None:
            # the non-spec rows: decodes, prefills, padding; the prefill slice is the same
            # object, or the rows after the decodes that build() peeled off and rebased
            qsl, qsl_cpu = batch_qsl, request.conv[1]
            first_seq = 0 if prefill_qsl is None or prefill_qsl is batch_qsl else metadata.num_decodes
        elif request.fla is not None:
            qsl, qsl_cpu, _ = request.fla
            prefill_qsl, batch_qsl, first_seq = qsl, None, 0
        else:
            raise ChunkMetaError(f"{type(metadata).__name__} has no non_spec_query_start_loc to build the step on.")
        if request.fla is not None and request.fla[1].shape[0] != qsl_cpu.shape[0] - first_seq:
            raise ChunkMetaError(
                f"the prefill slice has {request.fla[1].shape[0] - 1} rows, not the {qsl_cpu.shape[0] - 1 - first_seq} "
                "after the decodes: this build() splits the batch in a way chunkmeta does not know."
            )
        step = self.chunkmeta.build(qsl, qsl_cpu, first_seq=first_seq)
        prefill_backend = getattr(self, "gdn_prefill_backend", None)
        served = []
        if request.fla is not None:
            fields = _tables.fla_fields(step["fla"], request.fla[0], prefill_backend)
            metadata.chunk_indices, metadata.chunk_offsets = fields
            served.append("fla")
        if request.conv_served:
            _set_conv(metadata, _tables.conv_fields(step["conv"]))
            served.append("conv")
        self._chunkmeta_count(served)
        routes = {}
        if prefill_qsl is not None and prefill_backend != CUTEDSL:  # CuteDSL's offsets are int32, FLA's int64
            routes["prefill"] = Route(prefill_qsl, step["fla"])
        if batch_qsl is not None:
            routes["batch"] = Route(batch_qsl, step["fla_batch"])
        if self._chunkmeta_routes is not None:
            self._chunkmeta_routes.set(routes)

    def _vllm_tables(self, metadata, request: StepRequest) -> None:
        super()._vllm_tables(metadata, request)
        if request.fla is not None:
            metadata.chunk_indices, metadata.chunk_offsets = super()._build_chunk_metadata(*request.fla)


class MambaFamilyMixin(ChunkmetaBuilderMixin):
    """Mamba-family builders (``BaseMambaAttentionMetadataBuilder``): the conv tables of the
    prefill rows, and for Mamba2 its SSD chunk tables."""

    _chunkmeta_serves = Serves(conv=True)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False, **kwargs):
        if self.chunkmeta is None or common_attn_metadata.max_query_len <= 1:
            try:
                if kwargs:  # keyword-only spec-decode arguments (a call with none skips **'s cost)
                    return self._chunkmeta_vllm_build(
                        self, common_prefix_len, common_attn_metadata, fast_build, **kwargs
                    )
                return self._chunkmeta_vllm_build(self, common_prefix_len, common_attn_metadata, fast_build)
            except _PrefillFound:  # raised for builders with a chunkmeta only (_probing)
                pass
        return self._chunkmeta_step(common_prefix_len, common_attn_metadata, fast_build, **kwargs)

    def _chunkmeta_specs(self, vllm_config) -> dict:
        if not getattr(self, "needs_causal_conv1d_metadata", True):
            # a builder whose build() asks for no conv tables (vLLM 0.33.0: PleShortConv, not
            # wired); the instance serves what its specs are made for, so a call to the conv
            # stand-in all the same gets vLLM's function, not a table the step never built
            self._chunkmeta_serves = Serves(ssd=self._chunkmeta_serves.ssd)
        return _tables.specs(self._chunkmeta_serves, mamba_chunk_size=getattr(self, "chunk_size", None))

    def _chunkmeta_setup(self) -> None:
        if self._chunkmeta_serves.ssd:
            # checkpoint offsets of a step without checkpoints (the SSD fill always reads them)
            seqs = self.chunkmeta.capacity.seqs
            self._chunkmeta_zeros = (
                torch.zeros(seqs, dtype=torch.int32, device=self.chunkmeta.device),
                torch.zeros(seqs, dtype=torch.int32),
            )

    def _build_chunk_metadata_tensors(self, chunk_size, common, common_attn_metadata, checkpoint_offsets_p=None):
        request = _request_of(self)
        if request is None and self._chunkmeta_serves.ssd and _probing(self):
            raise _PrefillFound
        if request is None or not self._chunkmeta_serves.ssd:
            return super()._build_chunk_metadata_tensors(chunk_size, common, common_attn_metadata, checkpoint_offsets_p)
        request.ssd = (chunk_size, common, common_attn_metadata, checkpoint_offsets_p)
        return None, None, None, None

    def _chunkmeta_serve(self, metadata, request: StepRequest) -> None:
        qsl = metadata.query_start_loc_p  # the prefill rows, rebased: what both tables describe
        rows = {}
        if request.ssd is not None:
            chunk_size, common, m, _ = request.ssd
            built_for = self.chunkmeta.specs["ssd"].chunk_size
            if chunk_size != built_for:
                raise ChunkMetaError(f"chunk_size={chunk_size} is not the {built_for} the SSD tables are built for.")
            num_reqs, num_prefills = common.num_reqs, common.num_prefills
            # vLLM's own host derivation (seq_lens_cpu_upper_bound is exact on prefill rows)
            computed_cpu, qsl_cpu = self._prefill_cpu_metadata(m, num_reqs, num_prefills, common.num_decode_tokens)
            computed = m.compute_num_computed_tokens()[num_reqs - num_prefills : num_reqs]
            checkpoint = getattr(metadata, "checkpoint_meta", None)
            if checkpoint is not None:
                offsets = checkpoint.checkpoint_offsets
                offsets_cpu = torch.tensor(checkpoint.offsets, dtype=torch.int32)
            else:
                offsets, offsets_cpu = (z[:num_prefills] for z in self._chunkmeta_zeros)
            rows = dict(
                num_computed_tokens=computed,
                num_computed_tokens_cpu=computed_cpu,
                checkpoint_offsets=offsets,
                checkpoint_offsets_cpu=offsets_cpu,
            )
        elif request.conv is not None:
            qsl_cpu = request.conv[1]
        if request.conv is not None and request.ssd is not None and request.conv[1].shape != qsl_cpu.shape:
            raise ChunkMetaError("the conv and SSD tables of this step describe different rows.")
        step = self.chunkmeta.build(qsl, qsl_cpu, **rows)
        served = []
        if request.conv_served:
            _set_conv(metadata, _tables.conv_fields(step["conv"]))
            served.append("conv")
        if request.ssd is not None:
            _set_ssd(metadata, _tables.ssd_fields(step["ssd"]))
            served.append("ssd")
        self._chunkmeta_count(served)

    def _vllm_tables(self, metadata, request: StepRequest) -> None:
        super()._vllm_tables(metadata, request)
        if request.ssd is not None:
            _set_ssd(metadata, super()._build_chunk_metadata_tensors(*request.ssd))


def stats() -> dict:
    """The counters of every live chunkmeta builder, summed, with the vLLM router's hits."""
    total = {"builders": 0, "active": 0, "builds": 0, "served": {}, "fallbacks": 0, "fallback_causes": {}}
    for builder in list(_BUILDERS):
        one = builder.chunkmeta_stats()
        total["builders"] += 1
        total["active"] += one["active"]
        total["builds"] += one["builds"]
        total["fallbacks"] += one["fallbacks"]
        for key in ("served", "fallback_causes"):
            for name, count in one[key].items():
                total[key][name] = total[key].get(name, 0) + count
    from chunkmeta.integrations.vllm import routing

    if routing._ROUTER is not None:
        total["router_hits"], total["router_misses"] = routing._ROUTER.hits, routing._ROUTER.misses
    return total


_CLASSES: dict[tuple, type] = {}
_CLASSES_LOCK = threading.Lock()


def serves_for(base: type) -> Serves:
    """What chunkmeta serves for a vLLM builder class, from its family (by vLLM's class names:
    ``interface``). The ROCm Kimi-K3 builder keeps vLLM's conv tables: its fused AITER conv
    reads metadata fields that cannot be checked here."""
    from chunkmeta.integrations.vllm.interface import KIMI_ROCM_BUILDER, MAMBA2_BUILDER, is_gdn_family

    names = {klass.__name__ for klass in base.__mro__}
    if is_gdn_family(base):
        return Serves(fla=True, conv=KIMI_ROCM_BUILDER not in names)
    return Serves(conv=True, ssd=MAMBA2_BUILDER in names)


def chunkmeta_builder_class(base: type, *, reuse_block_table: bool = False) -> type:
    """The chunkmeta mixin of ``base``'s family in front of ``base`` (one class per base: vLLM
    groups layers and reuses metadata by builder type); with ``CHUNKMETA_VLLM_FULL_GRAPH`` on, a
    GDN-family or Mamba2 builder also gets its family's ``full_graph.FullGraphBuilderMixin``."""
    if issubclass(base, ChunkmetaBuilderMixin):
        return base
    from chunkmeta.integrations.vllm import full_graph
    from chunkmeta.integrations.vllm.interface import is_gdn_family

    gdn = is_gdn_family(base)
    serves = serves_for(base)
    # CHUNKMETA_VLLM_FULL_GRAPH: mixed steps in FULL graphs (GDN family, Mamba2)
    full = (gdn or serves.ssd) and full_graph.opted_in()
    key = (base, reuse_block_table, full)
    with _CLASSES_LOCK:
        cls = _CLASSES.get(key)
        if cls is None:
            mixins = (GdnFamilyMixin,) if gdn else (MambaFamilyMixin,)
            if full:
                mixins = ((full_graph.GdnFullGraphMixin if gdn else full_graph.Mamba2FullGraphMixin), *mixins)

            def body(namespace):
                namespace.update(
                    __module__=__name__,
                    __doc__=f"vLLM's {base.__name__} with its per-step prefill tables built by chunkmeta.",
                    _chunkmeta_reuse_block_table=reuse_block_table,
                    _chunkmeta_serves=serves,
                )

            cls = types.new_class(f"Chunkmeta{base.__name__}", (*mixins, base), exec_body=body)
            _CLASSES[key] = cls
    return cls
