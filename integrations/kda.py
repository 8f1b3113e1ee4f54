"""FLA's KDA and GDN chunked forwards fed by chunkmeta (flash-linear-attention, fla-core 0.6.0).

FLA derives the chunk tables itself, inside the first layer: ``prepare_chunk_indices`` syncs
the GPU (``repeat_interleave`` without ``output_size``), and its results are cached by tensor
identity (stale when a buffer is reused in place). Public ``chunk_kda`` has no way to take
precomputed tables: ``chunk_indices=`` / ``chunk_offsets=`` vanish into ``**kwargs``. GDN's
``chunk_gated_delta_rule`` takes ``chunk_indices=`` (0.6.0) but not ``chunk_offsets=``.

So chunkmeta routes its tables through the names FLA's forward looks up: it wraps
``prepare_chunk_indices``, ``prepare_chunk_offsets`` and ``prepare_chunk_indices_static``
wherever FLA's modules imported them. A wrapper answers from chunkmeta only when it is called
with the ``cu_seqlens`` tensor of the metadata in effect (and its chunk size); any other call
falls through to FLA unchanged. FLA's own forward code (checks, l2norm, gates, autocast,
backward) runs as is.

* ``chunk_kda(q, k, v, g, beta, *, metadata, **fla_kwargs)`` and
  ``chunk_gated_delta_rule(..., metadata=, **fla_kwargs)``: FLA's public forwards with this
  step's metadata in effect for the call (thread-local).
* ``patch_fla(service)``: for unmodified callers; while the service has an open step, calls with
  that step's ``cu_seqlens`` get the step's tables. A context manager; ``uninstall()`` too.

The wrappers are installed on first use and stay for the process (rebinding means scanning the
loaded modules: too slow per call); they cost one identity check per helper call and fall
through to FLA whenever no chunkmeta metadata matches. ``restore_fla()`` removes them.

Layouts: the exact layout; the padded ``"tail"`` layout (a padded ``cu_seqlens`` whose padding
rows point at a zero-length tail, valid for every FLA kernel; ``initial_state`` then has one row
per padded sequence); the padded ``"negative"`` layout, KDA only, run through FLA's
``use_graph=True`` path whose kernels skip ``(-1, 0)`` rows (``max_num_seqs`` is set for you).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from importlib import metadata as _importlib_metadata

from chunkmeta.errors import ChunkMetaError
from chunkmeta.metadata import ChunkMetadata

SUPPORTED_FLA = ("0.6.0",)
_WRAPPED = ("prepare_chunk_indices", "prepare_chunk_offsets", "prepare_chunk_indices_static")


def fla_version() -> str | None:
    try:
        return _importlib_metadata.version("fla-core")
    except _importlib_metadata.PackageNotFoundError:
        return None


def require_fla() -> None:
    """fla-core is installed, in a supported version, and its KDA/GDN modules are loaded."""
    version = fla_version()
    if version is None:
        raise ChunkMetaError(
            "chunkmeta.integrations.kda needs flash-linear-attention: pip install fla-core==0.6.0"
        )
    if version not in SUPPORTED_FLA:
        raise ChunkMetaError(
            f"chunkmeta.integrations.kda supports fla-core {', '.join(SUPPORTED_FLA)}, found {version}: "
            "its KDA/GDN entry points and helper names are version-specific; install fla-core==0.6.0."
        )
    import fla.ops.common.chunk_delta_h  # noqa: F401  (load every module that imports the helpers)
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.kda  # noqa: F401


class FlaRouter:
    """Wrappers around one FLA package's helpers, and where they look for metadata.

    ``package`` is the package whose modules imported the helpers (``"fla"``, or an engine's
    vendored copy such as SGLang's ``"sglang.srt.layers.attention.fla"``); ``index_module`` the
    module that defines them. Installed once per process (reference-counted); providers are a
    thread-local stack (the adapters' explicit ``metadata=``) and the services registered by
    ``patch_fla``.
    """

    def __init__(self, package: str, index_module: str, require=None):
        self.package = package
        self.index_module = index_module
        self._require = require
        self._lock = threading.Lock()
        self._installs = 0
        self._persistent = False
        self._originals: dict[str, object] = {}
        self._patched: list[tuple[object, str, object]] = []
        self._local = threading.local()
        self._services: list = []
        self.hits = 0  # calls answered from chunkmeta (tests and stats)

    # -- installation ---------------------------------------------------------------------

    def install(self) -> None:
        with self._lock:
            if self._installs == 0:
                if self._require is not None:
                    self._require()
                index = importlib.import_module(self.index_module)
                self._originals = {name: getattr(index, name) for name in _WRAPPED if hasattr(index, name)}
                wrappers = {
                    "prepare_chunk_indices": self._chunk_indices,
                    "prepare_chunk_offsets": self._chunk_offsets,
                    "prepare_chunk_indices_static": self._chunk_indices_static,
                }
                prefix = self.package + "."
                for module_name, module in list(sys.modules.items()):
                    if module is None or not (module_name == self.package or module_name.startswith(prefix)):
                        continue
                    for name, original in self._originals.items():
                        if getattr(module, name, None) is original:
                            self._patched.append((module, name, original))
                            setattr(module, name, wrappers[name])
            self._installs += 1

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
        if not self._persistent:
            self.install()
            self._persistent = True

    def restore(self) -> None:
        """Remove the wrappers whoever installed them."""
        with self._lock:
            self._installs = 0
            self._persistent = False
            self._unpatch()

    def _unpatch(self) -> None:
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()

    @property
    def installed(self) -> bool:
        return self._installs > 0

    # -- providers ------------------------------------------------------------------------

    @contextlib.contextmanager
    def active(self, metadata: ChunkMetadata):
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(metadata)
        try:
            yield
        finally:
            stack.pop()

    def _lookup(self, cu_seqlens, chunk_size) -> ChunkMetadata | None:
        for metadata in reversed(self._local.__dict__.get("stack", ())):
            if cu_seqlens is metadata.cu_seqlens and chunk_size == metadata.chunk_size:
                return metadata.check_live()
        for service in self._services:
            if service.in_step:
                metadata = service.current
                if cu_seqlens is metadata.cu_seqlens and chunk_size == metadata.chunk_size:
                    return metadata.check_live()
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


_ROUTER = FlaRouter("fla", "fla.ops.utils.index", require=require_fla)


def _prepared_kwargs(metadata: ChunkMetadata, fla_kwargs: dict, *, allow_graph: bool) -> dict:
    if not isinstance(metadata, ChunkMetadata):
        raise ChunkMetaError(f"metadata is a {type(metadata).__name__}: pass the step's ChunkMetadata.")
    metadata.check_live()
    for name in ("cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "chunk_offsets", "chunk_size"):
        if name in fla_kwargs:
            raise ChunkMetaError(f"{name}= comes from metadata: drop it from the FLA keyword arguments.")
    kwargs = dict(fla_kwargs, cu_seqlens=metadata.cu_seqlens, chunk_size=metadata.chunk_size)
    if metadata.padding == "negative":
        if not allow_graph:
            raise ChunkMetaError(
                "GDN kernels read (-1, 0) padding rows as sequence -1: build the padded layout with pad='tail'."
            )
        kwargs["use_graph"] = True
        kwargs["max_num_seqs"] = metadata.cu_seqlens.shape[0] - 1
    return kwargs


def chunk_kda(q, k, v, g, beta, *, metadata: ChunkMetadata, **fla_kwargs):
    """FLA's ``chunk_kda`` with ``metadata``'s cu_seqlens, chunk_indices and chunk_offsets.

    ``fla_kwargs`` pass through (``scale``, ``initial_state``, ``output_final_state``,
    ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``safe_gate``, ``lower_bound``, ...).
    Returns what FLA returns. No FLA ``prepare_*`` computation runs, so nothing syncs.
    """
    kwargs = _prepared_kwargs(metadata, fla_kwargs, allow_graph=True)
    _ROUTER.ensure_installed()
    import fla.ops.kda

    with _ROUTER.active(metadata):
        return fla.ops.kda.chunk_kda(q, k, v, g, beta, **kwargs)


def chunk_gated_delta_rule(q, k, v, g, beta, *, metadata: ChunkMetadata, **fla_kwargs):
    """FLA's ``chunk_gated_delta_rule`` (GDN) with ``metadata``'s tables (exact or tail-padded)."""
    kwargs = _prepared_kwargs(metadata, fla_kwargs, allow_graph=False)
    kwargs["chunk_indices"] = metadata.chunk_indices
    _ROUTER.ensure_installed()
    import fla.ops.gated_delta_rule

    with _ROUTER.active(metadata):
        return fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)


def restore_fla() -> None:
    """Put FLA's own helpers back (the adapters re-install theirs on their next call)."""
    _ROUTER.restore()


class FlaPatch:
    """``patch_fla(service)``'s handle: a context manager, or call ``uninstall()``."""

    def __init__(self, service, router: FlaRouter):
        self.service = service
        self._active = False
        self._router = router

    def install(self) -> "FlaPatch":
        if not self._active:
            self._router.install()
            self._router._services.append(self.service)
            self._active = True
        return self

    def uninstall(self) -> None:
        if self._active:
            self._router._services.remove(self.service)
            self._router.uninstall()
            self._active = False

    def __enter__(self) -> "FlaPatch":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def patch_fla(service, router: FlaRouter | None = None) -> FlaPatch:
    """Serve ``service``'s open step to unmodified FLA callers; reversible.

    While a step is open, FLA's ``prepare_chunk_indices`` / ``prepare_chunk_offsets`` /
    ``prepare_chunk_indices_static`` called with that step's ``cu_seqlens`` (the tensor
    ``service.current.cu_seqlens``) return the step's tables; every other call runs FLA's own.
    ``router`` selects another copy of FLA (an engine's vendored one); default: fla-core.
    """
    return FlaPatch(service, router or _ROUTER).install()


def router_hits() -> int:
    """How many FLA helper calls chunkmeta has answered in this process."""
    return _ROUTER.hits
