"""Policy: what to save and when (naming, scoring, retention), and loading it back on any world size.

:class:`Checkpoint` keeps the behaviour of :class:`ignite.handlers.Checkpoint` and makes it correct for
sharded state: every rank calls it, the ranks first agree on what to save (the recipient's decision wins),
sharded objects are consolidated on the recipient, the recipient alone writes, and every rank learns the
outcome, so that an error on one rank is an error on all of them instead of a hang. With a
:class:`~ignite_zero.ShardedSaver` every rank writes its own part instead; with ``async_save`` the training
loop waits only for a copy of each rank's part, and the rest runs in a thread.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import numbers
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from ignite.engine import Engine, Events
from ignite.handlers import checkpoint as ignite_checkpoint
from ignite.handlers.checkpoint import BaseSaveHandler

from ignite_zero import sharded, transport
from ignite_zero._compat import CheckpointEvents
from ignite_zero.adapters import ShardedState, adapt, map_objects
from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT, busy, rank_and_world, settle
from ignite_zero.loading import restore
from ignite_zero.savers import DiskSaver, ShardedSaver, check_filename
from ignite_zero.staging import Stager

__all__ = ["Checkpoint", "ModelCheckpoint"]

logger = logging.getLogger(__name__)


_async_streams = itertools.count()  # a stream of agreement rounds per asynchronous handler, numbered alike on all ranks


@dataclass(frozen=True)
class _SavePlan:
    """What one call of :class:`Checkpoint` writes and removes; identical on every rank once agreed."""

    filename: str
    priority: int | float
    name: str
    saved: tuple[tuple[int | float, str], ...]  # the retained (priority, filename) pairs after this save
    removed: tuple[str, ...]  # files to remove once the new one is durable


@dataclass
class _PendingSave:
    """An asynchronous save under way: its plan, its thread, and its error once it failed."""

    engine: Engine
    plan: _SavePlan
    thread: threading.Thread = field(init=False)
    error: BaseException | None = None


class Checkpoint(ignite_checkpoint.Checkpoint):
    """Drop-in for :class:`ignite.handlers.Checkpoint` that saves sharded training state correctly.

    Call it on every rank. Sharded objects in ``to_save`` (``ZeroRedundancyOptimizer``, fairscale ``OSS``,
    any optimizer with ``consolidate_state_dict``, also next to a ``DistributedDataParallel`` model) are
    consolidated on ``consolidate_recipient_rank``, which alone writes the file; the file holds the full,
    current state, loadable on any number of ranks with :meth:`load_objects`.

    Every argument of ignite's ``Checkpoint`` keeps its meaning. Deliberate differences:

    - the ranks agree before each save: if a rank does not call it within ``sync_timeout`` seconds, every
      rank that did raises :class:`~ignite_zero.CollectiveTimeoutError` naming the missing ranks; the
      recipient's score and file name are used on every rank (a rank that computed another logs a warning);
      an error on any rank, the recipient's write included, raises :class:`~ignite_zero.RankFailureError` on
      every rank;
    - old files are removed only once the new one is durable, and a file name that is reused is replaced
      atomically, so a failed save always leaves the previous checkpoints loadable;
    - a failed save raises; it is not retried;
    - ``save_handler`` is called on the recipient rank only; a string or path makes a
      :class:`~ignite_zero.DiskSaver` (durable writes, integrity trailer, mode ``0o666 & ~umask``);
    - scores that are numpy scalars are stored as Python numbers, so files load with
      ``torch.load(..., weights_only=True)``.

    Args:
        to_save: objects to save, as for ignite: anything with ``state_dict``/``load_state_dict``.
        save_handler: a directory (string or path), a :class:`~ignite_zero.DiskSaver`, or any callable
            ``(checkpoint, filename[, metadata])`` or ignite ``BaseSaveHandler``.
        filename_prefix: prefix of the file names.
        score_function: ``engine -> number``; the highest scores are kept.
        score_name: name of the score in file names; alone, it reads ``engine.state.metrics[score_name]``.
        n_saved: how many files to keep; ``None`` keeps all.
        global_step_transform: ``(engine, event_name) -> int`` global step for file names.
        filename_pattern: pattern of file names, as for ignite.
        include_self: also save this handler's own state under the key ``"checkpointer"``.
        greater_or_equal: keep the latest of equally scored checkpoints instead of the first.
        save_on_rank: ignite's name for the writing rank; ``None`` leaves it to ``consolidate_recipient_rank``.
        consolidate_recipient_rank: rank that receives the consolidated state and writes it. ``None`` takes
            ``save_on_rank``, else the rank of a ``DiskSaver`` given as ``save_handler``, else 0. Ranks given
            in two places must be equal.
        sync_timeout: seconds every rank waits for the others to reach the same save (default 120).
        async_save: save in the background. The training loop waits only while each rank copies its part of
            the state into host buffers kept for the next save (pinned for CUDA tensors; see
            :mod:`ignite_zero.staging` for their memory); gathering and writing go on in a thread, over a gloo
            group of their own. The next save waits for the previous one, and so do the end of the run and an
            exception in it; an error of a background save is raised there, on every rank, or by :meth:`wait`.
            ``last_checkpoint`` and ``SAVED_CHECKPOINT`` follow once the file is durable. Create asynchronous
            handlers in the same order on every rank.

    Examples:
        .. code-block:: python

            from ignite.engine import Events
            from ignite_zero import Checkpoint, DiskSaver

            to_save = {"model": model, "optimizer": zero_optimizer, "trainer": trainer}
            checkpoint = Checkpoint(to_save, DiskSaver("/tmp/ckpt", require_empty=False), n_saved=2,
                                    consolidate_recipient_rank=0)
            trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)  # on every rank

            # later, on any number of ranks (every rank calls it):
            Checkpoint.load_objects(to_load=to_save, checkpoint=checkpoint.last_checkpoint)

    .. versionadded:: 0.1.0
    """

    SAVED_CHECKPOINT = CheckpointEvents.SAVED_CHECKPOINT

    def __init__(
        self,
        to_save: Mapping,
        save_handler: str | Path | Callable | BaseSaveHandler,
        filename_prefix: str = "",
        score_function: Callable[[Engine], int | float] | None = None,
        score_name: str | None = None,
        n_saved: int | None = 1,
        global_step_transform: Callable | None = None,
        filename_pattern: str | None = None,
        include_self: bool = False,
        greater_or_equal: bool = False,
        save_on_rank: int | None = None,
        *,
        consolidate_recipient_rank: int | None = None,
        sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
        async_save: bool = False,
    ) -> None:
        if isinstance(to_save, Mapping):
            _check_objects(to_save, "state_dict")
        recipient = _resolve_recipient(consolidate_recipient_rank, save_on_rank, save_handler)
        if isinstance(save_handler, (str, Path)):
            save_handler = DiskSaver(save_handler, create_dir=True, save_on_rank=recipient)
        elif isinstance(save_handler, (DiskSaver, ShardedSaver)):
            save_handler.bind(recipient)
        if filename_prefix:
            check_filename(filename_prefix)
        if not (isinstance(sync_timeout, (int, float)) and sync_timeout > 0):
            raise ValueError(f"Argument `sync_timeout` should be a positive number of seconds, got {sync_timeout!r}")
        super().__init__(
            to_save,
            save_handler,
            filename_prefix=filename_prefix,
            score_function=score_function,
            score_name=score_name,
            n_saved=n_saved,
            global_step_transform=global_step_transform,
            filename_pattern=filename_pattern,
            include_self=include_self,
            greater_or_equal=greater_or_equal,
            save_on_rank=recipient,
        )
        self.consolidate_recipient_rank = recipient
        self.sync_timeout = float(sync_timeout)
        self._saver_takes_metadata = _takes_metadata(self.save_handler)
        self.ext = getattr(self.save_handler, "ext", self.ext)
        self._sharded = isinstance(self.save_handler, ShardedSaver)
        self.async_save = async_save
        self._pending: _PendingSave | None = None
        self._followed: weakref.WeakSet[Engine] = weakref.WeakSet()
        self._stager = Stager()
        self._stream = f"async{next(_async_streams)}" if async_save else "main"

    @property
    def last_checkpoint(self) -> str | Path | None:
        if not self._saved:
            return None
        dirname = getattr(self.save_handler, "dirname", None)
        return self._saved[-1].filename if dirname is None else Path(dirname) / self._saved[-1].filename

    def __call__(self, engine: Engine, *args: Any, **kwargs: Any) -> None:
        if not engine.has_registered_events(CheckpointEvents.SAVED_CHECKPOINT):
            engine.register_events(*CheckpointEvents)
        if self.async_save and engine not in self._followed:
            engine.add_event_handler(Events.COMPLETED, lambda _: self.wait())
            engine.add_event_handler(Events.EXCEPTION_RAISED, self._wait_then_raise)
            self._followed.add(engine)
        self.wait()
        objects, plan = self._agree(engine)
        if plan is None:
            return
        if self.async_save:
            self._start(engine, objects, plan)
        else:
            self._save_now(engine, objects, plan)

    def wait(self) -> None:
        """Block until the asynchronous save in progress, if any, is durable; raise its error if it failed.

        Every rank raises the same error. The next save, the end of the run (``Events.COMPLETED``) and an
        exception in the run wait too; ``last_checkpoint`` names the new file, and ``SAVED_CHECKPOINT`` fires,
        once it is durable.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.thread.join()
        if pending.error is not None:
            raise pending.error
        self._finish(pending.engine, pending.plan)

    def _agree(self, engine: Engine) -> tuple[Any, _SavePlan | None]:
        """Every rank's plan to the others; return the objects to save and the recipient's plan, followed by all."""
        rank, _ = rank_and_world()
        objects, plan, failure = None, None, None
        try:
            objects = adapt(self.to_save, self.consolidate_recipient_rank)
            plan = self._plan(engine)
            map_objects(objects, lambda _, obj: obj.check() if isinstance(obj, ShardedState) else None)
        except Exception as error:
            failure = error
        payload = (plan, _layout(self.to_save))
        proposals = settle(failure, what="checkpoint save", timeout=self.sync_timeout, payload=payload)
        _check_layouts([proposed_layout for _, proposed_layout in proposals])
        agreed: _SavePlan | None = proposals[self.consolidate_recipient_rank][0]
        if plan != agreed:
            logger.warning(
                "Rank %d planned %s, rank %d (the recipient) planned %s; following the recipient. Make "
                "`score_function` and `global_step_transform` return the same value on every rank.",
                rank,
                _summary(plan),
                self.consolidate_recipient_rank,
                _summary(agreed),
            )
        return objects, agreed

    def _save_now(self, engine: Engine, objects: Any, plan: _SavePlan) -> None:
        failure = None
        with busy(interval=min(1.0, self.sync_timeout / 4)):
            try:
                if self._sharded:
                    state = self._sharded_state(objects, plan)
                    group = _dcp_group(dedicated=False)
                    self.save_handler.save(state, plan.filename, group=group, timeout=self.sync_timeout)
                    self._remove_displaced(plan)
                else:
                    self._gather_and_write(objects, plan, lambda _, obj: obj.state_dict())
            except Exception as error:
                failure = error
        settle(failure, what=f"checkpoint save of {plan.filename}", timeout=self.sync_timeout)
        self._finish(engine, plan)

    def _start(self, engine: Engine, objects: Any, plan: _SavePlan) -> None:
        """Stage this rank's part of the state, then write it from a thread of its own."""
        failure, work = None, None
        started = time.perf_counter()
        try:
            work = self._stage_sharded(objects, plan) if self._sharded else self._stage_consolidated(objects, plan)
        except Exception as error:
            failure = error
        settle(failure, what=f"checkpoint staging of {plan.filename}", timeout=self.sync_timeout)
        logger.debug("Checkpoint %s staged in %.3f s", plan.filename, time.perf_counter() - started)
        pending = _PendingSave(engine, plan)
        pending.thread = threading.Thread(
            target=self._write_in_background, args=(pending, work), name="ignite_zero-save"
        )
        self._pending = pending
        pending.thread.start()

    def _stage_consolidated(self, objects: Any, plan: _SavePlan) -> Callable[[], None]:
        """Copy each sharded object's snapshot (and, on the recipient, every plain object's state); return the
        work that gathers the copies and writes them."""
        is_recipient = rank_and_world()[0] == self.consolidate_recipient_rank
        staged: dict[str, Any] = {}
        groups: dict[str, Any] = {}

        def stage(path: str, obj: Any) -> None:
            if isinstance(obj, ShardedState):
                groups[path] = obj.gather_group(dedicated=True)  # a collective the first time: in this thread
                staged[path] = self._stager.stage(obj.snapshot(), path)
            elif is_recipient:  # plain objects: only the recipient writes them
                staged[path] = self._stager.stage(obj.state_dict(), path)

        map_objects(objects, stage)

        def assemble(path: str, obj: Any) -> Any:
            return obj.assemble(staged[path], groups[path]) if isinstance(obj, ShardedState) else staged.get(path)

        return lambda: self._gather_and_write(objects, plan, assemble)

    def _stage_sharded(self, objects: Any, plan: _SavePlan) -> Callable[[], None]:
        """Let DCP copy this rank's part into host memory it keeps for the next save; return the work that waits
        for DCP's write and seals the directory."""
        state = self._sharded_state(objects, plan)
        group = _dcp_group(dedicated=True)
        finish = self.save_handler.save_async(
            state, plan.filename, group=group, timeout=self.sync_timeout, stream=self._stream
        )

        def work() -> None:
            finish()
            self._remove_displaced(plan)

        return work

    def _write_in_background(self, pending: _PendingSave, work: Callable[[], None]) -> None:
        failure = None
        with busy(interval=min(1.0, self.sync_timeout / 4)):
            try:
                work()
            except Exception as error:
                failure = error
        try:
            what = f"checkpoint save of {pending.plan.filename}"
            settle(failure, what=what, timeout=self.sync_timeout, stream=self._stream)
        except Exception as error:  # raised by wait(), in the training thread
            logger.error("Asynchronous save of %s failed: %s", pending.plan.filename, error)
            pending.error = error

    def _sharded_state(self, objects: Any, plan: _SavePlan) -> dict[str, Any]:
        """This rank's part of a sharded checkpoint: sharded objects' own parts, and its share of the others."""
        rank, world_size = rank_and_world()
        keeper = self.consolidate_recipient_rank

        def part(_: str, obj: Any) -> Any:
            if isinstance(obj, ShardedState):
                return obj.sharded_state_dict()
            return sharded.share(obj.state_dict(), rank, world_size, keeper)

        state = _without_nothing(map_objects(objects, part))
        if self.include_self and rank == keeper:
            state["checkpointer"] = {"_saved": [list(item) for item in plan.saved]}
        return state

    def _remove_displaced(self, plan: _SavePlan) -> None:
        for filename in plan.removed:
            self.save_handler.remove(filename)

    def _gather_and_write(self, objects: Any, plan: _SavePlan, state_of: Callable[[str, Any], Any]) -> None:
        """Collective: every object's full state (``state_of(path, obj)``) to the recipient, which writes it."""
        started = time.perf_counter()
        checkpoint = map_objects(objects, state_of)
        gathered = time.perf_counter()
        if rank_and_world()[0] == self.consolidate_recipient_rank:
            self._write(checkpoint, plan)
            logger.info(
                "Checkpoint %s: state gathered in %.2f s, written in %.2f s",
                plan.filename,
                gathered - started,
                time.perf_counter() - gathered,
            )

    def _finish(self, engine: Engine, plan: _SavePlan) -> None:
        self._saved = [ignite_checkpoint.Checkpoint.Item(p, f) for p, f in plan.saved]
        engine.fire_event(CheckpointEvents.SAVED_CHECKPOINT)

    def _wait_then_raise(self, engine: Engine, error: BaseException) -> None:
        """On an exception in the run: let a pending save finish (or report its failure), then raise as ignite does."""
        try:
            self.wait()
        except Exception as failure:
            logger.error("The run raised %r while an asynchronous save was pending, which failed: %s", error, failure)
        raise error

    def _plan(self, engine: Engine) -> _SavePlan | None:
        """This rank's view of what to save now; ``None`` when the score does not earn a place."""
        global_step = None
        if self.global_step_transform is not None:
            global_step = self.global_step_transform(engine, engine.last_event_name)
        if self.score_function is not None:
            priority = self.score_function(engine)
            if not isinstance(priority, numbers.Number):
                raise ValueError(f"Output of score_function should be a number, got {type(priority).__name__}")
            # numpy scalars become Python numbers: files must load with torch.load(weights_only=True).
            priority = int(priority) if isinstance(priority, numbers.Integral) else float(priority)  # type: ignore
        else:
            if global_step is None:
                global_step = engine.state.get_event_attrib_value(Events.ITERATION_COMPLETED)
            priority = global_step

        saved = [(item.priority, item.filename) for item in self._saved]
        full = self.n_saved is not None and len(saved) >= self.n_saved
        if full and not (priority >= saved[0][0] if self.greater_or_equal else priority > saved[0][0]):
            return None

        name = next(iter(self.to_save)) if len(self.to_save) == 1 else "checkpoint"
        score = None
        if self.score_function is not None:
            score = f"{priority}" if isinstance(priority, numbers.Integral) else f"{priority:.4f}"
        filename = check_filename(
            self._filename_pattern(global_step).format(
                filename_prefix=self.filename_prefix,
                ext=self.ext,
                name=name,
                score_name=self.score_name,
                score=score,
                global_step=global_step,
            )
        )
        removed: tuple[str, ...] = ()
        if any(f == filename for _, f in saved):  # same name: replaced atomically by the write itself
            saved = [(p, f) for p, f in saved if f != filename]
        elif full:
            removed = (saved.pop(0)[1],)
        saved.append((priority, filename))
        saved.sort(key=lambda item: item[0])
        return _SavePlan(filename, priority, name, tuple(saved), removed)

    def _filename_pattern(self, global_step: int | None) -> str:
        if self.filename_pattern is not None:
            return self.filename_pattern
        return self.setup_filename_pattern(
            with_prefix=len(self.filename_prefix) > 0,
            with_score=self.score_function is not None,
            with_score_name=self.score_name is not None,
            with_global_step=global_step is not None,
        )

    def _write(self, checkpoint: dict[str, Any], plan: _SavePlan) -> None:
        """On the recipient: write the new file durably, then remove the files it displaces."""
        if len(checkpoint) == 1:
            checkpoint = checkpoint[plan.name]
        if self.include_self:
            checkpoint["checkpointer"] = OrderedDict([("_saved", [list(item) for item in plan.saved])])
        metadata = {
            "basename": f"{self.filename_prefix}{'_' * int(len(self.filename_prefix) > 0)}{plan.name}",
            "score_name": self.score_name,
            "priority": plan.priority,
        }
        if self._saver_takes_metadata:
            self.save_handler(checkpoint, plan.filename, metadata)
        else:
            self.save_handler(checkpoint, plan.filename)
        if isinstance(self.save_handler, BaseSaveHandler):
            self._remove_displaced(plan)

    def reload_objects(self, to_load: Mapping, load_kwargs: dict | None = None, **filename_components: Any) -> None:
        """Load ``to_load`` from one of this handler's files, named by ``filename_components`` (``name``,
        ``score``, ``global_step``) as :meth:`ignite.handlers.Checkpoint.reload_objects` does.

        Unlike ignite's, it consolidates nothing to work out the file name, and it runs this class's
        :meth:`load_objects`, so sharded objects are restored on any world size. Call it on every rank.
        """
        self.wait()
        dirname = getattr(self.save_handler, "dirname", None)
        if dirname is None:
            raise AttributeError(
                f"Checkpoint's `save_handler` should be a DiskSaver (with a `dirname`), given {type(self.save_handler)}"
            )
        global_step = filename_components.get("global_step", None)
        filename = self._filename_pattern(global_step).format(
            filename_prefix=self.filename_prefix,
            ext=self.ext,
            name=filename_components.get("name", next(iter(self.to_save)) if len(self.to_save) == 1 else "checkpoint"),
            score_name=self.score_name,
            score=filename_components.get("score", None),
            global_step=global_step,
        )
        type(self).load_objects(to_load=to_load, checkpoint=Path(dirname) / filename, **(load_kwargs or {}))

    @staticmethod
    def load_objects(
        to_load: Mapping,
        checkpoint: str | Path | Mapping,
        *,
        weights_only: bool = True,
        sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        """Restore the objects of ``to_load`` from ``checkpoint``, saved on any number of ranks.

        When ``to_load`` holds sharded objects and a process group of several ranks is in use, this is a
        collective: call it on every rank. Each rank opens the file with ``mmap``, so ranks of one host share
        its pages, and restores its own part. With plain objects only, it is local, as in ignite.

        Every object is checked against its entry before anything is loaded: a missing entry, or a module
        whose keys or shapes differ (under ``strict=True``), raises before any object changes.

        Args:
            to_load: objects to restore, e.g. ``{"model": model, "optimizer": optimizer}``.
            checkpoint: path of a checkpoint file, or an already loaded checkpoint dictionary. With a single
                object in ``to_load``, the checkpoint may be that object's state dict itself.
            weights_only: load the file with ``torch.load(..., weights_only=True)`` (default). Pass False only
                for trusted files that hold arbitrary Python objects.
            sync_timeout: seconds every rank waits for the others to reach the same load.
            kwargs: keyword arguments of ``nn.Module.load_state_dict``, e.g. ``strict=False``.

        Raises:
            ~ignite_zero.IntegrityError: the file is truncated or corrupt.
            KeyError: the checkpoint has no entry for an object of ``to_load``.
        """
        if not isinstance(checkpoint, (Mapping, str, Path)):
            raise TypeError(f"Argument checkpoint should be a string or a dictionary, but given {type(checkpoint)}")
        if not isinstance(to_load, Mapping):
            raise TypeError(f"Argument `to_load` should be a dictionary, but given {type(to_load)}")
        _check_objects(to_load, "load_state_dict")
        restore(to_load, checkpoint, weights_only=weights_only, sync_timeout=sync_timeout, kwargs=kwargs)


class ModelCheckpoint(Checkpoint):
    """Drop-in for :class:`ignite.handlers.ModelCheckpoint`: a :class:`Checkpoint` writing with a
    :class:`~ignite_zero.DiskSaver`, given ``to_save`` when attached.

    Args:
        dirname: directory in which checkpoints are written.
        filename_prefix: prefix of the file names.
        score_function: ``engine -> number``; the highest scores are kept.
        score_name: name of the score in file names.
        n_saved: how many files to keep; ``None`` keeps all.
        atomic: write to a temporary file and rename it (default).
        require_empty: raise if ``dirname`` already holds ``.pt`` files.
        create_dir: create ``dirname`` if needed.
        global_step_transform: ``(engine, event_name) -> int`` global step for file names.
        filename_pattern: pattern of file names.
        include_self: also save this handler's own state.
        greater_or_equal: keep the latest of equally scored checkpoints.
        save_on_rank: ignite's name for the writing rank.
        consolidate_recipient_rank: rank that receives the consolidated state and writes it.
        sync_timeout: seconds every rank waits for the others to reach the same save.
        async_save: save in the background (see :class:`Checkpoint`).
        kwargs: keyword arguments of :func:`torch.save`.

    Examples:
        .. code-block:: python

            from ignite_zero import ModelCheckpoint

            handler = ModelCheckpoint("/tmp/models", "run", n_saved=2, require_empty=False)
            trainer.add_event_handler(Events.EPOCH_COMPLETED, handler, {"model": model, "optimizer": optimizer})

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        dirname: str | Path,
        filename_prefix: str = "",
        score_function: Callable | None = None,
        score_name: str | None = None,
        n_saved: int | None = 1,
        atomic: bool = True,
        require_empty: bool = True,
        create_dir: bool = True,
        global_step_transform: Callable | None = None,
        filename_pattern: str | None = None,
        include_self: bool = False,
        greater_or_equal: bool = False,
        save_on_rank: int | None = None,
        *,
        consolidate_recipient_rank: int | None = None,
        sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        recipient = _resolve_recipient(consolidate_recipient_rank, save_on_rank, None)
        saver = DiskSaver(
            dirname, atomic=atomic, create_dir=create_dir, require_empty=require_empty, save_on_rank=recipient, **kwargs
        )
        super().__init__(
            to_save={},
            save_handler=saver,
            filename_prefix=filename_prefix,
            score_function=score_function,
            score_name=score_name,
            n_saved=n_saved,
            global_step_transform=global_step_transform,
            filename_pattern=filename_pattern,
            include_self=include_self,
            greater_or_equal=greater_or_equal,
            consolidate_recipient_rank=recipient,
            sync_timeout=sync_timeout,
            async_save=async_save,
        )

    def __call__(self, engine: Engine, to_save: Mapping) -> None:  # type: ignore[override]
        if len(to_save) == 0:
            raise RuntimeError("No objects to checkpoint found.")
        _check_objects(to_save, "state_dict")
        self.to_save = to_save
        super().__call__(engine)


def _resolve_recipient(consolidate_recipient_rank: int | None, save_on_rank: int | None, save_handler: Any) -> int:
    """The one rank that receives and writes, from the places a user may have named it."""
    given = {}
    if consolidate_recipient_rank is not None:
        given["consolidate_recipient_rank"] = consolidate_recipient_rank
    if save_on_rank is not None:
        given["save_on_rank"] = save_on_rank
    if isinstance(save_handler, (DiskSaver, ShardedSaver)) and save_handler.rank_given:
        given["the save_handler's save_on_rank"] = save_handler.save_on_rank
    elif isinstance(save_handler, ignite_checkpoint.DiskSaver):
        given["the save_handler's save_on_rank"] = save_handler.save_on_rank
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


def _without_nothing(state: Any) -> Any:
    """``state`` without the entries this rank keeps none of (``{}`` in their place in lists, whose positions are
    names)."""
    if isinstance(state, Mapping):
        return {key: _without_nothing(value) for key, value in state.items() if value is not sharded.NOTHING}
    if isinstance(state, list):
        return [{} if value is sharded.NOTHING else _without_nothing(value) for value in state]
    return state


def _dcp_group(dedicated: bool) -> Any:
    """The gloo group of every rank for ``torch.distributed.checkpoint``'s collectives; ``None`` without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return transport.cpu_group(dedicated=dedicated)


def _check_objects(objects: Mapping, method: str) -> None:
    def check(path: str, obj: Any) -> None:
        if not callable(getattr(obj, method, None)):
            raise TypeError(
                f"Object {path} of type {type(obj).__name__} has no `{method}` method; every object to checkpoint "
                "needs `state_dict` and `load_state_dict`."
            )

    map_objects(objects, check)


def _takes_metadata(save_handler: Callable) -> bool:
    if isinstance(save_handler, BaseSaveHandler):
        return True
    parameters = inspect.signature(save_handler).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def _layout(objects: Any) -> list[str]:
    """The entries each rank is about to save, to catch ranks whose ``to_save`` differ before any collective.

    Only names count: a sharded optimizer on a sub-group sits beside a plain one on the other ranks.
    """
    layout: list[str] = []
    map_objects(objects, lambda path, _: layout.append(path))
    return layout


def _check_layouts(layouts: list[list[str]]) -> None:
    if any(layout != layouts[0] for layout in layouts):
        listing = "; ".join(f"rank {rank}: {layout}" for rank, layout in enumerate(layouts))
        raise ValueError(f"`to_save` differs between ranks ({listing}); build it the same way on every rank.")


def _summary(plan: _SavePlan | None) -> str:
    return "no save" if plan is None else f"{plan.filename} (priority {plan.priority})"
