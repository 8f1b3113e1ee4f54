"""Wiring chunkmeta into the running vLLM: ``install()`` / ``uninstall()`` and the plugin entry point.

``install()`` patches ``get_builder_cls`` of ``GDNAttentionBackend``, of the Mamba-family backends
(Mamba1, Mamba2, ShortConv), of ``KimiK3KDAAttentionBackend`` (NVIDIA) and of
``KimiK3ROCmKDABackend`` (whose layers hard-code them) to return the chunkmeta builders, and
replaces ``compute_causal_conv1d_metadata`` in the modules whose ``build()`` calls it by name
(``builders.conv_metadata``: vLLM's function outside a chunkmeta build). Patching the backend class, rather
than overriding ``GDN_ATTN`` in vLLM's backend registry, keeps the backend's identity
(``get_name()``, ``full_cls_name()``: the attention-group key), leaves other registry overrides
alone, and is not defeated by the selector's ``@cache``.

Nothing of vLLM is imported here: vLLM runs its plugins in the API server and the engine core too,
which build no model (and some modules query the GPU at import). Each module is wired by an import
hook right after vLLM itself imports it (``plugin.Patches.when_imported``), at once if it is
imported already.
"""

from __future__ import annotations

import importlib

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations import plugin
from chunkmeta.integrations.vllm import interface
from chunkmeta.integrations.vllm.builders import chunkmeta_builder_class, conv_metadata
from chunkmeta.integrations.vllm.interface import (
    CONV_FUNCTION,
    ENV_VAR,
    GDN_BACKEND,
    GDN_BUILDER,
    KIMI_NVIDIA_BACKEND,
    KIMI_ROCM_BACKEND,
    SUPPORTED_VLLM,
    VllmApi,
    VllmModules,
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


def _refuse(version: str, problems: list[str]) -> None:
    if problems:
        raise ChunkMetaError(
            f"vLLM {version} does not have the interface chunkmeta patches: {'; '.join(problems)}. "
            f"Use vllm=={SUPPORTED_VLLM[-1]}."
        )


def _wire_kimi(backend_name: str, gdn_builder, *, conv: bool):
    """Wire a Kimi-K3 backend module when vLLM imports it (``conv``: its build() calls
    ``compute_causal_conv1d_metadata`` by name, NVIDIA's; ROCm's goes through ``gdn_attn``).
    ``gdn_builder``: the class, or a function giving it when the module is wired."""

    def wire(module):
        base = gdn_builder() if not isinstance(gdn_builder, type) else gdn_builder
        backend = getattr(module, backend_name)
        problems = interface.check_backend(backend, base)
        if problems:
            raise ChunkMetaError("; ".join(problems))
        if conv:
            _patch_conv(module)
        _patch(backend, base)
        logger.info("chunkmeta: %s wired to %s", backend_name, backend.get_builder_cls().__name__)

    return wire


def _wire_layers(add) -> None:
    """With ``CHUNKMETA_VLLM_FULL_GRAPH`` on, ``add(module name, wire)`` for each linear-attention
    layer module whose mixed-step forward ``full_graph`` patches."""
    from chunkmeta.integrations.vllm import full_graph

    if full_graph.opted_in():
        for name, wire in full_graph.layer_wiring(_PATCHES).items():
            add(name, wire)


def _module_wiring(version: str, modules: VllmModules) -> dict:
    """Module name -> what to do once it is imported: every patch of that module, in one call
    (one import hook per module; a module that fails its check keeps vLLM's own path)."""
    jobs: dict[str, list] = {}

    def gdn(module):
        backend, builder = getattr(module, GDN_BACKEND, None), getattr(module, GDN_BUILDER, None)
        if not isinstance(backend, type) or not isinstance(builder, type):
            raise ChunkMetaError(f"{module.__name__} has no {GDN_BACKEND} / {GDN_BUILDER}")
        _refuse(version, interface.check_api(VllmApi(version, backend, builder)))
        _patch(backend, builder)

    def mamba(name):
        def wire(module):
            backend = getattr(module, name)
            _refuse(version, interface.check_mamba_backend(backend))
            _patch(backend, None)

        return wire

    def gdn_builder():
        return getattr(importlib.import_module(modules.gdn), GDN_BUILDER)  # the Kimi-K3 module imported it

    for name in modules.conv:
        jobs.setdefault(name, []).append(_patch_conv)
    jobs.setdefault(modules.gdn, []).append(gdn)
    for name, backend in modules.mamba:
        jobs.setdefault(name, []).append(mamba(backend))
    if modules.kimi_rocm is not None:
        jobs.setdefault(modules.kimi_rocm, []).append(_wire_kimi(KIMI_ROCM_BACKEND, gdn_builder, conv=False))
    if modules.kimi_nvidia is not None:
        jobs.setdefault(modules.kimi_nvidia, []).append(_wire_kimi(KIMI_NVIDIA_BACKEND, gdn_builder, conv=True))

    _wire_layers(lambda name, wire: jobs.setdefault(name, []).append(wire))

    def wiring(steps):
        def wire(module):
            with _PATCHES.all_or_nothing():  # a module is wired whole or not at all
                for step in steps:
                    step(module)

        return wire

    return {name: wiring(steps) for name, steps in jobs.items()}


def install(
    api: VllmApi | None = None, *, allow_untested: bool = False, modules: VllmModules | None = None
) -> tuple[type, ...]:
    """Route vLLM's GDN, Kimi-K3 (NVIDIA, ROCm) and Mamba-family metadata builders through chunkmeta. Idempotent.

    Without ``api`` (the plugin's way): imports nothing of vLLM. Each module of ``modules``
    (default ``interface.MODULES``) is wired right after vLLM itself imports it (``plugin.Patches
    .when_imported``), or at once if it is imported already: ``get_builder_cls`` of its backend
    returns the chunkmeta builder over the builder it returned before, ``compute_causal_conv1d_metadata``
    becomes chunkmeta's stand-in. The version is read from the distribution's metadata. With
    ``api`` (classes resolved already, e.g. ``load_vllm_api()``): those are patched at once.

    Call it before vLLM builds its attention groups (the plugin, ``register()``, runs early enough
    in every process). Returns the builder classes installed so far. Raises ``ChunkMetaError`` for
    a vLLM whose version is untested unless ``allow_untested``, or whose interface differs where it
    is imported already; a call that raises has undone what it applied (an earlier call's patches
    stay). A module vLLM imports later whose interface differs is logged and keeps vLLM's path.
    """
    if api is None:
        version = interface.vllm_version()
        if version is None:
            raise ChunkMetaError(
                "chunkmeta.integrations.vllm needs vLLM: pip install 'chunkmeta[vllm]' (vllm==0.33.0)."
            )
        interface.GATE.check(version, logger, allow_untested=allow_untested)
        with _PATCHES.all_or_nothing():
            for name, wire in _module_wiring(version, modules or interface.MODULES).items():
                _PATCHES.when_imported(name, wire)
        return tuple(installed().values())
    interface.GATE.check(api.version, logger, allow_untested=allow_untested)
    _refuse(api.version, interface.check_api(api))
    with _PATCHES.all_or_nothing():  # a failure (a Kimi-K3 module imported already, changed) undoes this call
        for module in api.conv_modules:
            _patch_conv(module)
        builders = tuple(_patch(backend, api.gdn_builder) for backend in (*api.backends(), *api.mamba_backends))
        if api.kimi_rocm_backend is None and api.kimi_rocm_module is not None:
            _PATCHES.when_imported(api.kimi_rocm_module, _wire_kimi(KIMI_ROCM_BACKEND, api.gdn_builder, conv=False))
        if api.kimi_nvidia_module is not None:
            _PATCHES.when_imported(api.kimi_nvidia_module, _wire_kimi(KIMI_NVIDIA_BACKEND, api.gdn_builder, conv=True))
        _wire_layers(lambda name, wire: _PATCHES.when_imported(name, wire))
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
    if builders is not None:
        logger.info(
            "chunkmeta: vLLM chunk metadata built by %s; wired when vLLM imports them: %s",
            ", ".join(b.__name__ for b in builders) or "no builder yet",
            ", ".join(pending()) or "nothing",
        )
