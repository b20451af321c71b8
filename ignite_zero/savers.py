"""Storage: where and how a checkpoint becomes durable on disk.

:class:`DiskSaver` is the drop-in for ignite's saver of the same name: one rank writes one file, to a temporary
name in the target directory, flushes it to disk, renames it, then flushes the directory, so that a crash at any
point leaves either the previous file or the complete new one. :class:`ShardedSaver` writes a directory that
every rank writes its part of, through ``torch.distributed.checkpoint``, with the same guarantees. Old
checkpoints are removed by the caller (:class:`~ignite_zero.Checkpoint`) only once the new one is durable.
"""

from __future__ import annotations

import ctypes
import errno
import inspect
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ignite_zero import _compat, integrity, sharded, tree
from ignite_zero.adapters import ShardedState
from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT, rank_and_world, settle
from ignite_zero.groups import cpu_group
from ignite_zero.storage.base import Saver, SaveRequest
from ignite_zero.storage.consolidated import ConsolidatingSaver

__all__ = ["DiskSaver", "ShardedSaver", "check_filename", "serialized_size"]

logger = logging.getLogger(__name__)

# Temporary files and directories are hidden and never end in ".pt" or ".dcp": nothing takes them for checkpoints.
_TEMPORARY = re.compile(r"^\..+\.ignite_zero-[0-9a-z]+\.tmp$")


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


class _DirectorySaver(Saver):
    """What the file and the directory savers share: the target directory, the one rank that writes (or, for a
    sharded save, seals and removes), the cleanup after interrupted saves, and retention."""

    def __init__(self, dirname: str | Path, create_dir: bool, require_empty: bool, save_on_rank: int | None) -> None:
        if save_on_rank is not None and (not isinstance(save_on_rank, int) or save_on_rank < 0):
            raise ValueError(f"Argument `save_on_rank` should be a non-negative integer, got {save_on_rank!r}")
        self.dirname = Path(dirname).expanduser()
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
            if _TEMPORARY.match(name):
                _remove_path(self.dirname / name)
                logger.warning("Removed %s, left by an interrupted save", self.dirname / name)

    def remove(self, filename: str) -> None:
        if not self.is_writer:
            return
        path = self.path(filename)
        if not path.exists():
            logger.warning("Checkpoint %s was already removed", path)
            return
        _remove_path(path)
        _fsync_directory(path.parent)


class DiskSaver(_DirectorySaver, ConsolidatingSaver):
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
                torch.save(checkpoint, cast(IO[bytes], stream), **self.kwargs)
            except Exception as error:
                if stream.error is not None:  # the real cause, e.g. ENOSPC or EIO, instead of torch's summary
                    raise stream.error from error
                raise
        if self.kwargs.get("_use_new_zipfile_serialization", True):  # the legacy format is no zip: no trailer
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


