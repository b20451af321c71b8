"""Loading: a checkpoint read where it can be, each rank given what it needs, every object restored or none.

A checkpoint is a file (a consolidated save) or a directory (a sharded save, :class:`~ignite_zero.ShardedSaver`),
which every rank reads through ``torch.distributed.checkpoint``: FSDP ranks read their own shards into templates
of them, ZeRO ranks the state of the parameters they own, and every rank the objects it holds whole.

When ``to_load`` holds sharded objects and several ranks run, loading is a collective in three rounds of
agreement (:func:`ignite_zero.agreement.settle`):

1. Every rank says whether it sees the file (and which: size and integrity trailer), and what part of each
   sharded entry it needs (:meth:`ShardedState.part_needed`).
2. Ranks that see the file open it with ``mmap``, so ranks of one host share its pages instead of holding
   one private copy each; one rank per host verifies its integrity. The first rank that sees it sends every
   rank that does not (a private or node-local directory) only the part it asked for. Every rank then
   checks its entries, and nothing is loaded anywhere unless every check passed.
3. Every rank restores its objects, and learns whether all others did.

With plain objects only, or without a process group, loading is local, as in ignite.
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ignite_zero import integrity, sharded, transport
from ignite_zero.adapters import ShardedState, adapt, map_objects
from ignite_zero.adapters.fsdp import full_optimizer_state_to_plain, owns_parameters
from ignite_zero.adapters.zero import as_saved_optimizer_state
from ignite_zero.agreement import rank_and_world, settle

__all__ = ["restore"]


def restore(
    to_load: Mapping, checkpoint: str | Path | Mapping, *, weights_only: bool, sync_timeout: float, kwargs: Mapping
) -> None:
    """Restore ``to_load`` from ``checkpoint``; see :meth:`ignite_zero.Checkpoint.load_objects`."""
    objects = adapt(to_load, 0)
    sharded: list[bool] = []
    map_objects(objects, lambda _, obj: sharded.append(isinstance(obj, ShardedState)))
    rank, world_size = rank_and_world()
    if world_size == 1 or not any(sharded):
        if isinstance(checkpoint, Mapping):
            entries = _entries(objects, checkpoint)
        else:
            entries = _read(objects, Path(checkpoint), weights_only, verify=True)
        entries = _for_plain_optimizers(objects, entries)
        _pair(objects, entries, lambda path, obj, entry: _check_entry(path, obj, entry, kwargs))
        _pair(objects, entries, lambda path, obj, entry: _load_entry(obj, entry, kwargs))
        return

    parts = map_objects(objects, lambda _, obj: obj.part_needed() if isinstance(obj, ShardedState) else None)
    identity, failure = None, None
    try:
        identity = "in memory" if isinstance(checkpoint, Mapping) else _identity(Path(checkpoint))
    except Exception as error:
        failure = error
    reports = settle(
        failure, what="checkpoint load", timeout=sync_timeout, payload=(socket.gethostname(), identity, parts)
    )
    seers = [r for r, (_, seen, _) in enumerate(reports) if seen is not None]
    _check_seers(checkpoint, reports, seers)

    entries, failure = None, None
    try:
        if isinstance(checkpoint, Mapping):
            entries = _entries(objects, checkpoint)
        elif identity is not None:
            entries = _read(objects, Path(checkpoint), weights_only, verify=_verifies(rank, reports, seers))
        entries = _for_plain_optimizers(objects, _distribute(entries, [need for _, _, need in reports], seers))
        _pair(objects, entries, lambda path, obj, entry: _check_entry(path, obj, entry, kwargs))
    except Exception as error:
        failure = error
    settle(failure, what="checkpoint load (reading and checking)", timeout=sync_timeout)

    failure = None
    try:
        _pair(objects, entries, lambda path, obj, entry: _load_entry(obj, entry, kwargs))
    except Exception as error:
        failure = error
    settle(failure, what="checkpoint load (restoring objects)", timeout=sync_timeout)


def _identity(path: Path) -> tuple[Any, ...] | None:
    """What this rank sees at ``path``: ``None`` if nothing; for a file its size and directory checksum, for a
    sharded checkpoint directory the checksum of its manifest."""
    if path.is_dir():
        if not sharded.is_sharded_checkpoint(path):
            raise integrity.IntegrityError(
                f"{path} is not a complete checkpoint: it has no .metadata (interrupted save?)"
            )
        manifest = path / sharded.MANIFEST
        return ("sharded", zlib.crc32(manifest.read_bytes()) if manifest.is_file() else None)
    if not path.is_file():
        return None
    trailer = integrity.read_trailer(path)  # cheap: the central directory only; fails on a truncated file
    return path.stat().st_size, None if trailer is None else trailer["directory_crc32"]


def _check_seers(checkpoint: Any, reports: list[tuple[str, Any, Any]], seers: list[int]) -> None:
    if not seers:
        raise FileNotFoundError(f"Checkpoint file {checkpoint} exists on no rank; pass the path of an existing file")
    if len(seers) < len(reports) and reports[seers[0]][1][0] == "sharded":
        blind = [r for r in range(len(reports)) if r not in seers]
        raise FileNotFoundError(
            f"Ranks {blind} cannot see the sharded checkpoint {checkpoint}: a sharded checkpoint is read by every "
            "rank, from a file system that all of them share."
        )
    identities = {reports[r][1] for r in seers}
    if len(identities) > 1:
        listing = ", ".join(f"rank {r}: {reports[r][1]}" for r in seers)
        raise ValueError(
            f"Ranks see different files at {checkpoint} (size, checksum: {listing}): a stale copy on some node? "
            "Make every rank see the same file, or only one."
        )


def _verifies(rank: int, reports: list[tuple[str, Any, Any]], seers: list[int]) -> bool:
    """One rank per host checks the whole file: the others read the same pages."""
    host = reports[rank][0]
    return rank == next(r for r in seers if reports[r][0] == host)


def _read(objects: Mapping, path: Path, weights_only: bool, verify: bool) -> Any:
    """The entry of every object in a checkpoint file or a sharded checkpoint directory."""
    if path.is_dir():
        return _read_sharded(objects, path, verify)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint file {path} does not exist on rank {rank_and_world()[0]}")
    if verify:
        integrity.verify_file(path)
    return _entries(objects, torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True))


@dataclass(frozen=True)
class _Filled:
    """An object's template of its own shards, filled from a sharded checkpoint: loaded with ``load_sharded``."""

    state: Any


