"""A short training run with dropout over a real data loader, stopped mid-epoch and resumed: what the resume tests
compare with an uninterrupted run."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from training import assert_state_equal

from ignite_zero import Checkpoint, DiskSaver, PerRank, RandomState, ResumableDistributedSampler, SaveOnSignal

DATA_SIZE, BATCH_SIZE = 60, 3  # on 2 ranks: 10 iterations an epoch
EPOCHS = 2


def samples(size: int = DATA_SIZE) -> TensorDataset:
    """Inputs, and each sample's index as its target, to tell which samples a batch held."""
    return TensorDataset(torch.randn(size, 7, generator=torch.Generator().manual_seed(1)), torch.arange(size))


def train(
    rank: int,
    world_size: int,
    directory: Path,
    loader: str,
    workers: int = 0,
    stop_at: int | None = None,
    signal_at: int | None = None,
    until_data_ends: bool = False,
    data_size: int = DATA_SIZE,
    epoch_length: int | None = None,
) -> dict[str, Any]:
    """Resume from the newest checkpoint in ``directory`` if any, train to the end of epoch ``EPOCHS`` (of 5 with
    ``epoch_length``) saving every 5 iterations, and return the samples seen (one list a batch), the model's and
    optimizer's states.

    Args:
        loader: ``"resumable"``, a ``DataLoader`` over a ``ResumableDistributedSampler`` saved as it is;
            ``"stateful"``, torchdata's ``StatefulDataLoader`` over a ``DistributedSampler``, saved with ``PerRank``.
        workers: the data loader's ``num_workers``.
        stop_at: stop after the save of this iteration, as a crash after it would.
        signal_at: send SIGUSR1 to rank 1 at this iteration: ``SaveOnSignal`` saves and stops a little later.
        until_data_ends: stop when the data loader's iterator of the first epoch run here ends, not at ``EPOCHS``.
        data_size: the number of samples.
        epoch_length: the trainer's, if not the data loader's length.
    """
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(7, 16), nn.Dropout(0.5), nn.Linear(16, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    seen: list[list[int]] = []

    def step(_: Engine, batch: list[torch.Tensor]) -> float:
        inputs, indices = batch
        seen.append(indices.tolist())
        optimizer.zero_grad()
        loss = model(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.item()

    trainer = Engine(step)
    dataset = samples(data_size)
    data: Any
    if loader == "resumable":
        data = ResumableDistributedSampler(dataset, trainer, shuffle=True, seed=3)
        batches: Any = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=data, num_workers=workers)
    else:
        sampler = DistributedSampler(dataset, shuffle=True, seed=3)
        batches = StatefulDataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, num_workers=workers)
        data = PerRank(batches)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "data": data, "rng": RandomState(trainer)}
    checkpoint = Checkpoint(to_save, DiskSaver(directory, require_empty=False), n_saved=2)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=5), checkpoint)
    stop = SaveOnSignal(checkpoint, signals=(signal.SIGUSR1,))
    stop.attach(trainer)
    if stop_at is not None:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), Engine.terminate)
    if signal_at is not None and rank == 1:
        trainer.add_event_handler(
            Events.ITERATION_COMPLETED(once=signal_at), lambda: os.kill(os.getpid(), signal.SIGUSR1)
        )
    if until_data_ends:
        trainer.add_event_handler(Events.DATALOADER_STOP_ITERATION, Engine.terminate)
    checkpoint.load_latest(to_save)
    epochs = 10 * EPOCHS if until_data_ends else EPOCHS if epoch_length is None else 5
    trainer.run(batches, max_epochs=epochs, epoch_length=epoch_length)
    return {
        "seen": seen,
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "stopped_at": stop.stopped_at,
        "iteration": trainer.state.iteration,
    }


def assert_resumed_as_uninterrupted(stopped: list[dict], resumed: list[dict], uninterrupted: list[dict]) -> None:
    """Each rank saw the batches of the uninterrupted run, in order, and ended with its model and optimizer states,
    bitwise."""
    for rank, whole in enumerate(uninterrupted):
        assert stopped[rank]["seen"] + resumed[rank]["seen"] == whole["seen"], f"rank {rank}"
        assert_state_equal(resumed[rank]["model"], whole["model"])
        assert_state_equal(resumed[rank]["optimizer"], whole["optimizer"])
