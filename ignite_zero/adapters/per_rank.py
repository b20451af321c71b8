"""State that differs by rank (random generators, a sampler's position): every rank's, kept as a list by rank."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ignite_zero.adapters.base import ShardedState
from ignite_zero.agreement import rank_and_world
from ignite_zero.transport import Overlap, gather_to

__all__ = ["PerRank"]


class PerRank(ShardedState):
    """An object whose state differs from rank to rank, saved for every rank.

    ``state_dict()`` is a collective: the recipient gets ``{"by_rank": [state of rank 0, state of rank 1, ...]}``
    and every other rank ``{}``. In a sharded checkpoint each rank writes its own state. ``load_state_dict()``
    gives each rank its own state back when the world size is the one it was saved with. On another world size it
    warns, then follows the object's own rule if it has one, ``load_state_dict_of_ranks(states, rank)`` (as
    :class:`~ignite_zero.RandomState` does: each rank seeded from the saved states), and else gives rank ``r`` the
    state of saved rank ``r % len(states)``.

    Args:
        obj: the object, with ``state_dict`` and ``load_state_dict`` of this rank's state.
        recipient_rank: global rank that receives every rank's state.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, PerRank, RandomState

            to_save = {"model": model, "optimizer": optimizer, "rng": RandomState(), "sampler": PerRank(sampler)}
            trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, "ckpt"))

    .. versionadded:: 0.1.0
    """

    def __init__(self, obj: Any, recipient_rank: int = 0) -> None:
        super().__init__(obj, recipient_rank)
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise TypeError(f"{type(obj).__name__} has no `{method}` method: PerRank needs both")

    def snapshot(self) -> Any:
        return self.obj.state_dict()

    def assemble(self, snapshot: Any, group: Any, overlap: Overlap | None = None) -> dict[str, Any]:
        states = gather_to(snapshot, self.recipient_rank, group, overlap=overlap)
        return {} if states is None else {"by_rank": states}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's state at its own position; the other positions stay empty, for their ranks to write.

        A sharded load reads every rank's state on every rank: the rule for another world size needs them, and
        they are small (a few generator states a rank for :class:`~ignite_zero.RandomState`).
        """
        rank, world_size = rank_and_world()
        return {"by_rank": [self.obj.state_dict() if r == rank else {} for r in range(world_size)]}

    def check_entry(self, state_dict: Mapping[str, Any]) -> None:
        states = state_dict.get("by_rank") if isinstance(state_dict, Mapping) else None
        if not isinstance(states, list) or not states:
            raise ValueError(
                f"Expected the states of every rank of this {type(self.obj).__name__} ({{'by_rank': [...]}}), got "
                f"{type(state_dict).__name__}: was it saved without PerRank (or RandomState)?"
            )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.check_entry(state_dict)
        states = state_dict["by_rank"]
        rank, world_size = rank_and_world()
        if len(states) == world_size:
            self.obj.load_state_dict(states[rank])
            return
        rule = getattr(self.obj, "load_state_dict_of_ranks", None)
        warnings.warn(
            f"The state of this {type(self.obj).__name__} was saved on {len(states)} ranks and is loaded on "
            f"{world_size}: "
            + (
                "each rank is given a state derived from the saved ones."
                if callable(rule)
                else f"rank {rank} takes the state of saved rank {rank % len(states)}."
            ),
            stacklevel=2,
        )
        if callable(rule):
            rule(states, rank)
        else:
            self.obj.load_state_dict(states[rank % len(states)])
