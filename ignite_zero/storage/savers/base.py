"""The seam between policy and storage: what :class:`~ignite_zero.Checkpoint` asks of every saver.

The policy decides what to save and when (names, scores, retention) and the ranks agree on it; a saver decides
where and how the state becomes durable. :class:`Checkpoint <ignite_zero.Checkpoint>` hands a saver the adapted
objects (plain objects and :class:`~ignite_zero.ShardedState` adapters) and a :class:`SaveRequest`, and asks it to
save now, or to stage a copy and commit it later, to remove, and to list what it holds. A new saver plugs in by
subclassing :class:`Saver`; ``checkpoint.py`` knows no concrete one.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignite.handlers.checkpoint import BaseSaveHandler

from ignite_zero.agreement import rank_and_world

__all__ = ["SaveRequest", "Saver", "unwrapped"]


@dataclass(frozen=True)
class SaveRequest:
    """One save, as the ranks agreed on it; identical on every rank that takes part.

    Attributes:
        filename: name of the new checkpoint.
        name: the only entry of a single-object save (whose file holds that object's state itself), else
            ``"checkpoint"``.
        metadata: ignite's metadata of a save (``basename``, ``score_name``, ``priority``).
        removed: checkpoints to remove once the new one is durable.
        recipient: the rank that receives consolidated state and commits the checkpoint.
        ranks: the ranks that take part. One rank alone when nothing in the save is sharded: the save then
            waits for nobody.
        timeout: seconds ranks wait for each other.
        stream: the stream of agreement rounds the saver's own rounds go on.
        extra: entries the policy adds to the checkpoint (the handler's own state under ``"checkpointer"``).
    """

    filename: str
    name: str
    metadata: Mapping[str, Any]
    removed: tuple[str, ...]
    recipient: int
    ranks: tuple[int, ...]
    timeout: float
    stream: str = "main"
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def collective(self) -> bool:
        """Whether several ranks take part."""
        return len(self.ranks) > 1

    @property
    def is_recipient(self) -> bool:
        return rank_and_world()[0] == self.recipient


class Saver(BaseSaveHandler):
    """Where and how checkpoints become durable.

    Every method is called on every rank that takes part in a save (:attr:`SaveRequest.ranks`); each saver decides
    what its rank does. ``save`` and ``stage`` return on a rank once that rank's part is done; the policy then
    shares the outcome among the ranks, so an error on one is an error on all. A saver is an ignite
    ``BaseSaveHandler`` too: called as ``saver(checkpoint, filename, metadata)``, it writes a state already built,
    so stock ignite can use it.
    """

    #: extension of the checkpoints' names
    ext: str = "pt"

    @property
    def requested_rank(self) -> int | None:
        """The writing rank the user gave this saver, if any (it must then be the checkpoint's recipient)."""
        return None

    def bind(self, recipient: int) -> None:  # noqa: B027 (an optional hook: most savers need no recipient)
        """Learn the checkpoint's recipient rank, once, when a :class:`~ignite_zero.Checkpoint` takes the saver."""

    def check(self) -> None:  # noqa: B027 (an optional hook: a saver with nothing to check before a save)
        """Raise now what would make the next save fail on this rank (the writer's directory, say).

        Called on every rank of a save of sharded state before the ranks agree on it, so that the agreement raises
        a failure on every rank at once, instead of this rank alone failing while the others wait for it; and
        before an asynchronous save is staged, so that its failure is raised by the call, not by a later wait.
        """

    def allow_existing_checkpoints(self) -> None:  # noqa: B027 (an optional hook: most savers refuse nothing)
        """Save from now on even where checkpoints are present already; called by
        :meth:`~ignite_zero.Checkpoint.load_latest` once it resumes from this saver's directory, whose checkpoints
        are then the run's own."""

    @property
    def identity(self) -> str:
        """What tells this saver's checkpoints apart from another saver's, the same on every rank."""
        return type(self).__qualname__

    @property
    def directory(self) -> Path | str | None:
        """Where the checkpoints live (a path, or a URL), ``None`` where the saver cannot say (a callable handler,
        say)."""
        return None

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """The options of the file system of :attr:`directory`, where it is a URL."""
        return None

    def location(self, filename: str) -> str | Path:
        """What ``last_checkpoint`` returns for the checkpoint ``filename``: its path, else its name."""
        return filename if self.directory is None else Path(self.directory) / filename

    @abstractmethod
    def save(self, objects: Any, request: SaveRequest) -> None:
        """Write the checkpoint of ``objects`` (collectives among ``request.ranks`` included), then remove the
        checkpoints it displaces (``request.removed``)."""

    @abstractmethod
    def stage(self, objects: Any, request: SaveRequest) -> Callable[[], None]:
        """Copy this rank's part of the state into host memory (all that blocks training), and return the work that
        writes the copy and removes the displaced checkpoints, to run in another thread."""

    @abstractmethod
    def remove(self, filename: str) -> None:
        """Remove the checkpoint ``filename``; called once a newer one is durable."""

    def list(self) -> list[str]:
        """Names of the complete checkpoints this saver holds; empty where it cannot tell."""
        return []


def unwrapped(checkpoint: dict[str, Any], request: SaveRequest) -> Any:
    """What a single file holds, as ignite writes it: the state of a single-object save itself, and the policy's
    extra entries."""
    content: Any = checkpoint[request.name] if len(checkpoint) == 1 else checkpoint
    if request.extra:
        content = dict(content) if not isinstance(content, dict) else content
        content.update(request.extra)
    return content
