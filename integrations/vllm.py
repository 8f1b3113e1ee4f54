"""vLLM adapter: chunkmeta behind vLLM's GDN / KDA chunk-metadata hook (vLLM 0.33.0).

Where vLLM builds the tables: ``GDNAttentionMetadataBuilder.build()``
(``vllm/v1/attention/backends/gdn_attn.py``) calls, once per step and only when the batch has
prefills, ``_build_chunk_metadata(prefill_query_start_loc, prefill_query_start_loc_cpu,
device) -> (chunk_indices, chunk_offsets)`` on the prefill slice (rebased to start at 0, decodes
peeled off the front, trailing zero-length padding rows possibly left in). Its default derives
the tables on the host from the CPU copy and copies them over; the ROCm Kimi-K3 builder
(``vllm/models/kimi_k3/amd/kda_metadata.py``) allocates fresh tensors and runs a serial
per-sequence kernel. Qwen3-Next / Qwen3.5 (GDN) and Kimi-Linear (KDA) use the stock builder.

What this module gives:

* ``ChunkmetaBuilderMixin``: put in front of a vLLM GDN-family builder, it answers the hook
  from one persistent ``ChunkMetadataBuilder`` per vLLM builder, sized from the scheduler
  config (``max_num_seqs``, ``max_num_batched_tokens``, chunk size 64): one device launch into
  ring buffers, no sync, no host->device copy. The tables are exactly vLLM's (int32 ``[NT, 2]``,
  int64 ``[N+1]``); for ``gdn_prefill_backend="cutedsl"`` they are in CuteDSL's layout.
* ``prepare_chunk_metadata_device(cu_seqlens, cu_seqlens_cpu, chunk_size)``: a drop-in for the
  ROCm Kimi-K3 helper (same signature, dtypes and fresh tensors).
* ``install()`` / ``uninstall()``: patch ``get_builder_cls`` of ``GDNAttentionBackend`` and of
  ``KimiK3ROCmKDABackend`` (whose layer hard-codes it) to return the mixed-in builders.
  Patching the backend class, rather than overriding ``GDN_ATTN`` in vLLM's backend registry,
  keeps the backend's identity (``get_name()``, ``full_cls_name()``: the attention-group key),
  leaves other registry overrides alone, and is not defeated by the selector's ``@cache``.
  The Kimi-K3 module is patched when vLLM imports it, never imported here: it imports vLLM's
  FLA utils, which query the GPU at import (``torch.cuda.get_device_name``), and that must not
  happen in vLLM's API-server and engine-core processes, which start workers afterwards.
* ``register()``: the ``vllm.general_plugins`` entry point; a no-op unless ``CHUNKMETA_VLLM=1``.

Nothing here imports vLLM at import time: ``load_vllm_api()`` does, inside ``install()``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import logging
import os
import sys
import threading
import types
from importlib import metadata as _importlib_metadata

import attrs
import torch

from chunkmeta.builder import ChunkMetadataBuilder, build_chunk_metadata
from chunkmeta.errors import ChunkMetaError
from chunkmeta.metadata import ChunkMetadata

# Under vLLM's "vllm" logger, so that inside vLLM these lines appear in vLLM's log, in its format
# and at its level (VLLM_LOGGING_LEVEL).
logger = logging.getLogger("vllm.chunkmeta")

SUPPORTED_VLLM = ("0.33.0",)
ENV_VAR = "CHUNKMETA_VLLM"
# vllm.third_party.flash_linear_attention.ops.utils.FLA_CHUNK_SIZE: every builder hook uses it.
FLA_CHUNK_SIZE = 64
# A vLLM builder builds once per step (DBO micro-batches have builders of their own), and only
# that step's forward reads the tables. On one stream the next fill queues after that forward,
# so the GPU side is safe at any depth; four slots also keep a step's tables intact while the
# host runs up to three steps ahead (async scheduling).
RING_DEPTH = 4

KIMI_ROCM_MODULE = "vllm.models.kimi_k3.amd.kda_metadata"
KIMI_ROCM_BACKEND = "KimiK3ROCmKDABackend"
HOOK = "_build_chunk_metadata"
HOOK_PARAMS = ("self", "prefill_query_start_loc", "prefill_query_start_loc_cpu", "device")
INIT_PARAMS = ("self", "kv_cache_spec", "layer_names", "vllm_config", "device")
# gdn_prefill_backend values whose build() never calls the hook: FlashInfer reads cu_seqlens
# itself, AITER FlyDSL brings its own metadata. chunkmeta allocates nothing for them.
HOOKLESS_BACKENDS = frozenset({"flashinfer", "aiter_flydsl"})
CUTEDSL = "cutedsl"

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


# -- the vLLM names the adapter touches ---------------------------------------------------


@attrs.frozen
class VllmApi:
    """The vLLM classes the adapter patches, resolved once (tests pass a model of them).

    ``gdn_backend`` / ``gdn_builder``: ``GDNAttentionBackend`` / ``GDNAttentionMetadataBuilder``
    (``vllm/v1/attention/backends/gdn_attn.py``). ``kimi_rocm_backend``: ``KimiK3ROCmKDABackend``
    (``vllm/models/kimi_k3/amd/kda_metadata.py``) if its module is imported already; otherwise
    ``kimi_rocm_module`` names that module, and ``install()`` wires the backend when vLLM imports it.
    """

    version: str
    gdn_backend: type
    gdn_builder: type
    kimi_rocm_backend: type | None = None
    kimi_rocm_module: str | None = None

    def backends(self) -> tuple[type, ...]:
        return tuple(b for b in (self.gdn_backend, self.kimi_rocm_backend) if b is not None)


def vllm_version() -> str | None:
    try:
        return _importlib_metadata.version("vllm")
    except _importlib_metadata.PackageNotFoundError:
        return None


def load_vllm_api() -> VllmApi:
    """The running vLLM's classes. Imports ``gdn_attn`` (safe in any vLLM process), never the
    Kimi-K3 ROCm module (see the module docstring)."""
    version = vllm_version()
    if version is None:
        raise ChunkMetaError(
            "chunkmeta.integrations.vllm needs vLLM: pip install 'chunkmeta[vllm]' (vllm==0.33.0)."
        )
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend, GDNAttentionMetadataBuilder

    kimi = getattr(sys.modules.get(KIMI_ROCM_MODULE), KIMI_ROCM_BACKEND, None)
    return VllmApi(version, GDNAttentionBackend, GDNAttentionMetadataBuilder, kimi,
                   None if kimi is not None else KIMI_ROCM_MODULE)


def is_supported_version(version: str) -> bool:
    """A release chunkmeta is tested against; local tags (``+rocm...``, ``+cu130``) are ignored."""
    return version.split("+", 1)[0] in SUPPORTED_VLLM


def _param_names(function) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


def check_api(api: VllmApi) -> list[str]:
    """What in ``api`` differs from the interface the adapter is written against (empty: none)."""
    problems = []
    hook = getattr(api.gdn_builder, HOOK, None)
    if hook is None:
        problems.append(f"{api.gdn_builder.__name__} has no {HOOK} hook")
    elif _param_names(hook) != HOOK_PARAMS:
        problems.append(f"{api.gdn_builder.__name__}.{HOOK}{_param_names(hook)} is not {HOOK}{HOOK_PARAMS}")
    init = _param_names(api.gdn_builder.__init__)
    if init is None or init[: len(INIT_PARAMS)] != INIT_PARAMS:
        problems.append(f"{api.gdn_builder.__name__}.__init__{init} does not start with {INIT_PARAMS}")
    problems += [p for backend in api.backends() for p in _check_backend(backend, api.gdn_builder)]
    return problems


def _check_backend(backend: type, gdn_builder: type) -> list[str]:
    getter = getattr(backend, "get_builder_cls", None)
    builder = getter() if callable(getter) else None
    if isinstance(builder, type) and issubclass(builder, gdn_builder):
        return []
    return [f"{backend.__name__}.get_builder_cls() returns {builder!r}, not a {gdn_builder.__name__}"]


# -- the builder --------------------------------------------------------------------------


def builder_for_config(vllm_config, device) -> ChunkMetadataBuilder:
    """A persistent ChunkMetadataBuilder for one vLLM builder, sized to the scheduler's limits.

    vLLM's runners size their ``query_start_loc`` buffer to ``max_num_seqs + 1`` entries and
    their token buffers to ``max_num_batched_tokens`` (CUDA-graph padding included), so every
    prefill slice fits.
    """
    scheduler = vllm_config.scheduler_config
    return ChunkMetadataBuilder(scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                                chunk_size=FLA_CHUNK_SIZE, device=device, ring_depth=RING_DEPTH)


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
    row is real and the workspaces are no larger than needed. The int64 -> int32 cast is a
    device op (no sync).
    """
    return metadata.chunk_indices, metadata.chunk_offsets.to(torch.int32)


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
            logger.info("chunkmeta: gdn_prefill_backend=%r builds no FLA chunk metadata; nothing to do",
                        prefill_backend)
            return
        try:
            chunkmeta = builder_for_config(vllm_config, device)
            warm_up(chunkmeta)
        except Exception as exc:  # limits it cannot hold, or a fill that fails on this platform
            logger.warning("chunkmeta: %s keeps vLLM's own chunk metadata: %s: %s", type(self).__name__,
                           type(exc).__name__, exc)
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
                "chunkmeta: %s This step uses vLLM's own chunk metadata (fallback %d).", exc,
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


