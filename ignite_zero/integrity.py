"""Integrity of checkpoint files, at the import path of earlier releases: the single-file format, its trailer and its
checks live in :mod:`ignite_zero.storage.formats.file`."""

from ignite_zero.storage.formats.file import (
    Blocks,
    IntegrityError,
    ReadChecks,
    SealingStream,
    Stored,
    is_legacy_format,
    read_trailer,
    verify_file,
)

__all__ = [
    "Blocks",
    "IntegrityError",
    "ReadChecks",
    "SealingStream",
    "Stored",
    "is_legacy_format",
    "read_trailer",
    "verify_file",
]
