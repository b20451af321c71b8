"""The repair of a replicated checkpoint before a load: each host fetches the files its copy lacks from the hosts
that hold them."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ignite_zero.agreement import Hosts, hosts_of_ranks, rank_and_world, together
from ignite_zero.storage.formats.base import IntegrityError
from ignite_zero.storage.formats.directory import MANIFEST
from ignite_zero.storage.places import Place, split
from ignite_zero.storage.replicas.checking import HostCopy, check_host_copy, replicated
from ignite_zero.storage.replicas.exchange import Transfer, exchange
from ignite_zero.transport.groups import cpu_group

__all__ = ["repair_before_load"]

logger = logging.getLogger(__name__)


def repair_before_load(where: str | os.PathLike, storage_options: Mapping[str, Any] | None, timeout: float) -> None:
    """Collective, before a load of the checkpoint ``where``: if it is a replicated one, every host's first rank
    fetches the files its host's directory lacks (all of them, for a host replaced by an empty one) from ranks whose
    hosts hold them, checked against the manifest, so that the load then reads from its own host's directory alone.

    A no-op for a checkpoint that is not replicated, or that lies where every host sees the same contents.

    Args:
        where: the checkpoint, a path or a URL.
        storage_options: the options of its file system, for a URL.
        timeout: seconds ranks wait for each other.

    Raises:
        IntegrityError: on every rank, when a file of the checkpoint survives on no host (naming the files), or the
            hosts hold different checkpoints under its name.
    """
    located = None
    with contextlib.suppress(Exception):  # a failure is raised again below, and reported to every rank
        located = split(where, storage_options)
    if located is not None and located[0].seen_alike_by_every_host:
        return
    # one round when no host holds a replicated checkpoint under the name: a plain sharded load pays no second one
    with together(f"search for the parts of {where}", timeout=timeout) as search:
        parent, name = split(where, storage_options) if located is None else located
        search.payload = replicated(parent, name) is not None
    if not any(search.payloads):
        return
    hosts = hosts_of_ranks(timeout)
    rank, _ = rank_and_world()
    with together(f"search for the parts of {where} (holdings)", timeout=timeout) as holdings:
        if hosts.is_first(rank):  # the first rank of each host reads for its host
            held = check_host_copy(parent, name)  # a corrupt copy is fetched again
            holdings.payload = (held, None if held is None else parent.child(name).read(MANIFEST))
        else:
            holdings.payload = (None, None)
    plan = _fetches(str(where), hosts, holdings.payloads)
    if plan is not None:
        _fetch(str(where), parent, name, *plan, timeout)


def _fetch(where: str, parent: Place, name: str, transfers: list[Transfer], raw: bytes, timeout: float) -> None:
    """Collective: every rank sends and receives its ``transfers`` into the checkpoint ``name`` of ``parent``; a host
    replaced by an empty one gets a new directory, sealed with the manifest ``raw``."""
    rank, _ = rank_and_world()
    committed = parent.child(name)
    with together(f"fetch of the missing parts of {where}", timeout=timeout):
        new = any(t.target == rank for t in transfers) and not committed.exists()  # a host replaced by an empty one
        target = committed
        if new:
            parent.make()
            target = parent.begin_directory(name)
        exchange(transfers, committed, target, cpu_group(), timeout, atomic=not new)
        if new:
            parent.commit_directory(name, lambda written: written.write(MANIFEST, lambda f: f.write(raw)))
    fetched = [t for t in transfers if t.target == rank]
    if fetched:
        logger.info("Fetched %d missing files of %s (%.1f MB)", len(fetched), where, sum(t.size for t in fetched) / 1e6)


def _fetches(
    where: str, hosts: Hosts, reports: Sequence[tuple[HostCopy | None, bytes | None]]
) -> tuple[list[Transfer], bytes] | None:
    """What each host's first rank fetches, and from which rank, to hold every file of the checkpoint; ``None`` if
    the checkpoint is no replicated one, or every host holds it whole. The same on every rank."""
    held = {rank: copy for rank, (copy, _) in enumerate(reports) if copy is not None}
    if not held:
        return None
    identities = {copy.identity for copy in held.values()}
    if len(identities) > 1:
        raise IntegrityError(
            f"The hosts hold different checkpoints under the name {where}: their manifests differ. Remove the stale "
            "copies (or load another checkpoint)."
        )
    files = next(iter(held.values())).files
    raw = next(manifest for _, manifest in reports if manifest is not None)
    leaders = hosts.first_ranks
    holders = {file: [rank for rank in leaders if rank in held and file in held[rank].good] for file in files}
    lost = sorted(file for file, ranks in holders.items() if not ranks)
    if lost:
        raise IntegrityError(f"The checkpoint {where} cannot be loaded: its files {lost} survive on no host")
    transfers = []
    for leader in leaders:
        have = held[leader].good if leader in held else frozenset()
        for number, file in enumerate(sorted(set(files) - have)):
            source = holders[file][number % len(holders[file])]  # spread over the hosts that hold it
            transfers.append(Transfer(source, leader, file, *files[file]))
    return (transfers, raw) if transfers else None
