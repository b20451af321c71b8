"""What the savers of directories share: the target directory (local, or a prefix behind a URL), the one rank that
writes (or, for a sharded save, seals and removes), file names that stay inside it, the cleanup after interrupted
saves, retention, and the estimate of a checkpoint's size for the disk-space check."""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ignite_zero import _compat, tree
from ignite_zero.agreement import rank_and_world
from ignite_zero.naming import check_filename
from ignite_zero.storage.places import LocalPlace, Place, place_of
from ignite_zero.storage.savers.base import Saver

__all__ = [
    "DirectorySaver",
    "check_room",
    "package_version",
    "serialized_size",
]

logger = logging.getLogger(__name__)

#: How many saves of this process write each checkpoint now, by directory and name: another handler's cleanup of the
#: same directory (two handlers may share one, the first saving in the background) leaves what they write alone.
_writing: collections.Counter[tuple[str, str]] = collections.Counter()
_writing_lock = threading.Lock()


class DirectorySaver(Saver):
    """What the file and the directory savers share: the target directory, the one rank that writes (or, for a
    sharded save, seals and removes), the cleanup after interrupted saves, and retention."""

    def __init__(
        self,
        dirname: str | Path | Place,
        create_dir: bool,
        require_empty: bool,
        save_on_rank: int | None,
        storage_options: Mapping[str, Any] | None,
        *,
        defer_require_empty: bool = False,
    ) -> None:
        if save_on_rank is not None and (not isinstance(save_on_rank, int) or save_on_rank < 0):
            raise ValueError(f"Argument `save_on_rank` should be a non-negative integer, got {save_on_rank!r}")
        self.place: Place = place_of(dirname, storage_options)
        #: the directory: a path, or the URL of a prefix
        self.dirname = self.place.location()
        self._create_dir = create_dir
        self._require_empty = require_empty
        self._defer_require_empty = defer_require_empty
        self._rank_given = save_on_rank is not None
        self.save_on_rank = 0 if save_on_rank is None else save_on_rank
        self._prepared = False
        if self._rank_given or rank_and_world()[1] == 1:  # else the recipient is known once a Checkpoint binds it
            self._prepare_now()

    @property
    def requested_rank(self) -> int | None:
        return self.save_on_rank if self._rank_given else None

    def bind(self, recipient: int) -> None:
        """Make ``recipient`` the writing rank; called by :class:`~ignite_zero.Checkpoint` when none was given."""
        if self._rank_given and recipient != self.save_on_rank:
            raise ValueError(f"This {type(self).__name__} writes on rank {self.save_on_rank}, not on rank {recipient}")
        self.save_on_rank = recipient
        self._prepare_now()

    @property
    def identity(self) -> str:
        return f"{type(self).__qualname__}:{self.dirname}"

    @property
    def directory(self) -> Path | str:
        return self.dirname

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self.place.storage_options

    def location(self, filename: str) -> str | Path:
        return self.place.location(filename)

    def list(self) -> list[str]:
        return sorted(name for name in self.place.entries() if name.endswith(f".{self.ext}"))

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the files."""
        return rank_and_world()[0] == self.save_on_rank

    def check(self) -> None:
        """On the writer: the directory exists (or is created), its bucket too, ``require_empty`` holds, and it is
        writable (checked here only, not when the saver is made: a handler may load from a read-only directory)."""
        self._prepare()
        if self.is_writer and not self.place.writable():
            raise PermissionError(
                errno.EACCES,
                f"Directory {self.dirname} is not writable by this process (rank {rank_and_world()[0]}), which "
                "writes the checkpoints: make it writable (its permissions, a read-only mount) or save elsewhere",
            )

    def allow_existing_checkpoints(self) -> None:
        """Let saves go into a directory that holds checkpoints already: ``require_empty`` guards a fresh run against
        another run's checkpoints, and a resumed run's own are no reason to refuse."""
        self._require_empty = False

    def _prepare_now(self) -> None:
        """The writer's check of its directory when the saver is made, as ignite's ``DiskSaver`` makes it.

        With ``defer_require_empty``, ``require_empty`` is left to :meth:`check` (``load_latest``'s, which may
        allow the run's own checkpoints first) or to the first save. In one process a failure raises here. In a
        process group it is logged here, and raised by the first save, on every rank (:meth:`check`): raised on the
        writer alone, it would end that rank (with the process group's store, under ``idist.Parallel``) and leave
        the others waiting for it at their first save.
        """
        try:
            self._make_directory()
            if not self._defer_require_empty:
                self._check_empty()
        except Exception as error:
            if rank_and_world()[1] == 1:
                raise
            logger.error(
                "%s (rank %d; raised on every rank by `load_latest` or the first save, if it holds then)",
                error,
                rank_and_world()[0],
            )

    def _prepare(self) -> None:
        """On the writer: the directory exists (or is created), and ``require_empty`` holds."""
        self._make_directory()
        self._check_empty()

    def _make_directory(self) -> None:
        if self._prepared or not self.is_writer:
            return
        if self._create_dir:
            self.place.make()
        elif not self.place.exists():
            raise ValueError(f"Directory path '{self.dirname}' is not found; create it or pass `create_dir=True`")
        self._prepared = True

    def _check_empty(self) -> None:
        """On the writer, once: ``require_empty`` holds. Not again once it held, for the directory then holds this
        saver's own checkpoints."""
        if not self._require_empty or not self.is_writer:
            return
        matched = self.list()
        if matched:
            raise ValueError(
                f"Files {matched} with extension '.{self.ext}' are already present in the directory "
                f"{self.dirname}. If you want to use this directory anyway, pass `require_empty=False`."
            )
        self._require_empty = False

    @contextlib.contextmanager
    def writing(self, filename: str) -> Iterator[None]:
        """Mark the checkpoint ``filename`` as written by this process while the block runs, so that the cleanup of
        another saver of this directory leaves its temporaries alone."""
        key = (self._where(), filename)
        with _writing_lock:
            _writing[key] += 1
        try:
            yield
        finally:
            with _writing_lock:
                _writing[key] -= 1
                if not _writing[key]:
                    del _writing[key]

    def _where(self) -> str:
        """The directory, the same for every saver of it however its path was spelled (relative, through a link)."""
        place = self.place
        return os.path.realpath(place.path) if isinstance(place, LocalPlace) else str(place)

    def _remove_temporaries(self) -> dict[str, bool]:
        """Remove what interrupted saves left; return what the directory holds then (names, whether directories).

        The live writers of this directory are this process's saves alone: what those write now (:meth:`writing`)
        stays.
        """
        where = self._where()
        with _writing_lock:
            writing = {name for place, name in _writing if place == where}
        entries = self.place.entries()
        for name in self.place.leftovers(entries, writing):
            self.place.remove(name)
            del entries[name]
            logger.warning("Removed %s, left by an interrupted save", self.place.location(name))
        for key in self.place.abort_uploads(writing):
            logger.warning("Aborted the upload of %s, left by an interrupted save", key)
        return entries

    def remove(self, filename: str) -> None:
        if not self.is_writer:
            return
        check_filename(filename)
        if filename not in self.place.entries():
            logger.warning("Checkpoint %s was already removed", self.place.location(filename))
            return
        self.place.remove(filename)


def check_room(place: Place, filename: str, needed: int, free: int | None, needs: str = "it needs about") -> None:
    """Fail before writing, clearly, when a new checkpoint of ``needed`` bytes cannot fit in the ``free`` bytes beside
    the ones it will replace (``None``: an object store, no limit to check).

    Raises:
        OSError: ``ENOSPC``, naming the checkpoint, both sizes and the ways out.
    """
    if free is not None and needed > free:
        raise OSError(
            errno.ENOSPC,
            f"Not enough disk space for checkpoint {place.location(filename)}: {needs} {needed / 1e6:.1f} MB, "
            f"{free / 1e6:.1f} MB are free (older checkpoints are removed only after the new one is written). Free "
            "some space, write elsewhere, or lower `n_saved`.",
        )


def serialized_size(obj: Any) -> int:
    """Upper estimate of the bytes ``torch.save`` writes for ``obj``: each distinct storage once, plus records."""
    storages: dict[int, int] = {}

    def tensors_of(value: Any) -> list[torch.Tensor]:
        if isinstance(value, DTensor):
            return [_compat.dtensor_local(value)]
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


def package_version() -> str:
    from ignite_zero import __version__

    return __version__
