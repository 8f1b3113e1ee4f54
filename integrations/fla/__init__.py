"""FLA's KDA and GDN chunked forwards fed by chunkmeta (flash-linear-attention, fla-core 0.6.0).

FLA derives the chunk tables itself, inside the first layer: ``prepare_chunk_indices`` syncs
the GPU (``repeat_interleave`` without ``output_size``), and its results are cached by tensor
identity (stale when a buffer is reused in place). chunkmeta routes its tables through the names
FLA's forward looks up instead (``router``: one ``FlaRouter`` implementation for fla-core and for
the copies of FLA that engines vendor).

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

Modules: ``router`` (FlaRouter, FlaPatch, ``vendored_router``), ``forwards`` (fla-core's KDA/GDN
forwards, its version gate, ``patch_fla``). ``chunkmeta.integrations.kda`` re-exports this package.
"""

from chunkmeta.integrations.fla.forwards import (
    GATE,
    ROUTER,
    SUPPORTED_FLA,
    chunk_gated_delta_rule,
    chunk_kda,
    fla_version,
    patch_fla,
    require_fla,
    restore_fla,
    router_hits,
)
from chunkmeta.integrations.fla.router import FlaPatch, FlaRouter, load_package, vendored_router

__all__ = [
    "GATE",
    "ROUTER",
    "SUPPORTED_FLA",
    "FlaPatch",
    "FlaRouter",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "fla_version",
    "load_package",
    "patch_fla",
    "require_fla",
    "restore_fla",
    "router_hits",
    "vendored_router",
]
