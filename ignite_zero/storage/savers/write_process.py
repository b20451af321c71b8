"""The process that writes the files of asynchronous saves, so that their work per entry leaves the training loop's
interpreter alone.

A thread that writes a save in the training process holds the interpreter for everything it does in Python: the
records and checksums of every entry, thousands of them in a state of many small tensors. A loop bound by Python (as
a GPU loop's host thread is) slows down by as much while the save runs. So each saver of a rank keeps a helper
process, started at its first asynchronous save large enough to slow the loop (:func:`worth_a_process`), which maps the
save's host copies (a :class:`~ignite_zero.staging.SharedBlock`) and writes each file from them with
:func:`~ignite_zero.storage.formats.dcp_files.write_entries`, the code a thread would run, while the saving thread
waits on a socket without holding the interpreter.

The helper is a new interpreter (not a fork of a process with CUDA and process groups) that runs this module. It
ignores signals (a job's scheduler signals every process of the job) and exits when its socket closes, as it does
when its parent exits. If it dies, the thread writes the file it was to write from the same host copies, and the next
save starts another helper; if none can start here, threads write every file, as they do without a helper.

The same helper writes a consolidated checkpoint of many entries (:meth:`WriteProcess.write_archive`) from a copy
of it in a shared block (:func:`shared_copy`): torch's archive of it, which a thread would pickle and write record by
record, holding the interpreter for as long.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch

from ignite_zero.pickling import join_tensors, split_plain
from ignite_zero.staging import HostBuffers, SharedBlock, makes_shared_blocks, shared_tensor
from ignite_zero.storage.formats import torch_zip
from ignite_zero.storage.formats.dcp_files import FileWritten, write_entries
from ignite_zero.storage.formats.file_trailer import write_sealed
from ignite_zero.storage.places import LocalPlace, Place

__all__ = [
    "ARCHIVE_BYTES",
    "PROCESS_BYTES",
    "PROCESS_ENTRIES",
    "SharedCheckpoint",
    "WriteProcess",
    "serve",
    "shared_copy",
    "worth_a_process",
]

logger = logging.getLogger(__name__)

#: A rank's part of a save with at least this many entries, or this many bytes, is written by its helper: below both,
#: a thread writes it in milliseconds, less than the helper costs (a new interpreter: about 3 s of a core to start,
#: and the resident memory of one that imported torch, about 0.3 GB).
PROCESS_ENTRIES, PROCESS_BYTES = 256, 64 << 20
#: The largest consolidated checkpoint its helper writes: the rank that writes it keeps a copy of it in shared memory
#: from one save to the next, so a larger one is written by the save's thread, from where it lies.
ARCHIVE_BYTES = 256 << 20
# The directory that holds this ignite_zero package.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
# A message: its kind and the length of the pickle that follows.
_HEADER = struct.Struct("<cQ")
_WRITE, _DONE, _FAILED = b"W", b"D", b"F"
# What a job asks the helper to write.
_ENTRIES, _ARCHIVE = "entries", "archive"


def worth_a_process(entries: Sequence[Any], block: SharedBlock) -> bool:
    """Whether a rank's part of a save, its ``entries`` copied into ``block``, is large enough for its helper
    (:data:`PROCESS_ENTRIES`, :data:`PROCESS_BYTES`)."""
    return len(entries) >= PROCESS_ENTRIES or block.size >= PROCESS_BYTES


class SharedCheckpoint(NamedTuple):
    """A consolidated checkpoint copied for its helper (see :func:`shared_copy`).

    Attributes:
        structure: the checkpoint without its tensors (:func:`~ignite_zero.pickling.split_plain`).
        tensors: copies of its tensors, in order, in ``block``.
        block: the shared block the helper maps.
    """

    structure: bytes
    tensors: list[torch.Tensor]
    block: SharedBlock

    @property
    def serialized_size(self) -> int:
        """Upper estimate of the bytes of its file, as
        :func:`~ignite_zero.storage.savers.destination.serialized_size` gives it: its tensors' bytes, the records
        and pickled description of each, and its structure."""
        return self.block.size + 384 * len(self.tensors) + len(self.structure) + (1 << 16)


def shared_copy(checkpoint: Any, buffers: HostBuffers, arrived: Callable[[], None]) -> SharedCheckpoint | None:
    """``checkpoint`` with its tensors copied into ``buffers``, kept for the next save, in shared memory, once
    ``arrived()`` put every byte in their memory: where its helper may write it, as :func:`torch.save` would from the
    checkpoint itself; else ``None``, before ``arrived()``, so that a larger checkpoint is still written as its bytes
    arrive, never held whole.

    That is a checkpoint large enough for a helper (:func:`worth_a_process`), up to :data:`ARCHIVE_BYTES`, of
    nothing but plain values (see :func:`~ignite_zero.pickling.split_plain`) and tensors that ``torch.save`` writes
    as their bytes alone (:func:`~ignite_zero.storage.formats.torch_zip.saved_as_its_bytes`), no two in the same
    memory (which it writes once), on a system that makes shared blocks.
    """
    split = split_plain(checkpoint, torch_zip.saved_as_its_bytes) if makes_shared_blocks() else None
    if split is None:
        return None
    structure, tensors = split
    nbytes = sum(tensor.nbytes for tensor in tensors)
    if (len(tensors) < PROCESS_ENTRIES and nbytes < PROCESS_BYTES) or nbytes > ARCHIVE_BYTES:
        return None
    addresses = [tensor.data_ptr() for tensor in tensors if tensor.nbytes]
    if len(set(addresses)) < len(addresses):
        return None
    arrived()
    copies = buffers.copy(tensors)
    return None if buffers.block is None else SharedCheckpoint(structure, copies, buffers.block)


class WriteProcess:
    """A helper process that writes files whose tensors lie in shared blocks; started by the first write, and again by
    the first write after it ended. Each :class:`~ignite_zero.ShardedSaver` and :class:`~ignite_zero.DiskSaver` of a
    rank keeps one."""

    def __init__(self) -> None:
        self._helper: _Helper | None = None
        self._answered = False  # whether any helper of this one wrote a file
        self._unavailable: str | None = None  # why no helper can run here, once the first one failed its first file
        self._lock = threading.Lock()  # one file at a time: the files of a save by several threads take turns
        self._described: tuple[tuple[str, list[int | None]], bytes] | None = None  # the last tensors described
        _every_process.add(self)

    @property
    def available(self) -> bool:
        """Whether writes go to a helper: false once the first helper could not write a first file, when every write
        is left to the calling thread."""
        return self._unavailable is None

    @property
    def pid(self) -> int | None:
        """The helper's process id while it runs; ``None`` before the first write and after it ended."""
        helper = self._helper
        return helper.process.pid if helper is not None and helper.process.poll() is None else None

    def write(self, place: Place, name: str, entries: list[Any], block: SharedBlock) -> FileWritten:
        """Write the file ``name`` of ``place`` in the helper, as :func:`write_entries` would: each of ``entries`` a
        value's bytes or a tensor of ``block``.

        A helper that ends before it answers (killed, out of memory) leaves the file to this thread, from the same
        host copies, with a warning; the next call starts another. Where the first helper could not write a first
        file (no interpreter to start, say), every later file is left to the calling thread too.

        Raises:
            Exception: what the write raised in the helper (``OSError`` for a full disk, say).
        """
        place = _absolute(place)
        with self._lock:
            if self._unavailable is None:
                tensors, values = self._describe(entries, block)
                answer = self._run(name, block, (_ENTRIES, place, name, tensors, values))
                if answer is not None:
                    return FileWritten(*answer)
        return write_entries(place, name, entries)

    def write_archive(
        self, place: Place, name: str, checkpoint: SharedCheckpoint, *, atomic: bool, pickle_protocol: int, facts: Any
    ) -> bool:
        """Write ``checkpoint`` as the file ``name`` of ``place`` in the helper, sealed with ``facts``, as
        :class:`~ignite_zero.DiskSaver` writes it (``atomic``: through a temporary file): whether it did. A helper
        that ends before it answers leaves the file to the caller, as :meth:`write` does.

        Raises:
            Exception: what the write raised in the helper (``OSError`` for a full disk, say).
        """
        place = _absolute(place)
        with self._lock:
            if self._unavailable is None:
                tensors, _ = self._describe(checkpoint.tensors, checkpoint.block)
                job = (_ARCHIVE, place, name, atomic, checkpoint.structure, tensors, pickle_protocol, facts)
                return self._run(name, checkpoint.block, job) is not None
        return False

    def _run(self, name: str, block: SharedBlock, job: tuple[Any, ...]) -> Any:
        """The helper's answer to ``job``, which writes the file ``name`` from ``block``; ``None`` where it ended
        before it answered."""
        try:
            kind, answer = self._ask(block, job)
        except (OSError, EOFError) as error:
            self._failed(name, error)
            return None
        if kind == _FAILED:
            raise answer
        return answer

    def _describe(self, entries: list[Any], block: SharedBlock) -> tuple[bytes, dict[int, bytes]]:
        """Where the helper finds each tensor of ``entries`` in ``block`` (``None`` at a value), pickled once while
        the same tensors come in the same order, as the host copies kept between saves do; and each value's bytes,
        by position."""
        key = (block.token, [id(entry) if isinstance(entry, torch.Tensor) else None for entry in entries])
        if self._described is None or self._described[0] != key:
            where = [block.where(entry) if isinstance(entry, torch.Tensor) else None for entry in entries]
            self._described = (key, pickle.dumps(where, protocol=pickle.HIGHEST_PROTOCOL))
        values = {n: bytes(entry) for n, entry in enumerate(entries) if not isinstance(entry, torch.Tensor)}
        return self._described[1], values

    def _ask(self, block: SharedBlock, job: tuple[Any, ...]) -> tuple[bytes, Any]:
        """Send ``job`` to the helper with ``block``'s descriptor (it maps the block for the job alone); its answer."""
        helper = self._helper
        if helper is None or helper.process.poll() is not None:
            self.close()
            helper = self._helper = _Helper.start()
        _send(helper.connection, _WRITE, job, fds=[block.fd])
        answer = _receive(helper.connection)
        self._answered = True
        return answer

    def _failed(self, name: str, error: BaseException) -> None:
        code = self.close()
        what = f"The process that writes asynchronous saves ended (exit code {code}) while it was to write {name}"
        if self._answered:
            logger.warning("%s (%s); this thread writes it, and the next save starts another", what, error)
        else:
            self._unavailable = f"{what}, its first file ({error})"
            logger.warning("%s; this process's threads write every file of its saves", self._unavailable)

    def close(self) -> int | None:
        """End the helper now (it exits when its connection closes, or is killed 10 s later); its exit code, ``None``
        if none ran. The next write starts another."""
        helper, self._helper = self._helper, None
        if helper is None:
            return None
        helper.close()
        return helper.process.returncode

    def _forget_in_forked_child(self) -> None:
        """In a child forked from this process: let go of the parent's helper, which only the parent may talk to."""
        self._lock = threading.Lock()  # another thread of the parent may have held it at the fork
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.close.detach()
            helper.connection.close()


