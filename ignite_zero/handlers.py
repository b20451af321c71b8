"""Handlers for users who keep their own saving code, and for long runs that must stop on a signal."""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import weakref
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import torch.distributed as dist
from ignite.engine import Engine, Events

from ignite_zero.adapters.zero import ZeROState, consolidate
from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT, peek, propose, rank_and_world, together
from ignite_zero.checkpoint import Checkpoint

__all__ = ["ConsolidateZeROHandler", "SaveOnSignal"]

logger = logging.getLogger(__name__)


class ConsolidateZeROHandler:
    """Consolidate a sharded optimizer's state on one rank, on every rank's behalf, at a regular interval.

    Afterwards ``optimizer.state_dict()`` on ``recipient_rank`` returns the current global state, ready for
    saving code of your own. Consolidation is a collective: attach the handler on every rank.

    Works with :class:`torch.distributed.optim.ZeroRedundancyOptimizer` (argument ``to``), fairscale's ``OSS``
    (argument ``recipient_rank``) and any optimizer with a ``consolidate_state_dict`` method, whose recipient
    argument is read from its signature. For ZeRO and OSS the shards travel once, to the recipient only, as raw
    tensors (``ignite_zero.transport``), instead of the optimizers' own pickled broadcast to every rank; the
    result is the same.

    Args:
        zero_optimizer: the sharded optimizer.
        call_every: consolidate every ``call_every`` epochs (or iterations).
        recipient_rank: global rank that receives the state.
        epoch_level: count epochs if True (default), iterations otherwise.
        sync_timeout: seconds every rank waits for the others before consolidating; a rank that does not
            come raises :class:`~ignite_zero.CollectiveTimeoutError` on the others instead of a hang.

    Examples:
        .. code-block:: python

            from ignite_zero import ConsolidateZeROHandler

            ConsolidateZeROHandler(optimizer, call_every=1, recipient_rank=0).attach(trainer)

            @trainer.on(Events.EPOCH_COMPLETED)
            def save(engine):
                if idist.get_rank() == 0:
                    torch.save(optimizer.state_dict(), "optimizer.pt")

        Attach it before your saving handler: handlers of one event run in the order they were added.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        zero_optimizer: Any,
        call_every: int = 1,
        recipient_rank: int = 0,
        epoch_level: bool = True,
        sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
    ) -> None:
        if not isinstance(call_every, int) or isinstance(call_every, bool) or call_every < 1:
            raise ValueError(f"Argument `call_every` should be a positive integer, got {call_every!r}")
        self._state = ZeROState(zero_optimizer, recipient_rank)
        _, world_size = rank_and_world()
        if recipient_rank >= world_size:
            raise ValueError(
                f"Argument `recipient_rank` is {recipient_rank}, outside the process group of {world_size} ranks; "
                f"choose a rank in [0, {world_size})"
            )
        self.zero_optimizer = zero_optimizer
        self.call_every = call_every
        self.recipient_rank = recipient_rank
        self.epoch_level = epoch_level
        self.sync_timeout = sync_timeout

    def attach(self, engine: Engine) -> None:
        """Run the handler on ``engine`` every ``call_every`` epochs (or iterations)."""
        event = Events.EPOCH_COMPLETED if self.epoch_level else Events.ITERATION_COMPLETED
        engine.add_event_handler(event(every=self.call_every), self)

    def __call__(self, engine: Engine | None = None) -> None:
        """Consolidate now, on every rank."""
        with together("ZeRO consolidation", timeout=self.sync_timeout):
            self._state.check()
        consolidate(self.zero_optimizer, self.recipient_rank)


_SignalHandler = Callable[[int, FrameType | None], Any] | int | None

# Runs of SaveOnSignal handlers started in each default process group, counted alike on every rank: each run has
# a key of its own in the store, and a group created again counts afresh, as ``agreement.rounds`` does.
_runs: weakref.WeakKeyDictionary[Any, itertools.count] = weakref.WeakKeyDictionary()


class SaveOnSignal:
    """Save a checkpoint on every rank at the same iteration when any rank receives a signal, then end the run.

    For jobs that are told to stop before they are killed: a SLURM time limit, a preemption, ``torchrun`` stopping
    its workers. Whichever ranks get the signal, every rank calls ``checkpoint(engine)`` at the same iteration
    boundary (a collective when ``to_save`` holds sharded objects), then ``engine.terminate()``: ignite fires
    ``Events.TERMINATE``, then ``Events.COMPLETED``. Attach it on every rank.

    How ranks agree on the iteration, with no collective in the training loop:

    - The signal handler only notes the signal (neither the store nor ``torch.distributed`` may be used inside a
      Python signal handler) and gives that signal back its default action.
    - At each iteration boundary (``Events.ITERATION_COMPLETED``), a rank that noted a signal proposes a target
      iteration, its own plus ``margin``, in the default process group's store; the first proposal wins (one
      atomic ``compare_set``), and every proposer gets the winner. A rank that noted nothing looks for a target
      at each boundary until it finds one: one ``store.check`` (the benchmarks page of the docs has its cost).
      Each run has a key of its own, counted alike on every rank and afresh in a new process group.
    - Each rank saves and stops at the boundary of the target iteration. Ranks of a job with a collective in every
      step (DDP, ZeRO, FSDP) are never more than one iteration apart, so with the default margin of 2 every rank
      is still before the target when it first looks. Without a process group, or with one rank, nothing is
      shared and the save happens at the boundary that follows the signal.

    At the edges:

    - A signal during a save, of this checkpoint or another, lets the save finish: the note is read at boundaries.
    - A second signal of the same kind ends the process at once, by the signal's default action, even in the
      middle of a save or of a collective; the previous checkpoint stays intact (savers write atomically). A
      signal of another kind counts as a first one.
    - If the run ends before the target (the signal came less than ``margin`` iterations before the end),
      nothing is saved: the run completes as usual and :attr:`stopped_at` stays ``None``.
    - A rank that finds the target already behind it (ranks ran further apart than ``margin``, which only a job
      without a collective in every step does) saves nothing and raises ``RuntimeError``. For gradient
      accumulation with ``no_sync`` over ``k`` steps, set ``margin`` to ``k + 1``.
    - Python installs signal handlers in the main thread only: attach the handler and run the engine there. The
      handlers are installed at ``Events.STARTED`` and the previous ones restored at ``Events.TERMINATE``,
      ``Events.COMPLETED`` and ``Events.EXCEPTION_RAISED`` (a handler that was not installed from Python comes
      back as the default action), or by :meth:`detach`.
    - On ``Events.EXCEPTION_RAISED`` it waits for an asynchronous save of ``checkpoint`` in flight, then raises
      the exception again, as ignite does for an event without handlers; handlers of that event added after this
      one do not run.
    - Called at ``Events.ITERATION_COMPLETED``, the checkpoint names its file by the iteration. If the same
      :class:`~ignite_zero.Checkpoint` also saves at ``Events.EPOCH_COMPLETED``, give it
      ``global_step_transform=global_step_from_engine(trainer, Events.ITERATION_COMPLETED)``, so that all its
      files are named and kept (``n_saved``) by iteration.

    With SLURM, ``#SBATCH --signal=USR1@90`` sends SIGUSR1 to the tasks of the job steps 90 s before the time
    limit (``B:USR1@90`` would reach the batch shell only); choose the lead time above a save and ``margin``
    iterations. With ``#SBATCH --requeue``, let the script exit with a code that says it stopped early
    (:attr:`stopped_at`) and run ``scontrol requeue $SLURM_JOB_ID`` after ``srun`` in that case; the requeued job
    resumes from ``checkpoint.last_checkpoint``. Under ``torchrun``, add SIGUSR1 to its ``--signals-to-handle``
    so that it passes the signal on.

    ``torchrun``, when stopped or preempted, sends the signal it got (SIGTERM; SIGINT for Ctrl-C, which is not
    handled here unless added to ``signals``) to every worker, then SIGKILL after ``--shutdown-timeout`` seconds
    (30 by default): the save must fit in that time. When a worker fails, torchrun
    stops the others the same way; their save of sharded state cannot complete without the failed rank
    (:class:`~ignite_zero.CollectiveTimeoutError` after ``sync_timeout``, or SIGKILL first), and the previous
    checkpoint stays intact.

    Args:
        checkpoint: the :class:`~ignite_zero.Checkpoint` to save, or any handler called as ``checkpoint(engine)``.
        signals: the signals to handle, SIGTERM and SIGUSR1 by default.
        margin: iterations between the boundary at which a rank proposes the target and the target, at least 1.

    Attributes:
        stopped_at: the iteration saved before this handler ended the last run, or ``None``.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, DiskSaver, SaveOnSignal

            checkpoint = Checkpoint(to_save, DiskSaver("ckpt", require_empty=False), n_saved=2)
            trainer.add_event_handler(Events.ITERATION_COMPLETED(every=1000), checkpoint)
            stop = SaveOnSignal(checkpoint)  # SIGTERM and SIGUSR1
            stop.attach(trainer)  # on every rank
            trainer.run(loader, max_epochs=100)
            if stop.stopped_at is not None:
                sys.exit(3)  # stopped early, checkpoint saved: e.g. requeue the job

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        checkpoint: Checkpoint | Callable[[Engine], Any],
        signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1),
        *,
        margin: int = 2,
    ) -> None:
        if not callable(checkpoint):
            raise TypeError(f"Argument `checkpoint` should be a Checkpoint or a callable, got {type(checkpoint)}")
        kinds = tuple(dict.fromkeys(signal.Signals(number) for number in signals))
        if not kinds:
            raise ValueError("Argument `signals` should name at least one signal")
        uncatchable = [kind.name for kind in kinds if kind in (signal.SIGKILL, signal.SIGSTOP)]
        if uncatchable:
            raise ValueError(f"Signals {uncatchable} cannot be caught; choose others, e.g. SIGTERM or SIGUSR1")
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 1:
            raise ValueError(f"Argument `margin` should be a positive integer, got {margin!r}")
        self.checkpoint = checkpoint
        self.signals = kinds
        self.margin = margin
        self.stopped_at: int | None = None
        self._engine: Engine | None = None
        self._previous: dict[signal.Signals, _SignalHandler] = {}
        self._received: signal.Signals | None = None
        self._key = ""
        self._target: tuple[int, int, str] | None = None  # (iteration, proposing rank, signal name)

    def attach(self, engine: Engine) -> None:
        """Handle the signals during each run of ``engine``; call it on every rank, in the main thread."""
        _require_main_thread()
        if self._engine is not None:
            raise RuntimeError("This SaveOnSignal is attached already; detach() it first")
        for event, handler in self._handlers():
            engine.add_event_handler(event, handler)
        self._engine = engine

    def detach(self) -> None:
        """Stop handling the signals: restore the previous handlers and leave the engine's events."""
        self._restore()
        if self._engine is not None:
            for event, handler in self._handlers():
                self._engine.remove_event_handler(handler, event)
            self._engine = None

    def _handlers(self) -> list[tuple[Events, Callable]]:
        return [
            (Events.STARTED, self._install),
            (Events.ITERATION_COMPLETED, self._at_boundary),
            (Events.TERMINATE, self._restore),
            (Events.COMPLETED, self._restore),
            (Events.EXCEPTION_RAISED, self._restore_and_raise),
        ]

    def _install(self, engine: Engine) -> None:
        _require_main_thread()
        self._restore()  # a run that ended without our handlers of its end: keep the handlers from before it
        self.stopped_at, self._received, self._target = None, None, None
        if rank_and_world()[1] > 1:
            self._key = f"save-on-signal/{next(_runs.setdefault(dist.group.WORLD, itertools.count()))}"
        for kind in self.signals:
            self._previous[kind] = signal.signal(kind, self._note)

    def _note(self, number: int, frame: FrameType | None) -> None:
        # Only a note, read at the next boundary: the store and torch.distributed may be in use right now.
        if self._received is None:
            self._received = signal.Signals(number)
        # The next signal of this kind takes the default action at once, even inside a save or a collective.
        signal.signal(number, signal.SIG_DFL)

    def _at_boundary(self, engine: Engine) -> None:
        # While no rank got a signal this is one store.check, cheap enough to ask at every iteration.
        iteration = engine.state.iteration
        if self._target is None:
            rank, world_size = rank_and_world()
            if self._received is not None:
                margin = self.margin if world_size > 1 else 0
                self._target = propose(self._key, (iteration + margin, rank, self._received.name))
            elif world_size > 1:
                self._target = peek(self._key)
            if self._target is None:
                return
            target, by, name = self._target
            logger.warning(
                "%s on rank %d: every rank saves at iteration %d and stops (rank %d is at iteration %d)",
                name,
                by,
                target,
                rank,
                iteration,
            )
        target, by, name = self._target
        if iteration < target:
            return
        if iteration > target:
            raise RuntimeError(
                f"Rank {rank_and_world()[0]} is at iteration {iteration}, past iteration {target} at which every "
                f"rank was to save because rank {by} received {name}: ranks ran more than `margin`={self.margin} "
                "iterations apart, as only a job without a collective in every step can. Nothing was saved on "
                "this rank. Raise `margin` above the number of iterations between two collectives."
            )
        self.checkpoint(engine)
        if isinstance(self.checkpoint, Checkpoint):
            self.checkpoint.wait()  # an asynchronous save is durable before the run ends
        self.stopped_at = iteration
        engine.terminate()

    def _restore(self, engine: Engine | None = None) -> None:
        while self._previous:
            kind, previous = self._previous.popitem()
            # None: installed from outside Python, which Python cannot reinstall; the default is the closest.
            signal.signal(kind, signal.SIG_DFL if previous is None else previous)

    def _restore_and_raise(self, engine: Engine, error: BaseException) -> None:
        self._restore()
        if isinstance(self.checkpoint, Checkpoint):
            # Raising here keeps later handlers of this event, the checkpoint's own wait among them, from running.
            try:
                self.checkpoint.wait()
            except Exception as failure:
                logger.error(
                    "The run raised %r while an asynchronous save was pending, which failed: %s", error, failure
                )
        raise error


def _require_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "SaveOnSignal installs signal handlers, which Python allows in the main thread only: attach it and run "
            f"the engine in the main thread, not in {threading.current_thread().name!r}"
        )
