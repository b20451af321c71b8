"""Handlers for users who keep their own saving code."""

from __future__ import annotations

from typing import Any

from ignite.engine import Engine, Events

from ignite_zero.adapters.zero import ZeROState, consolidate
from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT, rank_and_world, settle

__all__ = ["ConsolidateZeROHandler"]


class ConsolidateZeROHandler:
    """Consolidate a sharded optimizer's state on one rank, on every rank's behalf, at a regular interval.

    Afterwards ``optimizer.state_dict()`` on ``recipient_rank`` returns the current global state, ready for
    saving code of your own. Consolidation is a collective: attach the handler on every rank.

    Works with :class:`torch.distributed.optim.ZeroRedundancyOptimizer` (argument ``to``), fairscale's ``OSS``
    (argument ``recipient_rank``) and any optimizer with a ``consolidate_state_dict`` method, whose recipient
    argument is read from its signature. For ZeRO and OSS the shards travel once, to the recipient only, as raw
    tensors (:mod:`ignite_zero.transport`), instead of the optimizers' own pickled broadcast to every rank; the
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
        failure = None
        try:
            self._state.check()
        except ValueError as error:
            failure = error
        settle(failure, what="ZeRO consolidation", timeout=self.sync_timeout)
        consolidate(self.zero_optimizer, self.recipient_rank)
