"""Host memory of FSDP checkpoints, per rank: ignite_zero's adapters against ignite 0.5.5's ``Checkpoint``.

    python benchmarks/memory.py                    # every kind, 29.7M parameters in 8 units
    python benchmarks/memory.py --kinds fsdp2 hsdp

Each kind shards the same model (8 blocks of 3.7M parameters, one FSDP unit each, plus a small root unit),
trains two Adam steps on gloo ranks (CPU), then saves and loads ``{"model", "optimizer"}`` both ways. FSDP1 and
FSDP2 run on 2 ranks; ``hsdp`` (FSDP2 on a 2 x 2 mesh, ``(Replicate(), Shard(0))``) and ``tp`` (FSDP2 over tensor
parallelism on a 2 x 2 mesh: the blocks' layers alternately column- and row-wise parallel, ``(_StridedShard(0),
Shard(0))`` and ``(Shard(0), Shard(1))``) on 4:

- ``ignite_zero``: ``FSDPModelState`` and ``FSDPOptimizerState`` gather the full state on rank 1, which writes it
  with ``ignite_zero.DiskSaver``; loading reads the file with ``torch.load(mmap=True)`` on every rank and each
  rank copies its own part;
- ``ignite_zero s3``: the same file on object storage (moto's S3 server on 127.0.0.1), loaded with
  ``ignite_zero.Checkpoint.load_objects``: each rank reads the file's structure, then its elements of each tensor as
  it copies them in; the table also gives the most any rank downloaded;
- ``ignite``: ``ignite.handlers.Checkpoint(save_on_rank=0)``: every rank calls ``model.state_dict()`` and
  ``optimizer.state_dict()``, rank 0 writes; ``Checkpoint.load_objects`` loads the file on every rank. (Its files
  are not even right: the optimizer entry is rank 0's shard, and with FSDP2 the model entry too.)

Loads go into the trained model and optimizer, which already hold their state, so any growth is transient.
Growth is the peak during the operation minus the value just before it, sampled every 5 ms by a background
thread (see ``_common.measure``): the resident set for saves; for loads its anonymous part (RssAnon), because
an ``mmap``'d file's pages are shared page cache, not a rank's own memory. The process re-executes itself
with ``MALLOC_MMAP_THRESHOLD_`` set (and every rank sets glibc's thresholds with ``mallopt``), so that freed
tensors go back to the system instead of hiding later growth.

The bounds on a rank's memory: a rank that is not the recipient grows by at most twice the largest
FSDP unit's state (parameters and Adam state) plus 16 MiB, during saves and loads; the recipient (the writing
rank for ignite) by at most 1.1 times the full state. ``--plot PATH`` also draws the seconds and each rank's growth
as a PNG chart.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import Measurement, launch, loopback_s3, measure, scratch_directory
from _plot import Panel, add_plot_option, write_chart
from ignite.engine import Engine
from ignite.handlers import Checkpoint as IgniteCheckpoint
from ignite.handlers import DiskSaver as IgniteDiskSaver
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ignite_zero import Checkpoint, DiskSaver
from ignite_zero.adapters.fsdp import FSDPModelState, FSDPOptimizerState

MiB = 2**20
WIDTH, BLOCKS, RECIPIENT, IGNITE_WRITER = 1920, 8, 1, 0
WORLD_SIZES = {"fsdp1": 2, "fsdp2": 2, "hsdp": 4, "tp": 4}
BUCKET = "ignite-zero-memory"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, WIDTH)
        self.blocks = nn.Sequential(*(_Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def _shard(model: nn.Module, kind: str) -> nn.Module:
    if kind == "fsdp1":
        policy = ModuleWrapPolicy({_Block})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    mesh = None
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    elif kind == "tp":
        tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh = tp_mesh["dp"]
        for index, block in enumerate(model.blocks):
            # replicated in and out, so that the blocks stay plain; half of them column-, half row-wise
            style = (
                ColwiseParallel(output_layouts=Replicate()) if index % 2 else RowwiseParallel(input_layouts=Replicate())
            )
            parallelize_module(block, tp_mesh["tp"], {"lin": style})
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# --------------------------------------------------------------------------------------------------
# The operations, on every rank


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _downloads() -> list[int]:
    """The sizes of every ranged GET this process makes from the store from now on."""
    import s3fs

    fetched: list[int] = []
    fetch = s3fs.core.S3File._fetch_range

    def counted(self: Any, start: int, end: int) -> bytes:
        data = fetch(self, start, end)
        fetched.append(len(data))
        return data

    s3fs.core.S3File._fetch_range = counted
    return fetched


def _rank(rank: int, world_size: int, kind: str, directory: Path, endpoint: str) -> dict[str, Any]:
    import s3fs

    warnings.simplefilter("ignore")  # torch's and ignite's FSDP deprecation warnings, once per tensor
    torch.manual_seed(0)
    model = _shard(_Net(), kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(2):
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    to_save = {"model": model, "optimizer": optimizer}
    ours = {"model": FSDPModelState(model, RECIPIENT), "optimizer": FSDPOptimizerState(model, optimizer, RECIPIENT)}
    saver = DiskSaver(directory, require_empty=False, save_on_rank=RECIPIENT)
    ignite_saver = IgniteDiskSaver(directory, require_empty=False, save_on_rank=IGNITE_WRITER)
    theirs = IgniteCheckpoint(to_save, ignite_saver, filename_prefix="ignite", save_on_rank=IGNITE_WRITER)
    engine = Engine(lambda e, b: None)
    engine.state.iteration = 1
    full_bytes = 0

    def save_ours() -> None:
        nonlocal full_bytes
        state = {name: adapter.state_dict() for name, adapter in ours.items()}
        full_bytes = max(full_bytes, _nbytes(state))
        saver(state, "ours.pt")

    def load_ours() -> None:
        checkpoint = torch.load(directory / "ours.pt", mmap=True, weights_only=True)
        for name, adapter in ours.items():
            adapter.load_state_dict(checkpoint[name])

    options = {"endpoint_url": endpoint}
    remote = f"s3://{BUCKET}/{kind}.pt"
    fetched = _downloads()

    def load_remote() -> None:
        if rank == RECIPIENT:  # untimed: the measurement starts from what the process holds after this
            s3fs.S3FileSystem(**options).put(str(directory / "ours.pt"), remote)
        dist.barrier()
        fetched.clear()
        gc.collect()
        with measure() as measurement:
            Checkpoint.load_objects(to_save, remote, storage_options=options)
        results[("load", "ignite_zero s3")] = measurement

    theirs_file = directory / "ignite_checkpoint_1.pt"

    def load_theirs() -> None:
        IgniteCheckpoint.load_objects(to_save, str(theirs_file))

    operations = {
        ("save", "ignite_zero"): save_ours,
        ("save", "ignite"): lambda: theirs(engine),
        ("load", "ignite_zero"): load_ours,
        ("load", "ignite_zero s3"): load_remote,
        ("load", "ignite"): load_theirs,
    }
    results: dict[tuple[str, str], Measurement | str] = {}
    for key, operation in operations.items():
        gc.collect()
        dist.barrier()
        try:
            if key[1] == "ignite_zero s3":
                operation()  # measures itself, after its upload
                continue
            with measure() as measurement:
                operation()
            results[key] = measurement
        except Exception as error:  # report what failed (ignite's load of FSDP2 DTensors could), carry on
            results[key] = f"{type(error).__name__}: {str(error).splitlines()[0][:60]}"
    dist.barrier()
    written = {"ignite_zero": directory / "ours.pt", "ignite": theirs_file}
    files = {path: file.stat().st_size for path, file in written.items()}
    return {"results": results, "full_bytes": full_bytes, "files": files, "downloaded": (sum(fetched), len(fetched))}


# --------------------------------------------------------------------------------------------------
# Report


def _unit_state_bytes() -> int:
    """Parameters and Adam's two moments (fp32) of the largest FSDP unit: a block, or the root's own layers."""
    with torch.device("meta"):
        net = _Net()
    block = sum(p.numel() for p in net.blocks[0].parameters())
    root = sum(p.numel() for name, p in net.named_parameters() if not name.startswith("blocks."))
    return max(block, root) * 4 * 3


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}" if theirs >= MiB else "-"


def _measured(ranks: list[dict[str, Any]], op: str) -> tuple[dict[str, tuple[int, int, float]], list[str]]:
    """Each path's growth on the recipient (the writer for ignite) and on the worst other rank, and its slowest
    rank's seconds; and the lines of the paths that failed."""
    measured: dict[str, tuple[int, int, float]] = {}
    failed = []
    paths = [("ignite_zero", RECIPIENT), ("ignite", IGNITE_WRITER)]
    if op == "load":
        paths.insert(1, ("ignite_zero s3", RECIPIENT))
    for path, writer in paths:
        cells = [ranks[writer]["results"][(op, path)]]
        cells += [rank["results"][(op, path)] for index, rank in enumerate(ranks) if index != writer]
        failures = [cell for cell in cells if isinstance(cell, str)]
        if failures:
            failed.append(f"{op:5} {path:12} failed: {failures[0]}")
            continue
        recipient, *others = (cell.growth if op == "save" else cell.anon_growth for cell in cells)
        measured[path] = (recipient, max(others), max(cell.seconds for cell in cells))
    return measured, failed


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    unit = _unit_state_bytes()
    other_bound = 2 * unit + 16 * MiB
    lines = [
        f"Recipient: rank {RECIPIENT} for ignite_zero, the writer (rank {IGNITE_WRITER}) for ignite; other: the "
        f"worst other rank. Growth in MiB: RSS for saves, RssAnon for loads. Bounds: other ranks 2 x "
        f"{unit / MiB:.0f} MiB (largest unit's parameters + Adam) + 16 MiB; recipient 1.1 x the full state on "
        "saves, the other ranks' bound on loads. Ratio: ignite_zero / ignite.",
        "",
        f"{'kind':6} {'op':5} {'path':12} {'file':>6} {'recipient':>10} {'bound':>6} {'other':>6} {'bound':>6} "
        f"{'met':>4} {'seconds':>8} {'ratio recipient':>16} {'ratio other':>12}",
    ]
    for kind, ranks in results.items():
        full = ranks[RECIPIENT]["full_bytes"]
        for op in ("save", "load"):
            measured, failed = _measured(ranks, op)
            lines += [f"{kind:6} {line}" for line in failed]
            for path, (recipient, other, seconds) in measured.items():
                recipient_bound = 1.1 * full if op == "save" else other_bound
                met = recipient <= recipient_bound and other <= other_bound
                file = f"{ranks[RECIPIENT if path == 'ignite_zero' else IGNITE_WRITER]['files'].get(path, 0) / MiB:.0f}"
                ratios = ("", "")
                if path == "ignite_zero" and "ignite" in measured:
                    ratios = (_ratio(recipient, measured["ignite"][0]), _ratio(other, measured["ignite"][1]))
                lines.append(
                    f"{kind:6} {op:5} {path:12} {file if op == 'save' else '':>6} {recipient / MiB:>+10.0f} "
                    f"{recipient_bound / MiB:>6.0f} {other / MiB:>+6.0f} {other_bound / MiB:>6.0f} "
                    f"{'yes' if met else 'NO':>4} {seconds:>8.2f} {ratios[0]:>16} {ratios[1]:>12}"
                )
        downloaded, requests = max(rank["downloaded"] for rank in ranks)
        lines.append(
            f"{kind:6} full state: {full / MiB:.0f} MiB (model + optimizer), {len(ranks)} ranks; a load from s3 "
            f"downloads at most {downloaded / ranks[RECIPIENT]['files']['ignite_zero']:.2f} x the file on a rank, "
            f"in {requests} requests"
        )
    return "\n".join(lines)


