"""Policy: what to save and when (naming, scoring, retention), and loading it back on any world size.

:class:`Checkpoint` keeps the behaviour of :class:`ignite.handlers.Checkpoint` and makes it correct for
sharded state. A save of sharded objects is a collective among the ranks that hold them: they first agree on
what to save (the recipient's decision wins), the saver consolidates and writes, and every rank learns the
outcome, so that an error on one rank is an error on all of them instead of a hang. A save that holds no sharded
object waits for nobody, as in ignite: the recipient writes, and it tells the other ranks its decision and
its failures through the store, which they read without waiting. Where and how checkpoints are written is the
saver's business (``ignite_zero.storage``); asynchronous saves run through ``ignite_zero.storage.savers.background``.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignite.engine import Engine, Events
from ignite.handlers import checkpoint as ignite_checkpoint
from ignite.handlers.checkpoint import BaseSaveHandler

from ignite_zero import collector, tree
from ignite_zero._compat import CheckpointEvents
from ignite_zero.adapters import ShardedState, adapt
from ignite_zero.agreement import (
    DEFAULT_SYNC_TIMEOUT,
    RankFailureError,
    busy,
    peek,
    post,
    rank_and_world,
    settle,
    together,
)
from ignite_zero.loading.latest import find_latest
from ignite_zero.loading.objects import restore
from ignite_zero.loading.resume import ready_to_save_after, retention_until
from ignite_zero.naming import check_filename, read_name
from ignite_zero.save_ranks import check_entry_names, entry_names, resolve_recipient, sharing_ranks
from ignite_zero.storage import Saver, SaveRequest, as_saver, replicas, saver_for
from ignite_zero.storage.savers.background import BackgroundSaves

__all__ = ["Checkpoint"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _SaveDecision:
    """What one call of :class:`Checkpoint` decided to write and remove; identical on every rank once agreed."""

    filename: str
    priority: int | float
    name: str
    saved: tuple[tuple[int | float, str], ...]  # the retained (priority, filename) pairs after this save
    removed: tuple[str, ...]  # files to remove once the new one is durable


class Checkpoint(ignite_checkpoint.Checkpoint):
    """Drop-in for :class:`ignite.handlers.Checkpoint` that saves sharded training state correctly.

    Sharded objects in ``to_save`` (``ZeroRedundancyOptimizer``, fairscale ``OSS``, any optimizer with
    ``consolidate_state_dict``, FSDP1 and FSDP2 models and their optimizers, also next to a
    ``DistributedDataParallel`` model) are consolidated on ``consolidate_recipient_rank``, which alone writes the
    file; the file holds the full, current state, loadable on any number of ranks with :meth:`load_objects`. Call
    it on every rank that holds a shard of them; a handler of replicated state only may be called on any ranks,
    on rank 0 alone included, as in ignite.

    Every argument of ignite's ``Checkpoint`` keeps its meaning. Deliberate differences:

    - the ranks of a save of sharded state agree before it: if one of them does not call it within
      ``sync_timeout`` seconds, every rank that did raises :class:`~ignite_zero.CollectiveTimeoutError` naming
      the missing ranks; the recipient's score and file name are used on every rank (a rank that computed
      another logs a warning); an error on any rank, the recipient's write included, raises
      :class:`~ignite_zero.RankFailureError` on every rank. A save of replicated state waits for nobody: the
      recipient posts its outcome, which the other ranks take up at their next save;
    - old files are removed only once the new one is durable, and a file name that is reused is replaced
      atomically, so a failed save always leaves the previous checkpoints loadable;
    - a failed save raises; it is not retried;
    - a string or path makes a :class:`~ignite_zero.DiskSaver` (durable writes, integrity trailer, mode
      ``0o666 & ~umask``); any other handler is called as ignite calls it, on every rank, with ``{}`` for a
      sharded object's entry on the ranks other than the recipient;
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
            ``ignite_zero.staging`` for their memory); gathering and writing go on in a thread, over a gloo
            group of their own. The next save waits for the previous one, and so do the end of the run and an
            exception in it; an error of a background save is raised there, on every rank, or by :meth:`wait`.
            ``last_checkpoint`` and ``SAVED_CHECKPOINT`` follow once the file is durable. Handlers pair their
            background rounds by the checkpoints they write, whatever order ranks create them in (see
            ``ignite_zero.storage.savers.background``); a handler other than ours then runs in that thread too.

    Examples:
        .. code-block:: python

            from ignite.engine import Events
            from ignite_zero import Checkpoint, DiskSaver

            to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}  # e.g. a ZeRO optimizer
            checkpoint = Checkpoint(to_save, DiskSaver("ckpt", require_empty=False), n_saved=2,
                                    consolidate_recipient_rank=0)
            trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)  # on every rank
            trainer.run(loader, max_epochs=3)

            # later, on any number of ranks (every rank calls it):
            Checkpoint.load_objects(to_load=to_save, checkpoint=checkpoint.last_checkpoint)

    .. versionadded:: 0.1.0
    """

    SAVED_CHECKPOINT = CheckpointEvents.SAVED_CHECKPOINT

    def __init__(
        self,
        to_save: Mapping,
        save_handler: str | Path | Callable | BaseSaveHandler | Saver,
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
            tree.check_methods(to_save, "state_dict")
        saver = None if isinstance(save_handler, (str, Path)) else as_saver(save_handler)
        recipient = resolve_recipient(consolidate_recipient_rank, save_on_rank, saver)
        if isinstance(save_handler, (str, Path)):
            # the path's checkpoints may be the ones load_latest resumes from: only load_latest can allow them
            save_handler = saver = saver_for(
                save_handler, create_dir=True, save_on_rank=recipient, defer_require_empty=True
            )
        assert saver is not None
        saver.bind(recipient)
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
        self.async_save = async_save
        self._ext_given: str | None = None  # ignite's __init__ set "pt": the saver decides unless a user sets it
        self._saver = (save_handler, saver)
        self._background = BackgroundSaves(self.sync_timeout) if async_save else None
        self._calls = 0  # saves asked of this handler on this rank: orders the outcomes the recipient posts

    @property
    def saver(self) -> Saver:
        """``save_handler`` behind the saver protocol (``ignite_zero.storage``); follows a reassigned handler."""
        handler, saver = self._saver
        if handler is not self.save_handler:
            saver = as_saver(self.save_handler)
            saver.bind(self.consolidate_recipient_rank)
            self._saver = (self.save_handler, saver)
        return saver

    @property  # type: ignore[override]
    def ext(self) -> str:
        """Extension of the file names: the saver's (``pt``, ``dcp``), unless set after construction."""
        return self._ext_given or self.saver.ext

    @ext.setter
    def ext(self, value: str) -> None:
        self._ext_given = value

    @property
    def last_checkpoint(self) -> str | Path | None:
        retained = self._retained()
        return self.saver.location(retained[-1][1]) if retained else None

    @collector.paused()  # a save makes many objects, keeps few, and would set off passes over the heap
    def __call__(self, engine: Engine, *args: Any, **kwargs: Any) -> None:
        if not engine.has_registered_events(CheckpointEvents.SAVED_CHECKPOINT):
            engine.register_events(*CheckpointEvents)
        saver = self.saver
        self._calls += 1
        number = self._calls
        if self._background is not None:
            self._background.follow(engine, self.wait)
        self.wait()
        try:
            objects = adapt(self.to_save, self.consolidate_recipient_rank)
        except Exception as error:  # only sharded objects fail to adapt: every rank has to hear of it
            settle(error, what="checkpoint save", timeout=self.sync_timeout)
            raise
        ranks = sharing_ranks(objects)
        if len(ranks) > 1:
            decision = self._agree(engine, objects, ranks)
        else:
            decision = self._decide_alone(engine, saver)
        if decision is None:
            return
        request = self._request(decision, ranks)
        if self._background is not None:
            stream = self._background.claim(f"{saver.identity}|{self.filename_prefix}|{entry_names(self.to_save)}")
            request = dataclasses.replace(request, stream=stream)
            try:
                self._background.start(
                    lambda: self._staged(saver, objects, request),
                    what=decision.filename,
                    ranks=ranks,
                    durable=lambda: self._finish(engine, decision, len(ranks) == 1, number),
                )
            except Exception as error:
                if len(ranks) == 1:
                    self._tell_failure(error)
                raise
            return
        with together(f"checkpoint save of {decision.filename}", timeout=self.sync_timeout, ranks=ranks):
            try:
                with busy(interval=min(1.0, self.sync_timeout / 4)):
                    saver.save(objects, request)
            except Exception as error:
                if len(ranks) == 1:
                    self._tell_failure(error)
                raise
        self._finish(engine, decision, len(ranks) == 1, number)

    @staticmethod
    def _staged(saver: Saver, objects: Any, request: SaveRequest) -> Callable[[], None]:
        """``saver``'s staging of ``objects``, once it checked its directory: what would fail the first save
        (``require_empty``, say) is raised by the call that makes it, as a synchronous save raises it, not later by
        :meth:`wait`."""
        saver.check()
        return saver.stage(objects, request)

    def wait(self) -> None:
        """Block until the asynchronous save in progress, if any, is durable; raise its error if it failed.

        Every rank raises the same error. The next save, the end of the run (``Events.COMPLETED``) and an
        exception in the run wait too; ``last_checkpoint`` names the new file, and ``SAVED_CHECKPOINT`` fires,
        once it is durable.
        """
        if self._background is None:
            return
        try:
            self._background.wait()
        except Exception as error:
            self._tell_failure(error)
            raise

    def _agree(self, engine: Engine, objects: Any, ranks: list[int]) -> _SaveDecision | None:
        """Every rank's decision to the others; return the recipient's, which all follow."""
        rank, _ = rank_and_world()
        with together("checkpoint save", timeout=self.sync_timeout, ranks=ranks) as proposal:
            self.saver.check()
            decision = self._decide(engine)
            for _, obj in tree.leaves(objects):
                if isinstance(obj, ShardedState):
                    obj.check()
            proposal.payload = (decision, entry_names(self.to_save))
        proposals = proposal.payloads
        check_entry_names(dict(zip(ranks, (entries for _, entries in proposals))))
        if self.consolidate_recipient_rank not in ranks:
            raise ValueError(
                f"The sharded objects of this checkpoint live on ranks {ranks}, which do not include the recipient, "
                f"rank {self.consolidate_recipient_rank}. Set `consolidate_recipient_rank` to one of them."
            )
        agreed: _SaveDecision | None = proposals[ranks.index(self.consolidate_recipient_rank)][0]
        if decision != agreed:
            logger.warning(
                "Rank %d planned %s, rank %d (the recipient) planned %s; following the recipient. Make "
                "`score_function` and `global_step_transform` return the same value on every rank.",
                rank,
                _summary(decision),
                self.consolidate_recipient_rank,
                _summary(agreed),
            )
        return agreed

    def _decide_alone(self, engine: Engine, saver: Saver) -> _SaveDecision | None:
        """A save of replicated state, which waits for nobody. A rank other than the recipient first takes up what
        the recipient posted after its saves: a failure, raised here too, or the checkpoints it retained after an
        earlier save. Not after this same save, which the recipient may have finished first: its own decision then
        holds that checkpoint already, and every rank calls its handler, as in ignite."""
        if rank_and_world()[0] != self.consolidate_recipient_rank:
            outcome = peek(self._outcome_key(saver))
            if outcome is not None:
                number, saved, failure = outcome
                if failure is not None:
                    raise RankFailureError(
                        f"The last checkpoint save on rank {self.consolidate_recipient_rank}, the recipient, failed: "
                        f"{failure}. Fix its cause; this rank stops too, rather than train on without checkpoints."
                    )
                if number < self._calls:
                    self._retain(saved)
        return self._decide(engine)

    def _outcome_key(self, saver: Saver) -> str:
        """Where the recipient posts the outcome of its saves of replicated state, the same on every rank."""
        identity = f"{saver.identity}|{self.filename_prefix}|{self.filename_pattern}|{entry_names(self.to_save)}"
        return f"outcome/{zlib.crc32(identity.encode()):08x}"

    def _tell_failure(self, failure: BaseException) -> None:
        """On the recipient of a save of replicated state: let the other ranks know, without waiting for them."""
        if rank_and_world()[0] == self.consolidate_recipient_rank:
            text = f"{type(failure).__name__}: {failure}"
            post(self._outcome_key(self.saver), (self._calls, self._retained(), text))

    def _retained(self) -> list[tuple[int | float, str]]:
        """The retained ``(priority, filename)`` pairs, oldest first, through ignite's public state."""
        return [(priority, filename) for priority, filename in self.state_dict()["_saved"]]

    def _retain(self, pairs: Any) -> None:
        self.load_state_dict(OrderedDict([("_saved", [(priority, filename) for priority, filename in pairs])]))

    def _request(self, decision: _SaveDecision, ranks: list[int]) -> SaveRequest:
        extra: dict[str, Any] = {}
        if self.include_self:  # ignite's own form: what its state_dict() returns after this save
            extra["checkpointer"] = OrderedDict([("_saved", [(p, f) for p, f in decision.saved])])
        prefix = f"{self.filename_prefix}{'_' * int(len(self.filename_prefix) > 0)}"
        return SaveRequest(
            filename=decision.filename,
            name=decision.name,
            metadata={
                "basename": f"{prefix}{decision.name}",
                "score_name": self.score_name,
                "priority": decision.priority,
            },
            removed=decision.removed,
            recipient=self.consolidate_recipient_rank,
            ranks=tuple(ranks),
            timeout=self.sync_timeout,
            extra=extra,
        )

    def _finish(self, engine: Engine, decision: _SaveDecision, alone: bool, number: int) -> None:
        """The save ``number`` of this handler is durable: retain it, and post it for the other ranks of a save of
        replicated state."""
        self._retain(decision.saved)
        if alone and rank_and_world()[0] == self.consolidate_recipient_rank:
            post(self._outcome_key(self.saver), (number, list(decision.saved), None))
        engine.fire_event(CheckpointEvents.SAVED_CHECKPOINT)

    def _decide(self, engine: Engine) -> _SaveDecision | None:
        """This rank's decision of what to save now; ``None`` when the score does not earn a place."""
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

        saved = self._retained()
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
        return _SaveDecision(filename, priority, name, tuple(saved), removed)

    def _filename_pattern(self, global_step: int | None) -> str:
        if self.filename_pattern is not None:
            return self.filename_pattern
        return self.setup_filename_pattern(
            with_prefix=len(self.filename_prefix) > 0,
            with_score=self.score_function is not None,
            with_score_name=self.score_name is not None,
            with_global_step=global_step is not None,
        )

    def load_latest(self, to_load: Mapping, *, places: Sequence[str | Path] | None = None, **kwargs: Any) -> str | None:
        """Load ``to_load`` from the newest valid checkpoint of this handler (:func:`~ignite_zero.find_latest` in its
        directory, with its ``filename_prefix``), or of several tiers (``places``), and take up its retention: the
        checkpoints this handler would have kept, so that ``n_saved`` and ``last_checkpoint`` carry on from there.
        Call it on every rank.

        A directory whose checkpoints it searched and resumed from is this run's: the saver's ``require_empty`` no
        longer refuses it. It still guards a run that found nothing to resume, and a directory left out of
        ``places``. What would make the handler's first save fail then fails here, on every rank, before anything
        is loaded: a directory holding other checkpoints (another run's, or this one's under another
        ``filename_prefix``), one that cannot be created or written, a missing bucket. A checkpoint of the other
        kind in the handler's directory (a run that changed savers) is resumed as another tier's, which the
        handler's retention leaves be.

        Args:
            to_load: objects to restore, as for :meth:`load_objects`.
            places: directories (paths or URLs) to search together instead of this handler's own, e.g. a fast
                node-local tier and a durable one. The newest valid checkpoint of any of them is loaded; this handler
                carries on its retention from its own checkpoints up to that one.
            kwargs: further arguments of :meth:`load_objects`.

        Returns:
            The path it loaded, ``None`` (and nothing loaded) when there is no valid checkpoint.

        Raises:
            ~ignite_zero.RankFailureError: on every rank, when the saver's directory would fail the next save, with
                the reason and how load_latest left the directory (without a process group, the saver's own error).

        Examples:
            .. code-block:: python

                from ignite_zero import Checkpoint, DiskSaver

                checkpoint = Checkpoint(to_save, DiskSaver("ckpt", require_empty=False), n_saved=2)
                checkpoint.load_latest(to_save)  # a fresh run, or a restarted one: the same code
                trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)

            Two tiers, a fast node-local one and a durable one, searched together: see :ref:`two-tiers`.

        .. versionadded:: 0.1.0
        """
        options = self.saver.storage_options if places is None else kwargs.get("storage_options")
        found = self._find_latest(places, options)
        name = "" if found is None else Path(found).name
        # one of another kind there (the run changed savers) is resumed as another tier's: retention leaves it be
        own = found is not None and str(self.saver.location(name)) == found and name.endswith(f".{self.ext}")
        listed = ready_to_save_after(
            self.saver, found, places, options, filename_prefix=self.filename_prefix, timeout=self.sync_timeout
        )
        if found is None:
            return None
        kwargs.setdefault("sync_timeout", self.sync_timeout)
        kwargs.setdefault("storage_options", options)
        # a replicated checkpoint's files that this host lacks, fetched even where the load itself is local
        replicas.repair_before_load(found, options, self.sync_timeout)
        type(self).load_objects(to_load=to_load, checkpoint=found, **kwargs)
        self._retain(retention_until(name, listed, own=own, priority_in=self._priority_in, n_saved=self.n_saved))
        return found

    def _find_latest(self, places: Sequence[str | Path] | None, options: Mapping[str, Any] | None) -> str | None:
        """:func:`~ignite_zero.find_latest` in ``places``, else in this handler's directory, once its own save in
        progress is durable."""
        directory = self.saver.directory
        if directory is None and places is None:
            raise ValueError(
                f"load_latest looks for checkpoints in the directory of the save_handler, and this "
                f"{type(self.save_handler).__name__} has none; use a DiskSaver or ShardedSaver, pass `places`, or use "
                "find_latest."
            )
        self.wait()
        return find_latest(
            directory if places is None else places,  # type: ignore[arg-type]
            filename_prefix=self.filename_prefix,
            storage_options=options,
            sync_timeout=self.sync_timeout,
        )

    def _priority_in(self, filename: str) -> int | float | None:
        """The priority that this handler's file name pattern put in ``filename``, read by the rule of
        :mod:`ignite_zero.naming`: its score, else its global step."""
        with_step = self.score_function is None or self.global_step_transform is not None
        found = read_name(
            filename,
            self._filename_pattern(0 if with_step else None),
            ext=self.ext,
            filename_prefix=self.filename_prefix,
            score_name=self.score_name or "",
        )
        if found is None:
            return None
        if self.score_function is not None and found["score"] is not None:
            return float(found["score"])
        return None if found["global_step"] is None else int(found["global_step"])

    def reload_objects(self, to_load: Mapping, load_kwargs: dict | None = None, **filename_components: Any) -> None:
        """Load ``to_load`` from one of this handler's files, named by ``filename_components`` (``name``,
        ``score``, ``global_step``) as :meth:`ignite.handlers.Checkpoint.reload_objects` does.

        Unlike ignite's, it consolidates nothing to work out the file name, and it runs this class's
        :meth:`load_objects`, so sharded objects are restored on any world size. Call it on every rank.
        """
        self.wait()
        dirname = self.saver.directory
        if dirname is None:
            raise AttributeError(  # ignite's words first: code that matches them keeps working
                f"Checkpoint's `save_handler` should be of type `DiskSaver`, given {type(self.save_handler)}: "
                "reload_objects reads the file from the saver's directory; this handler has none. Pass a DiskSaver "
                "or a ShardedSaver, or load the file with Checkpoint.load_objects."
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
        load_kwargs = {"storage_options": self.saver.storage_options, **(load_kwargs or {})}
        type(self).load_objects(to_load=to_load, checkpoint=self.saver.location(filename), **load_kwargs)

    @staticmethod
    def load_objects(
        to_load: Mapping,
        checkpoint: str | Path | Mapping,
        *,
        weights_only: bool = True,
        sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
        storage_options: Mapping[str, Any] | None = None,
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
            checkpoint: path or URL of a checkpoint file or sharded checkpoint directory, or an already loaded
                checkpoint dictionary. With a single object in ``to_load``, the checkpoint may be that object's
                state dict itself. From an object store, each rank reads only the tensors it needs, with ranged
                reads.
            weights_only: read every pickle of the checkpoint as ``torch.load(..., weights_only=True)`` does
                (default), a sharded directory's ``.metadata`` as DCP's metadata alone: nothing it holds runs code.
                Pass False only for a checkpoint whose source you trust that holds arbitrary Python objects (see
                the docs' Security page).
            sync_timeout: seconds every rank waits for the others to reach the same load.
            storage_options: options of the URL's file system (for S3: ``endpoint_url``, ``key``, ``secret``...),
                as fsspec takes them.
            kwargs: keyword arguments of ``nn.Module.load_state_dict``, e.g. ``strict=False``.

        Raises:
            ~ignite_zero.IntegrityError: the file is truncated or corrupt.
            ~ignite_zero.UnsafeCheckpointError: the checkpoint holds a pickle that would run code (unless not
                ``weights_only``).
            ValueError: the checkpoint has no entry for an object of ``to_load`` (ignite's error).
        """
        if not isinstance(checkpoint, (Mapping, str, Path)):
            raise TypeError(f"Argument checkpoint should be a string or a dictionary, but given {type(checkpoint)}")
        if not isinstance(to_load, Mapping):
            raise TypeError(f"Argument `to_load` should be a dictionary, but given {type(to_load)}")
        tree.check_methods(to_load, "load_state_dict")
        restore(
            to_load,
            checkpoint,
            weights_only=weights_only,
            sync_timeout=sync_timeout,
            storage_options=storage_options,
            kwargs=kwargs,
        )


def _summary(decision: _SaveDecision | None) -> str:
    return "no save" if decision is None else f"{decision.filename} (priority {decision.priority})"
