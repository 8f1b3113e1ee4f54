"""The one exception chunkmeta raises for bad input or misuse."""


class ChunkMetaError(ValueError):
    """Bad input to a build, or a lifecycle rule broken.

    Raised before anything is launched or written: the builder, its buffers and every live
    ``ChunkMetadata`` are exactly as they were. The message names the argument, the offending
    value and the fix.
    """