# -- the ROCm Kimi-K3 drop-in -------------------------------------------------------------


def prepare_chunk_metadata_device(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor,
                                  chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for ``vllm.models.kimi_k3.amd.kda_metadata.prepare_chunk_metadata_device``.

    Same signature and outputs: ``chunk_indices`` ``[NT, 2]`` in ``cu_seqlens``' dtype (exact
    NT, true sequence indices), ``chunk_offsets`` int64 ``[N+1]``, fresh tensors on
    ``cu_seqlens``' device; sizes from ``cu_seqlens_cpu`` only (no sync). chunkmeta's fill is
    parallel over chunks where vLLM 0.33.0's kernel loops over each sequence's chunks.
    ``chunk_size`` must be a power of two in [16, 4096] (FLA uses 64).
    """
    try:
        metadata = build_chunk_metadata(cu_seqlens, cu_seqlens_cpu, chunk_size=chunk_size)
    except ChunkMetaError as exc:
        # The core names its inputs query_start_loc(_cpu); here they are cu_seqlens(_cpu).
        raise ChunkMetaError(str(exc).replace("query_start_loc", "cu_seqlens")) from None
    chunk_indices = metadata.chunk_indices
    if chunk_indices.dtype != cu_seqlens.dtype:
        chunk_indices = chunk_indices.to(cu_seqlens.dtype)
    return chunk_indices, metadata.chunk_offsets


# -- install / uninstall ------------------------------------------------------------------


@attrs.frozen
class _Patch:
    backend: type
    original: object | None  # the backend's own get_builder_cls attribute; None: it was inherited
    getter: object  # what install() put there
    builder: type


_PATCHES: dict[type, _Patch] = {}
_PATCHES_LOCK = threading.RLock()


def _getter(builder: type):
    def get_builder_cls():
        return builder

    get_builder_cls.__qualname__ = f"chunkmeta.get_builder_cls[{builder.__name__}]"
    return staticmethod(get_builder_cls)


def _patch(backend: type, gdn_builder: type) -> type:
    """Make ``backend.get_builder_cls()`` return the chunkmeta builder over its current builder."""
    with _PATCHES_LOCK:
        patch = _PATCHES.get(backend)
        if patch is None:
            base = backend.get_builder_cls()
            builder = chunkmeta_builder_class(base, reuse_block_table=base is gdn_builder)
            getter = _getter(builder)
            patch = _Patch(backend, backend.__dict__.get("get_builder_cls"), getter, builder)
            _PATCHES[backend] = patch
            backend.get_builder_cls = getter
        return patch.builder


class _OnImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once, right after ``name`` is imported by whoever imports it.

    A meta-path finder that finds nothing itself: for ``name`` it asks the other finders for the
    spec and wraps that module's loader ``exec_module`` (a per-module loader object), then
    removes itself. A failing callback is logged, never raised into the importer.
    """

    def __init__(self, name: str, callback):
        self.name = name
        self.callback = callback
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_callback(module):
            exec_module(module)
            self.remove()
            try:
                self.callback(module)
            except Exception as exc:
                logger.warning("chunkmeta: wiring %s failed, vLLM keeps its own: %s: %s", self.name,
                               type(exc).__name__, exc)

        spec.loader.exec_module = exec_then_callback
        return spec

    def arm(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


_DEFERRED: dict[str, _OnImport] = {}


def _defer(module_name: str, gdn_builder: type) -> None:
    """Patch ``module_name``'s Kimi-K3 ROCm backend now if it is imported, else when it is."""
    def wire(module):
        with _PATCHES_LOCK:
            _DEFERRED.pop(module_name, None)
        backend = getattr(module, KIMI_ROCM_BACKEND)
        problems = _check_backend(backend, gdn_builder)
        if problems:
            raise ChunkMetaError("; ".join(problems))
        _patch(backend, gdn_builder)
        logger.info("chunkmeta: %s wired to %s", KIMI_ROCM_BACKEND, backend.get_builder_cls().__name__)

    with _PATCHES_LOCK:
        if module_name in _DEFERRED:
            return
        module = sys.modules.get(module_name)
        if module is not None:
            wire(module)
            return
        hook = _DEFERRED[module_name] = _OnImport(module_name, wire)
        hook.arm()


def install(api: VllmApi | None = None, *, allow_untested: bool = False) -> tuple[type, ...]:
    """Route vLLM's GDN and ROCm Kimi-K3 KDA metadata builders through chunkmeta. Idempotent.

    Patches ``get_builder_cls`` of each backend in ``api`` (default: the running vLLM's) to
    return the chunkmeta builder over the builder it returned before; the Kimi-K3 ROCm backend
    when vLLM imports its module, if it has not yet. Call it before vLLM builds its attention
    groups (the plugin, ``register()``, runs early enough in every process). Returns the
    builder classes installed so far. Raises ``ChunkMetaError`` for a vLLM whose interface
    differs, or whose version is untested unless ``allow_untested``.
    """
    api = api if api is not None else load_vllm_api()
    if not (allow_untested or is_supported_version(api.version)):
        raise ChunkMetaError(
            f"vLLM {api.version} is untested with chunkmeta (supported: {', '.join(SUPPORTED_VLLM)}): "
            f"install vllm=={SUPPORTED_VLLM[-1]}, or pass allow_untested=True ({ENV_VAR}=force for the "
            "plugin) to try it."
        )
    problems = check_api(api)
    if problems:
        raise ChunkMetaError(
            f"vLLM {api.version} does not have the interface chunkmeta patches: {'; '.join(problems)}. "
            f"Use vllm=={SUPPORTED_VLLM[-1]}."
        )
    with _PATCHES_LOCK:
        builders = tuple(_patch(backend, api.gdn_builder) for backend in api.backends())
        if api.kimi_rocm_backend is None and api.kimi_rocm_module is not None:
            _defer(api.kimi_rocm_module, api.gdn_builder)
    return builders


def uninstall() -> None:
    """Undo ``install()`` (idempotent). Builders vLLM already made keep chunkmeta."""
    with _PATCHES_LOCK:
        for hook in _DEFERRED.values():
            hook.remove()
        _DEFERRED.clear()
        for backend, patch in reversed(list(_PATCHES.items())):
            if backend.__dict__.get("get_builder_cls") is not patch.getter:
                logger.warning("chunkmeta: %s.get_builder_cls was replaced after install(); left as it is",
                               backend.__name__)
            elif patch.original is None:
                del backend.get_builder_cls
            else:
                backend.get_builder_cls = patch.original
        _PATCHES.clear()


def installed() -> dict[type, type]:
    """Backend class -> chunkmeta builder class, for what ``install()`` has patched so far."""
    with _PATCHES_LOCK:
        return {backend: patch.builder for backend, patch in _PATCHES.items()}


def pending() -> tuple[str, ...]:
    """Modules ``install()`` will wire when they are imported."""
    with _PATCHES_LOCK:
        return tuple(_DEFERRED)


# -- the vLLM plugin ----------------------------------------------------------------------


def opt_in(environ=None) -> str | None:
    """``CHUNKMETA_VLLM``: None (off: unset, 0, false, ...), "on" (1, true, ...) or "force"
    (on, also for an untested vLLM whose interface matches)."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in _OFF:
        return None
    if value in _ON:
        return "on"
    if value == "force":
        return "force"
    logger.warning("chunkmeta: %s=%r is not understood (use 1 to enable, force for an untested vLLM, 0 to "
                   "disable); chunkmeta stays off", ENV_VAR, raw)
    return None


def register() -> None:
    """The ``vllm.general_plugins`` entry point, called with no arguments in every vLLM process.

    A no-op unless ``CHUNKMETA_VLLM`` opts in. Never raises: vLLM calls plugin functions
    without a guard, so any failure (an untested version, a changed interface) is logged as a
    warning and vLLM runs with its own chunk metadata.
    """
    mode = opt_in()
    if mode is None:
        return
    try:
        builders = install(allow_untested=mode == "force")
    except Exception as exc:
        logger.warning("chunkmeta: not enabled in vLLM, which keeps its own chunk metadata: %s: %s",
                       type(exc).__name__, exc)
        return
    later = f" (and {', '.join(pending())} when vLLM imports it)" if pending() else ""
    logger.info("chunkmeta: vLLM chunk metadata built by %s%s", ", ".join(b.__name__ for b in builders), later)
