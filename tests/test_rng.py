"""RandomState bound to the trainer: a run resumed mid-epoch draws the numbers of the uninterrupted run, whatever
its new data iterator draws when it is made."""

import pytest
import torch
from ignite.engine import Engine, Events
from launcher import run_ranks
from resuming import assert_resumed_as_uninterrupted, train
from torch.utils.data import DataLoader

from ignite_zero import RandomState


@pytest.mark.distributed
@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_resumed_mid_epoch_with_a_stateful_dataloader_goes_on_bitwise_as_the_uninterrupted_one(tmp_path, workers):
    """torchdata's StatefulDataLoader saved with PerRank, dropout in the model: the iterator made at the resume
    draws a base seed from torch's generator, which the uninterrupted run drew before the save."""
    daemon = workers == 0
    uninterrupted = run_ranks(train, 2, tmp_path / "whole", "stateful", workers, daemon=daemon)
    stopped = run_ranks(train, 2, tmp_path / "stopped", "stateful", workers, 15, daemon=daemon)
    resumed = run_ranks(train, 2, tmp_path / "stopped", "stateful", workers, daemon=daemon)
    assert_resumed_as_uninterrupted(stopped, resumed, uninterrupted)


def _draws(stop_at: int | None, saved: dict, with_handler: bool, epoch_length: int = 10) -> list[float]:
    """One process, a DataLoader of 10 batches, 20 iterations in epochs of ``epoch_length``; each step, and with
    ``with_handler`` a handler of ``GET_BATCH_STARTED`` added before the load, draw from torch's generator. With
    ``stop_at``, the trainer's and the generators' states are put in ``saved`` at that iteration and the run stops;
    else the run resumes from ``saved`` if it holds anything."""
    torch.manual_seed(1)
    draws: list[float] = []
    trainer = Engine(lambda *_: draws.append(torch.rand(1).item()))
    if with_handler:
        trainer.add_event_handler(Events.GET_BATCH_STARTED, lambda: draws.append(torch.rand(1).item()))
    generators = RandomState(trainer)
    if stop_at is not None:

        @trainer.on(Events.ITERATION_COMPLETED(once=stop_at))
        def save_and_stop(engine: Engine) -> None:
            saved.update(trainer=engine.state_dict(), rng=generators.state_dict())
            engine.terminate()

    elif saved:
        trainer.load_state_dict(saved["trainer"])
        generators.load_state_dict(saved["rng"])
    trainer.run(DataLoader(range(20), batch_size=2), max_epochs=20 // epoch_length, epoch_length=epoch_length)
    return draws


@pytest.mark.parametrize(
    ("stop_at", "with_handler", "epoch_length"),
    [(15, True, 10), (15, False, 10), (10, False, 10), (15, False, 5), (10, False, 20)],
)
def test_the_draws_after_a_resume_are_those_of_the_uninterrupted_run(stop_at, with_handler, epoch_length):
    """Mid-epoch (15), with or without a handler of GET_BATCH_STARTED that draws (it runs after the state is applied
    again), and at an epoch's end (10), where the data iterator is made at the same point as in the uninterrupted
    run and the state is not applied again. What counts is the data iterator's end, not the epoch's: at the end of
    an epoch of 5 the iterator of 10 batches is in its middle, and in the middle of an epoch of 20 it ends."""
    uninterrupted = _draws(None, {}, with_handler, epoch_length)
    saved: dict = {}
    stopped = _draws(stop_at, saved, with_handler, epoch_length)
    assert stopped + _draws(None, saved, with_handler, epoch_length) == uninterrupted
