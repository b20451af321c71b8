"""Checkpoints on object storage: one file a checkpoint, and sharded checkpoints, under one S3 URL.

The store, its endpoint and its keys come from the environment, as for any AWS client (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, or ``~/.aws``); the bucket must exist. Needs the ``s3`` extra
(``pip install -e ".[s3]"``).

On CPU (gloo, 2 processes), against an S3-compatible store such as MinIO:

    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python examples/object_storage.py s3://bucket/run

On GPUs, one process per GPU (NCCL):

    python examples/object_storage.py s3://bucket/run --backend nccl --nproc-per-node 8

Each mode trains a ZeRO model for ``--epochs`` and saves each epoch under ``URL/consolidated`` (one file, written
by rank 0 in one upload) or ``URL/sharded`` (a directory, every rank uploading its part). Then a fresh model and
optimizer load the newest checkpoint of each from the store, every rank reading with ranged requests only what
it holds, and are compared with the trained ones.
"""

from __future__ import annotations

import argparse
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Events, create_supervised_trainer
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import TensorDataset

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver, find_latest


def build(seed: int) -> tuple[nn.Module, ZeroRedundancyOptimizer]:
    torch.manual_seed(seed)
    model = idist.auto_model(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
        for k in a
    )


def run_mode(mode: str, url: str, epochs: int) -> None:
    model, optimizer = build(seed=0)
    inputs = torch.randn(128, 16, generator=torch.Generator().manual_seed(4))
    loader = idist.auto_dataloader(TensorDataset(inputs, inputs.sum(1, keepdim=True)), batch_size=16)
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss(), device=idist.device())
    # ignite_zero: a URL wherever a path is taken; each mode commits a checkpoint without a rename
    saver = DiskSaver(url, require_empty=False) if mode == "consolidated" else ShardedSaver(url, require_empty=False)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint({"model": model, "optimizer": optimizer}, saver))
    trainer.run(loader, max_epochs=epochs)

    latest = find_latest(url)  # the newest checkpoint that verifies; the same answer on every rank
    fresh_model, fresh_optimizer = build(seed=1)
    Checkpoint.load_objects({"model": fresh_model, "optimizer": fresh_optimizer}, latest)
    restored = same(fresh_model.state_dict(), model.state_dict()) and same(
        fresh_optimizer.optim.state_dict()["state"],
        optimizer.optim.state_dict()["state"],  # this rank's partition
    )
    if idist.get_rank() == 0:
        print(f"[{idist.get_world_size()} ranks] {mode}: saved and loaded {latest}; state restored: {restored}")
    if not restored:
        raise RuntimeError(f"the state loaded from {latest} differs from the saved one")


def train(local_rank: int, config: dict[str, Any]) -> None:
    for mode in ("consolidated", "sharded"):
        run_mode(mode, f"{config['url'].rstrip('/')}/{mode}", config["epochs"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="where the checkpoints go: s3://bucket/prefix")
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPUs)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="processes to start")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--start-method", default="spawn", help="how idist.Parallel starts processes")
    parser.add_argument("--master-port", type=int, help="a free port for the ranks to meet at (default: ignite's 2222)")
    args = parser.parse_args(argv)
    spawn = {"nproc_per_node": args.nproc_per_node, "master_port": args.master_port, "start_method": args.start_method}
    with idist.Parallel(backend=args.backend, **spawn) as p:
        p.run(train, {"url": args.url, "epochs": args.epochs})


if __name__ == "__main__":
    main()
