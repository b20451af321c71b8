"""The newest checkpoint in a place that is complete and passes verification, agreed by every rank.

Newest means: when every candidate's name ends with a number, as the default file names of
:class:`~ignite_zero.Checkpoint` do (``checkpoint_300.pt``, ``best_model_300_acc=0.9000.pt``: the global step or
iteration), the highest number, ties broken by modification time; otherwise the latest modification time.
Candidates are checkpoint files (``.pt``) and sharded checkpoint directories (``.dcp``), hidden temporaries of
interrupted saves aside. Each is verified in full, newest first; a truncated, corrupt or uncommitted one is skipped
with a warning in the log that says why.
"""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from typing import Any

from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT, rank_and_world, settle
from ignite_zero.integrity import IntegrityError
from ignite_zero.storage.base import local_path
from ignite_zero.storage.readers import reader_for

__all__ = ["find_latest"]

logger = logging.getLogger(__name__)

# The number that ends a default file name: `_300.pt`, `_300_acc=0.9000.pt`.
_NUMBER = re.compile(r"_(\d+)(?:_[^_=]+=[^_=]+)?\.(?:pt|dcp)$")


def find_latest(
    place: str | Path, *, filename_prefix: str = "", sync_timeout: float = DEFAULT_SYNC_TIMEOUT
) -> str | None:
    """The path of the newest valid checkpoint in the directory ``place``, ``None`` if there is none.

    With a process group this is a collective: call it on every rank. One rank per host checks the candidates (the
    others would read the same files), and every rank gets the same answer: the newest that any host found.

    Args:
        place: the directory the checkpoints were saved in.
        filename_prefix: only names that start with it, as :class:`~ignite_zero.Checkpoint`'s
            ``filename_prefix`` makes them (``"{filename_prefix}_..."``).
        sync_timeout: seconds every rank waits for the others.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, find_latest

            path = find_latest("/shared/ckpt")  # on every rank
            if path is not None:
                Checkpoint.load_objects(to_load=to_save, checkpoint=path)

    .. versionadded:: 0.2.0
    """
    directory = local_path(place)  # a URL is refused alike on every rank, before any round
    hosts = settle(None, what="search for the latest checkpoint", timeout=sync_timeout, payload=socket.gethostname())
    rank, _ = rank_and_world()
    found, failure = None, None
    if hosts.index(hosts[rank]) == rank:  # the first rank of its host checks
        try:
            found = _newest_valid(directory, filename_prefix)
        except Exception as error:
            failure = error
    answers = settle(failure, what="search for the latest checkpoint (results)", timeout=sync_timeout, payload=found)
    candidates = [answer for answer in answers if answer is not None]
    return None if not candidates else str(max(candidates, key=lambda item: item[0])[1])


def _newest_valid(place: Path, prefix: str) -> tuple[Any, Path] | None:
    """``(sort key, path)`` of the newest candidate that verifies."""
    if not place.is_dir():
        return None
    candidates = [path for path in place.iterdir() if _is_candidate(path, prefix)]
    numbers = {path: _NUMBER.search(path.name) for path in candidates}
    by_number = all(numbers.values())

    def key(path: Path) -> tuple[Any, ...]:
        mtime = path.stat().st_mtime
        match = numbers[path]
        return (int(match.group(1)), mtime) if by_number and match is not None else (mtime,)

    for path in sorted(candidates, key=key, reverse=True):
        try:
            reader = reader_for(path)
            if reader.identity() is None:
                raise IntegrityError(f"{path} is no longer there")
            reader.verify()
        except (IntegrityError, OSError, ValueError) as error:
            logger.warning("Skipping checkpoint %s: %s", path, error)
            continue
        return key(path), path
    return None


def _is_candidate(path: Path, prefix: str) -> bool:
    if path.name.startswith(".") or (prefix and not path.name.startswith(f"{prefix}_")):
        return False
    return (path.suffix == ".pt" and path.is_file()) or (path.suffix == ".dcp" and path.is_dir())
