"""Regions of full tensors that ranks hold (FSDP shards), assembled on one rank through the transport."""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import ProcessGroup

from ignite_zero.transport import (
    DEFAULT_CHUNK_BYTES,
    StreamReceiver,
    chunk_bytes_for,
    receive_all,
    receive_bytes,
    resolve,
    send_bytes,
    send_error,
    send_stream,
)

__all__ = ["Pieces", "Region", "gather_pieces"]


@dataclass(frozen=True)
class Region:
    """Where a local piece sits in its full tensor: ``key`` names the full tensor.

    ``dim == -1``: elements ``[start, start + length)`` of the flattened (row-major) full tensor;
    otherwise the slice ``[start, start + length)`` along dimension ``dim``.
    """

    key: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    start: int
    length: int

    @property
    def extent(self) -> int:
        """Elements (``dim == -1``) or rows (``dim >= 0``) that the pieces of this key must cover."""
        return math.prod(self.shape) if self.dim == -1 else self.shape[self.dim]

    def view(self, full: torch.Tensor) -> torch.Tensor:
        """This region of ``full``."""
        if self.dim == -1:
            return full.view(-1)[self.start : self.start + self.length]
        return full.narrow(self.dim, self.start, self.length)


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

    def add(self, key: tuple[Any, ...], shape: Sequence[int], piece: torch.Tensor, dim: int, start: int) -> None:
        """Add ``piece``: elements ``start...`` of the flattened full tensor (``dim=-1``) or a slice along ``dim``."""
        length = piece.numel() if dim == -1 else piece.shape[dim]
        self.regions.append(Region(key, tuple(int(s) for s in shape), piece.dtype, dim, int(start), int(length)))
        self.tensors.append(piece)
        self.order.append(key)

    def add_whole(self, key: tuple[Any, ...], value: Any) -> None:
        """Add a value this rank holds whole: a tensor (a replica, e.g. a buffer or ``step``) or any picklable."""
        if isinstance(value, torch.Tensor):
            self.add(key, value.shape, value.reshape(-1), -1, 0)
        else:
            self.values[key] = value
            self.order.append(key)

    def add_alias(self, key: tuple[Any, ...], target: tuple[Any, ...]) -> None:
        """``key`` names the same tensor as ``target`` (tied parameters): sent once, shared in the result."""
        self.values[key] = _Alias(target)
        self.order.append(key)


def _choose_sources(
    manifests: list[tuple[list[Region], dict[tuple[Any, ...], Any], list[tuple[Any, ...]]]], root: int
) -> tuple[
    list[tuple[Any, ...]], dict[tuple[Any, ...], list[tuple[int, int]]], dict[tuple[Any, ...], Region], list[list[int]]
]:
    """On the root: for every key, pieces that cover the full tensor exactly once, the root's own first.

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
    for key in order:
        candidates = by_key.get(key)
        if not candidates:
            continue
        first = regions[key] = candidates[0][2]
        spans: list[tuple[int, int]] = []
        picked: list[tuple[int, int]] = []
        for r, i, region in candidates:
            if (region.shape, region.dtype, region.dim) != (first.shape, first.dtype, first.dim):
                raise RuntimeError(f"Ranks disagree on {_name(key)}: {region} on rank {r}, {first} elsewhere")
            span = (region.start, region.start + region.length)
            if region.length == 0 or span in spans:  # an empty shard, or a replica already covered
                continue
            if any(a < span[1] and span[0] < b for a, b in spans):
                raise RuntimeError(f"Pieces of {_name(key)} overlap: {span} and {spans}")
            spans.append(span)
            picked.append((r, i))
        if sum(b - a for a, b in spans) != first.extent:
            raise RuntimeError(f"Pieces of {_name(key)} cover {sum(b - a for a, b in spans)} of {first.extent}")
        chosen[key] = sorted(picked)
        for r, i in chosen[key]:
            if r != root:
                sends[r].append(i)
    return order, chosen, regions, sends


def _name(key: tuple[Any, ...]) -> str:
    return ".".join(map(str, key))


def gather_pieces(
    pieces: Pieces, dst: int, group: ProcessGroup | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> dict[tuple[Any, ...], Any] | None:
    """Assemble full tensors from the pieces ranks hold, on ``dst``; a collective over ``group``.

    Every rank sends ``dst`` the description of its pieces (no data); ``dst`` allocates each full tensor once
    on the CPU, picks one source per region (its own pieces first, so NO_SHARD parameters, buffers and
    ``step`` values never travel), tells each rank what to send, and receives every region straight into
    place (a slice along ``dim > 0`` goes through a buffer of that slice). Senders send views of what they
    hold: their extra memory is the staging buffer only.

    Returns:
        On ``dst``: ``{key: full tensor or value}`` in ``dst``'s order, then keys only other ranks hold;
        aliases resolved to their target's tensor. ``None`` on other ranks.

    Raises:
        RuntimeError: on every rank, if ``dst`` finds the pieces inconsistent; on ``dst``, if a rank failed.
    """
    ranks = resolve(group, dst, "dst")
    manifest = (pieces.regions, pieces.values, pieces.order)
    if ranks.rank != ranks.root:
        send_bytes(pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL), dst, ranks.group)
        sends = pickle.loads(receive_bytes(dst, ranks.group, "the plan of the gather"))
        tensors = [pieces.tensors[i] for i in sends]
        send_stream(tensors, dst, ranks.group, chunk_bytes_for(tensors, chunk_bytes))
        return None

    manifests: list[Any] = [None] * ranks.size
    manifests[ranks.rank] = manifest
    for peer in range(ranks.size):
        if peer != ranks.rank:
            manifests[peer] = pickle.loads(receive_bytes(ranks.peer(peer), ranks.group, "its pieces"))
    try:
        order, chosen, chosen_regions, sends = _choose_sources(manifests, ranks.rank)
    except RuntimeError as error:
        for peer in range(ranks.size):
            if peer != ranks.rank:
                send_error(f"rank {dst}: {error}", ranks.peer(peer), ranks.group)
        raise
    full = {key: torch.empty(region.shape, dtype=region.dtype) for key, region in chosen_regions.items()}
    receivers = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for peer in range(ranks.size):
        if peer == ranks.rank:
            continue
        send_bytes(pickle.dumps(sends[peer]), ranks.peer(peer), ranks.group)
        destinations = []
        for index in sends[peer]:
            region = manifests[peer][0][index]
            target = region.view(full[region.key])
            if not target.is_contiguous():
                buffer = torch.empty(target.shape, dtype=target.dtype)
                staged.append((target, buffer))
                target = buffer
            destinations.append(target)
        receivers.append(StreamReceiver(ranks.peer(peer), destinations, chunk_bytes_for(destinations, chunk_bytes)))
    for key, picks in chosen.items():  # the root's own pieces: copied while nothing else is in flight
        for r, i in picks:
            if r == ranks.rank:
                target = pieces.regions[i].view(full[key])
                target.copy_(pieces.tensors[i].detach().reshape(target.shape))
    receive_all(receivers, ranks.group)
    for target, buffer in staged:
        target.copy_(buffer)

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
