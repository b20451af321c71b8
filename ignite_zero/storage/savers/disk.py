"""Single checkpoint files: :class:`DiskSaver`, the drop-in for ignite's saver of the same name.

One rank writes one file, which appears whole or not at all (:meth:`ignite_zero.storage.places.Place.write`: a
temporary file flushed and renamed on a local file system, a temporary object copied on the server on an object
store), so that a crash at any point leaves either the previous file or the complete new one. Old checkpoints are
removed only once the new one is durable.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import IO, Any, NamedTuple

import numpy
import torch

from ignite_zero.agreement import rank_and_world
from ignite_zero.naming import check_filename
from ignite_zero.staging import HostBuffers
from ignite_zero.storage.formats import torch_zip
from ignite_zero.storage.formats.file_trailer import write_sealed
from ignite_zero.storage.places import LocalPlace, Place
from ignite_zero.storage.savers.base import SaveRequest
from ignite_zero.storage.savers.consolidated import ConsolidatingSaver
from ignite_zero.storage.savers.destination import (
    DirectorySaver,
    check_room,
    package_version,
    serialized_size,
)
from ignite_zero.storage.savers.write_process import SharedCheckpoint, WriteProcess, shared_copy
from ignite_zero.transport import Overlap

__all__ = ["DiskSaver"]

logger = logging.getLogger(__name__)

# torch.save as this module found it: a patched one (a test's mock, say) is called instead of our own writer.
_TORCH_SAVE = torch.save
# The keywords of torch.save that our own writer honours as torch.save would.
_HONOURED_KEYWORDS = {"pickle_protocol"}


class DiskSaver(DirectorySaver, ConsolidatingSaver):
    """Durable, rank-aware disk saver: the drop-in for :class:`ignite.handlers.DiskSaver`.

    Args:
        dirname: directory in which checkpoints are written: a path, or an fsspec URL (``s3://bucket/run``).
        atomic: if True (default), write to a temporary file in ``dirname`` and rename it (on an object store:
            copy it on the server), so that a crash never leaves a partial file under a checkpoint's name. If
            False, write in place (for file systems without rename); the integrity trailer still exposes a
            partial file.
        create_dir: if True, create ``dirname`` when it does not exist.
        require_empty: if True, raise when ``dirname`` already holds ``.pt`` files,
            unless :meth:`Checkpoint.load_latest <ignite_zero.Checkpoint.load_latest>` resumed from them.
        save_on_rank: the only rank that writes. ``None`` (default) lets
            :class:`~ignite_zero.Checkpoint` pick its ``consolidate_recipient_rank``; on its own, rank 0.
        kwargs: keyword arguments of :func:`torch.save`. ``pickle_protocol`` is honoured by the package's own
            writer, which streams the state to the file at any size. Any other (``pickle_module``,
            ``_use_new_zipfile_serialization``, ``_disable_byteorder_record``) hands the write to :func:`torch.save`,
            which needs every byte of the state in memory first: a consolidated save then holds the whole state
            on the recipient. With ``_use_new_zipfile_serialization=False`` the file is in torch's legacy format:
            written as durably, but without integrity trailer (it has no zip comment to carry one), and loaded
            without ``mmap``.
        storage_options: options of the URL's file system (for S3: ``endpoint_url``, ``key``, ``secret``...),
            as fsspec takes them; for URLs only.
        defer_require_empty: if True, ``require_empty`` is checked by
            :meth:`Checkpoint.load_latest <ignite_zero.Checkpoint.load_latest>`, after it allowed the checkpoints
            it resumed from, or else by the first save; not when the saver is made, where ignite's checks it. What
            a :class:`~ignite_zero.Checkpoint` given a path makes.

    Differences from ignite's ``DiskSaver``, deliberate: the file and its directory are flushed to disk
    before the rename; new files get mode ``0o666 & ~umask`` (ignite adds group and world read); file names
    that would escape ``dirname`` are rejected; every file carries an integrity trailer
    (``ignite_zero.storage.formats.file``); removing a file that is already gone logs a warning instead of raising.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, DiskSaver

            saver = DiskSaver("ckpt", require_empty=False)
            handler = Checkpoint(to_save, saver, n_saved=2, consolidate_recipient_rank=1)
            trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)  # rank 1 writes the files

            # on an S3-compatible object store, at its endpoint (e.g. "https://minio.example.com:9000")
            saver = DiskSaver("s3://bucket/run", require_empty=False, storage_options={"endpoint_url": endpoint})

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        dirname: str | Path | Place,
        atomic: bool = True,
        create_dir: bool = True,
        require_empty: bool = True,
        save_on_rank: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        *,
        defer_require_empty: bool = False,
        **kwargs: Any,
    ) -> None:
        self._atomic = atomic
        self.kwargs = kwargs
        self._arriving: _Arriving | None = None  # during a save whose tensors' bytes are not all in their memory yet
        # each stream's copies of the checkpoints that the helper writes (two handlers of one saver may each have an
        # asynchronous save in flight)
        self._shared_copies: dict[str, HostBuffers] = {}
        super().__init__(
            dirname, create_dir, require_empty, save_on_rank, storage_options, defer_require_empty=defer_require_empty
        )

    def writes_here(self, request: SaveRequest) -> bool:
        return self.is_writer

    def write(self, content: Any, request: SaveRequest) -> None:
        self(content, request.filename, request.metadata)

    def write_arriving(self, content: Any, request: SaveRequest, arriving: Overlap) -> None:
        """Write each slice of a tensor as soon as its bytes have arrived, where this saver writes the archive
        itself; else (keywords only ``torch.save`` honours, a method replaced) once every byte has."""
        arrived = _Arriving(_arrived(arriving), arriving.finish)
        self._write_arriving(content, request.filename, arrived, request.metadata)

    def write_in_background(self, content: Any, request: SaveRequest, arriving: Overlap) -> None:
        """Write the checkpoint of an asynchronous save, in its thread: a checkpoint of many entries (or many bytes, up
        to a bound) is written by the saver's helper process once every byte has arrived, from a copy in shared
        memory, which leaves this process's interpreter to the training loop (see
        :func:`~ignite_zero.storage.savers.write_process.shared_copy`); any other, or where the helper ends before it
        answers, as :meth:`write_arriving` writes it."""
        shared = None
        if self.is_writer and self._helper_may_write():
            buffers = self._shared_copies.setdefault(request.stream, HostBuffers())
            shared = shared_copy(content, buffers, arriving.finish)
        if shared is None:
            self._shared_copies.pop(request.stream, None)  # a checkpoint its helper does not write keeps no copy
        elif self._write_in_helper(request.filename, shared):
            return
        self.write_arriving(content, request, arriving)

    def _helper_may_write(self) -> bool:
        """Whether the helper may write this saver's files as it would: torch's archive, written by this package, of
        a local file, by this class's own methods (code written for ignite replaces some), where a helper can run."""
        return (
            isinstance(self.place, LocalPlace)
            and self._writes_archive(_TORCH_SAVE)
            and _unchanged(self, "__call__", "write", "write_arriving", "_save_func", "_dump")
            and self._write_process.available
        )

    @functools.cached_property
    def _write_process(self) -> WriteProcess:
        return WriteProcess()

    def _write_in_helper(self, filename: str, shared: SharedCheckpoint) -> bool:
        """Write the checkpoint copied as ``shared`` as the file ``filename`` in the helper: whether it did."""
        with self._room_for(shared, filename):
            started = time.perf_counter()
            written = self._write_process.write_archive(
                self.place,
                filename,
                shared,
                atomic=self._atomic,
                pickle_protocol=self._pickle_protocol,
                facts=self._facts(),
            )
        if written:
            self._saved(filename, started)
        return written

    def write_streamed(
        self,
        checkpoint: Mapping,
        filename: str,
        source: Callable[[memoryview], Iterable[memoryview]],
        read_all: Callable[[], None],
    ) -> None:
        """Write ``checkpoint``, whose tensors' memory holds nothing yet, as the file ``filename``: ``source`` gives
        the bytes of each slice of that memory as the file is written (see
        :func:`~ignite_zero.storage.formats.torch_zip.write_archive`), so that the state is never held whole.

        Args:
            checkpoint: what the file holds.
            filename: its name in the directory.
            source: the bytes of a slice of a tensor's memory.
            read_all: fills every tensor's memory, for a write that ``torch.save`` makes (keywords only it
                honours, a method replaced), which reads the memory itself.
        """
        self._write_arriving(checkpoint, filename, _Arriving(source, read_all))

    def _write_arriving(
        self, checkpoint: Mapping, filename: str, arriving: _Arriving, metadata: Mapping | None = None
    ) -> None:
        if not (self._writes_archive(_TORCH_SAVE) and _unchanged(self, "_save_func", "_dump")):
            arriving.complete()  # whatever writes the file reads the tensors' memory itself
            self(checkpoint, filename, metadata)
            return
        self._arriving = arriving
        try:
            self(checkpoint, filename, metadata)
        finally:
            self._arriving = None

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        if not self.is_writer:
            return
        with self._room_for(checkpoint, filename):
            self._save_func(checkpoint, self.place.location(filename), torch.save)

    @contextlib.contextmanager
    def _room_for(self, checkpoint: Mapping | SharedCheckpoint, filename: str) -> Iterator[None]:
        """Check the directory, the name and the keywords, and make room for ``checkpoint`` as ``filename`` (what
        interrupted saves left removed, its size checked against the free space), for the block that writes it."""
        self._prepare()
        check_filename(filename)
        self._check_keywords()
        with self.writing(filename):
            self._remove_temporaries()
            self._check_room(checkpoint, filename)
            yield

    def _save_func(self, checkpoint: Mapping, path: Path | str, func: Callable[..., Any]) -> None:
        """Write ``checkpoint`` as the file ``path`` of this directory with ``func(checkpoint, file, **kwargs)``
        (``torch.save``), sealed with its integrity trailer: whole or not at all.

        The name and arguments of ignite's ``DiskSaver`` method, which code written for ignite patches and mocks.
        """
        filename = PurePosixPath(str(path)).name
        started = time.perf_counter()
        self.place.write(filename, lambda f: self._dump(checkpoint, f, func), atomic=self._atomic)
        self._saved(filename, started)

    def _saved(self, filename: str, started: float) -> None:
        logger.info(
            "Saved %s (%.1f MB) in %.2f s",
            self.place.location(filename),
            self.place.size(filename) / 1e6,
            time.perf_counter() - started,
        )

    def _dump(self, checkpoint: Mapping, f: IO[bytes], func: Callable[..., Any]) -> None:
        arriving = self._arriving

        def write(stream: IO[bytes]) -> None:
            if self._writes_archive(func):
                # torch.save's archive, written by us straight from tensor memory, faster than torch.save, and from
                # bytes still arriving (see docs/benchmarks.rst)
                source = None if arriving is None else arriving.source
                torch_zip.write_archive(stream, checkpoint, source, pickle_protocol=self._pickle_protocol)
            else:
                if arriving is not None:  # whatever writes it reads every byte: all must be there
                    arriving.complete()
                func(checkpoint, stream, **self.kwargs)

        # the legacy format is no zip: no trailer
        write_sealed(f, write, self._facts() if self.kwargs.get("_use_new_zipfile_serialization", True) else None)

    @property
    def _pickle_protocol(self) -> int:
        return self.kwargs.get("pickle_protocol", torch_zip.PICKLE_PROTOCOL)

    @staticmethod
    def _facts() -> dict[str, Any]:
        """What a file's integrity trailer records for ``ignite-zero inspect``."""
        return {"world_size": rank_and_world()[1], "torch": torch.__version__, "ignite_zero": package_version()}

    def _writes_archive(self, func: Callable[..., Any]) -> bool:
        """Whether :mod:`~ignite_zero.storage.formats.torch_zip` writes the checkpoint instead of ``func``: in place
        of torch.save itself, given none but the keywords that writer honours."""
        return func is _TORCH_SAVE and self.kwargs.keys() <= _HONOURED_KEYWORDS

    def _check_keywords(self) -> None:
        """Refuse keywords that ``torch.save`` does not take before any file is opened. At the save, not when the
        saver is made: ignite's ``DiskSaver`` takes any keyword there, and raises this ``TypeError`` here."""
        try:
            inspect.signature(torch.save).bind(None, None, **self.kwargs)
        except TypeError as error:
            accepted = [name for name in inspect.signature(torch.save).parameters if name not in ("obj", "f")]
            raise TypeError(
                f"save() {error}: DiskSaver passes its keyword arguments to torch.save, which takes {accepted}"
            ) from None

    def _check_room(self, checkpoint: Mapping | SharedCheckpoint, filename: str) -> None:
        """Fail before writing, clearly, when the new file cannot fit beside the ones it will replace."""
        free = self.place.free_space()
        if free is None:
            needed = 0
        elif isinstance(checkpoint, SharedCheckpoint):  # sized by its copy, without a walk over every entry
            needed = checkpoint.serialized_size
        else:
            needed = serialized_size(checkpoint)
        check_room(self.place, filename, needed, free)


class _Arriving(NamedTuple):
    """Bytes of a checkpoint's tensors that are not in their memory yet."""

    source: Callable[[memoryview], Iterable[memoryview]]  # the bytes of a slice of that memory, once there
    complete: Callable[[], None]  # puts every byte in its memory


def _unchanged(saver: DiskSaver, *names: str) -> bool:
    """Whether ``saver``'s methods ``names`` are DiskSaver's own (code written for ignite replaces ``_save_func``)."""
    return all(name not in vars(saver) and getattr(type(saver), name) is getattr(DiskSaver, name) for name in names)


def _arrived(arriving: Overlap) -> Callable[[memoryview], list[memoryview]]:
    """The bytes of a slice of a tensor's memory, once they have arrived (see :meth:`Overlap.bytes_of`)."""

    def source(piece: memoryview) -> list[memoryview]:
        return arriving.bytes_of(numpy.frombuffer(piece, dtype=numpy.uint8).ctypes.data, piece)

    return source
