"""The error every reader of a checkpoint raises for bad bytes on storage."""


class CheckpointError(RuntimeError):
    """A checkpoint on disk is missing, incomplete or corrupt.

    The message names the file (or tensor) at fault, so that the user knows what to
    delete or which tag to load instead.
    """

