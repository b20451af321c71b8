"""Regions of full tensors that ranks hold, assembled on one rank through the transport.

A region is an N-D block of its full tensor (:class:`Box`): a DTensor's local shard on any mesh (HSDP, FSDP2 over
tensor parallelism: one block, whatever the placements), or a range of the flattened tensor (FSDP1's and
fairscale's flat shards). The recipient checks that the distinct blocks of each tensor tile it exactly, takes each
from one rank (replicas send nothing), and receives it in place.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.distributed import ProcessGroup

from ignite_zero.pickling import immutable
from ignite_zero.staging import detached, owns_its_bytes
from ignite_zero.transport import (
    DEFAULT_CHUNK_BYTES,
    Overlap,
    Ranks,
    StreamReceiver,
    chunk_bytes_for,
    receive_all,
    receive_bytes,
    resolve,
    send_bytes,
    send_error,
    send_stream,
)

__all__ = ["Box", "Pieces", "Region", "gather_pieces"]


@dataclass(frozen=True)
class Box:
    """A block of a tensor of shape ``shape``: indices ``[offsets[d], offsets[d] + sizes[d])`` along every dimension.

    With ``flat``, the block is a range of the flattened (row-major) tensor: ``offsets`` and ``sizes`` have one
    entry each. FSDP1 and fairscale shard flattened parameters that way; DTensor shards are N-D blocks.
    """

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: bool = False

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """The whole tensor."""
        shape = tuple(int(s) for s in shape)
        return cls(shape, (0,) * len(shape), shape)

    @classmethod
    def range(cls, shape: Sequence[int], start: int, length: int) -> Box:
        """Elements ``[start, start + length)`` of the flattened tensor."""
        return cls(tuple(int(s) for s in shape), (int(start),), (int(length),), flat=True)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def space(self) -> tuple[int, ...]:
        """The shape that ``offsets`` and ``sizes`` index: the tensor's, or its flattened one's."""
        return (math.prod(self.shape),) if self.flat else self.shape

    @property
    def is_whole(self) -> bool:
        return self.sizes == self.space

    def view(self, full: torch.Tensor) -> torch.Tensor:
        """This block of ``full`` (a view)."""
        space = self.space
        view = full if full.shape == space else full.reshape(space)
        for dim, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            if size != space[dim]:  # a dimension the block spans needs no view of its own
                view = view.narrow(dim, offset, size)
        return view

    def runs(self) -> int:
        """Dimensions that index the block's contiguous runs in the full tensor: the block is contiguous for fixed
        indices along its first ``runs()`` dimensions (0: the block is one contiguous run)."""
        partial = [d for d, size in enumerate(self.sizes) if size != self.space[d]]
        return partial[-1] if partial else 0

    def blocks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor`` (laid out as the block, or as the full tensor) cut into the block's contiguous runs, in order.

        A DTensor's ``Shard(1)`` block of a matrix is one run per row in the full tensor: receiving run by run puts
        every row straight into place, where a buffer for the whole block would double the recipient's memory for it.
        """
        shaped = tensor.reshape(self.sizes) if tensor.shape != self.sizes else tensor
        lead = self.runs()
        if lead == 0:
            return [shaped]
        return [shaped[index] for index in itertools.product(*(range(s) for s in self.sizes[:lead]))]


@dataclass(frozen=True)
class Region:
    """Where a local piece sits in its full tensor: ``key`` names the full tensor, ``box`` the piece's block of it.

    ``layout`` describes how the rank holds it, compared between ranks that should agree (for a DTensor: its mesh
    and placements), and named in errors.
    """

    key: tuple[Any, ...]
    dtype: torch.dtype
    box: Box
    layout: Any = None


@dataclass(frozen=True)
class _Alias:
    target: tuple[Any, ...]


