"""Single checkpoint files: :class:`DiskSaver`, the drop-in for ignite's saver of the same name.

One rank writes one file, to a temporary name in the target directory, flushes it to disk, renames it, then flushes
the directory, so that a crash at any point leaves either the previous file or the complete new one. Old checkpoints
are removed only once the new one is durable.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch

from ignite_zero import _compat, integrity
from ignite_zero.agreement import rank_and_world
from ignite_zero.storage.base import SaveRequest
from ignite_zero.storage.consolidated import ConsolidatingSaver
from ignite_zero.storage.directory import DirectorySaver, fsync_directory, package_version, serialized_size

__all__ = ["DiskSaver"]

logger = logging.getLogger(__name__)


class DiskSaver(DirectorySaver, ConsolidatingSaver):
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
        kwargs: keyword arguments of :func:`torch.save`, e.g. ``pickle_protocol``. With
            ``_use_new_zipfile_serialization=False`` the file is in torch's legacy format: written as durably, but
            without integrity trailer (it has no zip comment to carry one), and loaded without ``mmap``.

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
        try:
            inspect.signature(torch.save).bind(None, None, **kwargs)
        except TypeError as error:
            accepted = [name for name in inspect.signature(torch.save).parameters if name not in ("obj", "f")]
            raise TypeError(
                f"save() {error}: DiskSaver passes its keyword arguments to torch.save, which takes {accepted}"
            ) from None
        self._atomic = atomic
        self.kwargs = kwargs
        super().__init__(dirname, create_dir, require_empty, save_on_rank)

    def writes_here(self, request: SaveRequest) -> bool:
        return self.is_writer

    def write(self, content: Any, request: SaveRequest) -> None:
        self(content, request.filename, request.metadata)

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
        fsync_directory(path.parent)

    def _write_in_place(self, checkpoint: Mapping, path: Path) -> None:
        # A new file rather than the old one truncated: a process that loaded the old one with mmap keeps it.
        path.unlink(missing_ok=True)
        with os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), "w+b") as f:
            self._dump(checkpoint, f)
        fsync_directory(path.parent)

    def _dump(self, checkpoint: Mapping, f: IO[bytes]) -> None:
        stream = _ErrorKeepingStream(f)
        with _compat.serialization_crc32():
            try:
                torch.save(checkpoint, cast(IO[bytes], stream), **self.kwargs)
            except Exception as error:
                if stream.error is not None:  # the real cause, e.g. ENOSPC or EIO, instead of torch's summary
                    raise stream.error from error
                raise
        if self.kwargs.get("_use_new_zipfile_serialization", True):  # the legacy format is no zip: no trailer
            integrity.seal(f, world_size=rank_and_world()[1], torch=torch.__version__, ignite_zero=package_version())
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
