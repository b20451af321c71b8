"""The process that writes the files of asynchronous sharded saves, so that their work per entry leaves the
training loop's interpreter alone.

A thread that writes a save in the training process holds the interpreter for everything it does in Python: the
records and checksums of every entry, thousands of them in a state of many small tensors. A loop bound by Python (as
a GPU loop's host thread is) slows down by as much while the save runs. So each rank keeps a helper process, started
at its first asynchronous save large enough to slow the loop (:func:`worth_a_process`), which maps the save's host
copies (a :class:`~ignite_zero.staging.SharedBlock`) and writes each file from them with
:func:`~ignite_zero.storage.formats.dcp_files.write_entries`, the code a thread would run, while the saving thread
waits on a socket without holding the interpreter.

The helper is a new interpreter (not a fork of a process with CUDA and process groups) that runs this module. It
ignores signals (a job's scheduler signals every process of the job) and exits when its socket closes, as it does
when its parent exits. If it dies, the thread writes the file it was to write from the same host copies, and the next
save starts another helper; if none can start here, threads write every file, as they do without a helper.
"""

from __future__ import annotations

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ignite_zero.staging import SharedBlock, SharedTensor, shared_tensor
from ignite_zero.storage.formats.dcp_files import FileWritten, write_entries
from ignite_zero.storage.places import Place

__all__ = ["PROCESS_BYTES", "PROCESS_ENTRIES", "WriteProcess", "serve", "worth_a_process"]

logger = logging.getLogger(__name__)

#: A rank's part of a save with at least this many entries, or this many bytes, is written by its helper: below both,
#: a thread writes it in milliseconds, less than the helper costs (a new interpreter: about 3 s of a core to start,
#: and the resident memory of one that imported torch, about 0.3 GB).
PROCESS_ENTRIES, PROCESS_BYTES = 256, 64 << 20
# The directory that holds this ignite_zero package.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
# A message: its kind and the length of the pickle that follows.
_HEADER = struct.Struct("<cQ")
_BLOCK, _WRITE, _DONE, _FAILED = b"B", b"W", b"D", b"F"


def worth_a_process(entries: Sequence[Any], block: SharedBlock) -> bool:
    """Whether a rank's part of a save, its ``entries`` copied into ``block``, is large enough for its helper
    (:data:`PROCESS_ENTRIES`, :data:`PROCESS_BYTES`)."""
    return len(entries) >= PROCESS_ENTRIES or block.size >= PROCESS_BYTES


class WriteProcess:
    """A helper process that writes files of entries whose tensors lie in shared blocks; started by the first write,
    and again by the first write after it ended."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None
        self._mapped: str | None = None  # the token of the block the helper maps
        self._answered = False  # whether the helper now running wrote a file
        self._unavailable: str | None = None  # why no helper can run here, once one failed before its first file
        self._lock = threading.Lock()  # one file at a time: the files of a save by several threads take turns

    @property
    def pid(self) -> int | None:
        """The helper's process id while it runs; ``None`` before the first write and after it ended."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def write(self, place: Place, name: str, entries: list[Any], block: SharedBlock) -> FileWritten:
        """Write the file ``name`` of ``place`` in the helper, as :func:`write_entries` would: each of ``entries`` a
        value's bytes or a tensor of ``block``.

        A helper that ends before it answers (killed, out of memory) leaves the file to this thread, from the same
        host copies, with a warning; the next call starts another. One that could not write a first file (no
        interpreter to start, say) leaves every later file to the calling thread too.

        Raises:
            Exception: what the write raised in the helper (``OSError`` for a full disk, say).
        """
        described = [block.where(entry) if isinstance(entry, torch.Tensor) else bytes(entry) for entry in entries]
        with self._lock:
            if self._unavailable is None:
                try:
                    kind, answer = self._ask(block, (block.token, place, name, described))
                except (OSError, EOFError) as error:
                    self._failed(name, error)
                else:
                    if kind == _FAILED:
                        raise answer
                    return FileWritten(*answer)
        return write_entries(place, name, entries)

    def _ask(self, block: SharedBlock, job: tuple[Any, ...]) -> tuple[bytes, Any]:
        """Send ``job`` to the helper (and ``block`` first, where it maps another); its answer."""
        connection = self._connection()
        if self._mapped != block.token:
            _send(connection, _BLOCK, (block.token, block.size), fds=[block.fd])
            self._mapped = block.token
        _send(connection, _WRITE, job)
        answer = _receive(connection)
        self._answered = True
        return answer

    def _failed(self, name: str, error: BaseException) -> None:
        answered, code = self._answered, self._stop()
        what = f"The process that writes asynchronous saves ended (exit code {code}) while it was to write {name}"
        if answered:
            logger.warning("%s (%s); this thread writes it, and the next save starts another", what, error)
        else:
            self._unavailable = f"{what}, its first file ({error})"
            logger.warning("%s; this process's threads write every file of its saves", self._unavailable)

    def _connection(self) -> socket.socket:
        if self._socket is not None and self._process is not None and self._process.poll() is None:
            return self._socket
        self._stop()
        ours, theirs = socket.socketpair()
        try:
            # This very ignite_zero, and the torch of this process's path, whatever put them there.
            paths = [_PACKAGE_ROOT, *(path or os.getcwd() for path in sys.path)]
            environment = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
            code = f"from ignite_zero.storage.savers.write_process import serve; serve({theirs.fileno()})"
            self._process = subprocess.Popen(
                [sys.executable, "-c", code],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=environment,
                start_new_session=True,  # a Ctrl-C in the terminal goes to the training process alone
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket, self._mapped, self._answered = ours, None, False
        weakref.finalize(self, _close, ours, self._process)
        return ours

    def _stop(self) -> int | None:
        """Close the connection (the helper exits when it sees it closed); the helper's exit code, if it ended."""
        process, connection = self._process, self._socket
        self._process, self._socket, self._mapped = None, None, None
        if connection is not None:
            connection.close()
        if process is None:
            return None
        try:
            return process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()


def _close(connection: socket.socket, process: subprocess.Popen[bytes]) -> None:
    connection.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


def _send(connection: socket.socket, kind: bytes, payload: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(kind, len(data))
    if fds:
        socket.send_fds(connection, [header], fds)  # the descriptors travel with the header, a few bytes
    else:
        connection.sendall(header)
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
    """The helper's loop: map each block it is sent, write each file it is asked for, answer with what was written or
    the error; return when the connection closes."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_IGN)  # its parent decides when it ends, by closing the connection
    torch.set_num_threads(1)
    connection = socket.socket(fileno=fd)
    blocks: dict[str, mmap.mmap] = {}
    while True:
        try:
            kind, payload, fds = _receive_with_fds(connection)
        except EOFError:
            return
        if kind == _BLOCK:
            token, size = payload
            blocks = {token: mmap.mmap(fds[0], size)}  # a save's block replaces the last one
            os.close(fds[0])
            continue
        token, place, name, described = payload
        try:
            entries = [shared_tensor(blocks[token], e) if isinstance(e, SharedTensor) else e for e in described]
            written = write_entries(place, name, entries)
            del entries
            _send(connection, _DONE, tuple(written))
        except Exception as error:
            try:
                answer = pickle.dumps(error)
                pickle.loads(answer)
            except Exception:  # an error that does not travel: its text does
                error = RuntimeError(f"{type(error).__name__}: {error}")
            _send(connection, _FAILED, error)
