"""Storage: where and how a checkpoint dictionary becomes a durable file.

:class:`DiskSaver` is the drop-in for ignite's saver of the same name. It writes on one rank only, to a
temporary name in the target directory, flushes the file to disk, renames it, then flushes the directory,
so that a crash at any point leaves either the previous file or the complete new one. Old checkpoints are
removed by the caller (:class:`~ignite_zero.Checkpoint`) only once the new one is durable.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from ignite.handlers.checkpoint import BaseSaveHandler

from ignite_zero import _compat, integrity
from ignite_zero.agreement import rank_and_world

__all__ = ["DiskSaver", "check_filename", "serialized_size"]

logger = logging.getLogger(__name__)

# Temporary files are hidden and never end in ".pt", so nothing takes them for checkpoints.
_TEMPORARY = re.compile(r"^\..+\.ignite_zero-[0-9a-f]{12}\.tmp$")


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


class DiskSaver(BaseSaveHandler):
    """Durable, rank-aware disk saver: the drop-in for :class:`ignite.handlers.DiskSaver`.

    Args:
        dirname: directory in which checkpoints are written.
        atomic: if True (default), write to a temporary file in ``dirname`` and rename it, so that a crash
            never leaves a partial file under a checkpoint's name. If False, write in place (for file
            systems without rename); the integrity trailer still exposes a partial file.
        create_dir: if True, create ``dirname`` when it does not exist.
        require_empty: if True, raise when ``dirname`` already holds ``.pt`` files.
        save_on_rank: the only rank that writes. ``None`` (default) lets
            :class:`~ignite_zero.Checkpoint` pick its ``consolidate_recipient_rank``; on its own, rank 0.
        kwargs: keyword arguments of :func:`torch.save`.

    Differences from ignite's ``DiskSaver``, deliberate: the file and its directory are flushed to disk
    before the rename; new files get mode ``0o666 & ~umask`` (ignite adds group and world read); file names
    that would escape ``dirname`` are rejected; every file carries an integrity trailer
    (:mod:`ignite_zero.integrity`); removing a file that is already gone logs a warning instead of raising.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, DiskSaver

            saver = DiskSaver("/tmp/ckpt", require_empty=False)
            handler = Checkpoint(to_save, saver, n_saved=2, consolidate_recipient_rank=1)

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        dirname: str | Path,
        atomic: bool = True,
        create_dir: bool = True,
        require_empty: bool = True,
        save_on_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("_use_new_zipfile_serialization", True) is False:
            raise ValueError(
                "DiskSaver writes torch's zip format only (it carries the integrity trailer); remove "
                "`_use_new_zipfile_serialization=False`."
            )
        if save_on_rank is not None and (not isinstance(save_on_rank, int) or save_on_rank < 0):
            raise ValueError(f"Argument `save_on_rank` should be a non-negative integer, got {save_on_rank!r}")
        self.dirname = Path(dirname).expanduser()
        self._atomic = atomic
        self._create_dir = create_dir
        self._require_empty = require_empty
        self.kwargs = kwargs
        self.rank_given = save_on_rank is not None
        self.save_on_rank = 0 if save_on_rank is None else save_on_rank
        self._prepared = False
        if self.rank_given:
            self._prepare()

    def bind(self, rank: int) -> None:
        """Make ``rank`` the writing rank; called by :class:`~ignite_zero.Checkpoint` when none was given."""
        if self.rank_given and rank != self.save_on_rank:
            raise ValueError(f"This DiskSaver writes on rank {self.save_on_rank}, not on rank {rank}")
        self.save_on_rank = rank
        self._prepare()

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
            matched = sorted(name for name in os.listdir(self.dirname) if name.endswith(".pt"))
            if matched:
                raise ValueError(
                    f"Files {matched} with extension '.pt' are already present in the directory {self.dirname}. "
                    "If you want to use this directory anyway, pass `require_empty=False`."
                )
        self._prepared = True

    def path(self, filename: str) -> Path:
        """Where the checkpoint ``filename`` lives."""
        return self.dirname / check_filename(filename)

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        if not self.is_writer:
            return
        self._prepare()
        path = self.path(filename)
        self._remove_temporaries()
        self._check_room(checkpoint, path)
        started = time.perf_counter()
        if self._atomic:
            self._write_atomically(checkpoint, path)
        else:
            self._write_in_place(checkpoint, path)
        logger.info("Saved %s (%.1f MB) in %.2f s", path, path.stat().st_size / 1e6, time.perf_counter() - started)

    def _write_atomically(self, checkpoint: Mapping, path: Path) -> None:
        temporary = path.with_name(f".{path.name}.ignite_zero-{uuid.uuid4().hex[:12]}.tmp")
        try:
            # os.open applies the umask to 0o666, as any newly created file gets.
            with os.fdopen(os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), "w+b") as f:
                self._dump(checkpoint, f)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_directory(path.parent)

    def _write_in_place(self, checkpoint: Mapping, path: Path) -> None:
        # A new file rather than the old one truncated: a process that loaded the old one with mmap keeps it.
        path.unlink(missing_ok=True)
        with os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), "w+b") as f:
            self._dump(checkpoint, f)
        _fsync_directory(path.parent)

    def _dump(self, checkpoint: Mapping, f: IO[bytes]) -> None:
        stream = _ErrorKeepingStream(f)
        with _compat.serialization_crc32():
            try:
                torch.save(checkpoint, stream, **self.kwargs)
            except Exception as error:
                if stream.error is not None:  # the real cause, e.g. ENOSPC or EIO, instead of torch's summary
                    raise stream.error from error
                raise
        integrity.seal(f, world_size=rank_and_world()[1], torch=torch.__version__, ignite_zero=_package_version())
        f.flush()
        os.fsync(f.fileno())

    def _check_room(self, checkpoint: Mapping, path: Path) -> None:
        """Fail before writing, clearly, when the new file cannot fit beside the ones it will replace."""
        needed = serialized_size(checkpoint)
        free = shutil.disk_usage(self.dirname).free
        if needed > free:
            raise OSError(
                errno.ENOSPC,
                f"Not enough disk space for checkpoint {path}: it needs about {needed / 1e6:.1f} MB, "
                f"{free / 1e6:.1f} MB are free (older checkpoints are removed only after the new one is written). "
                "Free some space, write elsewhere, or lower `n_saved`.",
            )

    def _remove_temporaries(self) -> None:
        # Left by a process killed while writing; a live writer of this directory is this process alone.
        for name in os.listdir(self.dirname):
            if _TEMPORARY.match(name):
                (self.dirname / name).unlink(missing_ok=True)
                logger.warning("Removed %s, left by an interrupted save", self.dirname / name)

    def remove(self, filename: str) -> None:
        if not self.is_writer:
            return
        path = self.path(filename)
        try:
            path.unlink()
        except FileNotFoundError:
            logger.warning("Checkpoint %s was already removed", path)
        else:
            _fsync_directory(path.parent)


class _ErrorKeepingStream:
    """Passes writes to a file and keeps the first error they raise.

    torch's zip writer turns an exception in ``write`` into "unexpected pos ..."; the kept error lets the
    saver report what really went wrong (no space left, an I/O error).
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.error: BaseException | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._f.write(data)
        except BaseException as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self._f.flush()


def serialized_size(obj: Any) -> int:
    """Upper estimate of the bytes ``torch.save`` writes for ``obj``: each distinct storage once, plus records."""
    storages: dict[int, int] = {}
    count = 0

    def visit(value: Any) -> None:
        nonlocal count
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr() if storage.nbytes() else id(value)] = storage.nbytes()
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        count += 1

    visit(obj)
    # per record: zip headers and alignment (about 200 bytes); per object: its pickled description
    return sum(storages.values()) + 256 * len(storages) + 128 * count + (1 << 16)


def _fsync_directory(dirname: Path) -> None:
    # Makes the rename (or unlink) itself durable: without it a power loss can revert the directory entry.
    fd = os.open(dirname, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _package_version() -> str:
    from ignite_zero import __version__

    return __version__
