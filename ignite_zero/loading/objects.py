"""Loading: a checkpoint read where it can be, each rank given what it needs, every object restored or none.

A checkpoint is read through the reader of its format (:mod:`ignite_zero.storage.formats`): a file (a
consolidated save) or a directory (a sharded save, :class:`~ignite_zero.ShardedSaver`). This module is the policy
of loading: who reads, who verifies, who is sent what, and that every object is restored or none (short of a
corrupt block found while reading into place, below).

When ``to_load`` holds sharded objects and several ranks run, loading is a collective in three rounds of
agreement (:func:`ignite_zero.agreement.together`):

1. Every rank says whether it sees the file (and which: size and integrity trailer), and what part of each
   sharded entry it needs (:meth:`ShardedState.part_needed`).
2. Every rank learns each rank's host (:func:`ignite_zero.agreement.hosts_of_ranks`: a round of its own the first
   time a process asks, remembered after), to pick one rank per host that verifies. Ranks that see the file read its
   structure, checked: the entries, their tensors still to be read
   (:mod:`ignite_zero.adapters.deferred`). The first rank that sees it, where some rank does not (a private or
   node-local directory), verifies it whole, maps it with ``mmap`` and sends every rank that does not see it only
   the part it asked for. Every rank then checks its entries (reading the small ones of per-rank state), and
   nothing is loaded anywhere unless every check passed.
3. Every rank restores its objects, and learns whether all others did. Each reads here what it loads, once:
   modules their tensors, FSDP objects their parts of each tensor, a ZeRO optimizer its partition, straight into
   the tensors they are loaded into where the layouts allow, each block checked as it arrives (from a sharded
   checkpoint, FSDP objects read their shards in round 2 already, straight into their own tensors). A corrupt
   block leaves the objects partly restored, with the same error on every rank.

With plain objects only, or without a process group, loading is local, as in ignite, and every tensor is read into
new memory, checked, before anything is loaded: a corrupt record changes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ignite_zero import _compat, collector, transport, tree
from ignite_zero.adapters import ShardedState, adapt, deferred, in_loadable_form
from ignite_zero.agreement import Hosts, hosts_of_ranks, rank_and_world, settle, together
from ignite_zero.loading.entries import ShardedEntry, entries_for, entries_of
from ignite_zero.loading.whole import as_one_file
from ignite_zero.storage import replicas
from ignite_zero.storage.formats import Reader, reader_for
from ignite_zero.transport.groups import cpu_group

__all__ = ["restore"]


# What each rank tells the others in the first round of a load: what it sees of the checkpoint (``None``: nothing),
# the part of each sharded entry it needs, and whether what it sees is a sharded checkpoint.
_Report = tuple[Any, Any, bool]


@collector.paused()  # a load makes many objects, keeps few, and would set off passes over the heap
def restore(
    to_load: Mapping,
    checkpoint: str | Path | Mapping,
    *,
    weights_only: bool,
    sync_timeout: float,
    storage_options: Mapping[str, Any] | None,
    kwargs: Mapping,
) -> None:
    """Restore ``to_load`` from ``checkpoint``; see :meth:`ignite_zero.Checkpoint.load_objects`."""
    objects = None
    try:
        objects = adapt(to_load, 0)
        if _collective(objects) and not isinstance(checkpoint, Mapping):  # files a host lacks, from hosts with them
            replicas.repair_before_load(checkpoint, storage_options, sync_timeout)
        reader = None if isinstance(checkpoint, Mapping) else reader_for(checkpoint, storage_options)
    except Exception as error:  # e.g. a directory this rank may not read: the others would wait for it in round 1
        if objects is None or _collective(objects):  # only sharded objects fail to adapt
            settle(error, what="checkpoint load", timeout=sync_timeout)
        raise
    if reader is None:
        _restore(objects, checkpoint, None, weights_only, sync_timeout, kwargs)
        return
    with reader:  # open until FSDP objects have read their parts
        _restore(objects, checkpoint, reader, weights_only, sync_timeout, kwargs)


def _restore(
    objects: Any,
    checkpoint: str | Path | Mapping,
    reader: Reader | None,
    weights_only: bool,
    sync_timeout: float,
    kwargs: Mapping,
) -> None:
    if not _collective(objects):
        if reader is None:
            local = entries_of(objects, checkpoint)
        else:
            local = entries_for(_checked_before_reading(reader), objects, weights_only)
        # read whole into new tensors, each checked, before anything changes: a corrupt record changes nothing
        for load in _prepare(objects, _for_plain_optimizers(objects, deferred.realize_all(local)), kwargs):
            load()
        return

    parts = tree.map_tree(lambda _, obj: obj.part_needed() if isinstance(obj, ShardedState) else None, objects)
    identity = None
    with together("checkpoint load", timeout=sync_timeout) as seen:
        sharded = reader is not None and reader.sharded  # what a rank that sees the checkpoint tells the others
        identity = "in memory" if reader is None else reader.identity()
        seen.payload = (identity, parts, sharded)
    reports: list[_Report] = seen.payloads
    seers = [r for r, (found, _, _) in enumerate(reports) if found is not None]
    _check_seers(checkpoint, reader, reports, seers)

    loads: list[Callable[[], None]] = []
    with together("checkpoint load (reading and checking)", timeout=sync_timeout):
        hosts = hosts_of_ranks(sync_timeout)
        found = _read(objects, checkpoint, reader, identity, weights_only, hosts, seers)
        found = _for_plain_optimizers(objects, _distribute(found, [need for _, need, _ in reports], seers))
        loads = _prepare(objects, found, kwargs)

    with together("checkpoint load (restoring objects)", timeout=sync_timeout):
        for load in loads:
            load()


def _read(
    objects: Any,
    checkpoint: str | Path | Mapping,
    reader: Reader | None,
    identity: Any,
    weights_only: bool,
    hosts: Hosts,
    seers: list[int],
) -> Any:
    """This rank's entries of a collective load: what it reads, checked (nothing where it cannot see the
    checkpoint: :func:`_distribute` sends it its part)."""
    rank, world_size = rank_and_world()
    if reader is None:
        return entries_of(objects, checkpoint)
    if identity is None:
        return None
    if _serves(rank, seers, world_size):  # reads for others: all of it, mapped
        reader.verify(whole=True)
        return entries_of(objects, as_one_file(reader, reader.load(weights_only)))
    if _verifies(rank, hosts, seers):
        reader.verify(whole=False)
    return entries_for(reader, objects, weights_only, into_objects=True)


def _collective(objects: Any) -> bool:
    """Whether loading ``objects`` is a collective: sharded objects among several ranks."""
    return rank_and_world()[1] > 1 and any(isinstance(obj, ShardedState) for _, obj in tree.leaves(objects))


def _checked_before_reading(reader: Reader) -> Reader:
    """``reader``, its checkpoint checked as much as a load needs before it reads (each part is checked as read)."""
    reader.verify(whole=False)
    return reader


def _check_seers(checkpoint: Any, reader: Reader | None, reports: list[_Report], seers: list[int]) -> None:
    if not seers:
        raise FileNotFoundError(f"Checkpoint file {checkpoint} exists on no rank; pass the path of an existing file")
    if len(seers) < len(reports) and reports[seers[0]][2]:
        blind = [r for r in range(len(reports)) if r not in seers]
        raise FileNotFoundError(
            f"Ranks {blind} cannot see the sharded checkpoint {checkpoint}: a sharded checkpoint is read by every "
            "rank, from a file system that all of them share."
        )
    identities = {reports[r][0] for r in seers}
    if len(identities) > 1:
        listing = ", ".join(f"rank {r}: {reports[r][0]}" for r in seers)
        raise ValueError(
            f"Ranks see different files at {checkpoint} (size, checksum: {listing}): a stale copy on some node? "
            "Make every rank see the same file, or only one."
        )


def _verifies(rank: int, hosts: Hosts, seers: list[int]) -> bool:
    """One rank per host checks the checkpoint as a load needs before it reads (each part is then checked as it is
    read): the others of its host read the same files."""
    return rank == next(r for r in seers if hosts.of(r) == hosts.of(rank))


def _serves(rank: int, seers: list[int], world_size: int) -> bool:
    """Whether this rank reads the checkpoint for ranks that cannot see it (see :func:`_distribute`)."""
    return len(seers) < world_size and rank == seers[0]


def _distribute(entries: Any, needs: list[Any], seers: list[int]) -> Any:
    """Send each rank that cannot read the file the part of every entry it needs; return this rank's entries."""
    rank, world_size = rank_and_world()
    needy = [r for r in range(world_size) if r not in seers]
    if not needy:
        return entries
    group = cpu_group()
    if rank in needy:
        return transport.receive_from(seers[0], group)
    if rank == seers[0]:
        failures = []
        for r in needy:  # every needy rank is answered, with its part or with the error
            try:
                part = deferred.realize_all(_select(entries, needs[r]))  # read here for a rank that cannot
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
    return tree.map_tree(
        lambda path, part: tree.get(entries, path) if part is None else part.select(tree.get(entries, path)), parts
    )


