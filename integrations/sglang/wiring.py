"""Wiring chunkmeta into SGLang: ``install()`` / ``uninstall()`` and the plugin entry point.

``install()`` swaps the backend classes where SGLang's backend selection imports them
(``attn_backend_wrapper``, ``srt/layers/attention/attention_registry.py``, imports them inside the
function body). SGLang runs its scheduler in spawned processes, so use the ``sglang.srt.plugins``
entry point ``sglang_plugin`` (opt-in: ``CHUNKMETA_SGLANG=1``), which SGLang calls in every process.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations import plugin
from chunkmeta.integrations.sglang.backends import KINDS, chunkmeta_backend
from chunkmeta.integrations.sglang.routing import find_fla

logger = logging.getLogger(__name__)

ENV_VAR = "CHUNKMETA_SGLANG"
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


def _find_target(package: str, kind: str) -> tuple[object, str]:
    tried = []
    for relative, attr in TARGETS[kind]:
        name = f"{package}.{relative}"
        tried.append(f"{name}.{attr}")
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        module = importlib.import_module(name)
        if isinstance(getattr(module, attr, None), type):
            return module, attr
    raise ChunkMetaError(
        f"package={package!r}: no {kind.upper()} backend class at {', '.join(tried)}; "
        f"chunkmeta supports SGLang {GATE.tested}."
    )


def install(package: str = "sglang") -> dict[str, type]:
    """Put chunkmeta's KDA, GDN and Mamba2 backends where SGLang's backend selection finds them.

    Replaces the backend classes' module attributes (saving SGLang's); idempotent. Backends built
    afterwards in this process use chunkmeta. ``package`` is the SGLang package (tests pass a
    stand-in). Returns ``{"kda": class, "gdn": class, "mamba2": class}`` (no ``"mamba2"`` where the
    release has no ``Mamba2AttnBackend``).
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
        fla_package = find_fla(package)
        patches = _PATCHES.setdefault(package, plugin.Patches(logger, "SGLang"))
        installed = {}
        for kind in KINDS:
            try:
                module, attr = _find_target(package, kind)
            except ChunkMetaError:
                if kind not in OPTIONAL_KINDS:
                    raise
                logger.info("chunkmeta: %s has no %s backend; it is left as it is", package, kind)
                continue
            patch = patches.current(module, attr)
            if patch is None:
                ours = chunkmeta_backend(
                    getattr(module, attr), kind=kind, fla_package=fla_package if kind != "mamba2" else None
                )
                patch = patches.apply(module, attr, ours)
                logger.info(
                    "chunkmeta: %s.%s -> %s (hooks: %s)", module.__name__, attr, ours.__name__, ours.chunkmeta_hooks
                )
            installed[kind] = patch.value
        return installed


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


def sglang_plugin() -> None:
    """Entry point of the ``sglang.srt.plugins`` group, which SGLang runs in every process.

    Opt-in: installs only when ``CHUNKMETA_SGLANG=1``, so having chunkmeta installed changes nothing
    by itself. (``SGLANG_PLUGINS`` can restrict which plugins SGLang loads at all.) A failure to
    install is a warning: SGLang then runs with its own chunk metadata.
    """
    plugin.enable(ENV_VAR, logger, "SGLang", lambda force: install())
