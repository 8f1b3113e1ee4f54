"""Wiring chunkmeta into SGLang: ``install()`` / ``uninstall()`` and the plugin entry point.

``install()`` swaps the backend classes where SGLang's backend selection imports them
(``attn_backend_wrapper``, ``srt/layers/attention/attention_registry.py``, imports them inside the
function body), each right after SGLang's own import of its module: nothing of SGLang is imported
here. SGLang runs its scheduler in spawned processes, so use the ``sglang.srt.plugins``
entry point ``sglang_plugin`` (opt-in: ``CHUNKMETA_SGLANG=1``), which SGLang calls in every process.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations import plugin
from chunkmeta.integrations.sglang.backends import KINDS, chunkmeta_backend
from chunkmeta.integrations.sglang.routing import find_fla
from chunkmeta.integrations.sglang.tables import ENV_VAR

logger = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ((0, 5, 9), (0, 5, 23))  # tested interfaces, inclusive
# Older releases lack the backends; a newer one is tried, its hooks checked class by class.
GATE = plugin.VersionGate(
    "SGLang",
    ".".join(map(str, SUPPORTED_VERSIONS[0])),
    ".".join(map(str, SUPPORTED_VERSIONS[1])),
    fix="upgrade SGLang: older releases lack the linear-attention backends the adapter subclasses.",
    newer_warns=True,
)

# Where each backend class lives, newest layout first (0.5.11 moved them; 0.5.9/0.5.10 named KDA
# "KimiLinearAttnBackend").
TARGETS = {
    "kda": (
        ("srt.layers.attention.linear.kda_backend", "KDAAttnBackend"),
        ("srt.layers.attention.hybrid_linear_attn_backend", "KimiLinearAttnBackend"),
    ),
    "gdn": (
        ("srt.layers.attention.linear.gdn_backend", "GDNAttnBackend"),
        ("srt.layers.attention.hybrid_linear_attn_backend", "GDNAttnBackend"),
    ),
    "mamba2": (("srt.layers.attention.hybrid_linear_attn_backend", "Mamba2AttnBackend"),),
}
assert tuple(TARGETS) == KINDS
OPTIONAL_KINDS = ("mamba2",)  # installed where the release has it; KDA and GDN must be there

_INSTALL_LOCK = threading.Lock()
_PATCHES: dict[str, plugin.Patches] = {}  # per SGLang package (tests install into stand-ins)


def package_version(package: str) -> str | None:
    """``package.__version__``, else its distribution's version, else None."""
    version = getattr(importlib.import_module(package), "__version__", None)
    return str(version) if version is not None else plugin.distribution_version(package)


def _wire_module(package: str, patches: plugin.Patches, targets: list[tuple[str, str]]):
    """What to do once SGLang imports one backend module: put chunkmeta's subclass in place of each
    backend class of ``targets`` (kind, class name) the module holds. A name the module lacks is
    another release's layout (``TARGETS``); a class that is chunkmeta's already (a module that
    re-exports one wired where it is defined) is left as it is."""

    def wire(module):
        with patches.all_or_nothing():  # a module is wired whole or not at all
            for kind, attr in targets:
                base = getattr(module, attr, None)
                if not isinstance(base, type) or patches.current(module, attr) is not None:
                    continue
                if getattr(base, "chunkmeta_base", None) is not None:
                    continue
                # SGLang's backend module has imported its vendored FLA by now: found, not imported
                fla_package = find_fla(package) if kind != "mamba2" else None
                ours = chunkmeta_backend(base, kind=kind, fla_package=fla_package)
                patches.apply(module, attr, ours)
                logger.info(
                    "chunkmeta: %s.%s -> %s (hooks: %s)", module.__name__, attr, ours.__name__, ours.chunkmeta_hooks
                )

    return wire


def _installed(package: str, patches: plugin.Patches) -> dict[str, type]:
    found = {}
    for patch in patches.applied():
        if patch.in_place:
            found.setdefault(patch.value.chunkmeta_kind, patch.value)
    return {kind: found[kind] for kind in KINDS if kind in found}


