"""Where a trainer is in its epoch's data: a distributed sampler that saves the epoch's global position and resumes
from it on any world size."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from torch.utils.data import Dataset, DistributedSampler

__all__ = ["ResumableDistributedSampler"]

# The events after which the trainer is not running: a state loaded then is a resume, not a data loader's restore.
_BETWEEN_RUNS = (None, Events.COMPLETED, Events.TERMINATE, Events.EXCEPTION_RAISED)


class _Pass(NamedTuple):
    """One iterator of the sampler: its epoch, where it starts in the epoch's order, how many positions of that
    order it covers across all ranks, how many indices it deals to all ranks (with the padding), and the trainer's
    iteration when it was made."""

    epoch: int
    start: int
    covered: int
    dealt: int
    iteration: int


class ResumableDistributedSampler(DistributedSampler):
    """torch's ``DistributedSampler``, with the position of the trainer in the epoch as its state: a run stopped in
    the middle of an epoch resumes at the next sample without reading the skipped batches, on any world size.

    For the same ``seed``, ``shuffle``, ``drop_last`` and epoch, each rank gets the indices that
    ``DistributedSampler`` gives it. Its state is the epoch and the position in that epoch's order (the permutation
    of the whole data set, before it is dealt to the ranks), computed from what the trainer consumed, not from how
    far the data loader has read ahead: ``position = start + batches consumed since the epoch's iterator was made x
    the data loader's batch_size x the world size``. Every rank consumed the same number of batches, so every rank
    saves the same state: put the sampler in ``to_save`` as it is (it is saved once) and it loads on any world
    size. After a load, the next iterator deals the rest of that epoch's order to the ranks (padded by repeating its
    head to a multiple of the world size, or cut to one with ``drop_last``, as ``DistributedSampler`` does with the
    whole order), and the iterators after it whole epochs again.

    The epoch advances by itself: each iterator read is the next epoch, so no ``set_epoch`` handler is needed. One
    that sets the trainer's epoch minus one, as ignite's examples do, gives the same epochs only while each trainer
    epoch reads one whole iterator (``epoch_length`` equal to the loader's length, on an unchanged world size); else
    it moves the data to another epoch and drops a loaded position. ``epoch`` is the epoch of the next iterator.

    On another world size, the number of batches in an epoch changes but the trainer's ``epoch_length`` comes from
    the checkpoint: ignite then carries on into the next epoch's data within the same trainer epoch, and the
    sampler's epochs follow the data.

    With ``torchdata``'s ``StatefulDataLoader``, put the sampler in ``to_save``, not the loader: the loader saves
    its sampler's state when it reads ahead, and restoring it from there raises ``RuntimeError``.

    Args:
        dataset: the data set, with a length.
        trainer: the engine that consumes the batches, and whose ``state.dataloader`` is a data loader over this
            sampler with a ``batch_size``.
        num_replicas: the world size; ``ignite.distributed``'s by default (1 without a process group).
        rank: this rank; ``ignite.distributed``'s by default (0 without a process group).
        shuffle: shuffle each epoch's order, with ``seed + epoch``.
        seed: the shuffle's seed, the same on every rank.
        drop_last: cut each order to a multiple of the world size instead of padding it.

    Examples:
        .. code-block:: python

            import ignite.distributed as idist
            from ignite_zero import Checkpoint, DiskSaver, RandomState, ResumableDistributedSampler

            sampler = ResumableDistributedSampler(dataset, trainer, shuffle=True)
            loader = idist.auto_dataloader(dataset, batch_size=64, sampler=sampler)
            to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "data": sampler,
                       "rng": RandomState(trainer)}
            checkpoint = Checkpoint(to_save, DiskSaver("ckpt", require_empty=False), n_saved=2)
            trainer.add_event_handler(Events.ITERATION_COMPLETED(every=1000), checkpoint)
            checkpoint.load_latest(to_save)
            trainer.run(loader, max_epochs=10)

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        dataset: Dataset,
        trainer: Engine,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(trainer, Engine):
            raise TypeError(f"Argument `trainer` should be the ignite Engine that trains, got {type(trainer).__name__}")
        num_replicas = idist.get_world_size() if num_replicas is None else num_replicas
        rank = idist.get_rank() if rank is None else rank
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.trainer = trainer
        self._start = 0  # where the next iterator starts in its epoch's order
        self._current: _Pass | None = None

    def __iter__(self) -> Iterator[int]:
        # A generator: nothing changes until the first index is drawn, as torchdata's StatefulDataLoader with workers
        # makes an iterator it never reads before the one it reads.
        full = self._order(self.epoch)
        order = full[self._start :]
        if self.drop_last:
            order = order[: len(order) - len(order) % self.num_replicas]
            covered = len(order)
        else:
            covered = len(order)
            padding = -len(order) % self.num_replicas
            if full:
                # From the head of the whole order, as DistributedSampler pads: the same indices on the same world size.
                order += (full * math.ceil(padding / len(full)))[:padding]
        self._current = _Pass(self.epoch, self._start, covered, len(order), self.trainer.state.iteration)
        self.epoch += 1
        self._start = 0
        yield from order[self.rank :: self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Make the next iterator epoch ``epoch``; a loaded position is kept only if it is of that epoch."""
        if epoch != self.epoch:
            self._start = 0
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """The epoch and the position in its order that the trainer reached, the same on every rank."""
        epoch, position = self._position()
        return {"epoch": epoch, "position": position, "dataset_size": len(self.dataset)}  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Start the next iterator at the saved position of the saved epoch, on this world size."""
        missing = {"epoch", "position", "dataset_size"} - set(state_dict)
        if missing:
            raise ValueError(
                f"The state of a ResumableDistributedSampler has 'epoch', 'position' and 'dataset_size'; this one "
                f"lacks {sorted(missing)}: was it saved from another sampler?"
            )
        size = len(self.dataset)  # type: ignore[arg-type]
        if state_dict["dataset_size"] != size:
            raise ValueError(
                f"The sampler's state was saved over a data set of {state_dict['dataset_size']} samples, and this one "
                f"has {size}: its position means nothing here; resume with the same data set, or leave the sampler "
                "out of the objects to load"
            )
        if self.trainer.last_event_name not in _BETWEEN_RUNS:
            raise RuntimeError(
                f"A ResumableDistributedSampler's state was loaded while its trainer runs (its last event is "
                f"{self.trainer.last_event_name}): the trainer's data iterator is already made, so the position would "
                "be lost or misread. Load it before trainer.run, not in one of the run's handlers nor after "
                "Engine.interrupt(). If torchdata's StatefulDataLoader restored it from its own state, which holds "
                "where the loader had read ahead to and not what the trainer consumed, put the sampler in `to_save` "
                "instead of the data loader."
            )
        self.epoch = int(state_dict["epoch"])
        self._start = int(state_dict["position"])
        self._current = None

    def _position(self) -> tuple[int, int]:
        """``(epoch, position)`` that the trainer reached; ``(epoch + 1, 0)`` once it consumed the whole epoch."""
        current = self._current
        if current is None:
            return self.epoch, self._start
        batch_size, drop_last = self._loader_batching()
        consumed = (self.trainer.state.iteration - current.iteration) * batch_size * self.num_replicas
        end = current.covered
        if drop_last:
            # The loader drops each rank's partial last batch: the epoch ends after the whole batches.
            end = min(end, current.dealt // self.num_replicas // batch_size * batch_size * self.num_replicas)
        if consumed >= end:
            return current.epoch + 1, 0
        return current.epoch, current.start + consumed

    def _loader_batching(self) -> tuple[int, bool]:
        """The ``batch_size`` and ``drop_last`` of the trainer's data loader over this sampler."""
        loader = self.trainer.state.dataloader
        if getattr(loader, "sampler", None) is not self:
            raise RuntimeError(
                "The trainer's data is not a data loader over this ResumableDistributedSampler, so what it consumed "
                "says nothing of the sampler's position: run the trainer on a DataLoader(dataset, sampler=sampler, "
                "batch_size=...), or on idist.auto_dataloader(dataset, sampler=sampler, batch_size=...)"
            )
        batch_size = getattr(loader, "batch_size", None)
        if not isinstance(batch_size, int):
            raise RuntimeError(
                "The trainer's data loader has no batch_size (it was given a batch_sampler): give it batch_size "
                "and this sampler instead, so that the batches consumed say how many samples were"
            )
        return batch_size, bool(getattr(loader, "drop_last", False))

    def _order(self, epoch: int) -> list[int]:
        """The epoch's order of the whole data set, as ``DistributedSampler`` makes it before dealing it."""
        size = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(size))
        return torch.randperm(size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
