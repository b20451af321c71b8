"""The protocol every adapter of sharded state follows."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from ignite_zero import tree
from ignite_zero.agreement import rank_and_world
from ignite_zero.transport import Overlap
from ignite_zero.transport.groups import cpu_group

__all__ = ["Part", "ShardedState", "copy_structure", "group_ranks"]


@runtime_checkable
class Part(Protocol):
    """A small, picklable description of the part of a checkpoint entry that one rank needs."""

    def select(self, entry: Any) -> Any:
        """That part of ``entry``, sharing its tensors."""


class ShardedState(ABC):
    """A ``Stateful`` view of one object whose state is spread over ranks.

    ``state_dict()`` is a collective: every rank calls it, the recipient gets the full state and every other
    rank gets ``{}``. ``load_state_dict()`` takes a full state, as saved on any world size, and restores this
    rank's part of it. Both work without a process group too, as the plain object would.

    Args:
        obj: the wrapped object.
        recipient_rank: global rank that receives the full state.

    .. versionadded:: 0.1.0
    """

    #: Whether ``load_state_dict`` takes only its parts of the entry's full tensors, each through
    #: :func:`ignite_zero.adapters.deferred.realize`: a reader that cannot map the file then reads each part as it
    #: is taken.
    loads_deferred = False

    def __init__(self, obj: Any, recipient_rank: int = 0) -> None:
        if not isinstance(recipient_rank, int) or isinstance(recipient_rank, bool) or recipient_rank < 0:
            raise ValueError(f"Argument `recipient_rank` should be a non-negative integer, got {recipient_rank!r}")
        self.obj = obj
        self.recipient_rank = recipient_rank

    @property
    def is_recipient(self) -> bool:
        """Whether this process receives the full state."""
        return rank_and_world()[0] == self.recipient_rank

    def check(self) -> None:
        """Validate, locally and without communication, that ``state_dict()`` can run; raise ``ValueError`` if not.

        Checkpoint runs it on every rank before any collective and shares the outcome, so that a problem on
        one rank becomes an error on all of them instead of a hang.
        """
        _, world_size = rank_and_world()
        if self.recipient_rank >= world_size:
            raise ValueError(
                f"Recipient rank {self.recipient_rank} is outside the process group of {world_size} ranks; "
                f"choose a rank in [0, {world_size})"
            )

    def ranks(self) -> list[int]:
        """The global ranks that hold a shard of the object, all of which take part in its ``state_dict()``."""
        return list(range(rank_and_world()[1]))

    def check_entry(self, state_dict: Mapping[str, Any]) -> None:
        """Raise, changing nothing, if ``load_state_dict(state_dict)`` would refuse it.

        Loading checks every object's entry first, so that an unfit entry loads nothing at all.
        """
        return None  # nothing to check ahead by default: load_state_dict's own checks apply

    def prepare_load(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Callable[[], None]:
        """Check ``state_dict`` as :meth:`check_entry` does, changing nothing, and return what then loads it, as
        ``load_state_dict(state_dict, *args, **kwargs)`` would (``strict``, say, for a model's adapter).

        Loading prepares every object's entry before it loads any. An adapter whose check works out how to load
        (which elements of which tensor go where) keeps that work for the load instead of doing it twice.

        .. versionadded:: 0.1.0
        """
        self.check_entry(state_dict, *args, **kwargs)
        return functools.partial(self.load_state_dict, state_dict, *args, **kwargs)

    def part_needed(self) -> Part | None:
        """What this rank needs of its entry when another rank reads the checkpoint for it (a file in a
        directory this rank cannot see); ``None``: all of it."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Collective: the full state on the recipient, ``{}`` on every other rank."""
        return self.assemble(self.snapshot(), self.gather_group())

    @abstractmethod
    def snapshot(self) -> Any:
        """This rank's contribution to the full state, as views of the live state; nothing is copied.

        An asynchronous save stages a copy of it (:class:`ignite_zero.staging.Stager`), then assembles the copy
        in the background while training changes the live state.
        """

    @abstractmethod
    def assemble(self, snapshot: Any, group: Any, overlap: Overlap | None = None) -> dict[str, Any]:
        """Collective over ``group``: the full state on the recipient from every rank's snapshot, ``{}`` elsewhere.

        Given ``overlap`` (a consolidated save), the tensors' bytes travel in its background: the result's tensors
        are complete once it says so (see :class:`ignite_zero.transport.Overlap`), and some may be the snapshot's own
        tensors, to be written, not changed.
        """

    def sharded_state_dict(self) -> Any:
        """What this rank writes in a sharded checkpoint (:class:`~ignite_zero.ShardedSaver`): its own part, under
        names from which any world size finds what it needs; a local call."""
        raise NotImplementedError(f"{type(self).__name__} cannot be saved sharded")

    def sharded_template(self, saved: set[tuple[Any, ...]], live: bool = False) -> Any | None:
        """For a sharded load: a state of this rank's shards for ``torch.distributed.checkpoint`` to fill, or
        ``None`` to read whole the saved entries that :meth:`wants`.

        Args:
            saved: the paths of the entries saved for this object, relative to it.
            live: the state may hold the object's own tensors, to be filled in place; else new ones.
        """
        return None

    def wants(self, path: tuple[Any, ...]) -> bool:
        """Whether this rank reads, in a sharded load, the saved entry at ``path`` (relative to this object)."""
        return True

    def load_sharded(self, state: Any) -> None:
        """Restore from what a sharded load read: the filled :meth:`sharded_template`, or the wanted entries."""
        self.load_state_dict(state)

    def gather_group(self, dedicated: str | None = None) -> Any:
        """The gloo group snapshots travel over: that of every rank, or ``None`` without a process group.

        Args:
            dedicated: names a group of its own, kept apart from training collectives and other uses (see
                :func:`ignite_zero.transport.groups.cpu_group`). Create it on every rank at the same point, before use
                from another thread.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return cpu_group(dedicated=dedicated)

    @abstractmethod
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore this rank's part of a full state saved on any world size. Never mutates ``state_dict``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.obj).__name__}, recipient_rank={self.recipient_rank})"


def copy_structure(value: Any) -> Any:
    """Copy the dicts, lists and tuples of a nested state, sharing its tensors and other leaves.

    Some ``load_state_dict`` implementations (``ZeroRedundancyOptimizer``'s among them) write into the
    dict they are given; handing them this copy keeps the caller's dict intact at no tensor cost.
    """
    return tree.map_tree(lambda _, leaf: leaf, value)


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group``; ``ValueError`` if it no longer belongs to the current process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("no process group is initialised")
    try:
        return dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError) as error:  # KeyError: a group torch no longer knows
        raise ValueError(f"unknown process group {error}") from error
