"""SGLang adapter: chunkmeta's chunk tables for SGLang's KDA and GDN linear-attention backends.

SGLang's ``KDAAttnBackend`` (Kimi-Linear, Kimi-K3) and ``GDNAttnBackend`` (Qwen3-Next, Qwen3.5)
hand their device ``query_start_loc`` to the vendored FLA kernels as ``cu_seqlens``, and FLA
derives the chunk tables inside the first layer with a host<->device sync per forward. This
adapter subclasses those backends so that each forward's tables are built once, on the device,
by chunkmeta's core, and every layer of the forward gets them. SGLang 0.5.9 to 0.5.23.

Modules, one job each:
  ``sizing``    a backend's capacity, a forward's trusted host lengths and token bound (host data)
  ``tables``    ``ForwardTables`` and ``BackendChunkMeta``: the exact, bounded and graph layouts
                (which forward modes get tables; fallback to FLA's own path with one warning)
  ``routing``   how tables reach the kernels: KDA's dispatcher kwargs, or the FLA router over
                SGLang's vendored FLA
  ``backends``  the backend subclasses and their hooks (eager, split / legacy CUDA-graph hooks)
  ``wiring``    ``install()`` / ``uninstall()`` and the ``sglang.srt.plugins`` entry point
                ``sglang_plugin`` (opt-in: ``CHUNKMETA_SGLANG=1``)
The opt-in, version gate and reversible patches are ``chunkmeta.integrations.plugin``'s; the
router is ``chunkmeta.integrations.fla``'s. Nothing here imports SGLang, at import time or in
``install()``: each backend module is wired when SGLang imports it.
"""

from chunkmeta.integrations.sglang.backends import KINDS, chunkmeta_backend, hook_generation
from chunkmeta.integrations.sglang.routing import add_tables_to_dispatcher, chunk_kda_takes_tables, find_fla
from chunkmeta.integrations.sglang.sizing import backend_capacity, token_bound, trusted_extend_lens
from chunkmeta.integrations.sglang.tables import (
    CHUNK_SIZE,
    PAD,
    SMALL_CHUNK_SIZES,
    BackendChunkMeta,
    ForwardTables,
    needs_chunk_tables,
)
from chunkmeta.integrations.sglang.wiring import (
    ENV_VAR,
    GATE,
    SUPPORTED_VERSIONS,
    TARGETS,
    install,
    installed,
    package_version,
    pending,
    sglang_plugin,
    uninstall,
)

__all__ = [
    "CHUNK_SIZE",
    "ENV_VAR",
    "GATE",
    "KINDS",
    "PAD",
    "SMALL_CHUNK_SIZES",
    "SUPPORTED_VERSIONS",
    "TARGETS",
    "BackendChunkMeta",
    "ForwardTables",
    "add_tables_to_dispatcher",
    "backend_capacity",
    "chunk_kda_takes_tables",
    "chunkmeta_backend",
    "find_fla",
    "hook_generation",
    "install",
    "installed",
    "needs_chunk_tables",
    "package_version",
    "pending",
    "sglang_plugin",
    "token_bound",
    "trusted_extend_lens",
    "uninstall",
]
