"""The training script of ``train.sbatch``: one task a rank, started by ``srun``; saves and stops on SIGUSR1.

``idist.Parallel`` takes the ranks and the rendezvous from SLURM's environment (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``; the port from ``SLURM_JOB_ID``, or ``MASTER_PORT`` with the other
torch variables). Every start resumes from the newest valid checkpoint in ``--output-dir``. When any task gets
SIGUSR1 (or SIGTERM), every rank saves at the same iteration and the process exits with status 3, which
``train.sbatch`` answers with ``scontrol requeue``.

    srun python examples/slurm/train.py --backend nccl --output-dir /shared/ckpt     # what train.sbatch runs
"""

from __future__ import annotations

import argparse
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Events, create_supervised_trainer
from ignite.handlers import global_step_from_engine
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import TensorDataset

from ignite_zero import Checkpoint, DiskSaver, RandomState, SaveOnSignal

STOPPED = 3  # the exit status that train.sbatch requeues on


def train(local_rank: int, config: dict[str, Any]) -> None:
    rank = idist.get_rank()
    torch.manual_seed(0)
    model = idist.auto_model(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    inputs = torch.randn(1024, 16, generator=torch.Generator().manual_seed(3))
    loader = idist.auto_dataloader(TensorDataset(inputs, inputs.sum(1, keepdim=True)), batch_size=16, shuffle=True)
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss(), device=idist.device())

    # ignite_zero: RandomState keeps every rank's generators (dropout, shuffling), so a resumed run goes on as an
    # uninterrupted one would. Files are named by iteration, both those of epochs and the one saved on a signal.
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "rng": RandomState()}
    checkpoint = Checkpoint(
        to_save,
        DiskSaver(config["output_dir"], require_empty=False),
        n_saved=2,
        global_step_transform=global_step_from_engine(trainer, Events.ITERATION_COMPLETED),
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    stop = SaveOnSignal(checkpoint)  # SIGTERM and SIGUSR1; on every rank, in the main thread
    stop.attach(trainer)

    @trainer.on(Events.EPOCH_COMPLETED)
    def report(engine: Any) -> None:
        if rank == 0:
            print(f"epoch {engine.state.epoch}: loss {engine.state.output:.4f}", flush=True)

    found = checkpoint.load_latest(to_save)
    if rank == 0:
        print(f"resumed from {found} at iteration {trainer.state.iteration}" if found else "no checkpoint yet")
    if trainer.state.epoch < config["epochs"]:
        trainer.run(loader, max_epochs=config["epochs"])
    if stop.stopped_at is not None:
        if rank == 0:
            print(
                f"stopped by a signal: saved {checkpoint.last_checkpoint} at iteration {stop.stopped_at}, "
                f"epoch {trainer.state.epoch}"
            )
        config["stopped"] = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl", help="nccl (GPUs) or gloo (CPU)")
    parser.add_argument("--epochs", type=int, default=100, help="train up to this epoch")
    parser.add_argument("--output-dir", required=True, help="checkpoint directory that every node sees, or a URL")
    args = parser.parse_args(argv)
    config: dict[str, Any] = {"epochs": args.epochs, "output_dir": args.output_dir, "stopped": False}
    with idist.Parallel(backend=args.backend) as parallel:  # this process is one task: nothing is spawned
        parallel.run(train, config)
    return STOPPED if config["stopped"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
