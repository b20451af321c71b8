"""The training script of ``train.sbatch``: one task a rank, started by ``srun``; saves and stops on SIGUSR1.

``idist.Parallel`` takes the ranks and the rendezvous from SLURM's environment (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``; the port from ``SLURM_JOB_ID``, or ``MASTER_PORT`` with the other
torch variables). Every start resumes from the newest valid checkpoint in ``--output-dir``. When any task gets
SIGUSR1 (or SIGTERM), every rank saves at the same iteration, in the middle of an epoch as likely as not, and the
process exits with status 3, which ``train.sbatch`` answers with ``scontrol requeue``; the requeued job continues
at the next batch, as the uninterrupted run would have.

    srun python examples/slurm/train.py --backend nccl --output-dir /shared/ckpt     # what train.sbatch runs
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Events, create_supervised_trainer
from ignite.handlers import global_step_from_engine
from ignite.utils import manual_seed
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import TensorDataset

from ignite_zero import Checkpoint, DiskSaver, RandomState, ResumableDistributedSampler, SaveOnSignal

STOPPED = 3  # the exit status that train.sbatch requeues on


def train(local_rank: int, config: dict[str, Any]) -> None:
    rank = idist.get_rank()
    manual_seed(0)  # random, numpy and torch: an uninterrupted run and a resumed one start alike
    model = idist.auto_model(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    inputs = torch.randn(1024, 16, generator=torch.Generator().manual_seed(3))
    dataset = TensorDataset(inputs, inputs.sum(1, keepdim=True))
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss(), device=idist.device())
    # ignite_zero: the sampler saves where the trainer is in the epoch, so that a run stopped mid-epoch resumes at
    # the next batch, on any number of ranks; each epoch is shuffled anew, with no set_epoch handler.
    sampler = ResumableDistributedSampler(dataset, trainer, shuffle=True)
    loader = idist.auto_dataloader(dataset, batch_size=16, sampler=sampler)

    # ignite_zero: RandomState(trainer) keeps every rank's generators (dropout) and applies them again once the
    # resumed run has made its data iterator, so a resumed run goes on as an uninterrupted one would. Files are
    # named by iteration, both those of epochs and the one saved on a signal.
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "data": sampler, "rng": RandomState(trainer)}
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

    if config["log_batches"]:

        @trainer.on(Events.ITERATION_COMPLETED)
        def log_batch(engine: Any) -> None:
            digest = hashlib.sha1(engine.state.batch[0].numpy().tobytes()).hexdigest()[:16]
            print(f"rank {rank} iteration {engine.state.iteration}: batch {digest}", flush=True)

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
    parser.add_argument("--log-batches", action="store_true", help="print a digest of each batch a rank trains on")
    args = parser.parse_args(argv)
    config: dict[str, Any] = {
        "epochs": args.epochs,
        "output_dir": args.output_dir,
        "log_batches": args.log_batches,
        "stopped": False,
    }
    with idist.Parallel(backend=args.backend) as parallel:  # this process is one task: nothing is spawned
        parallel.run(train, config)
    return STOPPED if config["stopped"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
