"""What every benchmark needs: ranks in a gloo process group, the models and optimizers they hold, resident memory
sampled while an operation runs, scratch files copied and emptied between operations, and the statistics the tables
print.

Memory is the growth of a process's resident set during one operation: a background thread samples
``/proc/self/statm`` every ``interval`` seconds (5 ms), and the kernel's own high-water mark is reset just
before and read just after (``/proc/self/clear_refs``), which catches peaks between samples; the growth of its
anonymous part, which leaves out the pages of mapped files, is sampled too. Every rank
makes glibc serve buffers of 1 MiB and more with ``mmap`` (``mallopt``), so that they go back to the system
when freed: otherwise glibc reuses freed memory and the growth of a later operation disappears.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import queue
import shutil
import socket
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _plot import add_plot_option
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ignite_zero.adapters import ZeROState
from ignite_zero.adapters.fsdp import FSDPModelState, FSDPOptimizerState
from ignite_zero.storage.places import fsync_path
from ignite_zero.storage.savers.sharded import share

__all__ = [
    "LinearAdam",
    "Measurement",
    "ZeROParameters",
    "copy_fresh",
    "each_configuration",
    "empty_except",
    "fsdp2_adam_after_one_step",
    "interleaved",
    "launch",
    "local_tensors",
    "measure",
    "parser",
    "scratch_directory",
    "summary",
    "worst_rank",
    "zero_adam_after_one_step",
]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident() -> tuple[int, int]:
    """The resident set and its anonymous part (without file-backed and shared pages), in bytes."""
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]), int(fields[2])
    return resident * _PAGE, (resident - shared) * _PAGE


def _high_water_mark() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@dataclass
class Measurement:
    """Seconds and resident-memory growth (bytes) of one operation on one rank.

    ``anon_growth`` leaves out pages of mapped files: reading an ``mmap``'d checkpoint fills the page cache,
    which the ranks of a host share, not their own memory.
    """

    seconds: float = 0.0
    growth: int = 0
    anon_growth: int = 0
    samples: int = 0


@contextmanager
def measure(interval: float = 0.005) -> Iterator[Measurement]:
    """Time the ``with`` block and record the peak growth of this process's resident set during it."""
    result = Measurement()
    baseline = _resident()
    peak = list(baseline)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval):
            peak[:] = map(max, peak, _resident())
            result.samples += 1

    _reset_high_water_mark()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    try:
        yield result
    finally:
        result.seconds = time.perf_counter() - started
        stop.set()
        sampler.join()
        resident, anon = _resident()
        result.growth = max(peak[0], resident, _high_water_mark()) - baseline[0]
        result.anon_growth = max(peak[1], anon) - baseline[1]


def _return_freed_memory() -> None:
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 20)
    libc.mallopt(m_trim_threshold, 1 << 20)


def _entry(
    rank: int,
    world_size: int,
    workdir: str,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    torch.set_num_threads(1)
    _return_freed_memory()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=10),
    )
    try:
        results.put((rank, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, RuntimeError(traceback.format_exc())))
        raise
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks of a gloo group; return their results."""
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="ignite_zero-bench-") as workdir:
        results = context.Queue()
        processes = [
            context.Process(target=_entry, args=(rank, world_size, workdir, fn, args, results))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        collected: dict[int, Any] = {}
        while len(collected) < world_size:
            try:
                rank, value = results.get(timeout=1.0)
                collected[rank] = value
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in collected]
                if dead:  # e.g. killed for memory: its peers may wait for it forever
                    for process in processes:
                        process.kill()
                    codes = [processes[r].exitcode for r in dead]
                    raise RuntimeError(f"ranks {dead} died (exit codes {codes})") from None
        for process in processes:
            process.join()
    errors = [value for value in collected.values() if isinstance(value, Exception)]
    if errors:
        raise errors[0]
    return [collected[rank] for rank in range(world_size)]


class ZeROParameters(nn.Module):
    """``count`` parameters in tensors of 4M: ``ZeroRedundancyOptimizer`` spreads whole tensors over ranks."""

    _TENSOR = 4 * 2**20

    def __init__(self, count: int) -> None:
        super().__init__()
        sizes = [self._TENSOR] * (count // self._TENSOR) + ([count % self._TENSOR] if count % self._TENSOR else [])
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(size) * 0.01) for size in sizes)


def fsdp2_adam_after_one_step(
    count: int, width: int = 2048, mesh: DeviceMesh | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """About ``count`` parameters in ``width x width`` linear layers, each an FSDP2 unit (``fully_shard``) over
    ``mesh`` (the whole world by default; a 2-D mesh for HSDP), and Adam on them with its state created by one step."""
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(max(1, round(count / (width * width + width))))))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def zero_adam_after_one_step(model: nn.Module) -> ZeroRedundancyOptimizer:
    """Adam under ZeRO, with its state created by one step."""
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def interleaved(paths: Sequence[str], runs: int) -> Iterator[tuple[bool, str]]:
    """``(measured, path)``: every path once per round, in an order that rotates each round, for ``runs`` measured
    rounds after one that is not (it warms up connections, caches, allocators and staging buffers)."""
    for run in range(runs + 1):
        shift = run % len(paths)
        for name in [*paths[shift:], *paths[:shift]]:
            yield run > 0, name


def parser(description: str, params: list[float], paths: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The command line every benchmark takes: sizes, world sizes, runs, which of its ``paths`` to run, and
    ``--plot``; a benchmark may add its own options."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, nargs="+", default=params, help="parameters of the model")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=5, help="measured rounds after the warm-up round")
    if paths:
        parser.add_argument("--paths", nargs="+", choices=paths, default=list(paths), help="what to measure")
    add_plot_option(parser)
    return parser


def local_tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of a nested state that this rank holds: a ``DTensor``'s local shard, a plain tensor itself."""
    if isinstance(state, DTensor):
        return [state.to_local()]
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in local_tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in local_tensors(value)]
    return []


