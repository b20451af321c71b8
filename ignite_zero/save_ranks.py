"""The ranks of a :class:`~ignite_zero.Checkpoint` save: the one that writes, those that take part, and the entries
every one of them must be about to save."""

from __future__ import annotations

from typing import Any

from ignite_zero import tree
from ignite_zero.adapters import ShardedState
from ignite_zero.agreement import rank_and_world
from ignite_zero.storage import Saver

__all__ = ["check_entry_names", "entry_names", "resolve_recipient", "sharing_ranks"]


def resolve_recipient(consolidate_recipient_rank: int | None, save_on_rank: int | None, saver: Saver | None) -> int:
    """The one rank that receives and writes, from the places a user may have named it.

    Raises:
        ValueError: a rank is not a non-negative integer, two places name different ranks, or the rank is outside
            the process group.
    """
    given = {}
    if consolidate_recipient_rank is not None:
        given["consolidate_recipient_rank"] = consolidate_recipient_rank
    if save_on_rank is not None:
        given["save_on_rank"] = save_on_rank
    if saver is not None and saver.requested_rank is not None:
        given["the save_handler's save_on_rank"] = saver.requested_rank
    for name, rank in given.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"Argument `{name}` should be a non-negative integer, got {rank!r}")
    if len(set(given.values())) > 1:
        listing = ", ".join(f"{name}={rank}" for name, rank in given.items())
        raise ValueError(
            f"Conflicting writing ranks: {listing}. The rank that receives the consolidated state is the one that "
            "writes: give one rank, e.g. only `consolidate_recipient_rank`."
        )
    recipient = next(iter(given.values()), 0)
    _, world_size = rank_and_world()
    if recipient >= world_size:
        raise ValueError(
            f"Recipient rank {recipient} is outside the process group of {world_size} ranks; choose a rank in "
            f"[0, {world_size})"
        )
    return recipient


def entry_names(objects: Any) -> list[str]:
    """The entries each rank is about to save, to catch ranks whose ``to_save`` differ before any collective.

    Only names count: a sharded optimizer on a sub-group sits beside a plain one on the other ranks.
    """
    return [tree.describe(path) for path, _ in tree.leaves(objects)]


def check_entry_names(by_rank: dict[int, list[str]]) -> None:
    """Raise ``ValueError`` unless every rank's :func:`entry_names` are the same."""
    if len({tuple(names) for names in by_rank.values()}) > 1:
        listing = "; ".join(f"rank {rank}: {names}" for rank, names in by_rank.items())
        raise ValueError(f"`to_save` differs between ranks ({listing}); build it the same way on every rank.")


def sharing_ranks(objects: Any) -> list[int]:
    """The ranks a save of ``objects`` needs: those holding a shard of one of them; this rank alone if none is
    sharded, so that a save of replicated state never waits for a rank that may not call it."""
    ranks = {rank for _, obj in tree.leaves(objects) if isinstance(obj, ShardedState) for rank in obj.ranks()}
    return sorted(ranks) if ranks else [rank_and_world()[0]]
