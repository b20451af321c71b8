"""Where checkpoints live: a local directory, or a prefix of an object store or any other file system behind an
fsspec URL (``s3://bucket/run``, ``gs://...``, ``memory://...``).

A :class:`Place` offers what the savers and readers need and nothing more: list, open for ranged reads, remove, and
the two ways of committing a write, which it alone knows how to make:

- :meth:`Place.write` makes a new file appear whole or not at all. On a local file system that is a temporary file,
  flushed to disk and renamed, then the directory flushed. An object store has no rename and nothing to flush. On S3
  the upload itself commits: an object appears once its upload completes (one ``PUT``, or a multipart upload's
  completion). Elsewhere the new object is uploaded under a hidden temporary key, copied to its name on the server,
  and the temporary key removed.
- :meth:`Place.begin_directory` and :meth:`Place.commit_directory` make a new directory, written by many processes,
  appear whole or not at all. Locally it is written under a hidden temporary name, flushed and renamed into place.
  A prefix of an object store cannot be renamed: its files are written in place, beside a mark that says the
  directory is unfinished, and it is whole once its seal (a file written last) is there; :meth:`Place.is_whole`
  asks that.

What a killed process left, :meth:`Place.leftovers` names, and the next save removes.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, cast

__all__ = [
    "LocalPlace",
    "Place",
    "RemotePlace",
    "StorageError",
    "StoredFile",
    "TEMPORARY",
    "fsync_path",
    "is_url",
    "place_of",
    "split",
    "temporary_name",
    "written_as",
]

# A URL's scheme: `s3://`, `gs://`, `memory://`...
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Ranged reads of objects: large enough to amortise a request's latency, small enough to bound memory.
READ_BLOCK = 8 << 20
# What a ranged read of a small part (a file's first byte, its tail, a record header, part of a tensor) fetches past
# what it asks for: with READ_BLOCK there, each look at a file's ends that a load takes would fetch a whole block.
SMALL_READ_BLOCK = 64 << 10


class StorageError(OSError):
    """A storage operation failed: the message names the URL and what the store answered."""


def is_url(place: str | Path) -> bool:
    """Whether ``place`` is a URL of another file system than the local one (``file://`` URLs are local paths)."""
    text = str(place)
    return bool(_SCHEME.match(text)) and not text.startswith("file://")


#: Names of temporary files and directories: hidden, and never ending in ".pt" or ".dcp", so that nothing takes them
#: for checkpoints.
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.ignite_zero-[0-9a-z]+\.tmp$")
# On an object store, where a new directory is written in place: the mark of one not yet whole, which tells the next
# save that the prefix is an interrupted write of ours (and not another tool's directory).
_UNFINISHED = ".ignite_zero-uncommitted"


def temporary_name(name: str) -> str:
    """The hidden name a new file is written under before it takes the name ``name``."""
    return f".{name}.ignite_zero-{uuid.uuid4().hex[:12]}.tmp"


def written_as(entry: str) -> str:
    """The name of the file or directory that ``entry`` (a name in a place, or a key's first part) is written for:
    the name a temporary will take, else ``entry`` itself."""
    temporary = TEMPORARY.match(entry)
    return temporary["name"] if temporary else entry


class Place(ABC):
    """A directory of checkpoints.

    Attributes:
        seen_alike_by_every_host: whether every host sees the same contents here (an object store), so that one
            rank reading it serves them all; a local path may be a different directory on each host.
        maps_files: whether its files can be mapped into memory (``torch.load(mmap=True)``), so that a read takes
            only the pages it touches and the ranks of a host share them; else files are read by ranges.
        storage_options: the options of its file system (for a URL), ``None`` for a local path.
    """

    seen_alike_by_every_host = False
    maps_files = False
    storage_options: dict[str, Any] | None = None

    @abstractmethod
    def __str__(self) -> str: ...

    @abstractmethod
    def location(self, name: str = "") -> str | Path:
        """What users are shown and given back for the entry ``name``: a path, or a URL."""

    @abstractmethod
    def child(self, name: str) -> Place:
        """The directory (or prefix) ``name`` inside this one."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether the directory exists (a prefix holding something, on an object store)."""

    @abstractmethod
    def make(self) -> None:
        """Create the directory with its parents; on an object store, check that the bucket is there."""

    def writable(self) -> bool:
        """Whether this process may create entries here; an object store tells only at the first write."""
        return True

    @abstractmethod
    def entries(self) -> dict[str, bool]:
        """The names directly inside, each mapped to whether it is a directory; empty if there is none."""

    @abstractmethod
    def file_sizes(self) -> dict[str, int]:
        """The files directly inside, each mapped to its size, from one listing; empty if there is none."""

    @abstractmethod
    def is_file(self, name: str) -> bool: ...

    @abstractmethod
    def is_dir(self, name: str) -> bool:
        """Whether ``name`` is a directory (a prefix holding something, on an object store)."""

    @abstractmethod
    def size(self, name: str) -> int: ...

    @abstractmethod
    def modified(self, name: str) -> float:
        """The entry's modification time, in seconds since the epoch."""

    @abstractmethod
    def open(self, name: str, block_size: int = READ_BLOCK) -> IO[bytes]:
        """The file ``name``, open for reading, seekable: on an object store, each read is a ranged ``GET`` of at
        least ``block_size`` bytes, kept for the reads that follow."""

    @abstractmethod
    def read(self, name: str) -> bytes:
        """The whole (small) file ``name``."""

    @abstractmethod
    def remove(self, name: str, recursive: bool = True) -> None:
        """Remove the file or directory ``name`` and everything in it; ``recursive=False``: the file ``name``."""

    @abstractmethod
    def write(self, name: str, dump: Callable[[IO[bytes]], object], atomic: bool = True) -> None:
        """Create the file ``name`` from what ``dump`` writes to the stream it is given, whole or not at all.

        Args:
            name: the file's name.
            dump: writes the content, sequentially; the stream may not seek.
            atomic: write to a temporary name and commit under ``name`` only once complete. If False, write in
                place (for file systems without rename); an object store's upload is atomic either way.
        """

    @abstractmethod
    def writing_directory(self, name: str) -> Place:
        """Where the files of the new directory ``name`` are written, with ``write(..., atomic=False)``, from
        :meth:`begin_directory` until :meth:`commit_directory` makes it ``name``, whole. Any process may ask."""

    @abstractmethod
    def begin_directory(self, name: str) -> Place:
        """Start the new directory ``name`` (by the one process that commits it); return
        :meth:`writing_directory`.

        On a constant name, the directory that has the name until then stays readable on a local file system, where
        the commit exchanges the two; an object store cannot replace a prefix at once, and removes it here.
        """

    @abstractmethod
    def commit_directory(self, name: str, seal: Callable[[Place], object]) -> None:
        """Make the directory begun with :meth:`begin_directory`, every file of it written, appear as ``name``,
        whole.

        Args:
            name: the directory's name.
            seal: writes the directory's last file into the place it is given, atomically (a manifest): on an object
                store, that file's existence is what makes the directory whole.
        """

    @abstractmethod
    def is_whole(self, seal: str) -> bool:
        """Whether this directory, if written through :meth:`begin_directory`, was committed: locally any directory
        is, since it takes its name only once whole; on an object store, one whose ``seal`` is there."""

    def leftovers(self, entries: Mapping[str, bool], writing: Collection[str] = ()) -> list[str]:
        """The names among ``entries`` (a listing of this place) that interrupted writes left: temporary files and
        directories, and on an object store directories begun and never committed.

        Args:
            entries: a listing of this place.
            writing: names of files and directories this process is writing here now: what their writes use is no
                leftover.
        """
        return [name for name in entries if TEMPORARY.match(name) and written_as(name) not in writing]

    def free_space(self) -> int | None:
        """Bytes free for new files, ``None`` where the storage cannot tell (object stores)."""
        return None

    def abort_uploads(self, writing: Collection[str] = ()) -> list[str]:
        """Abort the unfinished uploads under this place, left by processes killed while uploading, but those of
        ``writing`` (as for :meth:`leftovers`); return their keys. Only object stores have such uploads."""
        return []


class LocalPlace(Place):
    """A local (or mounted, shared) directory."""

    maps_files = True

    def __init__(self, path: Path) -> None:
        self.path = path

    def __str__(self) -> str:
        return str(self.path)

    def location(self, name: str = "") -> Path:
        return self.path / name if name else self.path

    def child(self, name: str) -> LocalPlace:
        return LocalPlace(self.path / name)

    def exists(self) -> bool:
        return self.path.is_dir()

    def make(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def writable(self) -> bool:
        # access() also answers for root: a read-only mount or an immutable directory refuses even root
        return os.access(self.path, os.W_OK | os.X_OK)

    def entries(self) -> dict[str, bool]:
        if not self.path.is_dir():
            return {}
        return {entry.name: entry.is_dir() for entry in os.scandir(self.path)}

    def file_sizes(self) -> dict[str, int]:
        if not self.path.is_dir():
            return {}
        return {entry.name: entry.stat().st_size for entry in os.scandir(self.path) if entry.is_file()}

    def is_file(self, name: str) -> bool:
        return (self.path / name).is_file()

    def is_dir(self, name: str) -> bool:
        return (self.path / name).is_dir()

    def size(self, name: str) -> int:
        return (self.path / name).stat().st_size

    def modified(self, name: str) -> float:
        return (self.path / name).stat().st_mtime

    def open(self, name: str, block_size: int = READ_BLOCK) -> IO[bytes]:
        return open(self.path / name, "rb")

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def remove(self, name: str, recursive: bool = True) -> None:
        path = self.path / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        fsync_path(self.path)

    def write(self, name: str, dump: Callable[[IO[bytes]], object], atomic: bool = True) -> None:
        final = self.path / name
        if not atomic:
            # A new file rather than the old one truncated: a process that loaded the old one with mmap keeps it.
            final.unlink(missing_ok=True)
            with os.fdopen(os.open(final, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), "w+b") as f:
                _dump_durably(dump, f)
            fsync_path(self.path)
            return
        temporary = self.path / temporary_name(name)
        try:
            # os.open applies the umask to 0o666, as any newly created file gets.
            with os.fdopen(os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), "w+b") as f:
                _dump_durably(dump, f)
            os.replace(temporary, final)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        fsync_path(self.path)

    def writing_directory(self, name: str) -> LocalPlace:
        return self.child(f".{name}.ignite_zero-partial.tmp")

    def begin_directory(self, name: str) -> LocalPlace:
        written = self.writing_directory(name)
        written.make()
        return written

    def commit_directory(self, name: str, seal: Callable[[Place], object]) -> None:
        written = self.writing_directory(name)
        seal(written)
        fsync_path(written.path)
        _install_directory(written.path, self.path / name)
        fsync_path(self.path)

    def is_whole(self, seal: str) -> bool:
        return self.exists()

    def free_space(self) -> int:
        return shutil.disk_usage(self.path).free


def _install_directory(source: Path, target: Path) -> None:
    """Put the directory ``source`` at ``target``, replacing a previous ``target`` atomically where Linux can."""
    if not target.exists():
        os.replace(source, target)
        return
    if _exchange(source, target):  # target now holds the new directory, source the old one
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


def _dump_durably(dump: Callable[[IO[bytes]], object], f: IO[bytes]) -> None:
    dump(f)
    f.flush()
    os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk: without it, a power loss can revert a rename or unlink in
    the directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RemotePlace(Place):
    """A prefix behind an fsspec URL.

    Args:
        url: the prefix, e.g. ``s3://bucket/run``.
        storage_options: the file system's options (for S3: ``endpoint_url``, ``key``, ``secret``,
            ``client_kwargs``...); the environment supplies the rest, as for any fsspec client.
    """

    seen_alike_by_every_host = True
    storage_options: dict[str, Any]

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        # Other ranks and processes write here too: a listing kept from before their writes would hide them.
        self.fs, self.root = _file_system(self.url, {"use_listings_cache": False, **self.storage_options})
        self.root = self.root.rstrip("/")

    def __str__(self) -> str:
        return self.url

    def __reduce__(self) -> tuple[Any, ...]:  # sent to other ranks by URL: each builds its own client
        return RemotePlace, (self.url, self.storage_options)

    def location(self, name: str = "") -> str:
        return f"{self.url}/{name}" if name else self.url

    def child(self, name: str) -> RemotePlace:
        return RemotePlace(self.location(name), self.storage_options)

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    @contextlib.contextmanager
    def _answering(self, what: str, name: str = "") -> Iterator[None]:
        """Errors of the store, with the URL and what was asked of it."""
        try:
            yield
        except StorageError:
            raise
        except FileNotFoundError:
            raise
        except Exception as error:
            raise StorageError(
                f"{what} {self.location(name)} failed: {type(error).__name__}: {error}. Check the URL, the "
                "credentials and `storage_options` (e.g. `endpoint_url`)."
            ) from error

    def exists(self) -> bool:
        with self._answering("Listing"):
            return bool(self.fs.exists(self.root))

    def make(self) -> None:
        with self._answering("Opening"):
            bucket = self.root.split("/", 1)[0]
            if "s3" in self._protocols:  # a bucket is not a directory: writing into a missing one fails late, obscurely
                try:
                    self.fs.call_s3("head_bucket", Bucket=bucket)
                except FileNotFoundError:
                    raise FileNotFoundError(
                        f"Bucket {bucket!r} of {self.url} does not exist (or these credentials cannot see it); create "
                        "it first: ignite_zero does not create buckets"
                    ) from None
            self.fs.makedirs(self.root, exist_ok=True)

    def entries(self) -> dict[str, bool]:
        return {name: info["type"] == "directory" for name, info in self._listing().items()}

    def file_sizes(self) -> dict[str, int]:
        return {name: int(info["size"]) for name, info in self._listing().items() if info["type"] != "directory"}

    def _listing(self) -> dict[str, dict[str, Any]]:
        """What one listing request says of each name directly under this prefix."""
        with self._answering("Listing"):
            try:
                listed = self.fs.ls(self.root, detail=True, refresh=True)
            except FileNotFoundError:
                return {}
        named = {info["name"].rstrip("/"): info for info in listed}
        return {name.rsplit("/", 1)[-1]: info for name, info in named.items() if name != self.root}

    def is_file(self, name: str) -> bool:
        with self._answering("Reading", name):
            return bool(self.fs.isfile(self._key(name)))

    def is_dir(self, name: str) -> bool:
        with self._answering("Reading", name):
            return bool(self.fs.isdir(self._key(name)))

    def size(self, name: str) -> int:
        with self._answering("Reading", name):
            return int(self.fs.size(self._key(name)))

    def modified(self, name: str) -> float:
        with self._answering("Reading", name):
            info = self.fs.info(self._key(name))
        stamp = info.get("LastModified", info.get("mtime", info.get("created")))
        if isinstance(stamp, datetime.datetime):
            return stamp.timestamp()
        return float(stamp) if stamp is not None else 0.0

    def open(self, name: str, block_size: int = READ_BLOCK) -> IO[bytes]:
        with self._answering("Reading", name):
            return self.fs.open(self._key(name), "rb", block_size=block_size, cache_type="readahead")

    def read(self, name: str) -> bytes:
        with self._answering("Reading", name):
            return bytes(self.fs.cat_file(self._key(name)))

    def remove(self, name: str, recursive: bool = True) -> None:
        with self._answering("Removing", name):
            try:
                if recursive:
                    self.fs.rm(self._key(name), recursive=True)  # lists the prefix first
                else:
                    self.fs.rm_file(self._key(name))  # one request
            except FileNotFoundError:
                pass

    def write(self, name: str, dump: Callable[[IO[bytes]], object], atomic: bool = True) -> None:
        final = self._key(name)
        # S3 makes an object visible only once its upload completes (one PUT, or the completion of a multipart
        # upload), replacing the previous one at that instant: the upload itself is the commit, and a copy on the
        # server would only add a pass over every byte. Other stores go through a temporary key and that copy.
        direct = not atomic or self._commits_uploads
        target = final if direct else self._key(temporary_name(name))
        with self._answering("Writing", name):
            stream = self.fs.open(target, "wb")
            try:
                dump(stream)
            except BaseException:
                _discard(stream)
                if not direct:
                    with contextlib.suppress(Exception):
                        self.fs.rm(target)
                raise
            stream.close()  # completes the upload: the object now exists, whole
            if not direct:
                try:
                    self.fs.copy(target, final)  # on the server: the name holds the old object or the new one
                finally:
                    with contextlib.suppress(Exception):
                        self.fs.rm(target)

    def writing_directory(self, name: str) -> RemotePlace:
        return self.child(name)  # in place: a prefix has no rename

    def begin_directory(self, name: str) -> RemotePlace:
        # A prefix cannot be replaced at once: a constant name's previous directory goes first.
        self.remove(name)
        written = self.writing_directory(name)
        written.write(_UNFINISHED, lambda f: f.write(b""))
        return written

    def commit_directory(self, name: str, seal: Callable[[Place], object]) -> None:
        written = self.writing_directory(name)
        seal(written)  # the commit: the directory is whole once its seal exists
        written.remove(_UNFINISHED, recursive=False)  # only tidies

    def is_whole(self, seal: str) -> bool:
        return self.is_file(seal)

    def leftovers(self, entries: Mapping[str, bool], writing: Collection[str] = ()) -> list[str]:
        unfinished = [
            name
            for name, is_dir in entries.items()
            if is_dir and name not in writing and self.child(name).is_file(_UNFINISHED)
        ]
        return super().leftovers(entries, writing) + unfinished

    @property
    def _commits_uploads(self) -> bool:
        """Whether an upload appears whole or not at all under its own name (S3)."""
        return "s3" in self._protocols

    @property
    def _protocols(self) -> tuple[str, ...]:
        protocol = self.fs.protocol
        return tuple(protocol) if isinstance(protocol, (tuple, list)) else (protocol,)

    def abort_uploads(self, writing: Collection[str] = ()) -> list[str]:
        """Abort the unfinished multipart uploads under this prefix (S3), but those of ``writing``; return their
        keys."""
        lister = getattr(self.fs, "list_multipart_uploads", None)
        if lister is None:
            return []
        bucket, _, prefix = self.root.partition("/")
        under = f"{prefix}/" if prefix else ""
        with self._answering("Listing uploads of"):
            uploads = [
                upload
                for upload in lister(bucket)
                if upload["Key"].startswith(under)
                and written_as(upload["Key"][len(under) :].partition("/")[0]) not in writing
            ]
            for upload in uploads:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        return [f"{bucket}/{upload['Key']}" for upload in uploads]


def _discard(stream: Any) -> None:
    """Abandon an upload in progress so that closing it does not commit what was written so far."""
    discard = getattr(stream, "discard", None)
    if callable(discard):
        with contextlib.suppress(Exception):
            discard()  # s3fs: aborts the multipart upload
    stream.closed = True  # else fsspec's finaliser closes the stream, which uploads the part written


def _file_system(url: str, storage_options: Mapping[str, Any]) -> tuple[Any, str]:
    from fsspec.core import url_to_fs  # type: ignore[import-untyped]

    try:
        return url_to_fs(url, **storage_options)
    except ValueError as error:
        raise ValueError(
            f"{url}: {error}. The URL's protocol is not one fsspec knows; use a local path, or a URL such as "
            "s3://bucket/run with the protocol's package installed (s3: pip install 'ignite-zero[s3]')"
        ) from error
    except ImportError as error:
        raise ImportError(
            f"{url}: {error}. Install the package of this protocol (s3: pip install 'ignite-zero[s3]')"
        ) from error


class StoredFile:
    """A file of a place, as the integrity checks read it.

    Args:
        place: the directory.
        name: the file's name in it.
    """

    def __init__(self, place: Place, name: str) -> None:
        self.place = place
        self.name = name

    def __str__(self) -> str:
        return str(self.place.location(self.name))

    def open(self) -> IO[bytes]:
        return self.place.open(self.name, block_size=SMALL_READ_BLOCK)  # integrity reads ends, or chunks of 8 MiB

    @property
    def size(self) -> int:
        return self.place.size(self.name)


def split(where: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> tuple[Place, str]:
    """The directory of the entry ``where`` (a path or a URL), and the entry's name in it."""
    text = str(where).rstrip("/")
    if is_url(text):
        parent, _, name = text.rpartition("/")
        if parent.endswith(":/") or not name:  # "s3://bucket": a bucket is no checkpoint
            raise ValueError(f"{where} names a bucket, not a checkpoint in it: pass the URL of a checkpoint")
        return RemotePlace(parent, storage_options), name
    path = cast(LocalPlace, place_of(where, storage_options)).path
    return LocalPlace(path.parent), path.name


def place_of(where: str | os.PathLike | Place, storage_options: Mapping[str, Any] | None = None) -> Place:
    """The place ``where`` names: a :class:`RemotePlace` for a URL, else a :class:`LocalPlace` (``file://`` URLs
    and ``~`` included).

    Raises:
        ValueError: ``storage_options`` given with a local path, or a URL whose protocol fsspec does not know.
    """
    if isinstance(where, Place):
        return where
    text = str(where)
    if is_url(text):
        return RemotePlace(text, storage_options)
    if storage_options:
        raise ValueError(
            f"`storage_options` {dict(storage_options)} were given with the local path {text}: they are for URLs "
            "(s3://...) only. Drop them, or pass a URL."
        )
    if text.startswith("file://"):
        text = text[len("file://") :]
    return LocalPlace(Path(text).expanduser())
