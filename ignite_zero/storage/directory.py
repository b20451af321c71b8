"""What the savers of local directories share: the target directory, the one rank that writes (or, for a sharded
save, seals and removes), file names that stay inside it, the cleanup after interrupted saves, retention, and the
estimate of a checkpoint's size for the disk-space check."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ignite_zero import tree
from ignite_zero.agreement import rank_and_world
from ignite_zero.storage.base import Saver, local_path

__all__ = [
    "TEMPORARY",
    "DirectorySaver",
    "check_filename",
    "fsync_directory",
    "package_version",
    "remove_path",
    "serialized_size",
]

logger = logging.getLogger(__name__)

# Temporary files and directories are hidden and never end in ".pt" or ".dcp": nothing takes them for checkpoints.
TEMPORARY = re.compile(r"^\..+\.ignite_zero-[0-9a-z]+\.tmp$")


def check_filename(filename: str) -> str:
    """Reject a checkpoint file name that would be written outside its directory.

    Raises:
        ValueError: for an empty name, an absolute path, a path separator, ``.`` or ``..``.
    """
    separators = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    if not filename or filename in (".", "..") or any(s in filename for s in separators) or "\0" in filename:
        raise ValueError(
            f"Checkpoint file name {filename!r} is not a plain file name: it would be written outside the target "
            "directory. Remove path separators and '..' from `filename_prefix`, `score_name` and `filename_pattern`."
        )
    return filename


class DirectorySaver(Saver):
    """What the file and the directory savers share: the target directory, the one rank that writes (or, for a
    sharded save, seals and removes), the cleanup after interrupted saves, and retention."""

    def __init__(self, dirname: str | Path, create_dir: bool, require_empty: bool, save_on_rank: int | None) -> None:
        if save_on_rank is not None and (not isinstance(save_on_rank, int) or save_on_rank < 0):
            raise ValueError(f"Argument `save_on_rank` should be a non-negative integer, got {save_on_rank!r}")
        self.dirname = local_path(dirname)
        self._create_dir = create_dir
        self._require_empty = require_empty
        self._rank_given = save_on_rank is not None
        self.save_on_rank = 0 if save_on_rank is None else save_on_rank
        self._prepared = False
        if self._rank_given:
            self._prepare()

    @property
    def requested_rank(self) -> int | None:
        return self.save_on_rank if self._rank_given else None

    def bind(self, recipient: int) -> None:
        """Make ``recipient`` the writing rank; called by :class:`~ignite_zero.Checkpoint` when none was given."""
        if self._rank_given and recipient != self.save_on_rank:
            raise ValueError(f"This {type(self).__name__} writes on rank {self.save_on_rank}, not on rank {recipient}")
        self.save_on_rank = recipient
        self._prepare()

    @property
    def identity(self) -> str:
        return f"{type(self).__qualname__}:{self.dirname}"

    @property
    def directory(self) -> Path:
        return self.dirname

    def list(self) -> list[str]:
        if not self.dirname.is_dir():
            return []
        return sorted(name for name in os.listdir(self.dirname) if name.endswith(f".{self.ext}"))

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the files."""
        return rank_and_world()[0] == self.save_on_rank

    def _prepare(self) -> None:
        if self._prepared or not self.is_writer:
            return
        if self._create_dir:
            self.dirname.mkdir(parents=True, exist_ok=True)
        if not self.dirname.is_dir():
            raise ValueError(f"Directory path '{self.dirname}' is not found; create it or pass `create_dir=True`")
        if self._require_empty:
            matched = sorted(name for name in os.listdir(self.dirname) if name.endswith(f".{self.ext}"))
            if matched:
                raise ValueError(
                    f"Files {matched} with extension '.{self.ext}' are already present in the directory "
                    f"{self.dirname}. If you want to use this directory anyway, pass `require_empty=False`."
                )
        self._prepared = True

    def path(self, filename: str) -> Path:
        """Where the checkpoint ``filename`` lives."""
        return self.dirname / check_filename(filename)

    def _remove_temporaries(self) -> None:
        # Left by a process killed while writing; the live writer of this directory is this rank alone.
        for name in os.listdir(self.dirname):
            if TEMPORARY.match(name):
                remove_path(self.dirname / name)
                logger.warning("Removed %s, left by an interrupted save", self.dirname / name)

    def remove(self, filename: str) -> None:
        if not self.is_writer:
            return
        path = self.path(filename)
        if not path.exists():
            logger.warning("Checkpoint %s was already removed", path)
            return
        remove_path(path)
        fsync_directory(path.parent)


def serialized_size(obj: Any) -> int:
    """Upper estimate of the bytes ``torch.save`` writes for ``obj``: each distinct storage once, plus records."""
    storages: dict[int, int] = {}

    def tensors_of(value: Any) -> list[torch.Tensor]:
        if isinstance(value, DTensor):
            return [value.to_local()]
        if callable(getattr(value, "local_shards", None)):  # a ShardedTensor: this rank's shards are its part
            return [shard.tensor for shard in value.local_shards()]
        return [value] if isinstance(value, torch.Tensor) else []

    leaves = tree.leaves(obj)
    for _, leaf in leaves:
        for tensor in tensors_of(leaf):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr() if storage.nbytes() else id(tensor)] = storage.nbytes()
    # per record: zip headers and alignment (about 200 bytes); per object: its pickled description
    return sum(storages.values()) + 256 * len(storages) + 128 * len(leaves) + (1 << 16)


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def fsync_directory(dirname: Path) -> None:
    # Makes the rename (or unlink) itself durable: without it a power loss can revert the directory entry.
    fd = os.open(dirname, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def package_version() -> str:
    from ignite_zero import __version__

    return __version__
