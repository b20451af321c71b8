"""A checkpoint's whole state as one file holds it: a sharded checkpoint's optimizer state keyed by index again (a
sharded directory stores dict keys as strings), for a rank that reads for others and for ``ignite-zero
consolidate``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ignite_zero.adapters.zero import as_saved_optimizer_state
from ignite_zero.storage.formats import Reader
from ignite_zero.storage.formats.consolidation import StreamedTensors, unread_state
from ignite_zero.storage.formats.directory import read_contents, read_manifest, verify
from ignite_zero.storage.places import Place

__all__ = ["as_one_file", "streamed_state"]


def as_one_file(reader: Reader, state: Any) -> Any:
    """``state``, everything the checkpoint ``reader`` reads holds (:meth:`Reader.load
    <ignite_zero.storage.formats.base.Reader.load>`), as one file of it would hold it (what ``ignite-zero
    consolidate`` writes)."""
    return _keyed_by_index(state) if reader.sharded else state


def streamed_state(
    place: Place, progress: Callable[[int, int], None] | None = None, trusted: bool = False
) -> tuple[dict[str, Any], StreamedTensors]:
    """The state of the checkpoint directory at ``place`` as one file holds it, its tensors unread, and the source
    of their bytes (:func:`~ignite_zero.storage.formats.consolidation.unread_state`); a directory without manifest
    (another tool's) is read unverified, with a warning.

    Raises:
        UnsafeCheckpointError: a pickle of it holds anything but data, unless ``trusted``.
        IntegrityError: the directory is incomplete, or its manifest, its index or ``.metadata`` is corrupt.
    """
    if read_manifest(place) is None:
        verify(place)  # its warning of a directory without manifest names the caller, as the command line shows it
    state, tensors = unread_state(place, read_contents(place, trusted), progress, trusted)
    return _keyed_by_index(state), tensors


def _keyed_by_index(state: Mapping[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's state with each object's optimizer state keyed by index again."""
    return {key: as_saved_optimizer_state(value) for key, value in state.items()}
