"""Checkpoint files as DiskSaver seals them, in memory: shared by the tests of the single-file format's trailer,
reads and verification."""

import io
from typing import Any

import torch

from ignite_zero.storage.formats import file_trailer

__all__ = ["sealed_bytes"]


def sealed_bytes(state: Any, **facts: Any) -> bytes:
    """``torch.save`` of ``state`` through a sealing stream, sealed with ``facts``: the file's bytes."""
    target = io.BytesIO()
    stream = file_trailer.SealingStream(target)
    torch.save(state, stream)
    stream.seal(**facts)
    return target.getvalue()
