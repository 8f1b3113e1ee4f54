"""What every engine plugin of chunkmeta needs: opt-in, a version gate, reversible patches, import hooks.

Engines run their plugins in every process they start (vLLM's ``vllm.general_plugins``, SGLang's
``sglang.srt.plugins``), so an adapter's plugin must do nothing unless the user opts in (an
environment variable), refuse an engine release whose interface it was not written against, undo
exactly what it did, and never import an engine module the engine has not imported itself (some
query the GPU at import, which the engines' front-end processes must not do). The adapters
(``chunkmeta.integrations.vllm``, ``chunkmeta.integrations.sglang``) keep only what is their
engine's: which names they patch, and with what.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import threading
from importlib import metadata as _importlib_metadata

import attrs

from chunkmeta.errors import ChunkMetaError

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
_RELEASE = re.compile(r"\d+(?:\.\d+)*")


# -- opt-in ------------------------------------------------------------------------------------


def opt_in(env_var: str, logger: logging.Logger, *, allow_force: bool = False, environ=None) -> str | None:
    """The user's choice in ``env_var``: None (off: unset, 0, false, no, off), ``"on"`` (1, true,
    yes, on) or, with ``allow_force``, ``"force"`` (on, also for an untested release whose
    interface matches). Anything else is off, with a warning: having chunkmeta installed must
    change nothing by itself."""
    raw = (os.environ if environ is None else environ).get(env_var, "")
    value = raw.strip().lower()
    if value in _OFF:
        return None
    if value in _ON:
        return "on"
    if allow_force and value == "force":
        return "force"
    choices = "1 to enable, force for an untested release, 0 to disable" if allow_force else "1 to enable, 0 to disable"
    logger.warning("chunkmeta: %s=%r is not understood (use %s); chunkmeta stays off", env_var, raw, choices)
    return None


def enable(env_var: str, logger: logging.Logger, engine: str, install, *, allow_force: bool = False):
    """What an entry point does in every engine process: nothing unless ``env_var`` opts in, else
    ``install(force)`` (``force``: the user opted in with ``force``) and its result. Never raises:
    an adapter that cannot install leaves the engine on its own path, with one warning."""
    mode = opt_in(env_var, logger, allow_force=allow_force)
    if mode is None:
        return None
    try:
        return install(mode == "force")
    except Exception as exc:  # noqa: BLE001  the engine must start whatever the adapter finds
        logger.warning(
            "chunkmeta: not enabled in %s, which keeps its own chunk metadata: %s: %s", engine, type(exc).__name__, exc
        )
        return None


def keeps_engine_path(logger: logging.Logger, what: str, exc: Exception, env_var: str) -> None:
    """The one warning of a backend (or builder) that keeps its engine's own path because chunkmeta
    could not be set up for it (sizing, configuration, a fill that fails to compile or warm up).
    ``what`` says who keeps what (``"X keeps SGLang's own chunk metadata"``); a ``ChunkMetaError``
    names the setting at fault and its fix; ``env_var`` (the opt-in) turns chunkmeta off."""
    logger.warning(
        "chunkmeta: %s: %s: %s (the engine runs on without it; %s=0 turns chunkmeta off)",
        what,
        type(exc).__name__,
        exc,
        env_var,
    )


# -- the version gate --------------------------------------------------------------------------


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (``"vllm"``, ``"fla-core"``), or None."""
    try:
        return _importlib_metadata.version(name)
    except _importlib_metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"0.33.0+rocm700"`` -> ``(0, 33, 0)``,
    ``"0.5.23.post1"`` -> ``(0, 5, 23)``; local tags and pre/post/dev suffixes are dropped."""
    found = _RELEASE.match(version.strip())
    return tuple(int(part) for part in found.group().split(".")) if found else ()


@attrs.frozen
class VersionGate:
    """The releases of ``engine`` an adapter is tested with, ``oldest`` to ``newest`` inclusive.

    An older release is refused. A newer one is refused too, unless ``newer_warns`` (the adapter
    checks the interface it patches class by class, so a newer release is tried, with a
    warning); ``allow_untested`` lets any release through. ``fix`` ends the refusal: what to do.
    """

    engine: str
    oldest: str
    newest: str
    fix: str
    newer_warns: bool = False

    @property
    def tested(self) -> str:
        return self.oldest if self.oldest == self.newest else f"{self.oldest} to {self.newest}"

    def is_tested(self, version: str) -> bool:
        return release(self.oldest) <= release(version)[:3] <= release(self.newest)

    def check(
        self, version: str, logger: logging.Logger, *, label: str | None = None, allow_untested: bool = False
    ) -> None:
        """ChunkMetaError unless ``version`` passes; ``label`` names what has that version in the
        message (default: the engine)."""
        if self.is_tested(version):
            return
        label = label or self.engine
        if self.newer_warns and release(version)[:3] > release(self.newest):
            logger.warning(
                "chunkmeta: %s %s is newer than the newest release tested (%s); the interface is "
                "checked class by class.",
                label,
                version,
                self.newest,
            )
            return
        if allow_untested:
            return
        raise ChunkMetaError(
            f"{label} {version} is untested with chunkmeta's {self.engine} adapter, which "
            f"supports {self.tested}: {self.fix}"
        )


# -- reversible patches and import hooks -------------------------------------------------------

_ABSENT = object()  # the owner had no attribute of its own (it inherited one, or had none)


@attrs.frozen
class Patch:
    """``owner.name`` set to ``value``; ``original`` is what the owner itself held before."""

    owner: object
    name: str
    original: object
    value: object

    @property
    def in_place(self) -> bool:
        return vars(self.owner).get(self.name, _ABSENT) is self.value


class Patches:
    """The attributes one adapter replaced in an engine, and the import hooks it armed; undone in
    reverse order by ``undo()``. Thread-safe: hold ``lock`` around a check-then-apply.

    A patch that someone else replaced since is left as it is (restoring ours would drop theirs),
    with a warning. An attribute the owner inherited is deleted again, not set to the inherited
    value, so the owner follows its base class as before.
    """

    def __init__(self, logger: logging.Logger, engine: str):
        self.lock = threading.RLock()
        self._logger = logger
        self._engine = engine
        self._patches: dict[tuple[object, str], Patch] = {}
        self._hooks: dict[str, ImportHook] = {}

    def apply(self, owner, name: str, value) -> Patch:
        """Set ``owner.name = value``, remembering what the owner held; replaces an earlier record of
        the same attribute (its original is gone once someone else replaced our value)."""
        with self.lock:
            patch = Patch(owner, name, vars(owner).get(name, _ABSENT), value)
            setattr(owner, name, value)
            self._patches.pop((owner, name), None)
            self._patches[(owner, name)] = patch
            return patch

    def current(self, owner, name: str) -> Patch | None:
        """Our patch of ``owner.name`` if it is still in place."""
        with self.lock:
            patch = self._patches.get((owner, name))
            return patch if patch is not None and patch.in_place else None

    def applied(self) -> list[Patch]:
        with self.lock:
            return list(self._patches.values())

    def when_imported(self, module_name: str, callback) -> None:
        """``callback(module)`` now if ``module_name`` is imported, else right after whoever imports
        it does (never imported here). Errors of a deferred callback are logged, never raised into
        the engine's import."""
        with self.lock:
            if module_name in self._hooks:
                return
            module = sys.modules.get(module_name)
            if module is not None:
                callback(module)
                return
            hook = self._hooks[module_name] = ImportHook(module_name, self._deferred(module_name, callback))
            hook.arm()

    def pending(self) -> tuple[str, ...]:
        """Modules whose callbacks wait for their import."""
        with self.lock:
            return tuple(self._hooks)

    def undo(self) -> None:
        """Disarm the import hooks and restore every patch still in place (idempotent)."""
        with self.lock:
            for hook in self._hooks.values():
                hook.remove()
            self._hooks.clear()
            for patch in reversed(list(self._patches.values())):
                self._restore(patch)
            self._patches.clear()

    @contextlib.contextmanager
    def all_or_nothing(self):
        """Hold ``lock`` over the block; if it raises, undo the patches it applied and the hooks it
        armed (what was there before stays), then re-raise."""
        with self.lock:
            patches, hooks = dict(self._patches), dict(self._hooks)
            try:
                yield
            except BaseException:
                for key, hook in list(self._hooks.items()):
                    if hooks.get(key) is not hook:
                        hook.remove()
                for key, patch in reversed(list(self._patches.items())):
                    if patches.get(key) is not patch:
                        self._restore(patch)
                self._patches = patches
                self._hooks = {key: hook for key, hook in hooks.items() if key in self._hooks}  # fired: gone
                raise

    def _restore(self, patch: Patch) -> None:
        if not patch.in_place:
            self._logger.warning(
                "chunkmeta: %s.%s was replaced after install(); left as it is", patch.owner.__name__, patch.name
            )
        elif patch.original is _ABSENT:
            delattr(patch.owner, patch.name)
        else:
            setattr(patch.owner, patch.name, patch.original)

    def _deferred(self, module_name: str, callback):
        def run(module):
            with self.lock:
                self._hooks.pop(module_name, None)
            try:
                callback(module)
            except Exception as exc:  # noqa: BLE001  the engine's import must go on whatever the wiring does
                self._logger.warning(
                    "chunkmeta: wiring %s failed, %s keeps its own: %s: %s",
                    module_name,
                    self._engine,
                    type(exc).__name__,
                    exc,
                )

        return run


class ImportHook(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once, right after ``name`` is imported, by whoever imports it.

    A meta-path finder that finds nothing itself: for ``name`` it asks the other finders for the
    spec and wraps that module's loader ``exec_module`` (a per-module loader object), then
    removes itself.
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
            self.callback(module)

        spec.loader.exec_module = exec_then_callback
        return spec

    def arm(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
