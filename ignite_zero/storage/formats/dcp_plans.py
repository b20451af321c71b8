"""DCP's save protocol, with its plans shared through the saver's own rounds instead of DCP's collectives.

``dcp.save`` gathers every rank's local plan to a coordinator and scatters the global plans back, then gathers every
rank's write results for ``.metadata`` and broadcasts the outcome: four object collectives over the process group.
Before and after them a sharded save runs its own rounds anyway (preparation, commit), through the store, and a round of
ours costs a fraction of one of DCP's exchanges (see the benchmarks page). So :class:`SavePlanning` runs the same steps
with the same planner (``DefaultSavePlanner``) and storage writer, in DCP's order, but its :class:`Offer` travels in the
preparation round and every rank makes the global plans from every rank's offer itself: planning is deterministic, and
each rank needs its own plan and the coordinator the metadata. The directory is the one ``dcp.save`` writes.

Plans are kept between saves, as DCP's ``enable_plan_caching`` keeps them, but without making them again to find out
whether they changed: a rank keeps its local plan while its state's layout holds (the names, shapes, strides, dtypes,
placements and meshes that the plan depends on, cheaper to compare than a plan to make), and offers none while it
does, and where no rank's did, the kept global plans and metadata are reused, sparing the global planning and the
pickling of plans. Every agreement on plans is numbered alike on every rank; a rank offers its number with its plan, so
that ranks that kept plans from different agreements (a round that failed on some ranks only, a saver used by other
ranks) are found out, and plan afresh.

What it costs at scale: the write results go to the coordinator alone (a round ``to`` one rank, see
:func:`ignite_zero.agreement.settle`), as DCP gathers them; but every rank reads every rank's plan, at the first save
and where plans change, to make the global plans itself: O(ranks x entries) a rank then, where DCP's coordinator
alone reads them and scatters each rank its own.
"""

from __future__ import annotations

import dataclasses
import io
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor

from ignite_zero import _compat
from ignite_zero.staging import HostBuffers, SharedBlock
from ignite_zero.storage.formats.dcp_files import FileWritten, MetadataFile, PlacedFile, PlaceStorageWriter
from ignite_zero.storage.formats.dcp_flat import flatten
from ignite_zero.storage.places import Place

__all__ = ["ENTRY_BYTES", "Offer", "SavePlanning", "StagedPart", "WrittenPart", "as_saved", "share_replicated"]