class ShardedSaver(_DirectorySaver):
    """Sharded saver: every rank writes its own part of a checkpoint directory, in parallel, through
    ``torch.distributed.checkpoint`` (DCP).

    Give it to :class:`~ignite_zero.Checkpoint` as ``save_handler``: the policy (names, scores, ``n_saved``,
    ``last_checkpoint``, agreement among ranks) is the same, but nothing is gathered on one rank. Each checkpoint
    is a directory named like the file would be, with the extension ``.dcp``. ZeRO and OSS ranks write the state
    of the parameters they own, FSDP1 and FSDP2 ranks their shards, and objects that every rank holds are written
    once; :meth:`Checkpoint.load_objects <ignite_zero.Checkpoint.load_objects>` reads it on any number of ranks,
    each rank reading only what it needs, and ``ignite-zero consolidate`` turns it into a single file.

    Durability: the ranks write into a hidden temporary directory, DCP writes its ``.metadata`` last, every
    file's CRC-32 is computed while it is written, and ``save_on_rank`` (the checkpoint's recipient) then seals
    the directory with a manifest of them, flushes it and renames it into place; older checkpoints are removed
    only after that. A directory under a checkpoint's name is always complete. Every rank must see the same
    ``dirname`` (a shared file system).

    Args:
        dirname: directory in which checkpoint directories are written.
        create_dir: if True, create ``dirname`` when it does not exist.
        require_empty: if True, raise when ``dirname`` already holds ``.dcp`` checkpoints.
        save_on_rank: the rank that seals and removes checkpoints. ``None`` (default) lets
            :class:`~ignite_zero.Checkpoint` pick its ``consolidate_recipient_rank``; on its own, rank 0.
        thread_count: threads that write each rank's files.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, ShardedSaver

            checkpoint = Checkpoint(to_save, ShardedSaver("/shared/ckpt", require_empty=False), n_saved=2)
            trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
            # later, on any number of ranks:
            Checkpoint.load_objects(to_load=to_save, checkpoint="/shared/ckpt/checkpoint_300.dcp")

    .. versionadded:: 0.1.0
    """

    ext = "dcp"

    def __init__(
        self,
        dirname: str | Path,
        create_dir: bool = True,
        require_empty: bool = True,
        save_on_rank: int | None = None,
        thread_count: int = 1,
    ) -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"Argument `thread_count` should be a positive integer, got {thread_count!r}")
        self.thread_count = thread_count
        self._async_writer: sharded.ChecksummingWriter | None = None  # kept, with its host copies, between saves
        super().__init__(dirname, create_dir, require_empty, save_on_rank)

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        """Collective: save ``checkpoint`` (this rank's part of it) as the directory ``filename``."""
        self.save_state(checkpoint, filename)

    def save(self, objects: Any, request: SaveRequest) -> None:
        state = self._part(objects, request)
        if state is None:
            return
        self.save_state(
            state,
            request.filename,
            group=_dcp_group(request, dedicated=False),
            timeout=request.timeout,
            stream=request.stream,
            ranks=request.ranks,
        )
        self._remove_displaced(request)

    def stage(self, objects: Any, request: SaveRequest) -> Callable[[], None]:
        """Let DCP copy this rank's part into host memory it keeps for the next save; the returned work waits for
        DCP's write and seals the directory."""
        state = self._part(objects, request)
        if state is None:
            return lambda: None
        finish = self.save_state_async(
            state,
            request.filename,
            group=_dcp_group(request, dedicated=True),
            timeout=request.timeout,
            stream=request.stream,
            ranks=request.ranks,
        )

        def work() -> None:
            finish()
            self._remove_displaced(request)

        return work

    def _part(self, objects: Any, request: SaveRequest) -> dict[str, Any] | None:
        """This rank's part of the checkpoint: sharded objects' own parts, and its share of the objects every rank
        holds; ``None`` when it writes nothing (a save of replicated state, written by the recipient alone)."""
        rank, world_size = rank_and_world()
        if request.collective and len(request.ranks) != world_size:
            raise ValueError(
                f"A sharded checkpoint is written by every rank, but the sharded objects of this save live on ranks "
                f"{list(request.ranks)} of {world_size}. Save them with a DiskSaver instead."
            )
        if not request.collective:
            if not request.is_recipient:
                return None
            rank, world_size = 0, 1

        def part(_: tree.Path, obj: Any) -> Any:
            if isinstance(obj, ShardedState):
                return obj.sharded_state_dict()
            return sharded.share(obj.state_dict(), rank, world_size, request.recipient if request.collective else 0)

        state = tree.map_tree(part, objects)
        state = {} if state is tree.OMIT else state
        if request.is_recipient:
            state.update(request.extra)
        return state

    def _remove_displaced(self, request: SaveRequest) -> None:
        for filename in request.removed:
            self.remove(filename)

    def save_state(
        self,
        state: Mapping,
        filename: str,
        *,
        group: Any = None,
        timeout: float = DEFAULT_SYNC_TIMEOUT,
        stream: str = "main",
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Collective: write every rank's ``state`` as the checkpoint directory ``filename``, and seal it.

        Args:
            state: this rank's part: plain tensors and values, ``DTensor``s and ``ShardedTensor``s.
            filename: name of the directory.
            group: gloo process group of every rank for DCP's own collectives; ``None`` for the default group.
            timeout: seconds ranks wait for each other around the write.
            stream: stream of agreement rounds (see :func:`ignite_zero.agreement.agree`).
            ranks: the ranks that write; one rank alone writes the whole directory without collectives.
        """
        partial, writer = self._begin(state, filename, timeout, stream, ranks, cache=False)
        failure = None
        started = time.perf_counter()
        try:
            dcp.save(dict(state), storage_writer=writer, process_group=group, no_dist=_alone(ranks))
        except (Exception, CheckpointException) as error:  # DCP's exception derives from BaseException
            failure = error
        self._commit(filename, partial, writer, failure, timeout, stream, ranks, started)

    def save_state_async(
        self, state: Mapping, filename: str, *, group: Any, timeout: float, stream: str, ranks: Sequence[int] | None
    ) -> Callable[[], None]:
        """Collective: stage this rank's ``state`` into host memory (the only part that blocks) and start writing
        it; return the function that waits for the write and seals the directory, to run in another thread.

        DCP keeps the host copies for the next save (``cache_staged_state_dict``); ``group`` must be a gloo group
        of its own (see :func:`ignite_zero.groups.cpu_group`), since DCP's collectives then run beside training.
        """
        partial, writer = self._begin(state, filename, timeout, stream, ranks, cache=True)
        started = time.perf_counter()
        # a Future: with DCP's default stager, staging is done once async_save returns
        future = cast(
            Future, dcp.async_save(dict(state), storage_writer=writer, process_group=group, no_dist=_alone(ranks))
        )

        def finish() -> None:
            failure = None
            try:
                future.result()
            except (Exception, CheckpointException) as error:
                failure = error
            self._commit(filename, partial, writer, failure, timeout, stream, ranks, started)

        return finish

    def _begin(
        self, state: Mapping, filename: str, timeout: float, stream: str, ranks: Sequence[int] | None, cache: bool
    ) -> tuple[Path, sharded.ChecksummingWriter]:
        """Collective: the writing rank clears what an interrupted save left and makes the temporary directory;
        every rank learns whether the parts of all ranks fit on the disk."""
        final = self.path(filename)
        partial = final.with_name(f".{final.name}.ignite_zero-partial.tmp")
        failure, free = None, None
        if self.is_writer:
            try:
                self._prepare()
                self._remove_temporaries()
                partial.mkdir()
                free = shutil.disk_usage(self.dirname).free
            except Exception as error:
                failure = error
        # an upper estimate: objects that every rank holds are counted on each, though written once
        reports = settle(
            failure,
            what=f"preparation of {filename}",
            timeout=timeout,
            stream=stream,
            payload=(serialized_size(state), free),
            ranks=ranks,
        )
        needed = sum(size for size, _ in reports)
        free = next(space for _, space in reports if space is not None)
        if needed > free:
            raise OSError(
                errno.ENOSPC,
                f"Not enough disk space for checkpoint {final}: its parts need up to {needed / 1e6:.1f} MB, "
                f"{free / 1e6:.1f} MB are free (older checkpoints are removed only after the new one is written). "
                "Free some space, write elsewhere, or lower `n_saved`.",
            )
        if not cache:
            writer = sharded.ChecksummingWriter(partial, self.thread_count)
        else:  # one writer for every asynchronous save: its host copies are reused
            if self._async_writer is None:
                self._async_writer = sharded.ChecksummingWriter(
                    partial, self.thread_count, cache_staged_state_dict=True
                )
            writer = self._async_writer
            writer.reset(partial)
        writer.written.clear()
        return partial, writer

    def _commit(
        self,
        filename: str,
        partial: Path,
        writer: sharded.ChecksummingWriter,
        failure: BaseException | None,
        timeout: float,
        stream: str,
        ranks: Sequence[int] | None,
        started: float,
    ) -> None:
        """Collective: every rank's files to the writing rank, which seals the directory and renames it into place."""
        files = settle(
            failure,
            what=f"sharded save of {filename}",
            timeout=timeout,
            payload=dict(writer.written),
            stream=stream,
            ranks=ranks,
        )
        if not self.is_writer:
            return
        listed = {name: record for rank_files in files for name, record in rank_files.items()}
        sharded.seal(partial, listed, world_size=len(files), torch=torch.__version__, ignite_zero=_package_version())
        _fsync_directory(partial)
        final = self.path(filename)
        _install_directory(partial, final)
        _fsync_directory(final.parent)
        size = sum(size for size, _ in listed.values())
        logger.info(
            "Saved %s (%.1f MB, %d files) in %.2f s", final, size / 1e6, len(listed), time.perf_counter() - started
        )


def _alone(ranks: Sequence[int] | None) -> bool:
    """Whether one rank writes a whole sharded checkpoint by itself, with no collective."""
    return ranks is not None and len(ranks) == 1


def _dcp_group(request: SaveRequest, dedicated: bool) -> Any:
    """The gloo group of every rank for ``torch.distributed.checkpoint``'s collectives; ``None`` without one. An
    asynchronous save's group is its stream's own."""
    if not request.collective:
        return None
    return cpu_group(dedicated=request.stream if dedicated else None)


def _install_directory(source: Path, target: Path) -> None:
    """Put the directory ``source`` at ``target``, replacing a previous ``target`` atomically where Linux can."""
    if not target.exists():
        os.replace(source, target)
        return
    if _exchange(source, target):  # target now holds the new checkpoint, source the old one
        shutil.rmtree(source)
        return
    # Without an atomic exchange: the old directory steps aside under a temporary name first.
    aside = target.with_name(f".{target.name}.ignite_zero-old.tmp")
    os.replace(target, aside)
    os.replace(source, target)
    shutil.rmtree(aside)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EXDEV):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(second))


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
        if isinstance(value, DTensor):
            value = value.to_local()
        if callable(getattr(value, "local_shards", None)):  # a ShardedTensor: this rank's shards are its part
            for shard in value.local_shards():
                visit(shard.tensor)
            return
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


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


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
