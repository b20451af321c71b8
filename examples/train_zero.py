"""Train with ZeroRedundancyOptimizer, checkpoint with ignite_zero, resume on a different number of processes.

On CPU (default: gloo, 2 processes, then resumed on 3):

    python examples/train_zero.py

On GPUs, one process per GPU:

    python examples/train_zero.py --backend nccl --nproc-per-node 4 --resume-nproc-per-node 2

or launched by torchrun (each phase is one launch; ``--phase`` picks it):

    torchrun --nproc-per-node 4 examples/train_zero.py --backend nccl --phase train
    torchrun --nproc-per-node 2 examples/train_zero.py --backend nccl --phase resume

``--resume auto`` makes training start from the newest valid checkpoint in ``--output-dir``, if there is one:
under ``torchrun --max-restarts 3``, a run that crashed or was preempted then resumes with no other code.

    torchrun --nproc-per-node 4 --max-restarts 3 examples/train_zero.py --phase train --resume auto \
        --output-dir /shared/ckpt
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Events, create_supervised_trainer
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import TensorDataset

from ignite_zero import Checkpoint, DiskSaver


def build(config: dict[str, Any]) -> tuple[nn.Module, ZeroRedundancyOptimizer, Any, Any]:
    """Model, sharded optimizer, trainer and data loader; the same on every rank and every world size."""
    torch.manual_seed(0)
    model = idist.auto_model(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    )
    # ignite_zero: every rank keeps the Adam state of its own share of the parameters only.
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(512, 32, generator=generator)
    dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    loader = idist.auto_dataloader(dataset, batch_size=32, shuffle=True)
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss(), device=idist.device())
    return model, optimizer, trainer, loader


def attach_checkpoint(to_save: dict[str, Any], trainer: Any, config: dict[str, Any]) -> Checkpoint:
    # ignite_zero: attached on every rank; rank 0 receives the consolidated optimizer state and writes the file.
    # include_self keeps the list of saved files in the checkpoint, so that a resumed run goes on removing them.
    checkpoint = Checkpoint(
        to_save,
        DiskSaver(config["output_dir"], require_empty=False),
        n_saved=2,
        include_self=True,
        consolidate_recipient_rank=0,
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)

    @trainer.on(Events.EPOCH_COMPLETED)
    def report(engine: Any) -> None:
        if idist.get_rank() == 0:
            print(
                f"[{idist.get_world_size()} ranks] epoch {engine.state.epoch}: loss {engine.state.output:.4f}, "
                f"saved {checkpoint.last_checkpoint}"
            )

    return checkpoint


def train(local_rank: int, config: dict[str, Any]) -> None:
    model, optimizer, trainer, loader = build(config)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    checkpoint = attach_checkpoint(to_save, trainer, config)
    if config["resume"] == "auto":
        # ignite_zero: on every rank; the newest checkpoint that verifies, and the handler's retention with it
        found = checkpoint.load_latest(to_save)
        if idist.get_rank() == 0:
            print(f"[{idist.get_world_size()} ranks] " + (f"resumed from {found}" if found else "no checkpoint yet"))
        if trainer.state.epoch >= config["epochs"]:
            return  # already trained: Engine.run would start over
    trainer.run(loader, max_epochs=config["epochs"])


def resume(local_rank: int, config: dict[str, Any]) -> None:
    model, optimizer, trainer, loader = build(config)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    checkpoint = attach_checkpoint(to_save, trainer, config)
    # ignite_zero: called on every rank; each takes its own share of the optimizer state, on any world size.
    found = checkpoint.load_latest(to_save)
    if found is None:
        raise RuntimeError(f"no valid checkpoint in {config['output_dir']} to resume from")
    path = Path(found)

    saved = torch.load(path, weights_only=True)["optimizer"]
    optimizer.consolidate_state_dict(to=0)
    if idist.get_rank() == 0:
        restored = optimizer.state_dict()
        matches = restored["state"].keys() == saved["state"].keys() and all(
            torch.equal(restored["state"][i][name].cpu(), saved["state"][i][name])
            for i in saved["state"]
            for name in saved["state"][i]
        )
        print(
            f"[{idist.get_world_size()} ranks] restored {path.name}: epoch {trainer.state.epoch}, iteration "
            f"{trainer.state.iteration}; optimizer state of {len(saved['state'])} parameters matches: {matches}"
        )
        if not matches:
            raise RuntimeError("the restored optimizer state differs from the checkpoint")
    trainer.run(loader, max_epochs=trainer.state.epoch + 1)
    if idist.get_rank() == 0:
        print(f"[{idist.get_world_size()} ranks] trained on to epoch {trainer.state.epoch}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPUs)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="processes for training")
    parser.add_argument("--resume-nproc-per-node", type=int, default=3, help="processes for resuming (0: train only)")
    parser.add_argument(
        "--resume", choices=["auto", "never"], default="never", help="auto: train on from the newest checkpoint"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--output-dir", default=None, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--phase", choices=["train", "resume"], help="run one phase in an existing launch (torchrun)")
    parser.add_argument("--start-method", default="spawn", help="how idist.Parallel starts processes")
    parser.add_argument("--master-port", type=int, help="a free port for the ranks to meet at (default: ignite's 2222)")
    args = parser.parse_args(argv)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="ignite_zero-example-")
    config = {"epochs": args.epochs, "output_dir": output_dir, "resume": args.resume}

    if args.phase is not None:  # processes started by torchrun
        with idist.Parallel(backend=args.backend) as parallel:
            parallel.run(train if args.phase == "train" else resume, config)
        return
    spawn = {"master_port": args.master_port, "start_method": args.start_method}
    with idist.Parallel(backend=args.backend, nproc_per_node=args.nproc_per_node, **spawn) as p:
        p.run(train, config)
    if args.resume_nproc_per_node == 0:
        return
    with idist.Parallel(backend=args.backend, nproc_per_node=args.resume_nproc_per_node, **spawn) as parallel:
        parallel.run(resume, config)


if __name__ == "__main__":
    main()
