"""chunkmeta: FLA chunk metadata for packed prefill batches, built on the device with no sync.

Public API: ``ChunkMetadata``, ``ChunkMetadataBuilder``, ``build_chunk_metadata``, the scheduler
hooks (``StepBatch``, ``ChunkMetaService``, ``GraphBuild`` for CUDA graphs), ``ChunkMetaError``
and the ``reference`` oracle. See README.md.
"""

from chunkmeta import reference
from chunkmeta.batch import StepBatch
from chunkmeta.builder import ChunkMetadataBuilder, build_chunk_metadata
from chunkmeta.errors import ChunkMetaError
from chunkmeta.graph import GraphBuild
from chunkmeta.metadata import ChunkMetadata
from chunkmeta.plan import verify_host_copy
from chunkmeta.service import ChunkMetaService, ServiceStats

__version__ = "0.1.0"

__all__ = [
    "ChunkMetaError",
    "ChunkMetaService",
    "GraphBuild",
    "ServiceStats",
    "StepBatch",
    "ChunkMetadata",
    "ChunkMetadataBuilder",
    "build_chunk_metadata",
    "reference",
    "verify_host_copy",
]
