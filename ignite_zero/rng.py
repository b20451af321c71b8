"""This process's random generators as a state: Python's, numpy's, torch's on the CPU and on every CUDA device."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from ignite.engine import Engine, Events

from ignite_zero._compat import add_first_event_handler

__all__ = ["RandomState"]


class RandomState:
    """The random generators of this process, to put in ``to_save``: resumed runs then draw the same numbers
    (dropout masks, augmentations, shuffles) as an uninterrupted run.

    :class:`~ignite_zero.Checkpoint` saves every rank's generators (it wraps this object in
    :class:`~ignite_zero.PerRank`), and on loading at the same world size each rank gets its own back. At another
    world size each rank is seeded from a digest of every saved state and its rank, the same way on every run, with
    a warning: the numbers then differ from an uninterrupted run, but stay distinct between ranks and reproducible.

    Bound to the trainer, ``RandomState(trainer)``, a run resumed in the middle of an epoch draws exactly the
    numbers of the uninterrupted run: the loaded state is applied again at the trainer's first
    ``Events.GET_BATCH_STARTED`` after the load, before that event's other handlers. A resumed ignite run makes its
    data iterator right after ``Events.EPOCH_STARTED``, and a ``DataLoader``'s iterator draws its base seed from torch's
    generator when it is made; the uninterrupted run made that iterator before the state was saved, so without the
    second application every number after the resume would be shifted. A run resumed where a data iterator of the
    uninterrupted run ended (each ``len(loader)`` iterations, whatever ``epoch_length`` is) makes its iterator at the
    same point as the uninterrupted run, and the state is not applied again.

    Covered: ``random``, ``numpy.random`` (the legacy global generator), torch's CPU generator, and the generator of
    every CUDA device once CUDA is initialised. Generators a program creates itself (``torch.Generator()``,
    ``numpy.random.default_rng()``) are its own to save.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, RandomState

            to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "rng": RandomState(trainer)}
            trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, "ckpt"))

    Args:
        trainer: the engine whose run is resumed, to apply the loaded state again at its first batch; ``None``
            (the default) applies it once, when loaded.

    .. versionadded:: 0.1.0
    """

    def __init__(self, trainer: Engine | None = None) -> None:
        if trainer is not None and not isinstance(trainer, Engine):
            raise TypeError(f"Argument `trainer` should be an ignite Engine or None, got {type(trainer).__name__}")
        self.trainer = trainer
        self._loaded: dict[str, Any] | None = None  # applied again at the trainer's first batch after a load

    def state_dict(self) -> dict[str, Any]:
        """The generators' states, in types that load with ``torch.load(..., weights_only=True)``."""
        kind, key, position, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {
                "kind": kind,
                "key": torch.from_numpy(key.astype(np.int64)),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._apply(state)
        self._apply_again_at_first_batch()

    def _apply(self, state: Mapping[str, Any]) -> None:
        random.setstate(_as_tuples(state["python"]))
        saved = state["numpy"]
        key = saved["key"].numpy().astype(np.uint32)
        np.random.set_state((saved["kind"], key, saved["position"], saved["has_gauss"], saved["gauss"]))
        torch.set_rng_state(state["torch"])
        cuda = state.get("cuda")
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])

    def load_state_dict_of_ranks(self, states: Sequence[Mapping[str, Any]], rank: int) -> None:
        """Seed every generator from a digest of the states of all saved ranks and ``rank``: the rule at another
        world size (see :class:`~ignite_zero.PerRank`)."""
        digest = hashlib.sha256(str(rank).encode())
        for state in states:
            digest.update(state["torch"].numpy().tobytes())
        seed = int.from_bytes(digest.digest()[:8], "little")
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed % 2**63)  # CUDA devices too
        self._apply_again_at_first_batch()

    def _apply_again_at_first_batch(self) -> None:
        if self.trainer is None:
            return
        self._loaded = self.state_dict()
        if not self.trainer.has_event_handler(self._at_first_batch, Events.GET_BATCH_STARTED):
            add_first_event_handler(self.trainer, Events.GET_BATCH_STARTED, self._at_first_batch)

    def _at_first_batch(self, engine: Engine) -> None:
        engine.remove_event_handler(self._at_first_batch, Events.GET_BATCH_STARTED)
        loaded, self._loaded = self._loaded, None
        if loaded is not None and engine.state.iteration % _iterator_length(engine):
            self._apply(loaded)


def _iterator_length(engine: Engine) -> int:
    """How many batches each data iterator of ``engine`` gives: ignite makes the next one when the last one ends,
    whatever the epoch length, so an uninterrupted run made its iterators at the multiples of this."""
    try:
        return len(engine.state.dataloader)  # type: ignore[arg-type]
    except TypeError:  # data without a length: an epoch's end is the only place an iterator is known to end
        return engine.state.epoch_length or 1


def _as_tuples(value: Any) -> Any:
    """``random.getstate()``'s nested tuples, which a round through a sharded checkpoint may turn into lists."""
    return tuple(_as_tuples(item) for item in value) if isinstance(value, (list, tuple)) else value
