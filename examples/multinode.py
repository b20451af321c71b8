"""Train on several hosts with sharded checkpoints: every rank writes its own part, and every run resumes.

A sharded checkpoint is one directory that every rank writes into, so ``--output-dir`` must be shared by every
host: a shared file system (NFS, Lustre...) or an object store (``s3://bucket/run``). The model is HSDP: FSDP2
sharded within a host and replicated across hosts (a device mesh of ``nnodes x nproc-per-node``).

On two hosts, with ignite's launcher (``idist.Parallel(nnodes=..., node_rank=...)``), one command on each host;
``--master-addr`` is host 0's address:

    python examples/multinode.py --nnodes 2 --node-rank 0 --nproc-per-node 8 --backend nccl \
        --master-addr host0 --master-port 29500 --output-dir /shared/ckpt        # on host 0
    python examples/multinode.py --nnodes 2 --node-rank 1 --nproc-per-node 8 --backend nccl \
        --master-addr host0 --master-port 29500 --output-dir /shared/ckpt        # on host 1

or with torchrun, which starts the processes itself (``--nproc-per-node 0`` here):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr host0 --master-port 29500 \
        examples/multinode.py --nproc-per-node 0 --backend nccl --output-dir /shared/ckpt     # and node-rank 1

On one machine with CPUs, two "hosts" of one process each over gloo: run the first command with
``--node-rank 0`` and ``--node-rank 1`` in two shells, ``--nproc-per-node 1 --master-addr 127.0.0.1``.

Each run resumes from the newest sealed checkpoint in ``--output-dir`` (``load_latest``), on any number of hosts
and ranks.
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Events, create_supervised_trainer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

from ignite_zero import Checkpoint, ShardedSaver


def build_model(nnodes: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(idist.device())
    # HSDP: replicated across hosts, sharded within each; the gradients' reduce-scatter stays on a host's links
    mesh = init_device_mesh(
        idist.device().type, (nnodes, idist.get_world_size() // nnodes), mesh_dim_names=("replicate", "shard")
    )
    return fully_shard(model, mesh=mesh)


def train(local_rank: int, config: dict[str, Any]) -> None:
    rank, world_size = idist.get_rank(), idist.get_world_size()
    model = build_model(idist.get_nnodes())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = torch.randn(256, 16, generator=torch.Generator().manual_seed(2))
    loader = idist.auto_dataloader(TensorDataset(inputs, inputs.mean(1, keepdim=True)), batch_size=64)
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss(), device=idist.device())

    # ignite_zero: every rank writes its own shards into one directory, which every host must share; the
    # recipient (rank 0) seals it with a manifest once every rank's files are there.
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    checkpoint = Checkpoint(to_save, ShardedSaver(config["output_dir"], require_empty=False), n_saved=2)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)  # on every rank of every host

    @trainer.on(Events.EPOCH_COMPLETED)
    def report(engine: Any) -> None:
        if rank == 0:
            print(f"[{world_size} ranks] epoch {engine.state.epoch}: saved {checkpoint.last_checkpoint}", flush=True)

    found = checkpoint.load_latest(to_save)  # every rank reads only its own shards
    print(f"[rank {rank} on {socket.gethostname()}] " + (f"resumed from {found}" if found else "no checkpoint yet"))
    if trainer.state.epoch < config["epochs"]:
        trainer.run(loader, max_epochs=config["epochs"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPUs)")
    parser.add_argument("--nnodes", type=int, default=1, help="hosts")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's number, 0 to nnodes - 1")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes a host (0: torchrun started them)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="host 0's address")
    parser.add_argument("--master-port", type=int, default=29500, help="a free port on host 0")
    parser.add_argument("--epochs", type=int, default=2, help="train up to this epoch")
    parser.add_argument("--output-dir", required=True, help="checkpoint directory that every host shares, or a URL")
    parser.add_argument("--start-method", default="spawn", help="how idist.Parallel starts processes")
    args = parser.parse_args(argv)
    config = {"epochs": args.epochs, "output_dir": args.output_dir}
    if args.nproc_per_node == 0:  # processes started by torchrun, which set the rendezvous in their environment
        with idist.Parallel(backend=args.backend) as parallel:
            parallel.run(train, config)
        return
    with idist.Parallel(
        backend=args.backend,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        nproc_per_node=args.nproc_per_node,
        master_addr=args.master_addr,
        master_port=args.master_port,
        start_method=args.start_method,
    ) as parallel:
        parallel.run(train, config)


if __name__ == "__main__":
    main()
