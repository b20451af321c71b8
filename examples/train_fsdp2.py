"""Train an FSDP2 model (``fully_shard``) with ignite, resume from the newest checkpoint, export the weights.

On CPU (default: gloo, 2 processes):

    python examples/train_fsdp2.py --output-dir ckpt --epochs 2
    python examples/train_fsdp2.py --output-dir ckpt --epochs 4      # resumes at epoch 2

On GPUs, one process per GPU (NCCL):

    python examples/train_fsdp2.py --backend nccl --nproc-per-node 8 --output-dir /shared/ckpt

or launched by torchrun, which starts the processes itself (``--nproc-per-node 0`` here):

    torchrun --nproc-per-node 8 examples/train_fsdp2.py --backend nccl --nproc-per-node 0 --output-dir ckpt

Every run starts from the newest checkpoint in ``--output-dir`` that verifies (``load_latest``), so a run that
was stopped, or crashed under ``torchrun --max-restarts``, goes on where it was. At the end, rank 0 writes the
model's weights of the last checkpoint as safetensors (``model.safetensors``) under ``--export-dir``, as
``ignite-zero export`` does, for serving.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

from ignite_zero import Checkpoint, DiskSaver, export


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    model.to(idist.device())
    mesh = init_device_mesh(idist.device().type, (idist.get_world_size(),))
    # each Linear a unit of its own, then the root: a rank holds 1/world_size of every parameter and of its state
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(local_rank: int, config: dict[str, Any]) -> None:
    rank, world_size = idist.get_rank(), idist.get_world_size()
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randn(512, 32, generator=torch.Generator().manual_seed(1))
    loader = idist.auto_dataloader(TensorDataset(inputs, inputs.sum(1, keepdim=True)), batch_size=32, shuffle=True)
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss(), device=idist.device())

    # ignite_zero: the FSDP2 model and its optimizer as they are; the file holds the unsharded state.
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    checkpoint = Checkpoint(to_save, DiskSaver(config["output_dir"], require_empty=False), n_saved=2, include_self=True)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)  # on every rank

    @trainer.on(Events.EPOCH_COMPLETED)
    def report(engine: Any) -> None:
        if rank == 0:
            print(
                f"[{world_size} ranks] epoch {engine.state.epoch}: loss {engine.state.output:.4f}, saved "
                f"{checkpoint.last_checkpoint}"
            )

    # ignite_zero: on every rank; a fresh run and a restarted one run the same code
    found = checkpoint.load_latest(to_save)
    if rank == 0:
        print(
            f"[{world_size} ranks] "
            + (f"resumed from {found} at epoch {trainer.state.epoch}" if found else "no checkpoint yet")
        )
    if trainer.state.epoch < config["epochs"]:
        trainer.run(loader, max_epochs=config["epochs"])

    if rank == 0 and checkpoint.last_checkpoint is not None:
        source = Path(str(checkpoint.last_checkpoint))
        target = Path(config["export_dir"]) / source.stem
        if target.exists():
            print(f"{target} exists: already exported")
        else:
            files = export(source, target)  # verifies the checkpoint first; one tensor in memory at a time
            print(f"exported {source.name} to {', '.join(str(path) for path in files)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPUs)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="processes to start (0: torchrun started them)")
    parser.add_argument("--epochs", type=int, default=2, help="train up to this epoch")
    parser.add_argument("--output-dir", default=None, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--export-dir", default=None, help="where the safetensors go (default: OUTPUT_DIR-export)")
    parser.add_argument("--start-method", default="spawn", help="how idist.Parallel starts processes")
    parser.add_argument("--master-port", type=int, help="a free port for the ranks to meet at (default: ignite's 2222)")
    args = parser.parse_args(argv)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="ignite_zero-fsdp2-")
    config = {"epochs": args.epochs, "output_dir": output_dir, "export_dir": args.export_dir or f"{output_dir}-export"}
    if args.nproc_per_node == 0:  # processes started by torchrun
        with idist.Parallel(backend=args.backend) as parallel:
            parallel.run(train, config)
        return
    spawn = {"nproc_per_node": args.nproc_per_node, "master_port": args.master_port, "start_method": args.start_method}
    with idist.Parallel(backend=args.backend, **spawn) as p:
        p.run(train, config)


if __name__ == "__main__":
    main()
