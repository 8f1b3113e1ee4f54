"""FlaRouter: chunkmeta's tables behind the helper names a copy of FLA looks up.

FLA's chunked forwards derive their chunk tables inside the first layer, through
``prepare_chunk_indices`` / ``prepare_chunk_offsets`` / ``prepare_chunk_indices_static``
(``fla/ops/utils/index.py``); ``prepare_chunk_indices`` syncs the GPU (``.tolist()``, or
``repeat_interleave`` without ``output_size``). A router wraps those names wherever one FLA
package's modules imported them. A wrapper answers from chunkmeta only when it is called with the
``cu_seqlens`` tensor of metadata in effect (and its chunk size); any other call falls through to
FLA unchanged, with the signature it was called with.

One implementation serves every copy of FLA: fla-core (``chunkmeta.integrations.fla``), and the
copies engines vendor (SGLang's ``sglang.kernels.ops.attention.fla``; ``vendored_router``), whose
``prepare_chunk_indices`` takes no ``cu_seqlens_cpu``. A copy whose helpers are bound by modules
outside its own package (vLLM's: the Kimi-K3 and GLM5-next KDA ops import them from
``vllm.third_party.flash_linear_attention``) names those modules (``modules=``): each is patched
when it is loaded, now or, through an import hook, whenever the engine imports it.

Metadata comes from providers: a thread-local stack (an explicit ``metadata=`` for one call) and
registered services (``patch_fla``: anything with ``in_step`` and ``current``, whose ``current``
has ``cu_seqlens``, ``chunk_size``, ``padding`` and ``check_live()``, as ``ChunkMetadata`` does).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import pkgutil
import sys
import threading

from chunkmeta.errors import ChunkMetaError

logger = logging.getLogger(__name__)

WRAPPED = ("prepare_chunk_indices", "prepare_chunk_offsets", "prepare_chunk_indices_static")


class FlaRouter:
    """Wrappers around one FLA package's helpers, and where they look for metadata.

    ``package`` is the package whose modules imported the helpers (``"fla"``, or an engine's
    vendored copy such as ``"sglang.kernels.ops.attention.fla"``); ``index_module`` the module
    that defines them; ``require`` runs before the first install (a version check, and loading
    every module that imports the helpers: only loaded modules are patched). Installed once per
    process (reference-counted).

    ``hits`` counts calls answered from chunkmeta; ``misses`` calls with a provider's
    ``cu_seqlens`` at a chunk size no provider serves (FLA then derives that table itself, with
    its sync).
    """

    def __init__(self, package: str, index_module: str, require=None, modules: tuple[str, ...] = ()):
        self.package = package
        self.index_module = index_module
        self.modules = tuple(modules)
        self._require = require
        self._hooks: list = []
        self._routed: dict[str, None] = {}
        # reentrant: a service's uninstall() can run from a weakref finalizer, that is from the
        # garbage collector, on a thread that holds the lock already (inside install())
        self._lock = threading.RLock()
        self._installs = 0
        self._generation = 0  # restore() starts a new one: installs counted before it are void
        self._persistent = False
        self._originals: dict[str, object] = {}
        self._patched: list[tuple[object, str, object]] = []
        self._local = threading.local()
        # replaced, never mutated, under _lock: _provided() iterates it on any thread without it
        self._services: tuple = ()
        self.hits = 0
        self.misses = 0

    # -- installation ---------------------------------------------------------------------

    def install(self) -> None:
        with self._lock:
            if self._installs == 0:
                if self._require is not None:
                    self._require()
                index = importlib.import_module(self.index_module)
                self._originals = {name: getattr(index, name) for name in WRAPPED if hasattr(index, name)}
                if self.modules:
                    self._watch_modules()
                else:
                    prefix = self.package + "."
                    for module_name, module in list(sys.modules.items()):
                        if module is not None and (module_name == self.package or module_name.startswith(prefix)):
                            self._patch_module(module)
            self._installs += 1

    def _patch_module(self, module) -> None:
        wrappers = {
            "prepare_chunk_indices": self._chunk_indices,
            "prepare_chunk_offsets": self._chunk_offsets,
            "prepare_chunk_indices_static": self._chunk_indices_static,
        }
        for name, original in self._originals.items():
            bound = getattr(module, name, None)
            if bound is original:
                self._patched.append((module, name, original))
                setattr(module, name, wrappers[name])
                self._routed[module.__name__] = None
            elif bound is not None and bound == wrappers[name]:
                # imported after the index module was patched: it bound the wrapper itself, and
                # gets FLA's helper back when the wrappers are removed
                self._patched.append((module, name, original))
                self._routed[module.__name__] = None

    def _watch_modules(self) -> None:
        # Engines import their op modules lazily (vLLM's Kimi-Linear layer imports its KDA op in
        # __init__, after the metadata builders may exist): a module not loaded yet is patched
        # right after whoever imports it executes it, so its calls never bypass the router.
        from chunkmeta.integrations.plugin import ImportHook

        def on_import(module):
            with self._lock:
                if self._installs > 0:
                    self._patch_module(module)

        for name in self.modules:
            module = sys.modules.get(name)
            if module is not None:
                self._patch_module(module)
            else:
                hook = ImportHook(name, on_import)
                hook.arm()
                self._hooks.append(hook)

    def uninstall(self) -> None:
        with self._lock:
            if self._installs == 0:
                return
            self._installs -= 1
            if self._installs == 0:
                self._unpatch()

    def ensure_installed(self) -> None:
        """Install once for the rest of the process (the adapters' use): rebinding FLA's names
        means scanning every loaded module, far too slow to redo per call, and the wrappers fall
        through to FLA whenever no chunkmeta metadata matches."""
        with self._lock:
            if not self._persistent:
                self.install()
                self._persistent = True

    def restore(self) -> None:
        """Remove the wrappers and import hooks, whoever installed them. Services stay registered
        (their wrappers are gone: FLA's own helpers answer until the next install); the installs
        counted so far are void, so a service removed later leaves the next install alone."""
        with self._lock:
            self._installs = 0
            self._generation += 1
            self._persistent = False
            self._unpatch()

    def _unpatch(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()
        self._routed.clear()

    def patched(self) -> tuple[str, ...]:
        """Modules whose helper names are the wrappers now (patched, or bound after the index was)."""
        with self._lock:
            return tuple(self._routed)

    @property
    def installed(self) -> bool:
        return self._installs > 0

    # -- providers ------------------------------------------------------------------------

    @contextlib.contextmanager
    def active(self, metadata):
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(metadata)
        try:
            yield
        finally:
            stack.pop()

    def _add_service(self, service) -> int:
        """Install and register ``service``; returns the generation its install counts in."""
        with self._lock:
            self.install()
            self._services = (*self._services, service)
            return self._generation

    def _remove_service(self, service, generation: int) -> None:
        with self._lock:
            services = self._services
            for i, registered in enumerate(services):
                if registered is service:
                    self._services = services[:i] + services[i + 1 :]
                    break
            if generation == self._generation:
                self.uninstall()

    def _provided(self):
        yield from reversed(self._local.__dict__.get("stack", ()))
        for service in self._services:  # one read of the attribute: a tuple no one mutates
            if service.in_step:
                current = service.current
                if current is not None:  # a service may end its step between the two reads
                    yield current

    def _lookup(self, cu_seqlens, chunk_size):
        ours = False
        for metadata in self._provided():
            if cu_seqlens is metadata.cu_seqlens:
                if chunk_size == metadata.chunk_size:
                    return metadata.check_live()
                ours = True
        if ours:
            self.misses += 1
        return None

    # -- the wrappers (FLA's signatures) --------------------------------------------------

    def _chunk_indices(self, cu_seqlens, chunk_size, cu_seqlens_cpu=None):
        metadata = self._lookup(cu_seqlens, chunk_size)
        if metadata is None:
            if cu_seqlens_cpu is None:  # vendored copies (SGLang's) take no cu_seqlens_cpu
                return self._originals["prepare_chunk_indices"](cu_seqlens, chunk_size)
            return self._originals["prepare_chunk_indices"](cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
        if metadata.padding == "negative":
            raise ChunkMetaError(
                "(-1, 0) padding rows reached a kernel that does not skip them: only FLA's KDA use_graph=True "
                "path does; build with pad='tail' for other kernels."
            )
        self.hits += 1
        return metadata.chunk_indices

    def _chunk_offsets(self, cu_seqlens, chunk_size):
        metadata = self._lookup(cu_seqlens, chunk_size)
        if metadata is None:
            return self._originals["prepare_chunk_offsets"](cu_seqlens, chunk_size)
        self.hits += 1
        return metadata.chunk_offsets

    def _chunk_indices_static(self, cu_seqlens, chunk_size, nt_max):
        metadata = self._lookup(cu_seqlens, chunk_size)
        if metadata is None:
            return self._originals["prepare_chunk_indices_static"](cu_seqlens, chunk_size, nt_max)
        if metadata.padding != "negative":
            raise ChunkMetaError(
                "FLA's use_graph=True path needs the padded layout with pad='negative' (its cu_seqlens has "
                "max_num_seqs + 1 entries); build_padded(..., pad='negative') or GraphBuild(..., pad='negative')."
            )
        self.hits += 1
        return metadata.chunk_indices, metadata.chunk_offsets


class FlaPatch:
    """``patch_fla(service)``'s handle: a context manager, or call ``uninstall()``."""

    def __init__(self, service, router: FlaRouter):
        self.service = service
        self._active = False
        self._generation = None
        self._router = router

    def install(self) -> FlaPatch:
        with self._router._lock:
            if not self._active:
                self._generation = self._router._add_service(self.service)
                self._active = True
        return self

    def uninstall(self) -> None:
        with self._router._lock:
            if self._active:
                self._active = False
                self._router._remove_service(self.service, self._generation)

    def __enter__(self) -> FlaPatch:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


# -- engines' vendored copies ------------------------------------------------------------------


def load_package(package: str) -> None:
    """Import every module of ``package``: the router patches only modules loaded when it installs."""
    root = importlib.import_module(package)
    for info in pkgutil.iter_modules(getattr(root, "__path__", [])):
        if info.name.startswith("bench"):  # benchmark scripts shipped inside the package
            continue
        try:
            importlib.import_module(f"{package}.{info.name}")
        except Exception as exc:  # noqa: BLE001  a module the engine never loads here keeps FLA's helpers
            logger.debug("chunkmeta: %s.%s not loaded: %s", package, info.name, exc)


_VENDORED: dict[str, FlaRouter] = {}
_VENDORED_LOCK = threading.Lock()


def vendored_router(package: str) -> FlaRouter:
    """The process-wide router over an engine's vendored FLA ``package`` (one per package: it
    patches that package's modules), whose helpers live in ``{package}.index``."""
    with _VENDORED_LOCK:
        router = _VENDORED.get(package)
        if router is None:
            router = _VENDORED[package] = FlaRouter(package, package + ".index", require=lambda: load_package(package))
        return router
