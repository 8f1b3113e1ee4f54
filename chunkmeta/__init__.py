"""chunkmeta: FLA chunk metadata for packed prefill batches, built on the device with no sync.

Public API: ``ChunkMetadata``, ``ChunkMetadataBuilder``, ``build_chunk_metadata``,
``ChunkMetaError`` and the ``reference`` oracle. See README.md.
"""

from chunkmeta import reference
from chunkmeta.builder import ChunkMetadataBuilder, build_chunk_metadata
from chunkmeta.errors import ChunkMetaError
from chunkmeta.metadata import ChunkMetadata

__version__ = "0.1.0"

__all__ = [
    "ChunkMetaError",
    "ChunkMetadata",
    "ChunkMetadataBuilder",
    "build_chunk_metadata",
    "reference",
]