def _pair(objects: Any, entries: Any, func: Callable[[str, Any, Any], Any]) -> Any:
    """``func(path, obj, entry)`` for every object of a nested ``to_load`` and its entry, in the same shape."""
    return tree.map_tree(lambda path, obj: func(tree.describe(path), obj, tree.get(entries, path)), objects)


def _for_plain_optimizers(objects: Any, entries: Any) -> Any:
    """Each entry in the form its object loads (:func:`~ignite_zero.adapters.in_loadable_form`): optimizer state
    saved by parameter name for optimizers that load it by index, and the other way round. The names are those of
    the parameters in the model the optimizer updates, which must be in ``to_load``."""
    models = [obj for _, obj in tree.leaves(objects) if isinstance(obj, nn.Module)]
    return _pair(objects, entries, lambda path, obj, entry: in_loadable_form(path, obj, entry, models))


def _prepare(objects: Any, entries: Any, kwargs: Mapping) -> list[Callable[[], None]]:
    """Check every object's entry, changing nothing, and return what loads each, in order: an entry that would not
    load is refused before any object changes."""
    loads: list[Callable[[], None]] = []

    def prepare(path: str, obj: Any, entry: Any) -> None:
        if isinstance(obj, ShardedState) and not isinstance(entry, ShardedEntry):
            # an adapter that loads deferred tensors reads its parts of them as it loads, as its check planned; the
            # others take their (small) entries read whole now
            entry = entry if obj.loads_deferred else deferred.realize_all(entry)
            loads.append(obj.prepare_load(entry, **_module_kwargs(obj, kwargs)))
            return
        _check_entry(path, obj, entry, kwargs)
        loads.append(functools.partial(_load_entry, obj, entry, kwargs))

    _pair(objects, entries, prepare)
    return loads


