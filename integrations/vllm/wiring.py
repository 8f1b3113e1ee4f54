"""Wiring chunkmeta into the running vLLM: ``install()`` / ``uninstall()`` and the plugin entry point.

``install()`` patches ``get_builder_cls`` of ``GDNAttentionBackend``, of the Mamba-family backends
(Mamba1, Mamba2, ShortConv), of ``KimiK3KDAAttentionBackend`` (NVIDIA) and of
``KimiK3ROCmKDABackend`` (whose layers hard-code them) to return the chunkmeta builders, and
replaces ``compute_causal_conv1d_metadata`` in the modules whose ``build()`` calls it by name
(``builders.conv_metadata``: vLLM's function outside a chunkmeta build). Patching the backend class, rather
than overriding ``GDN_ATTN`` in vLLM's backend registry, keeps the backend's identity
(``get_name()``, ``full_cls_name()``: the attention-group key), leaves other registry overrides
alone, and is not defeated by the selector's ``@cache``. The Kimi-K3 module is patched when vLLM
imports it, never imported here (see ``interface.load_vllm_api``).
"""

from __future__ import annotations

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations import plugin
from chunkmeta.integrations.vllm import interface
from chunkmeta.integrations.vllm.builders import chunkmeta_builder_class, conv_metadata
from chunkmeta.integrations.vllm.interface import (
    CONV_FUNCTION,
    ENV_VAR,
    KIMI_NVIDIA_BACKEND,
    KIMI_ROCM_BACKEND,
    SUPPORTED_VLLM,
    VllmApi,
    logger,
)

_PATCHES = plugin.Patches(logger, "vLLM")


def _getter(builder: type):
    def get_builder_cls():
        return builder

    get_builder_cls.__qualname__ = f"chunkmeta.get_builder_cls[{builder.__name__}]"
    return staticmethod(get_builder_cls)


def _patch(backend: type, gdn_builder: type) -> type:
    """Make ``backend.get_builder_cls()`` return the chunkmeta builder over its current builder."""
    with _PATCHES.lock:
        patch = _PATCHES.current(backend, "get_builder_cls")
        if patch is None:
            base = backend.get_builder_cls()
            builder = chunkmeta_builder_class(base, reuse_block_table=base is gdn_builder)
            patch = _PATCHES.apply(backend, "get_builder_cls", _getter(builder))
        return patch.value.__func__()


def _patch_conv(module) -> None:
    """``module.compute_causal_conv1d_metadata`` -> chunkmeta's stand-in over vLLM's function."""
    with _PATCHES.lock:
        if _PATCHES.current(module, CONV_FUNCTION) is None:
            problems = interface.check_conv_module(module)
            if problems:
                raise ChunkMetaError("; ".join(problems))
            _PATCHES.apply(module, CONV_FUNCTION, conv_metadata(getattr(module, CONV_FUNCTION)))


def _wire_kimi(backend_name: str, gdn_builder: type, *, conv: bool):
    """Wire a Kimi-K3 backend module when vLLM imports it (``conv``: its build() calls
    ``compute_causal_conv1d_metadata`` by name, NVIDIA's; ROCm's goes through ``gdn_attn``)."""

    def wire(module):
        backend = getattr(module, backend_name)
        problems = interface.check_backend(backend, gdn_builder)
        if problems:
            raise ChunkMetaError("; ".join(problems))
        if conv:
            _patch_conv(module)
        _patch(backend, gdn_builder)
        logger.info("chunkmeta: %s wired to %s", backend_name, backend.get_builder_cls().__name__)

    return wire


def install(api: VllmApi | None = None, *, allow_untested: bool = False) -> tuple[type, ...]:
    """Route vLLM's GDN, Kimi-K3 (NVIDIA, ROCm) and Mamba-family metadata builders through chunkmeta. Idempotent.

    Patches ``get_builder_cls`` of each backend in ``api`` (default: the running vLLM's) to
    return the chunkmeta builder over the builder it returned before; the Kimi-K3 ROCm backend
    when vLLM imports its module, if it has not yet. Call it before vLLM builds its attention
    groups (the plugin, ``register()``, runs early enough in every process). Returns the
    builder classes installed so far. Raises ``ChunkMetaError`` for a vLLM whose interface
    differs (a Kimi-K3 module imported already included), or whose version is untested unless
    ``allow_untested``; a call that raises has undone what it applied (an earlier call's patches
    stay). A Kimi-K3 module vLLM imports later and whose interface differs is logged, not raised.
    """
    api = api if api is not None else interface.load_vllm_api()
    interface.GATE.check(api.version, logger, allow_untested=allow_untested)
    problems = interface.check_api(api)
    if problems:
        raise ChunkMetaError(
            f"vLLM {api.version} does not have the interface chunkmeta patches: {'; '.join(problems)}. "
            f"Use vllm=={SUPPORTED_VLLM[-1]}."
        )
    with _PATCHES.all_or_nothing():  # a failure (a Kimi-K3 module imported already, changed) undoes this call
        for module in api.conv_modules:
            _patch_conv(module)
        builders = tuple(_patch(backend, api.gdn_builder) for backend in (*api.backends(), *api.mamba_backends))
        if api.kimi_rocm_backend is None and api.kimi_rocm_module is not None:
            _PATCHES.when_imported(api.kimi_rocm_module, _wire_kimi(KIMI_ROCM_BACKEND, api.gdn_builder, conv=False))
        if api.kimi_nvidia_module is not None:
            _PATCHES.when_imported(api.kimi_nvidia_module, _wire_kimi(KIMI_NVIDIA_BACKEND, api.gdn_builder, conv=True))
    return builders


def uninstall() -> None:
    """Undo ``install()`` (idempotent): the backends' ``get_builder_cls``, the conv stand-ins,
    the pending Kimi-K3 hooks, and the FLA router (vLLM's vendored FLA / KDA modules get their
    own ``prepare_chunk_*`` back, its import hooks are disarmed). Builders vLLM already made
    keep chunkmeta's FLA and SSD tables (their conv tables and the ops' in-forward derivation
    are vLLM's again) until a new ``install()`` and a new builder bring the router back."""
    from chunkmeta.integrations.vllm import routing

    _PATCHES.undo()
    routing.restore()


def installed() -> dict[type, type]:
    """Backend class -> chunkmeta builder class, for what ``install()`` has patched so far."""
    return {patch.owner: patch.value.__func__() for patch in _PATCHES.applied() if patch.name == "get_builder_cls"}


def pending() -> tuple[str, ...]:
    """Modules ``install()`` will wire when they are imported."""
    return _PATCHES.pending()


def opt_in(environ=None) -> str | None:
    """``CHUNKMETA_VLLM``: None (off: unset, 0, false, ...), "on" (1, true, ...) or "force"
    (on, also for an untested vLLM whose interface matches)."""
    return plugin.opt_in(ENV_VAR, logger, allow_force=True, environ=environ)


def register() -> None:
    """The ``vllm.general_plugins`` entry point, called with no arguments in every vLLM process.

    A no-op unless ``CHUNKMETA_VLLM`` opts in. Never raises: vLLM calls plugin functions
    without a guard, so any failure (an untested version, a changed interface) is logged as a
    warning and vLLM runs with its own chunk metadata.
    """
    builders = plugin.enable(ENV_VAR, logger, "vLLM", lambda force: install(allow_untested=force), allow_force=True)
    if builders:
        later = f" (and {', '.join(pending())} when vLLM imports it)" if pending() else ""
        logger.info("chunkmeta: vLLM chunk metadata built by %s%s", ", ".join(b.__name__ for b in builders), later)