def _absolute(place: Place) -> Place:
    """``place`` with an absolute path: the helper has its own working directory."""
    if isinstance(place, LocalPlace) and not place.path.is_absolute():
        return LocalPlace(place.path.absolute())
    return place


class _Helper:
    """A running helper: its process and the connection to it, closed (and the process waited for) once."""

    def __init__(self, process: subprocess.Popen[bytes], connection: socket.socket) -> None:
        self.process, self.connection = process, connection
        self.close = weakref.finalize(self, _close, connection, process)

    @classmethod
    def start(cls) -> _Helper:
        if not sys.executable:
            raise OSError("no Python interpreter to start: sys.executable is empty")
        ours, theirs = socket.socketpair()
        # This very ignite_zero first, then this process's path, whatever put its entries there; in isolated mode
        # (-I) so that the working directory and the environment add nothing before the path is set.
        paths = [_PACKAGE_ROOT, *(path or os.getcwd() for path in sys.path)]
        code = (
            "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
            "from ignite_zero.storage.savers.write_process import serve; serve(int(sys.argv[2]))"
        )
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-c", code, json.dumps(paths), str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the terminal goes to the training process alone
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(process, ours)


def _close(connection: socket.socket, process: subprocess.Popen[bytes]) -> None:
    connection.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# Every WriteProcess of this process: a child forked from it (a data loader's worker) closes their connections, or