def _check_entry(path: str, obj: Any, entry: Any, kwargs: Mapping) -> None:
    """Refuse, before anything is loaded, an entry that would not load."""
    if isinstance(entry, ShardedEntry):  # read through the object's own template: its names were checked by the read
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
        raise RuntimeError(  # as nn.Module.load_state_dict raises, but before anything changed
            f"Error(s) in loading state_dict for {type(obj).__name__}: the checkpoint entry {path} does not fit the "
            f"model: missing keys {missing}, unexpected keys {unexpected}, different shapes {shapes}. Nothing was "
            "loaded. Pass `strict=False` to load what fits."
        )


def _load_entry(obj: Any, entry: Any, kwargs: Mapping) -> None:
    """Restore ``obj`` from ``entry``, whose tensors may be deferred: read straight into ``obj``'s own tensors where
    ``obj`` is a module, else into new ones first (adapters of sharded state load as :func:`_prepare` prepared them)."""
    if isinstance(entry, ShardedEntry):
        if entry.read is not None:
            entry.read()
        obj.load_sharded(entry.state)
    elif isinstance(obj, nn.Module) and isinstance(entry, Mapping):
        _read_into_module(obj, entry)
        if kwargs.keys() <= {"strict"}:
            _compat.load_module_state(obj, entry, **kwargs)
        else:  # assign=True...: nn.Module's own
            obj.load_state_dict(entry, **kwargs)
    elif isinstance(obj, torch.optim.Optimizer):
        _compat.load_optimizer_state(obj, deferred.realize_all(entry))
    else:
        obj.load_state_dict(deferred.realize_all(entry), **_module_kwargs(obj, kwargs))


def _read_into_module(module: nn.Module, entry: Any) -> None:
    """Read the deferred tensors of a module's state dict ``entry`` straight into the module's parameters and
    buffers where they fit, the others into new tensors; ``entry`` then holds those tensors themselves, which
    ``load_state_dict`` copies onto themselves at no cost (and runs its hooks and extra state as usual)."""
    own = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in list(entry.items()):
            if not deferred.is_deferred(value):
                entry[name] = deferred.realize_all(value)
                continue
            target = own.get(name)
            if isinstance(target, torch.Tensor) and (target.shape, target.dtype) == (value.shape, value.dtype):
                deferred.copy_into(target.detach(), value)
                entry[name] = target
            else:  # a shape or dtype that load_state_dict refuses or converts: it says so, as usual
                entry[name] = deferred.realize(value)


def _module_kwargs(obj: Any, kwargs: Mapping) -> Mapping:
    """``load_objects``' keyword arguments are for modules (``strict``), models behind adapters included."""
    module = obj.obj if isinstance(obj, ShardedState) else obj
    return kwargs if isinstance(module, nn.Module) else {}
