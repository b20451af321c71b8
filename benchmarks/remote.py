"""Saves to object storage: ignite_zero against the plain uploads it should cost about as much as, in one run,
against moto's S3 server on 127.0.0.1 (``pip install "moto[server]" s3fs``; nothing leaves the machine).

    python benchmarks/remote.py                      # ZeRO, 100M parameters, 2 ranks, 5 rounds
    python benchmarks/remote.py --params 25e6 --runs 3

Every rank trains one step of Adam under ``ZeroRedundancyOptimizer`` (12 bytes per parameter), then the paths
save it again and again, interleaved (their order rotates every round) after a warm-up round:

- ``s3fs put``: the floor of a consolidated save: ``S3FileSystem.put`` of a file that ``torch.save`` wrote
  beforehand (on tmpfs, untimed) from the same consolidated state, on rank 0;
- ``consolidated``: ``Checkpoint(DiskSaver("s3://..."))``: the consolidation on rank 0, the upload sealed in the
  stream, the server-side copy to the checkpoint's name, agreement among ranks;
- ``FsspecWriter``: the floor of a sharded save: ``dcp.save`` of what ignite_zero's sharded save writes (every
  rank its optimizer shard, the model once) through DCP's ``FsspecWriter``;
- ``sharded``: ``Checkpoint(ShardedSaver("s3://..."))``: the same plus agreement, CRC-32 while writing and the
  manifest written last.

A save's time is its worst rank's. The table gives each path's min / median / max over the rounds, and the ratios
the targets are stated in (consolidated / s3fs put <= 1.5, sharded / FsspecWriter <= 1.2) as the median [min-max]
of the ratios within each round.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import ZeROParameters, launch, loopback_s3, parser, summary, worst_rank, zero_adam_after_one_step
from _plot import seconds_panel, write_chart
from ignite.engine import Engine

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver, _compat
from ignite_zero.adapters import ZeROState

PATHS = ("s3fs put", "consolidated", "FsspecWriter", "sharded")
FLOORS = {"consolidated": "s3fs put", "sharded": "FsspecWriter"}
BUCKET = "ignite-zero-bench"


def _rank(rank: int, world_size: int, count: int, runs: int, endpoint: str) -> dict[str, list[float]]:
    import s3fs

    # moto completes a multipart upload of 1.2 GB in more than botocore's 60 s: a retry would find it gone
    options = {"endpoint_url": endpoint, "config_kwargs": {"read_timeout": 900}}
    client = s3fs.S3FileSystem(**options)
    model = ZeROParameters(count)
    optimizer = zero_adam_after_one_step(model)
    to_save = {"model": model, "optimizer": optimizer}
    engine = Engine(lambda e, b: None)
    handlers = {
        "consolidated": Checkpoint(to_save, DiskSaver(f"s3://{BUCKET}/files", storage_options=options), n_saved=None),
        "sharded": Checkpoint(to_save, ShardedSaver(f"s3://{BUCKET}/dirs", storage_options=options), n_saved=None),
    }
    local = Path("/dev/shm") / "ignite_zero-remote-floor.pt"
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:  # the floor's file, untimed
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, local)

    def put() -> None:
        if rank == 0:
            client.put(str(local), f"{BUCKET}/put/{engine.state.iteration}.pt")

    def fsspec_writer() -> None:
        state = {"model": model.state_dict(), "optimizer": ZeROState(optimizer).sharded_state_dict()}
        writer = _compat.DcpFsspecWriter(f"s3://{BUCKET}/raw/{engine.state.iteration}", sync_files=False, **options)
        dcp.save(state, storage_writer=writer)

    floors = {"s3fs put": put, "FsspecWriter": fsspec_writer}
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for run in range(runs + 1):  # the first round warms up connections and allocators
        for name in PATHS[run % len(PATHS) :] + PATHS[: run % len(PATHS)]:
            engine.state.iteration += 1
            dist.barrier()
            started = time.perf_counter()
            floors[name]() if name in floors else handlers[name](engine)
            elapsed = time.perf_counter() - started
            dist.barrier()
            if run:
                times[name].append(elapsed)
            if rank == 0:  # no path pays for the objects an earlier one left: moto keeps them in memory
                for prefix in ("put", "files", "raw", "dirs"):
                    if client.exists(f"{BUCKET}/{prefix}"):
                        client.rm(f"{BUCKET}/{prefix}", recursive=True)
            dist.barrier()
    if rank == 0:
        local.unlink()
    return times


def _table(count: int, world_size: int, ranks: list[dict[str, list[float]]]) -> str:
    worst = worst_rank(ranks)
    rows = ["| path | seconds min / median / max | MB/s (median) | ratio |", "|---|---|---|---|"]
    size = 12 * count / 1e6
    for path in PATHS:
        low, middle, high = summary(worst[path])
        ratio = ""
        if path in FLOORS:
            r_low, r_mid, r_high = summary([a / b for a, b in zip(worst[path], worst[FLOORS[path]])])
            ratio = f"{r_mid:.2f} x {FLOORS[path]} [{r_low:.2f}-{r_high:.2f}]"
        rows.append(f"| {path} | {low:.2f} / {middle:.2f} / {high:.2f} | {size / middle:.0f} | {ratio} |")
    return f"ZeRO, {count / 1e6:.0f}M parameters ({size:.0f} MB of state) on {world_size} ranks:\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    options = parser(__doc__, [100e6])
    options.set_defaults(world_sizes=[2])
    args = options.parse_args(argv)
    server, endpoint = loopback_s3()
    try:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(BUCKET)
        runs = {}
        for count in map(int, args.params):
            for world_size in args.world_sizes:
                ranks = launch(_rank, world_size, count, args.runs, endpoint)
                print(_table(count, world_size, ranks) + "\n", flush=True)
                runs[f"{count / 1e6:.0f}M, {world_size} ranks"] = worst_rank(ranks)
        if args.plot:
            write_chart(
                args.plot, "saves to moto's S3 server on 127.0.0.1 (worst rank)", [seconds_panel("seconds", runs)]
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
