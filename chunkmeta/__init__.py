"""chunkmeta: FLA chunk metadata for packed prefill batches, built on the device with no sync.

Public API: ``ChunkMetadata``, ``ChunkMetadataBuilder``, ``build_chunk_metadata``, the scheduler
hooks (``StepBatch``, ``ChunkMetaService``, ``GraphBuild`` for CUDA graphs), ``ChunkMetaError``
and the ``reference`` oracle. See README.md.
"""

from chunkmeta import reference, tables
from chunkmeta.batch import StepBatch
from chunkmeta.builder import ChunkMetadataBuilder, build_chunk_metadata
from chunkmeta.errors import ChunkMetaError
from chunkmeta.graph import GraphBuild, StepGraphBuild
from chunkmeta.metadata import ChunkMetadata, ConvBlocks, Mamba2Chunks, SglangMamba2Chunks, StepTables
from chunkmeta.plan import verify_host_copy
from chunkmeta.service import ChunkMetaService, ServiceStats
from chunkmeta.step_builder import StepTablesBuilder

__version__ = "0.1.0"

__all__ = [
    "ChunkMetaError",
    "ChunkMetaService",
    "GraphBuild",
    "StepGraphBuild",
    "ServiceStats",
    "StepBatch",
    "ChunkMetadata",
    "ConvBlocks",
    "Mamba2Chunks",
    "SglangMamba2Chunks",
    "StepTables",
    "StepTablesBuilder",
    "ChunkMetadataBuilder",
    "build_chunk_metadata",
    "reference",
    "tables",
    "verify_host_copy",
]
