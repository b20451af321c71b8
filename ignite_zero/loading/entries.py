"""Which entries of a checkpoint each object loads: the entry of every object, as this rank needs it, read through
the reader of the checkpoint's format with what each adapter says of its object (the part of an entry a rank needs,
a template of its own shards).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from ignite_zero import tree
from ignite_zero.adapters import ShardedState, deferred
from ignite_zero.adapters.zero import as_saved_optimizer_state
from ignite_zero.storage.formats import Reader
from ignite_zero.storage.formats.dcp_saved import InPlaceReads, SavedTensor, SavedTensors
from ignite_zero.storage.formats.directory import DirectoryReader, load, name_of, nest, template
from ignite_zero.storage.formats.file import FileReader
from ignite_zero.storage.formats.file_trailer import is_legacy_format

__all__ = ["ShardedEntry", "entries_for", "entries_of"]


@dataclass(frozen=True)
class ShardedEntry:
    """An object's entry read into its template of its own shards, from a sharded checkpoint: loaded with
    ``load_sharded``.

    Attributes:
        state: the template.
        read: what is still to read into it, when it is the object's own state: read when the object is restored,
            once every rank has checked its entries.
    """

    state: Any
    read: Callable[[], None] | None = None


def entries_of(objects: Mapping, loaded: Any) -> dict[str, Any]:
    """The entry of ``loaded`` for each object of ``objects``, as ignite pairs them: with a single object, a
    checkpoint without its key is that object's state itself."""
    if len(objects) == 1:
        key = next(iter(objects))
        if not isinstance(loaded, Mapping) or key not in loaded:  # a single-object save holds its state itself
            return {key: loaded}
    missing = [key for key in objects if key not in loaded]
    if missing:
        raise ValueError(  # ignite's words first (x: `to_load`, y: the checkpoint): code that matches them works
            f"Key '{missing[0]}' from x is not found in y: the checkpoint has no entry for {missing} (it holds "
            f"{sorted(loaded)}); load only the objects it holds, or pass the right file."
        )
    return {key: loaded[key] for key in objects}


def entries_for(reader: Reader, objects: Mapping, weights_only: bool, into_objects: bool = False) -> Any:
    """The entry of every object of ``objects`` (nested as ``objects``): what this rank loads. Nothing of the
    objects changes here: tensors read when an object is restored are deferred (:mod:`ignite_zero.adapters.deferred`),
    or given in :class:`ShardedEntry` with what is still to read.

    Args:
        reader: the checkpoint.
        objects: the objects to load, adapted.
        weights_only: as for ``torch.load``.
        into_objects: read what the objects' own tensors can take straight into them as they are restored (a
            collective load, where a corrupt block then leaves them partly restored); else what is not deferred
            is read now, into new tensors.
    """
    if isinstance(reader, DirectoryReader):
        return _directory_entries(reader, objects, weights_only, into_objects)
    if isinstance(reader, FileReader):
        return _file_entries(reader, objects, weights_only)
    raise TypeError(f"No entries for a checkpoint read by {type(reader).__name__}")


def _file_entries(reader: FileReader, objects: Mapping, weights_only: bool) -> Any:
    """What ``objects`` load from a file, its tensors deferred: each is read when it is loaded, straight into the
    tensor it is loaded into where the layouts allow, or into a new one, each block checked as it arrives
    (:class:`~ignite_zero.storage.formats.file_reads.ReadChecks`). A rank reads its part of each sharded entry only
    (FSDP's parts of each tensor, its partition of a ZeRO optimizer's state), once: verifying the file first, then
    mapping and copying it, read every byte twice. Nothing is read here."""
    if is_legacy_format(reader.stored):  # no records to read in parts: loaded whole (locally only)
        return entries_of(objects, reader.structure(weights_only))
    reader.check_exists()
    found = entries_of(objects, reader.structure(weights_only))
    for path, obj in tree.leaves(objects):
        if isinstance(obj, ShardedState) and not obj.loads_deferred and (part := obj.part_needed()) is not None:
            parent = tree.get(found, path[:-1])
            parent[path[-1]] = part.select(tree.get(found, path))
    return deferred.defer(found, reader.parts())