def worst_rank(ranks: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, list[float]]:
    """Each round's time of each path on its slowest rank: an operation ends when every rank's does."""
    return {path: [max(values) for values in zip(*(rank[path] for rank in ranks))] for path in ranks[0]}


def each_configuration(
    rank_fn: Callable[..., Any], args: argparse.Namespace, name: str, table: Callable[[dict[tuple[int, int], Any]], str]
) -> dict[tuple[int, int], Any]:
    """``rank_fn(rank, world_size, parameters, runs, directory, *paths)`` on every size and world size, each in a
    scratch directory of its own; print the table of the ranks' results by ``(parameters, world size)`` as each
    configuration ends (a long run shows what it has). Return those results, for a chart."""
    directory = scratch_directory() / f"ignite_zero-{name}"
    results = {}
    for count in map(int, args.params):
        for world_size in args.world_sizes:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            paths = getattr(args, "paths", ())
            results[(count, world_size)] = launch(rank_fn, world_size, count, args.runs, directory, *paths)
            print(f"{count / 1e6:.0f}M parameters on {world_size} ranks:\n{table(results)}\n", flush=True)
    shutil.rmtree(directory, ignore_errors=True)
    return results


def summary(values: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def scratch_directory() -> Path:
    """A directory on the disk the benchmarks write to (``IGNITE_ZERO_BENCH_DIR``, else the temporary one)."""
    return Path(os.environ.get("IGNITE_ZERO_BENCH_DIR", tempfile.gettempdir()))


def loopback_s3() -> tuple[Any, str]:
    """moto's S3 server on a free loopback port, every AWS client pointed at it before any is made."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, endpoint


def copy_fresh(source: Path, target: Path, cold: bool) -> None:
    """Copy the file or directory ``source`` to ``target``, then read every file of the copy once, or, ``cold``,
    flush it to the disk and drop it from the page cache (dirty pages would stay)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)
    for path in [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            if cold:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while f.read(8 << 20):
                    pass


def empty_except(directory: Path, keep: set[Path]) -> None:
    """Remove everything in ``directory``, but only the contents of the directories ``keep`` (savers' own)."""
    for path in directory.iterdir():
        if path in keep:
            empty_except(path, set())
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


class LinearAdam:
    """One rank's model and optimizer, what it writes and reads raw, and the sharded state DCP saves and loads."""

    def __init__(self, kind: str, layers: int, width: int, rank: int, world_size: int) -> None:
        torch.manual_seed(0)  # every rank holds the same model before sharding
        self.kind = kind
        if kind == "zero":
            self.model: nn.Module = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
            self.optimizer: Any = zero_adam_after_one_step(self.model)
            shard = ZeROState(self.optimizer).sharded_state_dict()
            self.own = local_tensors(
                {"model": share(self.model.state_dict(), rank, world_size, keeper=0), "opt": shard}
            )
        else:
            self.model, self.optimizer = fsdp2_adam_after_one_step(layers * (width * width + width), width)
            model_state = FSDPModelState(self.model, 0).sharded_state_dict()
            optimizer_state = FSDPOptimizerState(self.model, self.optimizer, 0).sharded_state_dict()
            self.own = local_tensors({"model": model_state, "optimizer": optimizer_state})
        self.own = [t.contiguous() for t in self.own]
        # what a load reads: ZeRO ranks the whole model (every rank holds it) and their optimizer shard
        self.needed = self.own if kind != "zero" else [*self.model.state_dict().values(), *local_tensors(shard)]
        self.needed_bytes = sum(t.numel() * t.element_size() for t in self.needed)
        self.own_bytes = sum(t.numel() * t.element_size() for t in self.own)
        total = torch.tensor([self.own_bytes], dtype=torch.int64)
        dist.all_reduce(total)
        self.total_bytes = int(total)
        self.objects = {"model": self.model, "optimizer": self.optimizer}
        # ZeRO's torch.save floor writes the state consolidated once, beforehand, on rank 0
        self.full = None
        if kind == "zero":
            self.full = {"model": self.model.state_dict(), "optimizer": ZeROState(self.optimizer).state_dict()}

    def dcp_state(self) -> dict[str, Any]:
        if self.kind == "zero":
            return {"model": self.model.state_dict(), "optimizer": ZeROState(self.optimizer).sharded_state_dict()}
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def dcp_load(self, checkpoint: Path) -> None:
        state = self.dcp_state()
        dcp.load(state, checkpoint_id=checkpoint)
        if self.kind == "fsdp2":
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )

    def torch_full(self, rank: int, path: Path) -> None:
        if self.kind == "zero":
            full = self.full
        else:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
            full = {"model": model_state, "optimizer": optimizer_state}
        if rank == 0:
            torch.save(full, path)
            fsync_path(path)
