"""Who keeps whose files in a replicated sharded save: the hosts of its ranks, and each rank's partners on other
hosts, chosen by host name."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ReplicaHosts", "manifest_facts", "replica_hosts_of"]


@dataclass(frozen=True)
class ReplicaHosts:
    """The hosts of the ranks of a save, and the ranks on other hosts that keep each rank's files.

    Attributes:
        members: the ranks of the save, sorted.
        hosts: the host name of each member, in the same order.
        replicas: copies of each rank's files on other hosts (0 on a single host).
    """

    members: tuple[int, ...]
    hosts: tuple[str, ...]
    replicas: int

    @property
    def host_names(self) -> list[str]:
        """The hosts, sorted by name: the ring along which files are replicated."""
        return sorted(set(self.hosts))

    def host_of(self, rank: int) -> str:
        return self.hosts[self.members.index(rank)]

    def ranks_on(self, host: str) -> list[int]:
        return [rank for rank, name in zip(self.members, self.hosts) if name == host]

    def leader(self, rank: int) -> int:
        """The rank that prepares, seals and removes the directory of ``rank``'s host: its host's first."""
        return self.ranks_on(self.host_of(rank))[0]

    def partners(self, rank: int) -> list[int]:
        """The ranks that keep ``rank``'s files: on each of the next ``replicas`` hosts by name, the rank at the same
        position among its host's ranks."""
        names = self.host_names
        host = self.host_of(rank)
        position = self.ranks_on(host).index(rank)
        start = names.index(host)
        return [self.ranks_on(names[(start + step) % len(names)])[position] for step in range(1, self.replicas + 1)]

    def kept_on(self, host: str) -> list[int]:
        """The ranks whose files ``host``'s directory holds: its own, and those it keeps replicas of."""
        return [rank for rank in self.members if self.host_of(rank) == host or self._partner_on(rank, host)]

    def _partner_on(self, rank: int, host: str) -> bool:
        return any(self.host_of(partner) == host for partner in self.partners(rank))


def replica_hosts_of(members: Sequence[int], hosts: Sequence[str], replicas: int, dirname: Any) -> ReplicaHosts:
    """Who keeps whose files in a save of ``replicas`` copies by ranks ``members`` on ``hosts``; the same on every
    rank, and so are its errors.

    Raises:
        ValueError: ``replicas`` not below the number of hosts, or hosts with different numbers of ranks.
    """
    names = sorted(set(hosts))
    if len(names) == 1:
        warnings.warn(
            f"ShardedSaver({str(dirname)!r}, replicas={replicas}): every rank runs on one host ({names[0]}), so each "
            "checkpoint is kept once, on its disk. Replicas need ranks on several hosts.",
            stacklevel=4,
        )
        return ReplicaHosts(tuple(members), tuple(hosts), 0)
    if replicas >= len(names):
        raise ValueError(
            f"ShardedSaver(replicas={replicas}) keeps every rank's files on {replicas} hosts besides its own, but the "
            f"job runs on {len(names)} hosts ({', '.join(names)}). Pass `replicas` of at most {len(names) - 1}."
        )
    counts = {name: hosts.count(name) for name in names}
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"{name}: {count}" for name, count in counts.items())
        raise ValueError(
            f"Hosts run different numbers of ranks ({listing}), and a replicated ShardedSaver pairs each rank with the "
            "rank at the same position on other hosts. Run as many ranks on every host, or save to a directory that "
            "every rank shares with `replicas=0`."
        )
    return ReplicaHosts(tuple(members), tuple(hosts), replicas)


def manifest_facts(replica_hosts: ReplicaHosts, files: Mapping[int, Iterable[str]]) -> dict[str, Any]:
    """What a replicated checkpoint's manifest says of its copies, given the ``files`` of each rank: how many, on
    which hosts, and which hosts keep each file (so that one host's directory tells what lives elsewhere). Their
    presence marks the checkpoint replicated."""
    keepers = {
        name: [
            replica_hosts.host_of(rank),
            *(replica_hosts.host_of(partner) for partner in replica_hosts.partners(rank)),
        ]
        for rank, names in files.items()
        for name in names
    }
    return {
        "replicas": replica_hosts.replicas,
        "hosts": replica_hosts.host_names,
        "keepers": dict(sorted(keepers.items())),
    }
