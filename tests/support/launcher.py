"""Run a test scenario on several ranks: forked processes joined in a real gloo process group.

Forking costs about 0.1 s per launch where spawning re-imports torch (4-6 s), so every test module imports
what its ranks need at the top and children inherit it. Each rank's return value comes back through a file;
a rank that raises sends its traceback; a rank still running at the deadline is killed, and the test fails
naming it, so no test can hang.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["attempt", "run_ranks"]


def _entry(rank: int, world_size: int, workdir: Path, fn: Callable[..., Any], args: tuple, init: bool) -> None:
    torch.set_num_threads(1)
    outcome: tuple[bool, Any]
    try:
        if init:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{workdir / 'store'}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=60),
            )
            # every rank joined: one whose scenario ends at once cannot close the group on a rank still joining it
            dist.barrier()
        outcome = (True, fn(rank, world_size, *args))
    except BaseException:
        outcome = (False, traceback.format_exc())
    try:
        payload = pickle.dumps(outcome)
    except Exception:
        payload = pickle.dumps((False, f"rank {rank} returned an unpicklable value\n{traceback.format_exc()}"))
    (workdir / f"result{rank}").write_bytes(payload)
    if init and outcome[0]:
        dist.destroy_process_group()


def attempt(operation: Callable[[], Any]) -> tuple[str | None, str, float]:
    """What ``operation`` raised (its type's name and its text; ``None`` and ``""`` if nothing), and after how many
    seconds: what a scenario returns, so that the test compares the ranks' errors and times."""
    started = time.monotonic()
    try:
        operation()
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - started
    return None, "", time.monotonic() - started


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    init: bool = True,
    killed: Collection[int] = (),
    daemon: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; return each rank's result.

    Args:
        fn: module-level scenario function.
        world_size: number of ranks.
        args: further arguments, e.g. a shared ``tmp_path``.
        timeout: seconds before ranks still running are killed and the test fails.
        init: join the ranks in a gloo process group (False: independent processes, no process group).
        killed: ranks that must die by SIGKILL (fault injection); their result is ``None``.
        daemon: False for ranks that start processes of their own (a data loader's workers), which Python forbids
            to daemonic processes.

    Raises:
        AssertionError: a rank raised, died or hung unexpectedly; the message holds every rank's traceback.
    """
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="ignite_zero-ranks-") as tmp:
        workdir = Path(tmp)
        processes = [
            context.Process(target=_entry, args=(rank, world_size, workdir, fn, args, init), daemon=daemon)
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        results: list[Any] = []
        problems: list[str] = []
        for rank, process in enumerate(processes):
            result_file = workdir / f"result{rank}"
            if rank in killed:
                if process.exitcode != -signal.SIGKILL:
                    problems.append(f"rank {rank} should have been killed, exit code {process.exitcode}")
                results.append(None)
                continue
            if not result_file.exists():
                problems.append(f"rank {rank}: {'hung' if rank in hung else f'died (exit code {process.exitcode})'}")
                results.append(None)
                continue
            ok, value = pickle.loads(result_file.read_bytes())
            if not ok:
                problems.append(f"rank {rank} raised:\n{value}")
            results.append(value)
        if problems:
            raise AssertionError(
                f"{fn.__name__} on {world_size} ranks failed (hung ranks {hung}):\n" + "\n".join(problems)
            )
        return results