def _chart(results: dict[str, list[dict[str, Any]]]) -> list[Panel]:
    """Seconds of saves and loads, and memory per rank: the recipient's and the worst other rank's growth."""
    values: dict[str, dict[str, dict[str, float]]] = {name: {} for name in ("seconds", "recipient", "other")}
    for kind, ranks in results.items():
        for op in ("save", "load"):
            measured, _ = _measured(ranks, op)
            group = f"{kind} {op}"
            values["seconds"][group] = {path: seconds for path, (_, _, seconds) in measured.items()}
            values["recipient"][group] = {path: recipient / MiB for path, (recipient, _, _) in measured.items()}
            values["other"][group] = {path: other / MiB for path, (_, other, _) in measured.items()}
    return [
        Panel("seconds, slowest rank", "seconds (log scale)", values["seconds"], log=True),
        Panel("growth of the rank that writes (ignite_zero's recipient, ignite's writer)", "MiB", values["recipient"]),
        Panel("growth of the worst other rank", "MiB", values["other"]),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=list(WORLD_SIZES), choices=list(WORLD_SIZES))
    add_plot_option(parser)
    args = parser.parse_args(argv)
    directory = scratch_directory() / f"ignite_zero-memory-{os.getpid()}"
    directory.mkdir(parents=True)
    results = {}
    server, endpoint = loopback_s3()
    try:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(BUCKET)
        for kind in args.kinds:
            results[kind] = launch(_rank, WORLD_SIZES[kind], kind, directory, endpoint)
            for path in directory.glob("*.pt"):
                path.unlink()
    finally:
        server.stop()
        for path in directory.glob("*"):
            path.unlink()
        directory.rmdir()
    print(_table(results))
    if args.plot:
        write_chart(args.plot, "FSDP checkpoints: ignite_zero against ignite 0.5.5, per rank", _chart(results))


if __name__ == "__main__":
    # glibc reuses freed blocks (its mmap threshold grows after frees), which hides growth; a fixed threshold
    # makes every large tensor its own mapping, returned to the system when freed.
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    main()