def _read_sharded(objects: Mapping, directory: Path, verify: bool) -> Any:
    """Read from a sharded checkpoint what each object needs: its own shards where it gives a template, else the
    saved entries it wants, whole (optimizer state keyed by index again)."""
    if verify:
        sharded.verify(directory)
    metadata = sharded.read_metadata(directory)
    saved = {sharded.path_of(metadata, name) for name in metadata.state_dict_metadata}
    templates: dict[tuple[Any, ...], Any] = {}
    flat: dict[str, Any] = {}
    for path, obj in _leaves(objects):
        relative = {p[len(path) :] for p in saved if p[: len(path)] == path}
        if not relative:
            raise KeyError(
                f"The checkpoint has no entry {'.'.join(map(str, path))} (it holds "
                f"{sorted({str(p[0]) for p in saved})}); load only the objects it holds, or pass the right directory."
            )
        template = obj.sharded_template(relative) if isinstance(obj, ShardedState) else None
        if template is not None:
            templates[path] = template
            continue
        wants = obj.wants if isinstance(obj, ShardedState) else (lambda _: True)
        flat.update(
            sharded.template(
                metadata, lambda p, path=path, wants=wants: p[: len(path)] == path and wants(p[len(path) :])
            )
        )
    state: dict[str, Any] = dict(flat)
    for path, template in templates.items():
        state[sharded.name_of(path)] = template
    sharded.load(state, directory)
    nested = sharded.nest(metadata, {name: state[name] for name in flat})

    def entry(path: tuple[Any, ...], obj: Any) -> Any:
        if path in templates:
            return _Filled(state[sharded.name_of(path)])
        node: Any = nested
        for step in path:
            node = node[step]
        return as_saved_optimizer_state(node)

    return _map_paths(objects, entry)