def _check_required(package: str, found: dict[str, type]) -> None:
    """Refuse a release whose every candidate module for KDA or GDN is imported and holds no
    backend class (a release chunkmeta does not know); one not imported yet is waited for."""
    for kind in KINDS:
        if kind in OPTIONAL_KINDS or kind in found:
            continue
        names = [(f"{package}.{relative}", attr) for relative, attr in TARGETS[kind]]
        modules = [sys.modules.get(name) for name, _ in names]
        if all(module is not None for module in modules) and not any(
            isinstance(getattr(module, attr, None), type) for module, (_, attr) in zip(modules, names, strict=True)
        ):
            raise ChunkMetaError(
                f"package={package!r}: no {kind.upper()} backend class at "
                f"{', '.join(f'{name}.{attr}' for name, attr in names)}; chunkmeta supports SGLang {GATE.tested}."
            )


def install(package: str = "sglang") -> dict[str, type]:
    """Put chunkmeta's KDA, GDN and Mamba2 backends where SGLang's backend selection finds them.

    Imports no SGLang module but ``package`` itself (which SGLang's plugin loader has imported):
    SGLang loads plugins in its engine, detokenizer and scheduler processes alike, and the backend
    modules import SGLang's kernels. Each backend module (``TARGETS``) is wired right after SGLang
    itself imports it (``plugin.Patches.when_imported``), at once if it is imported already: the
    backend class's module attribute becomes chunkmeta's subclass (SGLang's is saved). Idempotent.
    Backends built afterwards in this process use chunkmeta. ``package`` is the SGLang package
    (tests pass a stand-in). Returns the classes installed so far, ``{"kda": class, "gdn": class,
    "mamba2": class}`` once SGLang has imported them (no ``"mamba2"`` where the release has no
    ``Mamba2AttnBackend``).
    """
    with _INSTALL_LOCK:
        try:
            importlib.import_module(package)
        except ImportError as exc:
            raise ChunkMetaError(
                f"package={package!r} is not importable ({exc}): install SGLang {GATE.tested}."
            ) from None
        version = package_version(package)
        if version is not None:
            GATE.check(version, logger, label=package)
        patches = _PATCHES.setdefault(package, plugin.Patches(logger, "SGLang"))
        by_module: dict[str, list[tuple[str, str]]] = {}
        for kind in KINDS:
            for relative, attr in TARGETS[kind]:
                by_module.setdefault(f"{package}.{relative}", []).append((kind, attr))
        with patches.all_or_nothing():
            for name, targets in by_module.items():
                patches.when_imported(name, _wire_module(package, patches, targets))
            found = _installed(package, patches)
            _check_required(package, found)
        return found


def uninstall(package: str = "sglang") -> None:
    """Restore SGLang's backend classes (idempotent). Backends already built keep chunkmeta until
    they are dropped (``backend.chunkmeta.close()`` stops one at once)."""
    with _INSTALL_LOCK:
        patches = _PATCHES.pop(package, None)
        if patches is not None:
            patches.undo()


def installed(package: str = "sglang") -> bool:
    patches = _PATCHES.get(package)
    return patches is not None and bool(patches.applied())


def pending(package: str = "sglang") -> tuple[str, ...]:
    """Backend modules ``install()`` wires when SGLang imports them."""
    patches = _PATCHES.get(package)
    return patches.pending() if patches is not None else ()


def sglang_plugin() -> None:
    """Entry point of the ``sglang.srt.plugins`` group, which SGLang runs in every process.

    Opt-in: installs only when ``CHUNKMETA_SGLANG=1``, so having chunkmeta installed changes nothing
    by itself. (``SGLANG_PLUGINS`` can restrict which plugins SGLang loads at all.) A failure to
    install is a warning: SGLang then runs with its own chunk metadata.
    """
    plugin.enable(ENV_VAR, logger, "SGLang", lambda force: install())