def _directory_entries(reader: DirectoryReader, objects: Mapping, weights_only: bool, into_objects: bool) -> Any:
    """What each object needs from a directory: its own shards where it gives a template, else the saved entries it
    wants, whole (optimizer state keyed by index again), their tensors deferred, each read when its object takes it,
    straight into the object's tensor where it fits.

    Shards are read now into new tensors, or, ``into_objects``, into the object's own when it is restored, where
    they are exactly as saved (else, to reshard, now into new ones). Another tool's directory (no manifest) is
    read whole now, into new tensors.
    """
    found = _DirectoryEntries(reader, not weights_only)
    for path, obj in tree.leaves(objects):
        found.add(path, obj, into_objects)
    return found.read(objects)


class _DirectoryEntries:
    """The entries of a directory's objects, gathered object by object, then read at once."""

    def __init__(self, reader: DirectoryReader, trusted: bool) -> None:
        self._reader = reader
        self._trusted = reader.trusted or trusted
        self._records, self._index = reader.contents(self._trusted)
        self._saved: SavedTensors | None = None
        if self._records is not None:
            self._saved = reader.saved_tensors(self._records, self._index)
        # each saved path by the object it belongs to (its first step): what an object's own paths are, found once
        self._by_object: dict[Any, set[tuple[Any, ...]]] = {}
        for saved in self._index.paths.values():
            self._by_object.setdefault(saved[0], set()).add(saved[1:])
        self._templates: dict[tuple[Any, ...], Any] = {}
        self._later: dict[tuple[Any, ...], InPlaceReads] = {}  # shards read into the objects' own tensors later
        self._flat: dict[str, Any] = {}

    def add(self, path: tree.Path, obj: Any, into_objects: bool) -> None:
        """Gather the entries of the object at ``path``: its template of its own shards, or the entries it wants."""
        below = self._by_object.get(path[0], set())
        depth = len(path) - 1
        relative = {p[depth:] for p in below if p[:depth] == path[1:]} if depth else set(below)
        if not relative:
            raise ValueError(  # ignite's words first, as for a file
                f"Key '{'.'.join(map(str, path))}' from x is not found in y: the checkpoint has no such entry (it "
                f"holds {sorted(map(str, self._by_object))}); load only the objects it holds, or pass the right "
                "directory."
            )
        own = obj.sharded_template(relative, into_objects) if isinstance(obj, ShardedState) else None
        if own is not None:
            reads = None
            if self._saved is not None and into_objects:
                reads = self._saved.in_place_reads({name_of(path): own})
            if reads is not None:
                reads.read_values(not self._trusted)  # into the template's own structures: nothing of it changes
                self._later[path] = reads
            elif into_objects:  # to reshard: read now, into new tensors, before every rank's checks
                own = cast(ShardedState, obj).sharded_template(relative, False)
            self._templates[path] = own
            return
        wants: Callable[[tree.Path], bool] = obj.wants if isinstance(obj, ShardedState) else (lambda _: True)

        def keep(p: tree.Path) -> bool:
            return p[: len(path)] == path and wants(p[len(path) :])

        self._flat.update(self._deferred(template(self._index, keep, unread=self._saved is not None)))

    def _deferred(self, flat: dict[str, Any]) -> dict[str, Any]:
        """``flat`` with each of its meta tensors read from the directory when its object takes it."""
        if self._saved is not None:
            for name, value in flat.items():
                if isinstance(value, torch.Tensor):
                    deferred.defer(value, SavedTensor(self._saved, name, value.shape))
        return flat

    def read(self, objects: Mapping) -> Any:
        """Read what is not deferred nor left for later, and return every object's entry."""
        now: dict[str, Any] = {name: value for name, value in self._flat.items() if not deferred.is_deferred(value)}
        now.update({name_of(path): own for path, own in self._templates.items() if path not in self._later})
        reads = None if self._saved is None else self._saved.in_place_reads(now)
        if reads is None:  # DCP plans what needs resharding
            load(now, self._reader.place, self._records, self._trusted)
        else:
            reads.read_values(not self._trusted)
            reads.read_tensors()
        nested = nest(self._index, {name: now.get(name, value) for name, value in self._flat.items()})

        def entry(path: tuple[Any, ...], _: Any) -> Any:
            if path in self._templates:
                later = self._later.get(path)
                return ShardedEntry(self._templates[path], later.read_tensors if later is not None else None)
            return as_saved_optimizer_state(tree.get(nested, path))

        return tree.map_tree(entry, objects)