@dataclass
class Pieces:
    """What one rank holds towards a full state: tensor pieces with their regions, and plain values.

    ``order`` is the key order of the assembled result (the recipient's own order wins).
    """

    regions: list[Region] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    values: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    order: list[tuple[Any, ...]] = field(default_factory=list)

    def add(self, key: tuple[Any, ...], box: Box, piece: torch.Tensor, layout: Any = None) -> None:
        """Add ``piece``, the block ``box`` of the full tensor ``key`` (laid out as the block, or flat)."""
        if piece.numel() != box.numel:
            raise ValueError(f"A piece of {_name(key)} has {piece.numel()} elements, its block {box} {box.numel}")
        self.regions.append(Region(key, piece.dtype, box, layout))
        self.tensors.append(piece)
        self.order.append(key)

    def add_whole(self, key: tuple[Any, ...], value: Any) -> None:
        """Add a value this rank holds whole: a tensor (a replica, e.g. a buffer or ``step``) or any picklable."""
        if isinstance(value, torch.Tensor):
            self.add(key, Box.whole(value.shape), value)
        else:
            self.values[key] = value
            self.order.append(key)

    def add_alias(self, key: tuple[Any, ...], target: tuple[Any, ...]) -> None:
        """``key`` names the same tensor as ``target`` (tied parameters): sent once, shared in the result."""
        self.values[key] = _Alias(target)
        self.order.append(key)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole only to be copied (an asynchronous save's staging): the regions and the order, complete by
        # then and never changed after, are shared with the copy rather than pickled entry by entry.
        return _pieces, (_Complete(self.regions, self.order), self.tensors, self.values)


@immutable
class _Complete(NamedTuple):
    """The regions and key order of pieces that no one adds to any more."""

    regions: list[Region]
    order: list[tuple[Any, ...]]


def _pieces(complete: _Complete, tensors: list[torch.Tensor], values: dict[tuple[Any, ...], Any]) -> Pieces:
    return Pieces(complete.regions, tensors, values, complete.order)


_Manifest = tuple[list[Region], dict[tuple[Any, ...], Any], list[tuple[Any, ...]]]


def _check_layouts(key: tuple[Any, ...], candidates: list[tuple[int, int, Region]]) -> None:
    """Ranks that share a device mesh must hold a tensor with the same mesh and placements.

    Raises:
        RuntimeError: naming the tensor, both ranks and their layouts.
    """
    layout_of = {r: region.layout for r, _, region in candidates}
    first_holder: dict[Any, int] = {}
    for r, layout in layout_of.items():  # a few distinct layouts: one per mesh the tensor sits on
        first_holder.setdefault(layout, r)
    for layout, r in first_holder.items():
        for peer in getattr(layout, "ranks", ()):
            if layout_of.get(peer, layout) != layout:
                raise RuntimeError(
                    f"Ranks disagree on how they hold {_name(key)}: {layout} on rank {r}, {layout_of[peer]} on rank "
                    f"{peer}: build the same device mesh and shard the same way on every rank of a mesh"
                )


def _check_cover(key: tuple[Any, ...], boxes: list[Box], space: tuple[int, ...], layouts: set[Any]) -> None:
    """The distinct, non-empty ``boxes`` must tile ``space`` exactly: no overlap, no gap.

    Raises:
        RuntimeError: naming the tensor, the boxes and how the ranks hold it.
    """
    overlapping = _first_overlap(boxes)
    if overlapping is not None:
        a, b = overlapping
        held = _held(layouts)
        hint = "; is each rank's local tensor one block of the full tensor?" if held else ""
        raise RuntimeError(f"Pieces of {_name(key)} overlap: {boxes[a]} and {boxes[b]}{held}{hint}")
    covered = sum(box.numel for box in boxes)
    if covered != math.prod(space):
        raise RuntimeError(f"Pieces of {_name(key)} cover {covered} of its {math.prod(space)} elements{_held(layouts)}")


def _held(layouts: set[Any]) -> str:
    """How the ranks hold a tensor, for an error: described only then, since a save checks thousands of tensors."""
    described = sorted(str(layout) for layout in layouts if layout is not None)
    return f" (held as {', '.join(described)})" if described else ""


# Up to this many boxes of a tensor are compared pair by pair in Python; more at once, vectorised: building tensors
# costs more than comparing a few boxes (a save of thousands of tensors held by a few ranks each), and less than
# comparing thousands of pieces pair by pair.
_COMPARED_IN_PYTHON = 16


def _first_overlap(boxes: list[Box]) -> tuple[int, int] | None:
    """The positions of two of ``boxes`` that overlap, if any do."""
    if len(boxes) <= _COMPARED_IN_PYTHON:
        for a, first in enumerate(boxes):
            for b in range(a + 1, len(boxes)):
                second = boxes[b]
                if all(
                    start < other_start + other_size and other_start < start + size
                    for start, size, other_start, other_size in zip(
                        first.offsets, first.sizes, second.offsets, second.sizes
                    )
                ):
                    return a, b
        return None
    start = torch.tensor([box.offsets for box in boxes], dtype=torch.int64)
    end = start + torch.tensor([box.sizes for box in boxes], dtype=torch.int64)
    overlap = ((start[:, None] < end[None]) & (start[None] < end[:, None])).all(dim=-1)
    overlap.fill_diagonal_(False)
    if not overlap.any():
        return None
    a, b = (int(i) for i in overlap.nonzero()[0])
    return a, b


def _choose_sources(
    manifests: list[_Manifest], root: int
) -> tuple[
    list[tuple[Any, ...]], dict[tuple[Any, ...], list[tuple[int, int]]], dict[tuple[Any, ...], Region], list[list[int]]
]:
    """On the root: for every key, pieces that cover the full tensor exactly once, the root's own first.

    Identical blocks (replicas: HSDP's replicate dimension, a parameter replicated over tensor parallelism, NO_SHARD)
    come from one rank only: the root if it holds one, else the replica with the fewest bytes to send so far, so
    that the replicas share the sending. A rank holding the whole tensor covers it alone.

    Returns the key order, per key the chosen ``(rank, piece index)`` pairs (none for an empty tensor) and a
    region describing the full tensor, and per rank the indices of the pieces it sends, in the order the root
    receives them.

    Raises:
        RuntimeError: ranks disagree on a tensor, or its pieces overlap or leave gaps.
    """
    ranks = [root] + [r for r in range(len(manifests)) if r != root]
    by_key: dict[tuple[Any, ...], list[tuple[int, int, Region]]] = {}
    for r in ranks:
        for i, region in enumerate(manifests[r][0]):
            by_key.setdefault(region.key, []).append((r, i, region))
    order = list(dict.fromkeys(key for r in ranks for key in manifests[r][2]))
    chosen: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    regions: dict[tuple[Any, ...], Region] = {}
    sends: list[list[int]] = [[] for _ in manifests]
    load = [0] * len(manifests)  # bytes each rank sends
    # Checks already passed, by what they depend on: a model's layers are alike, and their tensors' layouts and
    # blocks repeat, so that a save of thousands of tensors checks each kind once.
    layouts_checked: set[tuple[int, ...]] = set()
    covers_checked: set[tuple[Box, ...]] = set()
    for key in order:
        candidates = by_key.get(key)
        if not candidates:
            continue
        first = regions[key] = candidates[0][2]
        for r, _, region in candidates:
            if region.box.shape != first.box.shape or region.dtype != first.dtype:
                raise RuntimeError(
                    f"Ranks disagree on {_name(key)}: shape {region.box.shape} and {region.dtype} on rank {r}, "
                    f"{first.box.shape} and {first.dtype} on rank {candidates[0][0]}"
                )
        layouts = tuple(id(region.layout) for _, _, region in candidates)  # the manifests hold them meanwhile
        if layouts not in layouts_checked:
            _check_layouts(key, candidates)
            layouts_checked.add(layouts)
        if candidates[0][0] == root and first.box.is_whole and all(c[2].box.flat == first.box.flat for c in candidates):
            # the root holds it whole, and no rank holds it in another form: nothing else to check or choose
            chosen[key] = [(root, candidates[0][1])] if first.box.numel else []
            continue
        whole = [c for c in candidates if c[2].box.is_whole]
        replicas: dict[Box, list[tuple[int, int]]] = {}
        for r, i, region in whole or candidates:
            if region.box.numel:
                replicas.setdefault(region.box, []).append((r, i))
        boxes = tuple(replicas)
        if boxes not in covers_checked:
            if len({box.space for box in boxes}) > 1:
                raise RuntimeError(f"Ranks disagree on {_name(key)}: some hold flat ranges of it, others blocks")
            _check_cover(key, list(boxes), first.box.space, {c[2].layout for c in candidates})
            covers_checked.add(boxes)
        picked = []
        for box, holders in replicas.items():
            # ranks were met root first: the root's own replica, if it holds one, leads
            r, i = holders[0] if holders[0][0] == root else min(holders, key=lambda h: load[h[0]])
            load[r] += box.numel * first.dtype.itemsize
            picked.append((r, i))
        chosen[key] = sorted(picked)
        for r, i in chosen[key]:
            if r != root:
                sends[r].append(i)
    return order, chosen, regions, sends


def _name(key: tuple[Any, ...]) -> str:
    return ".".join(map(str, key))


def gather_pieces(
    pieces: Pieces,
    dst: int,
    group: ProcessGroup | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    overlap: Overlap | None = None,
) -> dict[tuple[Any, ...], Any] | None:
    """Assemble full tensors from the pieces ranks hold, on ``dst``; a collective over ``group``.

    Every rank sends ``dst`` the description of its pieces (no data); ``dst`` allocates each full tensor once
    on the CPU, picks one source per block (its own pieces first, so NO_SHARD parameters, buffers and ``step``
    values never travel; one replica of each block), tells each rank what to send, and receives every block
    straight into place, run by run where a block is not contiguous in the full tensor (see :meth:`Box.blocks`).
    Senders send views of what they hold: their extra memory is the staging buffer only.

    Args:
        pieces: what this rank holds.
        dst: global rank that assembles the full tensors.
        group: process group whose CPU backend is gloo; ``None`` for the default group.
        chunk_bytes: most bytes a sender stages at a time, and the largest message.
        overlap: where given (a consolidated save), the blocks travel in its background, into slots that the saver
            writes from, and the gather returns at once (see :class:`ignite_zero.transport.Overlap`); the root's own
            pieces that are whole tensors alone in their memory are then full tensors of the result themselves.

    Returns:
        On ``dst``: ``{key: full tensor or value}`` in ``dst``'s order, then keys only other ranks hold;
        aliases resolved to their target's tensor. ``None`` on other ranks.

    Raises:
        RuntimeError: on every rank, if ``dst`` finds the pieces inconsistent (naming the tensor and how the ranks
            hold it); on ``dst``, if a rank failed.
    """
    ranks = resolve(group, dst, "dst")
    if ranks.rank != ranks.root:
        _send_pieces(pieces, ranks, dst, chunk_bytes, overlap)
        return None
    described = _receive_descriptions(ranks)
    try:
        manifests, (order, chosen, chosen_regions, sends) = _planned(pieces, described, ranks.rank)
    except RuntimeError as error:
        for peer in range(ranks.size):
            if peer != ranks.rank:
                send_error(f"rank {dst}: {error}", ranks.peer(peer), ranks.group)
        raise
    own = _own_whole_tensors(pieces, chosen, ranks.rank) if overlap is not None else {}
    full = {
        key: own[key] if key in own else torch.empty(region.box.shape, dtype=region.dtype)
        for key, region in chosen_regions.items()
    }
    receivers = _ask_for_pieces(manifests, sends, full, ranks, chunk_bytes)
    _copy_own_pieces(pieces, {key: picks for key, picks in chosen.items() if key not in own}, full, ranks.rank, overlap)
    if overlap is None:
        receive_all(receivers, ranks.group)
    else:
        overlap.receive(receivers, ranks.group)
    return _assembled(order, full, manifests, ranks)


def _send_pieces(pieces: Pieces, ranks: Ranks, dst: int, chunk_bytes: int, overlap: Overlap | None) -> None:
    """A sender's part of :func:`gather_pieces`: describe its pieces, learn which to send, send their runs."""
    # the layout of its pieces pickled apart from its values, which may change while the layout holds
    layout = pickle.dumps((pieces.regions, pieces.order), protocol=pickle.HIGHEST_PROTOCOL)
    send_bytes(pickle.dumps((layout, pieces.values), protocol=pickle.HIGHEST_PROTOCOL), dst, ranks.group)
    sends = pickle.loads(receive_bytes(dst, ranks.group, "the plan of the gather"))
    tensors = [run for i in sends for run in pieces.regions[i].box.blocks(pieces.tensors[i])]
    if overlap is None:
        send_stream(tensors, dst, ranks.group, chunk_bytes_for(tensors, chunk_bytes))
    else:
        overlap.send(tensors, dst, ranks.group, chunk_bytes_for(tensors, chunk_bytes))


def _receive_descriptions(ranks: Ranks) -> list[tuple[bytes, dict[tuple[Any, ...], Any]] | None]:
    """Every other rank's description of its pieces, by group rank (``None`` for the root): the layout of its pieces,
    pickled, and its values."""
    described: list[Any] = [None] * ranks.size
    for peer in range(ranks.size):
        if peer != ranks.rank:
            described[peer] = pickle.loads(receive_bytes(ranks.peer(peer), ranks.group, "its pieces"))
    return described


class _Plan(NamedTuple):
    """What :func:`_choose_sources` made of the layouts of every rank's pieces, kept for the next gather of pieces laid
    out alike (see :func:`_planned`)."""

    own: tuple[list[Region], list[tuple[Any, ...]]]  # a copy of the root's regions and order it was made from
    chosen: tuple[Any, ...]  # what _choose_sources returned


# The plans of the last gathers, by the root and a digest of every other rank's layout as it arrived (the layouts
# themselves would hold as much memory as all ranks' descriptions, for as long as the plan): a save gathers the same
# state again and again, laid out alike, and choosing the sources of thousands of tensors costs tens of milliseconds.
_PLANS: dict[tuple[Any, ...], _Plan] = {}
_PLANS_KEPT = 8


def _planned(
    pieces: Pieces, described: list[tuple[bytes, dict[tuple[Any, ...], Any]] | None], root: int
) -> tuple[list[_Manifest], tuple[Any, ...]]:
    """Every rank's manifest (the root's ``pieces``, the others' ``described``) and :func:`_choose_sources`' plan of
    them: the plan kept from an earlier gather while every rank's regions and order are the same (the others' pickled
    alike, the root's equal), else made afresh and kept."""
    manifests = [
        (pieces.regions, pieces.values, pieces.order) if part is None else _manifest(*part) for part in described
    ]
    key = (
        root,
        tuple(None if part is None else hashlib.blake2b(part[0], digest_size=32).digest() for part in described),
    )
    plan = _PLANS.get(key)  # one look: another thread's gather may clear it meanwhile
    if plan is None or plan.own != (pieces.regions, pieces.order):
        plan = _Plan((list(pieces.regions), list(pieces.order)), _choose_sources(manifests, root))
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.clear()
        _PLANS[key] = plan
    return manifests, plan.chosen


def _manifest(layout: bytes, values: dict[tuple[Any, ...], Any]) -> _Manifest:
    """A rank's manifest from the layout of its pieces, pickled, and its values."""
    regions, order = pickle.loads(layout)
    return regions, values, order


def _ask_for_pieces(
    manifests: list[_Manifest],
    sends: list[list[int]],
    full: dict[tuple[Any, ...], torch.Tensor],
    ranks: Ranks,
    chunk_bytes: int,
) -> list[StreamReceiver]:
    """Tell each sender which of its pieces to send (``sends``), and return the receivers of their runs, each into
    its place in the ``full`` tensors."""
    receivers = []
    for peer in range(ranks.size):
        if peer == ranks.rank:
            continue
        send_bytes(pickle.dumps(sends[peer]), ranks.peer(peer), ranks.group)
        destinations = []
        for index in sends[peer]:
            region = manifests[peer][0][index]
            destinations += region.box.blocks(region.box.view(full[region.key]))
        receivers.append(StreamReceiver(ranks.peer(peer), destinations, chunk_bytes_for(destinations, chunk_bytes)))
    return receivers


def _own_whole_tensors(
    pieces: Pieces, chosen: dict[tuple[Any, ...], list[tuple[int, int]]], rank: int
) -> dict[tuple[Any, ...], torch.Tensor]:
    """The root's own pieces that are whole tensors alone in their CPU memory (a replica, ``step``, a staged copy):
    a consolidated save writes each from where it is, as :meth:`Overlap.defer_copy` leaves a larger piece, rather
    than a copy in a tensor allocated for it; each memory once, as each full tensor has its own."""
    found: dict[tuple[Any, ...], torch.Tensor] = {}
    memories: set[int] = set()
    for key, picks in chosen.items():
        if len(picks) != 1 or picks[0][0] != rank:
            continue
        box, tensor = pieces.regions[picks[0][1]].box, pieces.tensors[picks[0][1]]
        if not (box.is_whole and tensor.is_cpu and tensor.numel()):
            continue
        if not owns_its_bytes(tensor):
            continue  # a view of more memory, which the file would hold whole
        if tensor.data_ptr() in memories:
            continue
        memories.add(tensor.data_ptr())
        tensor = detached(tensor)  # a plain tensor out of autograd, as an allocated one is
        found[key] = tensor if tensor.shape == box.shape else tensor.view(box.shape)
    return found


def _copy_own_pieces(
    pieces: Pieces,
    chosen: dict[tuple[Any, ...], list[tuple[int, int]]],
    full: dict[tuple[Any, ...], torch.Tensor],
    rank: int,
    overlap: Overlap | None,
) -> None:
    """Copy the root's own chosen pieces into the ``full`` tensors, while nothing else is in flight; given
    ``overlap``, a piece of one run is left where it is, for a saver to write from (:meth:`Overlap.defer_copy`)."""
    for key, picks in chosen.items():
        for r, i in picks:
            if r == rank:
                target = pieces.regions[i].box.view(full[key])
                source = pieces.tensors[i]
                if source.requires_grad:
                    source = source.detach()
                if source.shape != target.shape:
                    source = source.reshape(target.shape)
                if overlap is not None and pieces.regions[i].box.runs() == 0:
                    overlap.defer_copy(target, source)
                else:
                    target.copy_(source)


def _assembled(
    order: list[tuple[Any, ...]], full: dict[tuple[Any, ...], torch.Tensor], manifests: list[_Manifest], ranks: Ranks
) -> dict[tuple[Any, ...], Any]:
    """The result of :func:`gather_pieces` on the root: the ``full`` tensors and the values, in ``order``."""
    result: dict[tuple[Any, ...], Any] = {}
    for key in order:
        if key in full:
            result[key] = full[key]
            continue
        for r in [ranks.rank] + [r for r in range(ranks.size) if r != ranks.rank]:
            if key in manifests[r][1]:
                # a copy: the root's own values are live objects (e.g. a module's extra state)
                result[key] = copy.deepcopy(manifests[r][1][key])
                break
    for key, value in result.items():
        if isinstance(value, _Alias):
            result[key] = result[value.target]
    return result
