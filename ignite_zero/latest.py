"""The newest checkpoint in a place that is complete and passes verification, agreed by every rank.

Newest means: when every candidate's name ends with a number, as the default file names of
:class:`~ignite_zero.Checkpoint` do (``checkpoint_300.pt``, ``best_model_300_acc=0.9000.pt``: the global step or
iteration), the highest number, ties broken by modification time; otherwise the latest modification time.
Candidates are checkpoint files (``.pt``) and sharded checkpoint directories (``.dcp``), hidden temporaries of
interrupted saves aside, in a local directory or under a URL (on an object store, a sharded checkpoint without its
manifest is uncommitted). Each is verified in full, newest first; a truncated, corrupt or uncommitted one is skipped
with a warning in the log that says why.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT, rank_and_world, settle
from ignite_zero.naming import global_step_of
from ignite_zero.storage.formats import IntegrityError, format_for, is_candidate
from ignite_zero.storage.places import Place, place_of

__all__ = ["find_latest"]

logger = logging.getLogger(__name__)


def find_latest(
    place: str | os.PathLike,
    *,
    filename_prefix: str = "",
    storage_options: Mapping[str, Any] | None = None,
    sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
) -> str | None:
    """The path (or URL) of the newest valid checkpoint in the directory ``place``, ``None`` if there is none.

    With a process group this is a collective: call it on every rank. One rank per host checks the candidates (the
    others would read the same files), and every rank gets the same answer: the newest that any host found.

    Args:
        place: the directory the checkpoints were saved in: a path, or an fsspec URL (``s3://bucket/run``).
        filename_prefix: only names that start with it, as :class:`~ignite_zero.Checkpoint`'s
            ``filename_prefix`` makes them (``"{filename_prefix}_..."``).
        storage_options: options of the URL's file system (for S3: ``endpoint_url``, ``key``, ``secret``...).
        sync_timeout: seconds every rank waits for the others.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, find_latest

            path = find_latest("ckpt")  # on every rank
            if path is not None:
                Checkpoint.load_objects(to_load=to_save, checkpoint=path)

    .. versionadded:: 0.2.0
    .. versionchanged:: 0.2.0
        ``place`` may be an fsspec URL, with ``storage_options``.
    """
    directory, failure = None, None
    try:
        directory = place_of(place, storage_options)
    except Exception as error:  # raised on every rank by the first round, not on this one alone
        failure = error
    hosts = settle(failure, what="search for the latest checkpoint", timeout=sync_timeout, payload=socket.gethostname())
    assert directory is not None
    rank, _ = rank_and_world()
    found = None
    # the first rank of each host checks; one rank alone where every host sees the same contents
    if (rank == 0) if directory.seen_alike_by_every_host else hosts.index(hosts[rank]) == rank:
        try:
            found = _newest_valid(directory, filename_prefix)
        except Exception as error:
            failure = error
    answers = settle(failure, what="search for the latest checkpoint (results)", timeout=sync_timeout, payload=found)
    candidates = [answer for answer in answers if answer is not None]
    return None if not candidates else str(max(candidates, key=lambda item: item[0])[1])


def _newest_valid(place: Place, prefix: str) -> tuple[Any, str] | None:
    """``(sort key, location)`` of the newest candidate that verifies."""
    candidates = {
        name: is_directory
        for name, is_directory in place.entries().items()
        if _is_candidate(name, is_directory, prefix)
    }
    steps = {name: global_step_of(name) for name in candidates}
    by_number = all(step is not None for step in steps.values())

    readers = {name: format_for(place, name, is_directory) for name, is_directory in candidates.items()}

    def key(name: str) -> tuple[Any, ...]:
        try:
            modified = readers[name].modified()
        except FileNotFoundError:  # uncommitted, or removed meanwhile: verification says so below
            modified = 0.0
        step = steps[name]
        return (step, modified) if by_number and step is not None else (modified,)

    for name in sorted(candidates, key=key, reverse=True):
        location = place.location(name)
        try:
            reader = readers[name]
            if reader.identity() is None:
                raise IntegrityError(f"{location} is no longer there")
            # every byte where the files are at hand; on an object store, what a load checks before it reads (each
            # part is checked as a rank reads it), not a download of every checkpoint
            reader.verify(whole=place.maps_files)
        except (IntegrityError, OSError, ValueError) as error:
            logger.warning("Skipping checkpoint %s: %s", location, error)
            continue
        return key(name), str(location)
    return None


def _is_candidate(name: str, is_directory: bool, prefix: str) -> bool:
    if name.startswith(".") or (prefix and not name.startswith(f"{prefix}_")):
        return False
    return is_candidate(name, is_directory)
