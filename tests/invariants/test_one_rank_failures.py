"""A check that fails on one rank of a save or load fails it on every rank, at once, with the same error.

Each case below fails one check on one rank only: the recipient (rank 0), or a rank that is not the recipient
(rank 1). Every rank must then raise the same exception, with the same text, within 5 s: well inside the
`sync_timeout` of 60 s, so that no rank waits for another until it times out, and none blames the user for a
collective called on some ranks only. The ranks here join by TCP, so that the one that runs as the unprivileged user
``nobody`` (for the permission cases) still reaches the process group's store.

The ranks a case lists are those on which that check is made: in a consolidated save only the recipient touches
the directory (its place, its bucket, its free space, ``require_empty``); in a sharded save every rank writes into it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from ignite.engine import Engine
from launcher import attempt, run_ranks
from training import tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver, find_latest

pytestmark = pytest.mark.distributed

NOBODY = 65534
SYNC_TIMEOUT = 60.0


def _objects(rank: int) -> dict[str, Any]:
    model = tiny_model()
    optimizer = zero_adam(model)
    train_step(model, optimizer, rank, 0)
    return {"model": model, "optimizer": optimizer}


def _save(saver: Callable[[], Any], **kwargs: Any) -> Callable[[int, bool, Path], Callable[[], None]]:
    """A case: a save of sharded state with ``saver()`` on every rank."""

    def case(rank: int, fails: bool, tmp: Path) -> Callable[[], None]:
        objects = _objects(rank)
        if fails and kwargs.get("as_nobody"):
            _become_nobody()  # before the saver is made, which checks its directory on the recipient
        options = {key: value(fails) for key, value in kwargs.items() if key != "as_nobody"}
        checkpoint = Checkpoint(objects, saver(tmp), sync_timeout=SYNC_TIMEOUT, **options)
        return lambda: checkpoint(Engine(lambda e, b: None))

    return case


def _load_as_nobody(load: Callable[[dict[str, Any], Path], Any]) -> Callable[[int, bool, Path], Callable[[], None]]:
    """A case: every rank saves a checkpoint into a directory only root may read, then loads it; the failing rank
    runs as ``nobody`` for the load."""

    def case(rank: int, fails: bool, tmp: Path) -> Callable[[], None]:
        objects = _objects(rank)
        Checkpoint(objects, DiskSaver(tmp / "private"), sync_timeout=SYNC_TIMEOUT)(Engine(lambda e, b: None))
        dist.barrier()
        if rank == 0:
            os.chmod(tmp / "private", 0o700)
        dist.barrier()
        if fails:
            _become_nobody()
        return lambda: load(objects, tmp / "private")

    return case


def _become_nobody() -> None:
    os.setegid(NOBODY)
    os.seteuid(NOBODY)


def _become_root() -> None:
    if os.geteuid() != 0:
        os.seteuid(0)
        os.setegid(0)


_S3: dict[str, str] = {}  # the options of the loopback S3 server, set by the test before the ranks start

CASES: dict[str, tuple[Callable[..., Callable[[], None]], tuple[int, ...], str]] = {
    # name: (the case, the ranks that make this check, what the error says)
    "missing directory": (
        _save(lambda tmp: DiskSaver(tmp / "missing", create_dir=False)),
        (0,),
        r"Directory path '\S+/missing' is not found",
    ),
    "missing bucket": (
        _save(lambda tmp: DiskSaver("s3://no-such-bucket-here/run", storage_options=_S3)),
        (0,),
        "Bucket 'no-such-bucket-here' of s3://no-such-bucket-here/run does not exist",
    ),
    "require_empty": (
        _save(lambda tmp: DiskSaver(tmp / "full", require_empty=True)),
        (0,),
        r"Files \['old.pt'\] with extension '.pt' are already present",
    ),
    "permissions, a file": (
        _save(lambda tmp: DiskSaver(tmp / "locked" / "run"), as_nobody=True),
        (0,),
        "Permission denied",
    ),
    "permissions, a sharded directory": (
        _save(lambda tmp: ShardedSaver(tmp / "shared"), as_nobody=True),
        (0, 1),
        "Permission denied",
    ),
    "disk space, a file": (
        _save(lambda tmp: DiskSaver(tmp / "small")),
        (0,),
        "Not enough disk space for checkpoint",
    ),
    "disk space, a sharded directory": (
        _save(lambda tmp: ShardedSaver(tmp / "small")),
        (0,),
        "Not enough disk space for checkpoint",
    ),
    "a name outside the directory": (
        _save(
            lambda tmp: DiskSaver(tmp / "names"),
            filename_pattern=lambda fails: "{name}_{global_step}.{ext}",
            global_step_transform=lambda fails: lambda engine, event: "../escape" if fails else 1,
        ),
        (0, 1),
        "is not a plain file name",
    ),
    "permissions, a load": (
        _load_as_nobody(lambda objects, path: Checkpoint.load_objects(objects, path / "checkpoint_0.pt")),
        (0, 1),
        "Permission denied",
    ),
    "permissions, the search for the latest": (  # one rank per host searches: rank 0 here
        _load_as_nobody(lambda objects, path: find_latest(path, sync_timeout=SYNC_TIMEOUT)),
        (0,),
        "Permission denied",
    ),
}


def _scenario(rank: int, world_size: int, port: int, case: str, failing: int, tmp: Path) -> tuple[Any, ...]:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=SYNC_TIMEOUT),
    )
    try:
        return attempt(CASES[case][0](rank, rank == failing, tmp))
    finally:
        _become_root()
        dist.destroy_process_group()


@pytest.fixture
def directories(tmp_path: Path) -> Iterator[Path]:
    """What the cases write into: a directory holding a checkpoint already, one only root may write into, and a
    real file system too small for any checkpoint (a 16 KiB tmpfs, mounted as root)."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.pt").write_bytes(b"")
    (tmp_path / "locked").mkdir(mode=0o755)
    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root, to mount a small file system and to act as another user")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield tmp_path
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.parametrize(
    ("case", "failing"),
    [(case, rank) for case, (_, ranks, _) in CASES.items() for rank in ranks],
    ids=[f"{case} on rank {rank}" for case, (_, ranks, _) in CASES.items() for rank in ranks],
)
def test_a_check_failed_on_one_rank_raises_the_same_error_on_every_rank_at_once(
    case: str, failing: int, directories: Path, s3_endpoint: str, free_port: int
) -> None:
    _S3["endpoint_url"] = s3_endpoint
    results = run_ranks(_scenario, 2, free_port, case, failing, directories, init=False, timeout=60)
    kinds = {(kind, text) for kind, text, _ in results}
    assert len(kinds) == 1, f"the ranks raised different errors: {results}"
    kind, text = kinds.pop()
    assert kind is not None, f"no rank raised: {results}"
    assert re.search(CASES[case][2], text), text
    assert all(elapsed < 5 for _, _, elapsed in results), [elapsed for _, _, elapsed in results]
