"""What reading a checkpoint may run: nothing that its author put in it, unless its user vouches for it.

A checkpoint often comes from elsewhere (a shared bucket, a colleague's run, a download), and two kinds of pickles lie
in one: DCP's ``.metadata`` of a sharded directory, and the pickles of ``torch.save`` (a file's structure, a
directory's values). :func:`load_metadata` reads the first through an unpickler that admits only what DCP's metadata
is made of; :func:`refusing_code` turns ``torch.load(..., weights_only=True)``'s refusal of the second into the same
:class:`~ignite_zero.storage.formats.base.UnsafeCheckpointError`. Either way the error names the checkpoint, what was
refused, and how to load it anyway: ``weights_only=False``, or ``--trust`` on the command line. A manifest's checksums
prove that a checkpoint is whole, not who wrote it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ignite_zero import _compat, collector
from ignite_zero.storage.formats.base import IntegrityError, UnsafeCheckpointError

__all__ = ["TRUST_HINT", "load_metadata", "load_value", "refusing_code"]

#: How to load a refused checkpoint anyway, for messages.
TRUST_HINT = (
    "if you trust where it comes from, load it with weights_only=False (Checkpoint.load_objects, load_latest) or "
    "--trust (ignite-zero)"
)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, ``torch.Size``, dtypes and plain values; refuses any other global."""

    _ALLOWED = _compat.dcp_metadata_globals()

    def __init__(self, content: bytes, where: str) -> None:
        super().__init__(io.BytesIO(content))
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self._ALLOWED or is_dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._where}: refused to unpickle the global {module}.{name}, which DCP's metadata is not made of "
            f"and which could run code; {TRUST_HINT}"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._where}: refused a persistent id in DCP's metadata; {TRUST_HINT}")


def load_metadata(content: bytes, where: str, trusted: bool = False) -> Any:
    """DCP's metadata from the bytes of a ``.metadata`` file.

    Args:
        content: the file's bytes.
        where: the file, for messages.
        trusted: unpickle whatever it holds, as DCP does.

    Raises:
        UnsafeCheckpointError: it holds anything but DCP's metadata, unless ``trusted``.
    """
    with collector.paused():  # hundreds of thousands of objects, no garbage
        if trusted:
            return pickle.loads(content)
        try:
            return _MetadataUnpickler(content, where).load()
        except UnsafeCheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as error:
            raise IntegrityError(f"{where} is not DCP's metadata ({error}): corrupt or truncated") from error


@contextmanager
def refusing_code(where: str) -> Iterator[None]:
    """Around ``torch.load(..., weights_only=True)`` of a checkpoint's pickle: its refusal of a global becomes an
    :class:`~ignite_zero.storage.formats.base.UnsafeCheckpointError` that names ``where``."""
    try:
        yield
    except UnsafeCheckpointError:
        raise
    except pickle.UnpicklingError as error:
        refused = _first_line(str(error))
        raise UnsafeCheckpointError(f"{where}: refused to unpickle what it holds ({refused}); {TRUST_HINT}") from error


def load_value(content: bytes | bytearray | memoryview, where: str, weights_only: bool) -> Any:
    """A value that ``torch.save`` pickled (an entry of a sharded directory), with ``torch.load``.

    Raises:
        UnsafeCheckpointError: it holds anything but data, unless not ``weights_only``.
    """
    with refusing_code(where):
        return torch.load(io.BytesIO(content), weights_only=weights_only)


def _first_line(message: str) -> str:
    """What torch says it refused: the line of its message that names the global, else its first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "global" in line]
    return (named or lines or ["an unsupported pickle"])[0]
