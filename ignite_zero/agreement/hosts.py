"""Which host each rank runs on, exchanged once per process group and shared by every caller."""

from __future__ import annotations

import socket
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ignite_zero.agreement.rounds import agree, rank_and_world

__all__ = ["Hosts", "hosts_of_ranks"]


@dataclass(frozen=True)
class Hosts:
    """The host name of every rank of the default process group, by rank."""

    names: tuple[str, ...]

    def of(self, rank: int) -> str:
        """The host that ``rank`` runs on."""
        return self.names[rank]

    def first_rank(self, rank: int) -> int:
        """The lowest rank on the host of ``rank``: the one that acts for its host."""
        return self.names.index(self.names[rank])

    def is_first(self, rank: int) -> bool:
        """Whether ``rank`` is the lowest rank on its host."""
        return self.first_rank(rank) == rank

    @property
    def first_ranks(self) -> list[int]:
        """The lowest rank of each host, in rank order."""
        return [rank for rank in range(len(self.names)) if self.is_first(rank)]

    def ranks_on(self, host: str) -> list[int]:
        """The ranks that run on ``host``, in rank order."""
        return [rank for rank, name in enumerate(self.names) if name == host]


# One exchange per default process group: a group destroyed and created again asks afresh.
_known: weakref.WeakKeyDictionary[Any, Hosts] = weakref.WeakKeyDictionary()
_asking = threading.Lock()


def hosts_of_ranks(timeout: float) -> Hosts:
    """Every rank's host: one round of :func:`~ignite_zero.agreement.rounds.agree` on a stream of its own, the first
    time any thread of this process asks within the current default process group, and remembered after.

    Every rank must ask at the same point of its work the first time (each caller asks at the start of a collective
    operation, on every rank). One rank and no process group: this host alone.

    Args:
        timeout: seconds to wait for the other ranks the first time, as for ``agree``.
    """
    if rank_and_world()[1] == 1:
        return Hosts((socket.gethostname(),))
    with _asking:  # a background save and the training thread may ask at once: one round, not two
        group = dist.group.WORLD
        known = _known.get(group)
        if known is None:
            names = agree(socket.gethostname(), what="exchange of host names", timeout=timeout, stream="hosts")
            known = _known[group] = Hosts(tuple(names))
        return known