def as_saved(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` as DCP saves it: its ``Stateful`` values by their state dicts."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}


class _LocalTensorSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, but for two steps whose cost shows in every save of many small tensors: how it
    flattens the state (:func:`~ignite_zero.storage.formats.dcp_flat.flatten`), and how it finds a DTensor's data to
    write: its local tensor, read without the autograd function of ``to_local()``.

    Args:
        pickled_before: the plain values the last save pickled, by name, each with its :func:`_plain_key`: a value
            equal to one of them is not pickled again (an optimizer's hyperparameters, say: ``torch.save`` of each
            costs more than writing a small tensor's archive).

    Attributes:
        pickled: this save's plain values and their bytes, as :meth:`resolve_items` pickled them or took them.
    """

    def __init__(self, pickled_before: Mapping[str, tuple[Any, bytes]] | None = None) -> None:
        super().__init__()
        self.pickled_before = {} if pickled_before is None else pickled_before
        self.pickled: dict[str, tuple[Any, bytes]] = {}

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        flattened = flatten(state_dict) if self.flatten_state_dict and self.flatten_sharded_tensors else None
        if flattened is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        super().set_up_planner({}, storage_meta, is_coordinator)  # whatever else DCP sets up, on nothing to flatten
        self.state_dict, self.mappings = flattened

    def lookup_object(self, index: MetadataIndex) -> Any:
        local = _local_data(self.state_dict.get(index.fqn))
        return super().lookup_object(index) if local is None else local

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plans, from plans in which each tensor several ranks hold is left to one of them already (see
        :func:`share_replicated`): DCP's own deduplication is left the values."""
        return super().create_global_plan(share_replicated(all_plans))

    def resolve_items(self, items: Sequence[WriteItem]) -> list[Any]:
        """:meth:`resolve_data` of each of ``items``, in order, in one pass over them: what DCP's three calls an item
        cost shows in a save of many small tensors."""
        state = self.state_dict
        resolved: list[Any] = []
        for item in items:
            if item.type is WriteItemType.BYTE_IO:
                resolved.append(self._pickled_value(item))
                continue
            local = _local_data(state.get(item.index.fqn))
            resolved.append(self.resolve_data(item) if local is None else local)
        return resolved

    def _pickled_value(self, item: WriteItem) -> Any:
        """The value ``item`` writes, pickled as DCP pickles it (``torch.save``, in an ``io.BytesIO``), or the bytes of
        an equal plain value that the last save pickled under its name."""
        name = item.index.fqn
        key = _plain_key(self.state_dict.get(name))
        if key is None:
            return self.resolve_data(item)
        kept = self.pickled_before.get(name)
        if kept is None or kept[0] != key:
            pickled = self.resolve_data(item)
            assert isinstance(pickled, io.BytesIO)
            kept = (key, pickled.getvalue())
        self.pickled[name] = kept
        return io.BytesIO(kept[1])


_DOUBLE = struct.Struct("<d")


def _plain_key(value: Any) -> Any:
    """What tells a plain value (``None``, a bool, number, string or bytes, or a tuple or list of such values) from
    every other, and from any value that loads back otherwise: types included (``1``, ``1.0`` and ``True`` are equal
    in Python), a float's every bit (``-0.0`` and ``0.0``), a list copied into it (changed in place, it is another);
    ``None`` for anything else, which is pickled at every save. Not a tuple or list that holds one: which of those are
    one object (``[a, a]`` or ``[[1], [1]]``) changes what loads back, and the key does not tell. Equal strings in a
    list, one object or not, load back equal (pickled once or twice)."""
    kind = type(value)
    if kind in (tuple, list):
        items = tuple(map(_scalar_key, value))
        return None if any(item is None for item in items) else (kind, items)
    return _scalar_key(value)


def _scalar_key(value: Any) -> Any:
    """:func:`_plain_key` of ``None``, a bool, number, string or bytes (exactly those types); ``None`` otherwise."""
    kind = type(value)
    if kind is float:
        return kind, _DOUBLE.pack(value)
    if value is None or kind in (bool, int, str, bytes):
        return kind, value
    return None


#: What writing an entry costs beyond its bytes, counted as bytes (its record and checksums, about 10-20 us at a few
#: GB/s): a rank given thousands of small replicated tensors takes longer than the others, whatever their bytes.
ENTRY_BYTES = 32 << 10


def share_replicated(plans: Sequence[SavePlan]) -> list[SavePlan]:
    """``plans`` with each tensor that several of them hold (a replicated one: Adam's ``step``, a buffer, a parameter
    that is not sharded, HSDP's replicas) kept in one only: that of the rank with the least to write so far, counting
    first what each rank alone holds, each item as its bytes and :data:`ENTRY_BYTES`.

    DCP's own deduplication gives each such item to the plan with the fewest bytes counted so far, counting as it meets
    the items, the first plan's first: the replicated tensors of a state of many small tensors all go to one rank, which
    then writes a third more entries than the others (2,000 of Adam's ``step`` tensors in a save of 8,000 entries).
    Values (pickled, a few) are left to it: where tensors come before them, as in an optimizer's state, it gives them
    all to one rank, which keeps a dict's values in their order in ``.metadata``, the order in which a load into plain
    objects rebuilds the dict.
    """
    holders: dict[MetadataIndex, list[int]] = {}
    for position, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(position)
    load = [sum(_cost(item) for item in plan.items if len(holders[item.index]) == 1) for plan in plans]
    keeper: dict[MetadataIndex, int] = {}
    shared = {
        item.index: item
        for plan in plans
        for item in plan.items
        if len(holders[item.index]) > 1 and item.type is not WriteItemType.BYTE_IO
    }
    for index, item in shared.items():
        position = min(holders[index], key=load.__getitem__)
        load[position] += _cost(item)
        keeper[index] = position
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if keeper.get(item.index, position) == position])
        for position, plan in enumerate(plans)
    ]


def _cost(item: WriteItem) -> int:
    return (item.tensor_storage_size() or 0) + ENTRY_BYTES


def _local_data(value: Any) -> torch.Tensor | None:
    """The tensor whose data a tensor item of ``value`` writes, where that is a plain tensor (written whole) or the
    local tensor of a DTensor whose placements have a layout; ``None`` where DCP's own lookup should find it."""
    if type(value) is torch.Tensor:
        return value
    if type(value) is not DTensor:
        return None
    for placement in value.placements:
        if placement.is_partial():
            return None
    local = _compat.dtensor_local(value)
    return local if type(local) is torch.Tensor else None  # a tensor subclass may find its shard itself, as DCP lets it


def _state_layout(planner: DefaultSavePlanner) -> tuple[list[Any] | None, int]:
    """What the local plan of ``planner``'s flattened state depends on, entry by entry, ``None`` where it cannot be
    told cheaply (a ``ShardedTensor``, another object that plans its own writes: that state is planned every save);
    and about how many bytes its files take: each tensor's, and room for each entry's record and pickled value."""
    layout: list[Any] | None = [torch.is_grad_enabled(), planner.mappings]
    nbytes = (1 << 16) + 256 * len(planner.state_dict)
    for name, value in planner.state_dict.items():
        if type(value) is DTensor:  # its chunk is its global layout's; its properties its local tensor's
            local = _compat.dtensor_local(value)
            nbytes += local.nbytes
            if layout is not None:
                global_layout = _compat.dtensor_layout(value)
                layout.append((name, global_layout, value.requires_grad, local.requires_grad, local.is_pinned()))
        elif hasattr(value, "local_shards"):
            nbytes += sum(shard.tensor.nbytes for shard in value.local_shards())
            layout = None
        elif hasattr(value, "__create_write_items__"):
            nbytes += value.nbytes if isinstance(value, torch.Tensor) else 0
            layout = None
        elif isinstance(value, torch.Tensor):
            nbytes += value.nbytes
            if layout is not None:
                layout.append((name, value.shape, value.dtype, value.layout, value.requires_grad, value.is_pinned()))
        elif layout is not None:  # written pickled, whatever it holds
            layout.append(name)
    return layout, nbytes


@dataclasses.dataclass(frozen=True)
class Offer:
    """What a rank brings to the agreement on plans.

    Attributes:
        kept: the number of the agreement this rank keeps plans from, among the same ranks; 0 if none.
        latest: the highest number of an agreement this rank took part in.
        plan: this rank's local plan; ``None`` where it is the one kept.
    """

    kept: int
    latest: int
    plan: SavePlan | None


@dataclasses.dataclass(frozen=True)
class WrittenPart:
    """Where a rank wrote each item of its part of the global plan, in the plan's order: what the write results say,
    as a few arrays that travel to the coordinator in one piece, not thousands of objects to pickle and build again.

    Attributes:
        files: the names of the files written.
        places: a row per item: the number of its file in ``files``, its offset there and its length.
    """

    files: tuple[str, ...]
    places: np.ndarray

    @classmethod
    def of_files(cls, plan: SavePlan, files: Sequence[PlacedFile]) -> WrittenPart:
        """The places of the items of ``plan``, written as ``files``: from their records, without DCP's results."""
        places = np.empty((len(plan.items), 3), dtype=np.int64)
        for number, file in enumerate(files):
            places[file.positions, 0] = number
            places[file.positions, 1:] = file.written.records[:, :2]
        return cls(tuple(file.name for file in files), places)

    def results(self, plan: SavePlan) -> list[WriteResult]:
        """DCP's results of writing ``plan``, the part these places are of."""
        return [
            WriteResult(item.index, length, _compat.dcp_storage_info(self.files[file], offset, length))
            for item, (file, offset, length) in zip(plan.items, self.places.tolist(), strict=True)
        ]

    def same_places(self, other: WrittenPart) -> bool:
        return self.files == other.files and np.array_equal(self.places, other.places)


class StagedPart(NamedTuple):
    """A host copy of what a rank writes of a save: its part of the plan, and what each item resolved to (a value's
    bytes, a copy of a tensor), in the plan's order; the block that the copies lie in, where they are shared."""

    plan: SavePlan
    values: list[Any]
    block: SharedBlock | None


@dataclasses.dataclass(frozen=True)
class _Agreement:
    members: tuple[int, ...]
    position: int  # this rank's among them
    number: int
    local_plans: list[SavePlan]  # every rank's, in the order of members
    central_plan: SavePlan  # this rank's part of the global plan
    metadata: Metadata | None  # the coordinator's only
    global_plans: list[SavePlan] | None  # the coordinator's only


class SavePlanning:
    """One stream of saves of one saver: the plans of each save, agreed among its ranks, and those kept from the last.

    A save calls :meth:`offer`, shares the offer of every rank, then calls :meth:`make_global_plans` with all of them;
    where that returns False, every rank shares :meth:`full_offer` and calls it again. Then :meth:`write` writes this
    rank's files and, given every rank's write results, the coordinator writes ``.metadata`` (:meth:`finish`).

    Agreements are numbered above every number that any of their ranks saw, so that two ranks keeping plans from
    agreements of the same number and ranks took part in the same one.
    """

    def __init__(self) -> None:
        self._kept: _Agreement | None = None
        self._latest = 0
        self._planner: _LocalTensorSavePlanner | None = None
        self._local_plan: SavePlan | None = None
        self._planned: tuple[list[Any], SavePlan] | None = None  # the layout of the last local plan made, and that plan
        self._pickled: dict[str, tuple[Any, bytes]] = {}  # the plain values the last save pickled (see the planner)
        #: about how many bytes this rank's files of the save being planned take (see :meth:`offer`)
        self.part_bytes = 0
        self._members: tuple[int, ...] = ()
        self._position = 0
        # the coordinator's: where the last save under the kept agreement wrote, and its .metadata
        self._written: tuple[list[WrittenPart], MetadataFile] | None = None

    @property
    def central_plan(self) -> SavePlan | None:
        """This rank's part of the agreed global plan; ``None`` before an agreement."""
        return None if self._kept is None else self._kept.central_plan

    @property
    def metadata(self) -> Metadata | None:
        """The agreed ``.metadata``, but for the write results; on the coordinator only."""
        return None if self._kept is None else self._kept.metadata

    @property
    def metadata_file(self) -> MetadataFile | None:
        """The coordinator's ``.metadata`` of the last save under the kept agreement; ``None`` elsewhere."""
        return None if self._written is None else self._written[1]

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank writes ``.metadata``: the first of the save's ranks, as DCP's coordinator."""
        return self._position == 0

    def offer(self, state: Mapping[str, Any], writer: StorageWriter, members: Sequence[int], rank: int) -> Offer:
        """Plan this rank's part of a save.

        Args:
            state: this rank's part, as DCP saves it (see :func:`as_saved`).
            writer: the storage writer of the save.
            members: the ranks of the save, in the order of the rounds' payloads.
            rank: this rank, one of them.

        Returns:
            The offer to share with the other members.
        """
        self._members, self._position = tuple(members), list(members).index(rank)
        planner = _LocalTensorSavePlanner(self._pickled)
        planner.set_up_planner(dict(state), storage_meta=writer.storage_meta(), is_coordinator=self.is_coordinator)
        writer.set_up_storage_writer(self.is_coordinator, rank=self._position, use_collectives=True)
        self._planner = planner
        layout, self.part_bytes = _state_layout(planner)
        if layout is not None and self._planned is not None and self._planned[0] == layout:
            local_plan = self._planned[1]
        else:
            local_plan = planner.create_local_plan()
            self._planned = None if layout is None else (layout, local_plan)
        self._local_plan = writer.prepare_local_plan(local_plan)
        kept = self._kept
        if kept is None or (kept.members, kept.position) != (self._members, self._position):
            return self.full_offer()
        own = kept.local_plans[self._position]
        same = own is self._local_plan or own == self._local_plan
        return Offer(kept.number, self._latest, None if same else self._local_plan)

    def full_offer(self) -> Offer:
        """This rank's offer with its plan: where it keeps none, and in the second round where ranks kept plans from
        different agreements."""
        assert self._local_plan is not None, "offer() first"
        return Offer(0, self._latest, self._local_plan)

    def make_global_plans(self, offers: Sequence[Offer], writer: StorageWriter) -> bool:
        """Make the save's plans from every rank's offer, here, as every rank does alike: this rank's part of the
        global plan (and the coordinator's metadata), made afresh where any plan changed, else kept.

        Args:
            offers: every rank's offer, in the order of the members.
            writer: the storage writer that :meth:`offer` was given.

        Returns:
            False, with nothing planned, where ranks offered no plan from different kept agreements: every rank then
            shares :meth:`full_offer` and makes them again.
        """
        kept = self._kept
        self._latest = max(self._latest, *(offer.latest for offer in offers))
        if any(offer.plan is None for offer in offers) and (
            kept is None or any(offer.kept != kept.number for offer in offers)
        ):
            self._kept = None
            return False
        if kept is not None and all(offer.plan is None for offer in offers):
            return True
        plans = [offer.plan or kept.local_plans[n] for n, offer in enumerate(offers)]  # type: ignore[union-attr]
        plans[self._position] = self._local_plan  # not the round's copy: the next offer finds it kept by identity
        assert self._planner is not None, "offer() first"
        global_plans, metadata = self._planner.create_global_plan(plans)
        global_plans = writer.prepare_global_plan(global_plans)
        self._latest += 1
        central_plan = global_plans[self._position]
        coordinated = (metadata, global_plans) if self.is_coordinator else (None, None)
        self._kept = _Agreement(self._members, self._position, self._latest, plans, central_plan, *coordinated)
        self._written = None
        return True

    def write(self, writer: PlaceStorageWriter) -> WrittenPart:
        """Write this rank's part of the agreed plan.

        Args:
            writer: the storage writer that :meth:`offer` was given.

        Returns:
            Where each item was written, for :meth:`finish` on the coordinator.
        """
        kept, planner = self._kept, self._planner
        assert planner is not None and kept is not None, "offer() and make_global_plans() first"
        plan = planner.finish_plan(kept.central_plan)
        return WrittenPart.of_files(plan, writer.write_plan(plan, planner.resolve_items))

    def stage(self, buffers: HostBuffers) -> StagedPart:
        """Copy what this rank writes of the agreed plan into host memory: each item's tensor into ``buffers``, each
        value pickled; the state itself may then change while :meth:`write_staged` writes the copy."""
        kept, planner = self._kept, self._planner
        assert planner is not None and kept is not None, "offer() and make_global_plans() first"
        plan = planner.finish_plan(kept.central_plan)
        resolved = planner.resolve_items(plan.items)
        copies = iter(buffers.copy([value for value in resolved if isinstance(value, torch.Tensor)]))
        staged = [next(copies) if isinstance(value, torch.Tensor) else value.getvalue() for value in resolved]
        return StagedPart(plan, staged, buffers.block)

    def write_staged(
        self, writer: PlaceStorageWriter, staged: StagedPart, write_file: Callable[[Place, str, list[Any]], FileWritten]
    ) -> WrittenPart:
        """Write this rank's part from ``staged``, each file with ``write_file`` (see
        :meth:`~ignite_zero.storage.formats.dcp_files.PlaceStorageWriter.write_staged`)."""
        return WrittenPart.of_files(staged.plan, writer.write_staged(staged.plan, staged.values, write_file))

    def finish(self, writer: PlaceStorageWriter, parts: Sequence[WrittenPart]) -> None:
        """On the coordinator, once every rank wrote: ``.metadata`` and the index of the entries; the last save's
        bytes again where every rank wrote every item where it did then (the same plans, the same sizes), with this
        save's storage facts.

        Args:
            writer: the storage writer that :meth:`offer` was given.
            parts: every rank's result of :meth:`write`, in the order of the members.
        """
        kept, written = self._kept, self._written
        assert kept is not None and kept.metadata is not None, "the coordinator's make_global_plans() first"
        assert kept.global_plans is not None
        if written is not None and all(a.same_places(b) for a, b in zip(written[0], parts, strict=True)):
            writer.write_metadata(written[1])
            return
        results = [part.results(plan) for part, plan in zip(parts, kept.global_plans, strict=True)]
        writer.finish(metadata=kept.metadata, results=results)
        assert writer.metadata_file is not None
        self._written = (list(parts), writer.metadata_file)

    def release(self) -> None:
        """Drop what this save holds of the state (the planner refers to its tensors); plans stay kept, and the plain
        values it pickled."""
        if self._planner is not None and self._planner.pickled:
            self._pickled = self._planner.pickled
        self._planner = None