def _leaves(objects: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every object of a nested ``to_load`` with its path (dict keys, list positions)."""
    if isinstance(objects, Mapping):
        return [leaf for key, value in objects.items() for leaf in _leaves(value, (*path, key))]
    if isinstance(objects, list):
        return [leaf for index, value in enumerate(objects) for leaf in _leaves(value, (*path, index))]
    return [(path, objects)]


def _map_paths(objects: Any, func: Callable[[tuple[Any, ...], Any], Any], path: tuple[Any, ...] = ()) -> Any:
    if isinstance(objects, Mapping):
        return {key: _map_paths(value, func, (*path, key)) for key, value in objects.items()}
    if isinstance(objects, list):
        return [_map_paths(value, func, (*path, index)) for index, value in enumerate(objects)]
    return func(path, objects)


def _distribute(entries: Any, needs: list[Any], seers: list[int]) -> Any:
    """Send each rank that cannot read the file the part of every entry it needs; return this rank's entries."""
    rank, world_size = rank_and_world()
    needy = [r for r in range(world_size) if r not in seers]
    if not needy:
        return entries
    group = transport.cpu_group()
    if rank in needy:
        return transport.receive_from(seers[0], group)
    if rank == seers[0]:
        failures = []
        for r in needy:  # every needy rank is answered, with its part or with the error
            try:
                part = _select(entries, needs[r])
            except Exception as error:
                transport.send_failure(error, r, group)
                failures.append(error)
                continue
            transport.send_to(part, r, group)
        if failures:
            raise failures[0]
    return entries


def _select(entries: Any, parts: Any) -> Any:
    """What a rank needs of ``entries``: every entry whole, except where it asked for a part."""
    if isinstance(parts, Mapping):
        return {key: _select(entries[key], part) for key, part in parts.items()}
    if isinstance(parts, list):
        return [_select(entry, part) for entry, part in zip(entries, parts)]
    return entries if parts is None else parts.select(entries)


def _entries(objects: Mapping, loaded: Mapping) -> Any:
    """The entry of ``loaded`` for each object, in the shape of ``objects``."""
    if len(objects) == 1:
        key = next(iter(objects))
        if key not in loaded:  # a single-object save holds the object's state dict itself
            return {key: loaded}
    missing = [key for key in objects if key not in loaded]
    if missing:
        raise KeyError(
            f"The checkpoint has no entry for {missing} (it holds {sorted(loaded)}); load only the objects it "
            "holds, or pass the right file."
        )
    return {key: loaded[key] for key in objects}


def _pair(objects: Any, entries: Any, func: Callable[[str, Any, Any], Any], path: str = "") -> Any:
    """``func(path, obj, entry)`` for every object of a nested ``to_load`` and its entry, in the same shape."""
    if isinstance(objects, Mapping):
        result = {}
        for key, obj in objects.items():
            if not isinstance(entries, Mapping) or key not in entries:
                raise KeyError(f"The checkpoint has no entry {path}[{key!r}]; load only the objects it holds")
            result[key] = _pair(obj, entries[key], func, f"{path}[{key!r}]")
        return result
    if isinstance(objects, list):
        if not isinstance(entries, (list, tuple)) or len(entries) != len(objects):
            raise KeyError(f"The checkpoint entry {path} does not hold {len(objects)} objects")
        return [_pair(obj, entry, func, f"{path}[{index}]") for index, (obj, entry) in enumerate(zip(objects, entries))]
    return func(path, objects, entries)


def _for_plain_optimizers(objects: Any, entries: Any) -> Any:
    """Entries of plain optimizers saved by name (from an FSDP model), in the index-keyed form they load.

    The names are those of the parameters in the plain model the optimizer updates, which must be in ``to_load``.
    """
    models: list[nn.Module] = []
    map_objects(objects, lambda _, obj: models.append(obj) if isinstance(obj, nn.Module) else None)

    def translate(path: str, obj: Any, entry: Any) -> Any:
        if not (isinstance(obj, torch.optim.Optimizer) and _names_parameters(entry)):
            return entry
        model = next((m for m in models if owns_parameters(m, obj)), None)
        if model is None:
            raise ValueError(
                f"The checkpoint entry {path} names its parameters (it was saved from an FSDP model): load it together "
                "with the model whose parameters the optimizer updates, e.g. {'model': model, 'optimizer': optimizer}"
            )
        return full_optimizer_state_to_plain(model, obj, entry)

    return _pair(objects, entries, translate)


def _names_parameters(entry: Any) -> bool:
    groups = entry.get("param_groups") if isinstance(entry, Mapping) else None
    return bool(groups) and isinstance(groups[0], Mapping) and any(isinstance(p, str) for p in groups[0]["params"])


def _check_entry(path: str, obj: Any, entry: Any, kwargs: Mapping) -> None:
    """Refuse, before anything is loaded, an entry that would not load."""
    if isinstance(entry, _Filled):  # read through the object's own template: its names were checked by the read
        return
    if isinstance(obj, ShardedState):
        obj.check_entry(entry, **_module_kwargs(obj, kwargs))
        return
    if not isinstance(obj, nn.Module) or not kwargs.get("strict", True):
        return
    if not isinstance(entry, Mapping):
        raise ValueError(f"The checkpoint entry {path} is a {type(entry).__name__}, not a state dict")
    expected = obj.state_dict()
    missing = [name for name in expected if name not in entry]
    unexpected = [name for name in entry if name not in expected]
    shapes = [
        f"{name}: checkpoint {tuple(entry[name].shape)}, model {tuple(value.shape)}"
        for name, value in expected.items()
        if isinstance(value, torch.Tensor)
        and isinstance(entry.get(name), torch.Tensor)
        and entry[name].shape != value.shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"The checkpoint entry {path} does not fit the model: missing keys {missing}, unexpected keys "
            f"{unexpected}, different shapes {shapes}. Nothing was loaded. Pass `strict=False` to load what fits."
        )


def _load_entry(obj: Any, entry: Any, kwargs: Mapping) -> None:
    if isinstance(entry, _Filled):
        obj.load_sharded(entry.state)
    else:
        obj.load_state_dict(entry, **_module_kwargs(obj, kwargs))


def _module_kwargs(obj: Any, kwargs: Mapping) -> Mapping:
    """``load_objects``' keyword arguments are for modules (``strict``), models behind adapters included."""
    module = obj.obj if isinstance(obj, ShardedState) else obj
    return kwargs if isinstance(module, nn.Module) else {}
