"""The newest checkpoint in one place or several that is complete and passes verification, agreed by every rank.

Newest means: when every candidate's name ends with a number, as the default file names of
:class:`~ignite_zero.Checkpoint` do (``checkpoint_300.pt``, ``best_model_300_acc=0.9000.pt``: the global step or
iteration), the highest number, ties broken by modification time; otherwise the latest modification time. Across
several places (tiers: a node-local directory saved every few minutes, a durable one every epoch) the rule spans
them all. Candidates are checkpoint files (``.pt``) and sharded checkpoint directories (``.dcp``), hidden
temporaries of interrupted saves aside, in a local directory or under a URL (on an object store, a sharded
checkpoint without its manifest is uncommitted). Each is verified, newest first, until one passes; a truncated,
corrupt or uncommitted one is skipped with a warning in the log that says why.

A place on a local path may hold different contents on each host (node-local disks): one rank of each host checks
what its host holds, and a checkpoint is valid when its every part verified on at least one host.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT, Hosts, hosts_of_ranks, rank_and_world, together
from ignite_zero.naming import global_step_of
from ignite_zero.storage import replicas
from ignite_zero.storage.formats import IntegrityError, format_for, is_candidate
from ignite_zero.storage.places import Place, place_of

__all__ = ["find_latest"]

logger = logging.getLogger(__name__)

# The one part of a checkpoint that is verified whole: a file, or a directory that one host holds entirely.
_WHOLE = ""


@dataclass(frozen=True)
class _Verdict:
    """What one host found of a candidate: which checkpoint it holds (``identity``), the parts that checkpoint has,
    and the parts that verified here."""

    identity: Any
    parts: frozenset[str]
    good: frozenset[str]


def find_latest(
    place: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    filename_prefix: str = "",
    storage_options: Mapping[str, Any] | None = None,
    sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
) -> str | None:
    """The path (or URL) of the newest valid checkpoint in the directory ``place``, or in any of a list of them;
    ``None`` if there is none.

    With a process group this is a collective: call it on every rank. One rank per host checks the candidates of a
    local path (one rank in all for an object store, which every host sees alike), and every rank gets the same
    answer: the newest checkpoint that verified, on any host.

    Args:
        place: the directory the checkpoints were saved in: a path, or an fsspec URL (``s3://bucket/run``); or a
            list of them, searched together (tiers).
        filename_prefix: only names that start with it, as :class:`~ignite_zero.Checkpoint`'s
            ``filename_prefix`` makes them (``"{filename_prefix}_..."``).
        storage_options: options of the URLs' file system (for S3: ``endpoint_url``, ``key``, ``secret``...).
        sync_timeout: seconds every rank waits for the others.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, find_latest

            path = find_latest("ckpt")  # on every rank
            if path is not None:
                Checkpoint.load_objects(to_load=to_save, checkpoint=path)

    .. versionadded:: 0.1.0
    """
    named = [place] if isinstance(place, (str, os.PathLike)) else list(place)
    with together("search for the latest checkpoint", timeout=sync_timeout) as opening:
        if not named:
            raise ValueError("find_latest was given an empty list of places; pass at least one directory or URL")
        opening.payload = [place_of(where, storage_options) for where in named]
    directories: list[Place] = opening.payload
    hosts = hosts_of_ranks(sync_timeout)
    rank, _ = rank_and_world()
    mine = [index for index, directory in enumerate(directories) if _checks(directory, rank, hosts)]
    with together("search for the latest checkpoint (listing)", timeout=sync_timeout) as listing:
        listing.payload = {index: _candidates(directories[index], filename_prefix) for index in mine}
    for index, name in _newest_first(listing.payloads):
        if _verified_on_some_host(
            directories[index], name, held=name in listing.payload.get(index, {}), timeout=sync_timeout
        ):
            return str(directories[index].location(name))
    return None


def _verified_on_some_host(directory: Place, name: str, *, held: bool, timeout: float) -> bool:
    """Whether the candidate ``name`` of ``directory`` verified whole on some host; each host that ``held`` it in its
    listing verifies what it has. A collective, as :func:`find_latest` is."""
    with together("search for the latest checkpoint (verification)", timeout=timeout) as verification:
        if held:
            verification.payload = _verdict(directory, name)
    missing = _missing([v for v in verification.payloads if v is not None])
    if missing and rank_and_world()[0] == 0 and missing != [_WHOLE]:  # a replicated checkpoint: hosts logged theirs
        logger.warning("Skipping checkpoint %s: its files %s survive on no host", directory.location(name), missing)
    return not missing


def _checks(directory: Place, rank: int, hosts: Hosts) -> bool:
    """Whether this rank checks ``directory``: the first rank of each host, or rank 0 alone where every host sees
    the same contents."""
    return rank == 0 if directory.seen_alike_by_every_host else hosts.is_first(rank)


def _candidates(place: Place, prefix: str) -> dict[str, tuple[int | None, float]]:
    """The candidates of ``place``: each name's global step (``None`` if it has none) and modification time."""
    found = {}
    for name, is_directory in place.entries().items():
        if not _is_candidate(name, is_directory, prefix):
            continue
        try:
            modified = format_for(place, name, is_directory).modified()
        except FileNotFoundError:  # uncommitted, or removed meanwhile: verification says so
            modified = 0.0
        found[name] = (global_step_of(name), modified)
    return found


def _newest_first(listings: list[dict[int, dict[str, tuple[int | None, float]]]]) -> list[tuple[int, str]]:
    """Every candidate that any rank listed, as ``(index of its place, name)``, newest first."""
    modified: dict[tuple[int, str], float] = {}
    steps: dict[tuple[int, str], int | None] = {}
    for listing in listings:
        for index, names in listing.items():
            for name, (step, time) in names.items():
                modified[index, name] = max(time, modified.get((index, name), time))
                steps[index, name] = step
    by_number = all(step is not None for step in steps.values())

    def key(candidate: tuple[int, str]) -> tuple[Any, ...]:
        return (steps[candidate], modified[candidate]) if by_number else (modified[candidate],)

    return sorted(modified, key=key, reverse=True)


def _verdict(place: Place, name: str) -> _Verdict | None:
    """What this host holds of the candidate ``name``, verified; ``None`` if nothing. Of a replicated checkpoint,
    the files that verify here; of any other, whether it verifies whole."""
    location = place.location(name)
    try:
        # replicas live on node-local disks only: a store that every host sees alike is asked nothing more
        held = None if place.seen_alike_by_every_host else replicas.check_host_copy(place, name)
        if held is not None:
            return _Verdict(held.identity, frozenset(held.files), held.good)
        reader = format_for(place, name)
        identity = reader.identity()
        if identity is None:
            return None
        # every byte where the files are at hand; on an object store, what a load checks before it reads (each part
        # is checked as a rank reads it), not a download of every checkpoint
        reader.verify(whole=place.maps_files)
    except (IntegrityError, OSError, ValueError) as error:
        logger.warning("Skipping checkpoint %s: %s", location, error)
        return _Verdict(location, frozenset([_WHOLE]), frozenset())
    return _Verdict(identity, frozenset([_WHOLE]), frozenset([_WHOLE]))


def _missing(verdicts: list[_Verdict]) -> list[str]:
    """The parts of a candidate that verified on no host (of the checkpoint the hosts hold most of, where they hold
    different ones under its name); empty when it is whole somewhere, ``[""]`` when no host holds it at all."""
    by_identity: dict[Any, list[_Verdict]] = {}
    for verdict in verdicts:
        by_identity.setdefault(verdict.identity, []).append(verdict)
    best = [_WHOLE]
    for alike in by_identity.values():
        parts = frozenset().union(*(v.parts for v in alike))
        good = frozenset().union(*(v.good for v in alike))
        missing = sorted(parts - good)
        if not missing:
            return []
        if best == [_WHOLE] or len(missing) < len(best):
            best = missing
    return best


def _is_candidate(name: str, is_directory: bool, prefix: str) -> bool:
    if name.startswith(".") or (prefix and not name.startswith(f"{prefix}_")):
        return False
    return is_candidate(name, is_directory)
