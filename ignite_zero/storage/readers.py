"""Reading checkpoints: one reader per format, which loading asks for the checkpoint's identity, its verification,
and the entries the objects of one rank need.

- :class:`FileReader`: a single file (a consolidated save, or plain ``torch.save``, zip or legacy format), mapped
  with ``mmap`` where it can be, so that the ranks of one host share its pages.
- :class:`DirectoryReader`: a sharded checkpoint directory (``torch.distributed.checkpoint``), from which every
  rank reads only what it needs: FSDP ranks their own shards into templates of them, ZeRO ranks the state of the
  parameters they own, and every rank the objects it holds whole.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ignite_zero import integrity, sharded, tree
from ignite_zero.adapters import ShardedState
from ignite_zero.adapters.zero import as_saved_optimizer_state
from ignite_zero.agreement import rank_and_world
from ignite_zero.storage.base import local_path

__all__ = ["DirectoryReader", "FileReader", "Filled", "Reader", "entries_of", "reader_for"]


@dataclass(frozen=True)
class Filled:
    """An object's template of its own shards, filled from a sharded checkpoint: loaded with ``load_sharded``."""

    state: Any


class Reader(ABC):
    """One checkpoint, as loading reads it.

    Args:
        path: where the checkpoint lies.
    """

    #: whether every rank must read the checkpoint itself, or one that sees it may send the others their part
    read_by_every_rank = False

    def __init__(self, path: Path) -> None:
        self.path = path

    @abstractmethod
    def identity(self) -> Any | None:
        """What this rank sees of the checkpoint, cheaply, to compare with other ranks; ``None`` if nothing."""

    @abstractmethod
    def verify(self) -> None:
        """Check the whole checkpoint against its integrity record; raise :class:`~ignite_zero.IntegrityError`."""

    @abstractmethod
    def entries(self, objects: Mapping, weights_only: bool) -> Any:
        """The entry of every object of ``objects`` (nested as ``objects``): what it loads."""


class FileReader(Reader):
    """A checkpoint file: its identity is its size and the checksum its trailer holds."""

    def identity(self) -> tuple[Any, ...] | None:
        if not self.path.is_file():
            return None
        trailer = integrity.read_trailer(self.path)  # cheap: the central directory only; fails on a truncated file
        return self.path.stat().st_size, None if trailer is None else trailer["directory_crc32"]

    def verify(self) -> None:
        integrity.verify_file(self._existing())

    def load(self, weights_only: bool) -> Any:
        """Everything the file holds, its tensors mapped from the file (copied for the legacy format)."""
        self._existing()
        mmap = not integrity.is_legacy_format(self.path)
        return torch.load(self.path, map_location="cpu", weights_only=weights_only, mmap=mmap)

    def entries(self, objects: Mapping, weights_only: bool) -> Any:
        return entries_of(objects, self.load(weights_only))

    def _existing(self) -> Path:
        if not self.path.is_file():
            raise FileNotFoundError(f"Checkpoint file {self.path} does not exist on rank {rank_and_world()[0]}")
        return self.path


class DirectoryReader(Reader):
    """A sharded checkpoint directory: its identity is the checksum of its manifest."""

    read_by_every_rank = True

    def identity(self) -> tuple[Any, ...] | None:
        if not self.path.is_dir():
            return None
        if not sharded.is_sharded_checkpoint(self.path):
            raise integrity.IntegrityError(
                f"{self.path} is not a complete checkpoint: it has no .metadata (interrupted save?)"
            )
        manifest = self.path / sharded.MANIFEST
        return ("sharded", zlib.crc32(manifest.read_bytes()) if manifest.is_file() else None)

    def verify(self) -> None:
        sharded.verify(self.path)

    def entries(self, objects: Mapping, weights_only: bool) -> Any:
        """Read what each object needs: its own shards where it gives a template, else the saved entries it wants,
        whole (optimizer state keyed by index again)."""
        metadata = sharded.read_metadata(self.path)
        saved = {sharded.path_of(metadata, name) for name in metadata.state_dict_metadata}
        templates: dict[tuple[Any, ...], Any] = {}
        flat: dict[str, Any] = {}
        for path, obj in tree.leaves(objects):
            relative = {p[len(path) :] for p in saved if p[: len(path)] == path}
            if not relative:
                raise KeyError(
                    f"The checkpoint has no entry {'.'.join(map(str, path))} (it holds "
                    f"{sorted({str(p[0]) for p in saved})}); load only the objects it holds, or pass the right "
                    "directory."
                )
            template = obj.sharded_template(relative) if isinstance(obj, ShardedState) else None
            if template is not None:
                templates[path] = template
                continue
            wants: Callable[[tree.Path], bool] = obj.wants if isinstance(obj, ShardedState) else (lambda _: True)

            def keep(p: tree.Path, path: tree.Path = path, wants: Callable[[tree.Path], bool] = wants) -> bool:
                return p[: len(path)] == path and wants(p[len(path) :])

            flat.update(sharded.template(metadata, keep))
        state: dict[str, Any] = dict(flat)
        for path, template in templates.items():
            state[sharded.name_of(path)] = template
        sharded.load(state, self.path)
        nested = sharded.nest(metadata, {name: state[name] for name in flat})

        def entry(path: tuple[Any, ...], _: Any) -> Any:
            if path in templates:
                return Filled(state[sharded.name_of(path)])
            return as_saved_optimizer_state(tree.get(nested, path))

        return tree.map_tree(entry, objects)


def reader_for(place: str | Path) -> Reader:
    """The reader of the checkpoint at ``place``: a directory is a sharded checkpoint, anything else a file."""
    path = local_path(place)
    return DirectoryReader(path) if path.is_dir() else FileReader(path)


def entries_of(objects: Mapping, loaded: Any) -> dict[str, Any]:
    """The entry of ``loaded`` for each object of ``objects``, as ignite pairs them: with a single object, a
    checkpoint without its key is that object's state itself."""
    if len(objects) == 1:
        key = next(iter(objects))
        if not isinstance(loaded, Mapping) or key not in loaded:  # a single-object save holds its state itself
            return {key: loaded}
    missing = [key for key in objects if key not in loaded]
    if missing:
        raise KeyError(
            f"The checkpoint has no entry for {missing} (it holds {sorted(loaded)}); load only the objects it "
            "holds, or pass the right file."
        )
    return {key: loaded[key] for key in objects}