# their helpers would wait for the child too before they see their parent gone.
_every_process: weakref.WeakSet[WriteProcess] = weakref.WeakSet()


def _forget_helpers_in_child() -> None:
    for process in list(_every_process):
        process._forget_in_forked_child()


os.register_at_fork(after_in_child=_forget_helpers_in_child)


def _send(connection: socket.socket, kind: bytes, payload: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(kind, len(data))
    sent = socket.send_fds(connection, [header], fds) if fds else 0  # the descriptors travel with the header
    connection.sendall(header[sent:])
    connection.sendall(data)


def _receive(connection: socket.socket) -> tuple[bytes, Any]:
    kind, payload, _ = _receive_with_fds(connection)
    return kind, payload


def _receive_with_fds(connection: socket.socket) -> tuple[bytes, Any, list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, 1)
    while 0 < len(header) < _HEADER.size:
        more = connection.recv(_HEADER.size - len(header))
        if not more:
            break
        header += more
    if len(header) < _HEADER.size:
        raise EOFError("the connection closed")
    kind, length = _HEADER.unpack(header)
    data = bytearray(length)
    view, received = memoryview(data), 0
    while received < length:
        count = connection.recv_into(view[received:])
        if not count:
            raise EOFError("the connection closed")
        received += count
    return kind, pickle.loads(data), fds


def serve(fd: int) -> None:
    """The helper's loop: write each file it is asked for, from the block whose descriptor comes with the request
    (mapped for that file alone), and answer with what was written or the error; return when the connection closes."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_IGN)  # its parent decides when it ends, by closing the connection
    torch.set_num_threads(1)
    connection = socket.socket(fileno=fd)
    while True:
        try:
            _, (kind, *job), fds = _receive_with_fds(connection)
        except EOFError:
            return
        try:
            answer: tuple[bytes, Any] = (_DONE, _JOBS[kind](_mapped(fds[0]), *job))
        except Exception as error:
            try:
                pickle.loads(pickle.dumps(error))
            except Exception:  # an error that does not travel: its text does
                error = RuntimeError(f"{type(error).__name__}: {error}")
            answer = (_FAILED, error.with_traceback(None))  # and the frames that hold the block go
        _send(connection, *answer)


def _mapped(fd: int) -> mmap.mmap:
    """The block of descriptor ``fd``, mapped for one job alone."""
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def _write_from(block: mmap.mmap, place: Place, name: str, tensors: bytes, values: dict[int, bytes]) -> tuple[Any, ...]:
    """Write the file ``name`` of ``place`` from ``block``: its entries are the tensors ``tensors`` describes (see
    :meth:`WriteProcess._describe`), and ``values`` by position."""
    described = pickle.loads(tensors)
    entries = [values[n] if where is None else shared_tensor(block, where) for n, where in enumerate(described)]
    return tuple(write_entries(place, name, entries))


def _write_archive_from(
    block: mmap.mmap,
    place: Place,
    name: str,
    atomic: bool,
    structure: bytes,
    tensors: bytes,
    pickle_protocol: int,
    facts: Any,
) -> tuple[()]:
    """Write the file ``name`` of ``place``: torch's archive of the checkpoint ``structure`` whose tensors are those
    ``tensors`` describes in ``block``, sealed with ``facts``."""
    checkpoint = join_tensors(structure, [shared_tensor(block, where) for where in pickle.loads(tensors)])

    def archive(stream: IO[bytes]) -> None:
        torch_zip.write_archive(stream, checkpoint, pickle_protocol=pickle_protocol)

    place.write(name, lambda f: write_sealed(f, archive, facts), atomic=atomic)
    return ()


_JOBS: dict[str, Callable[..., tuple[Any, ...]]] = {_ENTRIES: _write_from, _ARCHIVE: _write_archive_from}
