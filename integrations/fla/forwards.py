"""FLA's KDA and GDN chunked forwards fed by chunkmeta (fla-core 0.6.0).

Public ``chunk_kda`` has no way to take precomputed tables (``chunk_indices=`` / ``chunk_offsets=``
vanish into ``**kwargs``); GDN's ``chunk_gated_delta_rule`` takes ``chunk_indices=`` (0.6.0) but not
``chunk_offsets=``. So the tables go through the fla-core router (``chunkmeta.integrations.fla.router``)
while FLA's own forward code (checks, l2norm, gates, autocast, backward) runs as is.
"""

from __future__ import annotations

import logging

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations.fla.router import FlaPatch, FlaRouter
from chunkmeta.integrations.plugin import VersionGate, distribution_version
from chunkmeta.metadata import ChunkMetadata

logger = logging.getLogger(__name__)

SUPPORTED_FLA = ("0.6.0",)
GATE = VersionGate(
    "FLA",
    SUPPORTED_FLA[0],
    SUPPORTED_FLA[-1],
    fix="its KDA/GDN entry points and helper names are version-specific; install fla-core==0.6.0.",
)


def fla_version() -> str | None:
    return distribution_version("fla-core")


def require_fla() -> None:
    """fla-core is installed, in a supported version, and its KDA/GDN modules are loaded."""
    version = fla_version()
    if version is None:
        raise ChunkMetaError("chunkmeta.integrations.fla needs flash-linear-attention: pip install fla-core==0.6.0")
    GATE.check(version, logger, label="fla-core")
    # the router patches the modules loaded when it installs: load every one that imports the helpers
    import fla.ops.common.chunk_delta_h
    import fla.ops.gated_delta_rule
    import fla.ops.kda  # noqa: F401


ROUTER = FlaRouter("fla", "fla.ops.utils.index", require=require_fla)


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
    ROUTER.ensure_installed()
    import fla.ops.kda

    with ROUTER.active(metadata):
        return fla.ops.kda.chunk_kda(q, k, v, g, beta, **kwargs)


def chunk_gated_delta_rule(q, k, v, g, beta, *, metadata: ChunkMetadata, **fla_kwargs):
    """FLA's ``chunk_gated_delta_rule`` (GDN) with ``metadata``'s tables (exact or tail-padded)."""
    kwargs = _prepared_kwargs(metadata, fla_kwargs, allow_graph=False)
    kwargs["chunk_indices"] = metadata.chunk_indices
    ROUTER.ensure_installed()
    import fla.ops.gated_delta_rule

    with ROUTER.active(metadata):
        return fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)


def restore_fla() -> None:
    """Put FLA's own helpers back (the adapters re-install theirs on their next call)."""
    ROUTER.restore()


def patch_fla(service, router: FlaRouter | None = None) -> FlaPatch:
    """Serve ``service``'s open step to unmodified FLA callers; reversible.

    While a step is open, FLA's ``prepare_chunk_indices`` / ``prepare_chunk_offsets`` /
    ``prepare_chunk_indices_static`` called with that step's ``cu_seqlens`` (the tensor
    ``service.current.cu_seqlens``) return the step's tables; every other call runs FLA's own.
    ``router`` selects another copy of FLA (an engine's vendored one); default: fla-core.
    """
    return FlaPatch(service, router or ROUTER).install()


def router_hits() -> int:
    """How many fla-core helper calls chunkmeta has answered in this process."""
    return ROUTER.hits
