"""Moving sharded state to one rank (and back) as raw tensors, once, in bounded memory.

``ZeroRedundancyOptimizer.consolidate_state_dict`` (and fairscale's ``OSS``) ``torch.save`` every rank's
local optimizer state and *broadcast* it to every rank: about 0.01 GB/s, and each non-recipient's memory
grows by about 11 times its shard. Here every rank sends what the recipient needs, to the recipient only,
over point-to-point messages:

* a small **header**: pickled structure and metadata, no tensor data, length first;
* a **tensor stream**: the values of a list of tensors as raw bytes. Both sides cut the stream into the
  same messages from the list of ``(dtype, numel)`` alone (see :func:`_plan`), so no per-message metadata
  travels: gloo aborts the receiving *process* on a size mismatch, it cannot be left to chance. Tensors
  under 1 MiB are packed into shared messages (one message costs about 1 ms on gloo/TCP whatever its
  size; Adam's 0-d ``step`` tensors all travel together); bigger ones get messages of their own, of at most
  ``chunk_bytes``, sent straight from the tensor's memory and received straight into their destination.
  Anything else (packs, non-contiguous or CUDA tensors) goes through one reusable staging buffer (pinned
  for CUDA), so a sender's extra memory is bounded whatever the size of its state.

Two collectives are built on the stream:

* :func:`gather_to` / :func:`scatter_from`: whole objects (e.g. each rank's local ZeRO optimizer state)
  to one rank and back; the receiver gets views of one flat buffer per (sender, dtype);
* :func:`gather_pieces`: regions of full tensors that ranks hold (FSDP shards); the recipient allocates
  each full tensor once, picks one source per region (its own copy first, so replicated values never
  travel) and receives every region straight into place.

A rank that cannot send tells the receiver instead of leaving it waiting (a negative header length
announces an error message), so an error never turns into a hang. Headers are unpickled on the receiving
rank: a rank trusts its peers exactly as ``torch.distributed``'s own object collectives do.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Pieces",
    "Region",
    "cpu_group",
    "gather_pieces",
    "gather_to",
    "join_tensors",
    "receive_from",
    "scatter_from",
    "send_failure",
    "send_to",
    "split_tensors",
]

#: Largest message and staging buffer. Gathering 400 MB over gloo/TCP on a 2-core host took 0.37 s with
#: 4 MiB, 0.28-0.33 s with 16 MiB and 0.27 s with 64 MiB; only staged data costs memory.
DEFAULT_CHUNK_BYTES = 16 * 2**20

# Tensors below this size are packed (copied) into shared messages; bigger ones get their own.
_PACK_BELOW_BYTES = 2**20

# A sender stages at most 1/_STAGING_SHARE of what it sends (1 MiB at least): the staging buffer stays a
# small share of a rank's shard at any world size (DESIGN.md invariant 4).
_STAGING_SHARE = 16
_MIN_AUTO_CHUNK_BYTES = 2**20

# Pieces inside a packed message start at multiples of this, so that typed views of the byte buffer are
# aligned for every dtype (complex128 included).
_ALIGN = 16

# Dedicated gloo groups, keyed by the group they stand for (and whether they are kept apart from it even under
# gloo); dropped when the default group changes.
_gloo_groups: dict[Any, ProcessGroup] = {}
_gloo_groups_owner: list[Any] = [None]


def cpu_group(
    group: ProcessGroup | None = None, timeout: timedelta | None = None, *, dedicated: bool = False
) -> ProcessGroup:
    """A process group over the ranks of ``group`` (default: all) that moves CPU tensors through gloo.

    That is ``group`` itself when its backend for CPU tensors is gloo (``"gloo"``, ``"cpu:gloo,cuda:nccl"``)
    and ``dedicated`` is false; otherwise a dedicated gloo group over the same ranks, created on the first
    call and cached, so that NCCL jobs never allocate device memory to move host data.

    Args:
        group: the group to stand in for; ``None`` for the default group.
        timeout: timeout of a dedicated group's operations; ``None`` keeps torch's default.
        dedicated: a group of its own even under gloo, for traffic that runs beside training collectives
            (an asynchronous save): messages of two threads on one group could interleave.

    .. warning::
        Creating the dedicated group is a collective among the ranks of ``group``: they must all make
        their first call for it at the same point of the program (a checkpoint save does).
    """
    default = dist.group.WORLD
    if default is None:
        raise RuntimeError("`cpu_group` needs an initialized default process group")
    group = default if group is None else group
    if _cpu_backend(group) == "gloo" and not dedicated:
        return group
    if _gloo_groups_owner[0] is not default:
        _gloo_groups.clear()
        _gloo_groups_owner[0] = default
    key = (group, dedicated)
    if key not in _gloo_groups:
        ranks = dist.get_process_group_ranks(group)
        options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        _gloo_groups[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True, **options)
    return _gloo_groups[key]


# --------------------------------------------------------------------------------------------------
# Process group helpers


def _cpu_backend(group: ProcessGroup) -> str:
    """The backend that moves CPU tensors on ``group``, or ``""`` if none does."""
    config = dist.get_backend_config(group)  # "gloo", "cuda:nccl" or "cpu:gloo,cuda:nccl"
    if ":" not in config:
        return config
    return dict(item.split(":", 1) for item in config.split(",")).get("cpu", "")


@dataclass(frozen=True)
class _Ranks:
    group: ProcessGroup | None
    size: int
    rank: int  # this rank, within the group
    root: int  # the gathering (scattering) rank, within the group

    def peer(self, group_rank: int) -> int:
        """Global rank of a group rank (point-to-point calls take global ranks)."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank


def _resolve(group: ProcessGroup | None, root: int, name: str) -> _Ranks:
    """Ranks involved, with the same checks on every rank; ``root`` is a global rank."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None or root != 0:
            raise ValueError(f"Without a process group `{name}` must be 0 and `group` None, but given {root}, {group}")
        return _Ranks(None, 1, 0, 0)
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("This rank is not part of `group`")
    ranks = dist.get_process_group_ranks(group)
    if root not in ranks:
        raise ValueError(f"Argument `{name}` should be a global rank in the group {ranks}, but given {root}")
    if _cpu_backend(group) in ("", "nccl"):
        raise ValueError("`group` has no backend for CPU tensors (NCCL only?): pass `cpu_group(group)` instead")
    return _Ranks(group, len(ranks), rank, ranks.index(root))


# --------------------------------------------------------------------------------------------------
# Headers: length-prefixed bytes, or an error message in their place


class _PeerError(RuntimeError):
    """A peer reported that it could not send what was expected of it."""


def _send_bytes(data: bytes, peer: int, group: ProcessGroup | None, length: int | None = None) -> None:
    dist.send(torch.tensor([len(data) if length is None else length], dtype=torch.int64), peer, group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, group)


def _send_error(error: BaseException | str, peer: int, group: ProcessGroup | None) -> None:
    # A negative length announces an error message instead of a header: the peer raises, not hangs.
    text = error if isinstance(error, str) else f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
    message = text.encode()
    _send_bytes(message, peer, group, -len(message))


def _recv_bytes(peer: int, group: ProcessGroup | None, what: str) -> bytes:
    """Receive a header; raise :class:`_PeerError` if the peer sent an error message instead."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, peer, group)
    n = int(length.item())
    data = bytearray(abs(n))
    dist.recv(torch.frombuffer(data, dtype=torch.uint8), peer, group)
    if n < 0:
        raise _PeerError(f"rank {peer} could not send {what}: {data.decode(errors='replace')}")
    return bytes(data)


# --------------------------------------------------------------------------------------------------
# Tensor streams


@dataclass
class _Message:
    """One point-to-point message: the element ranges ``(tensor, first, end)`` it carries, in order."""

    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # byte offset of each piece in a packed message
    nbytes: int = 0
    own: bool = False  # a slice of one big tensor, sent and received in place


def _plan(metas: Sequence[tuple[torch.dtype, int]], chunk_bytes: int) -> list[_Message]:
    """Cut the values of tensors ``(dtype, numel)`` into messages; the same on sender and receiver."""
    messages: list[_Message] = []
    pack: _Message | None = None
    for index, (dtype, numel) in enumerate(metas):
        size = numel * dtype.itemsize
        if size == 0:
            continue
        if size < _PACK_BELOW_BYTES and size <= chunk_bytes:
            start = -(-(pack.nbytes if pack else 0) // _ALIGN) * _ALIGN
            if pack is None or start + size > chunk_bytes:
                pack, start = _Message(), 0
                messages.append(pack)
            pack.pieces.append((index, 0, numel))
            pack.offsets.append(start)
            pack.nbytes = start + size
            continue
        capacity = max(1, chunk_bytes // dtype.itemsize)
        for first in range(0, numel, capacity):
            end = min(first + capacity, numel)
            messages.append(_Message([(index, first, end)], [0], (end - first) * dtype.itemsize, own=True))
    return messages


def _chunk_bytes_for(tensors: Sequence[torch.Tensor], chunk_bytes: int) -> int:
    # A small shard gets a smaller chunk, so that staging stays a small share of it (invariant 4).
    payload = sum(t.numel() * t.element_size() for t in tensors)
    return min(chunk_bytes, max(_MIN_AUTO_CHUNK_BYTES, payload // _STAGING_SHARE))


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    # gloo moves bytes; a uint8 view sidesteps any per-dtype support (bool, bf16, complex).
    return t.detach().reshape(-1).view(torch.uint8)


def _is_direct(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg())


def _send_stream(tensors: Sequence[torch.Tensor], peer: int, group: ProcessGroup | None, chunk_bytes: int) -> None:
    """Send the values of ``tensors``; the peer runs :class:`_StreamReceiver` with the same ``chunk_bytes``."""
    messages = _plan([(t.dtype, t.numel()) for t in tensors], chunk_bytes)
    staging: torch.Tensor | None = None
    for message in messages:
        if message.own and _is_direct(tensors[message.pieces[0][0]]):
            index, first, end = message.pieces[0]
            dist.send(_flat_bytes(tensors[index][...].reshape(-1)[first:end]), peer, group)
            continue
        if staging is None:
            largest = max(m.nbytes for m in messages if not (m.own and _is_direct(tensors[m.pieces[0][0]])))
            pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors)
            staging = torch.empty(largest, dtype=torch.uint8, pin_memory=pin)
        for (index, first, end), offset in zip(message.pieces, message.offsets):
            source = tensors[index].detach()
            target = staging[offset : offset + (end - first) * source.element_size()].view(source.dtype)
            _copy_flat_range(source, first, end, target)
        dist.send(staging[: message.nbytes], peer, group)  # blocks until gloo is done with `staging`


def _copy_flat_range(src: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> None:
    """Copy elements ``[start, stop)`` of ``src`` in row-major order into ``out``, never all of ``src``.

    A non-contiguous tensor cannot be flattened without a full copy, so whole rows along dim 0 are copied
    as blocks, and the partial rows at both ends recursively.
    """
    if src.dim() <= 1 or src.is_contiguous():
        out.copy_(src.reshape(-1)[start:stop])  # a view: a device-to-host copy moves just this slice
        return
    row = src[0].numel()
    pos = start
    if pos % row:  # head: the end of a row
        r = pos // row
        end = min(stop, (r + 1) * row)
        _copy_flat_range(src[r], pos - r * row, end - r * row, out[: end - start])
        pos = end
    body_end = stop - stop % row
    if body_end > pos:  # body: whole rows
        out[pos - start : body_end - start].view(-1, *src.shape[1:]).copy_(src[pos // row : body_end // row])
        pos = body_end
    if pos < stop:  # tail: the start of a row
        r = pos // row
        _copy_flat_range(src[r], pos - r * row, stop - r * row, out[pos - start :])


class _StreamReceiver:
    """Receives a stream from one peer into contiguous CPU ``destinations``, one message at a time."""

    def __init__(self, peer: int, destinations: Sequence[torch.Tensor], chunk_bytes: int) -> None:
        self.peer = peer
        self._destinations = destinations
        self._messages = iter(_plan([(t.dtype, t.numel()) for t in destinations], chunk_bytes))
        self._staging: torch.Tensor | None = None
        self._current: _Message | None = None

    def post(self, group: ProcessGroup | None) -> dist.Work | None:
        """Post the receive of the next message; ``None`` once the stream is complete."""
        self._current = next(self._messages, None)
        if self._current is None:
            return None
        if self._current.own:
            index, first, end = self._current.pieces[0]
            buffer = _flat_bytes(self._destinations[index].reshape(-1)[first:end])
        else:
            if self._staging is None or self._staging.numel() < self._current.nbytes:
                self._staging = torch.empty(self._current.nbytes, dtype=torch.uint8)
            buffer = self._staging[: self._current.nbytes]
        work = dist.irecv(buffer, self.peer, group)
        if work is None:  # only for a rank outside `group`, which `_resolve` rules out
            raise RuntimeError("This rank is not part of `group`")
        return work

    def unpack(self) -> None:
        """Copy the pieces of a received packed message to their destinations."""
        message = self._current
        if message is None or message.own or self._staging is None:
            return
        for (index, first, end), offset in zip(message.pieces, message.offsets):
            destination = self._destinations[index]
            nbytes = (end - first) * destination.element_size()
            destination.reshape(-1)[first:end].copy_(self._staging[offset : offset + nbytes].view(destination.dtype))


def _receive_all(receivers: Sequence[_StreamReceiver], group: ProcessGroup | None) -> None:
    """Receive every stream, round-robin with one receive in flight per peer.

    With 4 ranks on 2 cores, receiving from all senders at once beat receiving rank by rank by 13-20%;
    more than one receive in flight per sender did not help further.
    """
    pending = [(receiver, work) for receiver in receivers if (work := receiver.post(group)) is not None]
    while pending:
        still = []
        for receiver, work in pending:
            work.wait()
            receiver.unpack()
            if (work := receiver.post(group)) is not None:
                still.append((receiver, work))
        pending = still


# --------------------------------------------------------------------------------------------------
# Objects: a skeleton pickled with its tensors replaced by indices, then the tensors


class _TensorExtractor(pickle.Pickler):
    """Pickles an object's structure and collects its tensors, each distinct tensor object once."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided or obj.is_quantized:
            raise TypeError(f"Cannot send a {type(obj).__name__} with layout {obj.layout}: only plain strided tensors")
        if obj.device.type == "meta":
            raise TypeError("Cannot send a tensor on the meta device: it has no data")
        index = self._index.get(id(obj))
        if index is None:  # `self.tensors` keeps the object alive, so its id stays unique
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index


class _TensorInjector(pickle.Unpickler):
    """Unpickles a structure, putting the tensors back by index."""

    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._tensors[pid]


def _split(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    buffer = io.BytesIO()
    extractor = _TensorExtractor(buffer)
    extractor.dump(obj)
    return buffer.getvalue(), extractor.tensors


def split_tensors(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``obj``'s structure, pickled without its tensors, and its tensors (each distinct tensor once)."""
    return _split(obj)


def join_tensors(structure: bytes, tensors: list[torch.Tensor]) -> Any:
    """The object :func:`split_tensors` took apart, with ``tensors`` in place of its own."""
    return _TensorInjector(structure, tensors).load()


def _to_cpu(obj: Any) -> Any:
    structure, tensors = _split(obj)  # also applies the senders' checks, so any rank may be the root
    if all(t.device.type == "cpu" for t in tensors):
        return obj
    return _TensorInjector(structure, [t.cpu() for t in tensors]).load()


@dataclass
class _OutgoingObject:
    header: bytes
    tensors: list[torch.Tensor]
    chunk_bytes: int


def _prepare(obj: Any, chunk_bytes: int) -> _OutgoingObject:
    """Serialize the skeleton; raises before anything is sent if ``obj`` cannot be sent."""
    structure, tensors = _split(obj)
    chunk_bytes = _chunk_bytes_for(tensors, chunk_bytes)
    metas = [(t.dtype, tuple(t.shape)) for t in tensors]
    header = pickle.dumps((chunk_bytes, metas, structure), protocol=pickle.HIGHEST_PROTOCOL)
    return _OutgoingObject(header, tensors, chunk_bytes)


def _send_object(outgoing: _OutgoingObject, peer: int, group: ProcessGroup | None) -> None:
    _send_bytes(outgoing.header, peer, group)
    _send_stream(outgoing.tensors, peer, group, outgoing.chunk_bytes)


class _IncomingObject:
    """An object being received: one flat CPU buffer per dtype, and the views its tensors will be."""

    def __init__(self, peer: int, header: bytes) -> None:
        chunk_bytes, metas, self._structure = pickle.loads(header)
        numels: dict[torch.dtype, int] = {}
        offsets = []
        for dtype, shape in metas:
            offsets.append(numels.get(dtype, 0))
            numels[dtype] = offsets[-1] + math.prod(shape)
        buffers = {dtype: torch.empty(numel, dtype=dtype) for dtype, numel in numels.items()}
        self._tensors = [
            buffers[dtype][offset : offset + math.prod(shape)].view(shape)
            for (dtype, shape), offset in zip(metas, offsets)
        ]
        self.receiver = _StreamReceiver(peer, self._tensors, chunk_bytes)

    def result(self) -> Any:
        return _TensorInjector(self._structure, self._tensors).load()


def send_to(obj: Any, dst: int, group: ProcessGroup | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Send ``obj`` to the global rank ``dst``, which calls :func:`receive_from`; point to point.

    Raises:
        TypeError: ``obj`` holds a tensor without plain strided data; ``dst`` is told and raises too.
    """
    ranks = _resolve(group, dst, "dst")
    try:
        outgoing = _prepare(obj, chunk_bytes)
    except Exception as error:  # an unpicklable leaf or an unsupported tensor: tell `dst`, then fail here
        _send_error(error, dst, ranks.group)
        raise
    _send_object(outgoing, dst, ranks.group)


def send_failure(error: BaseException, dst: int, group: ProcessGroup | None = None) -> None:
    """Tell the global rank ``dst``, waiting in :func:`receive_from`, that its object will not come: it raises."""
    _send_error(error, dst, _resolve(group, dst, "dst").group)


def receive_from(src: int, group: ProcessGroup | None = None) -> Any:
    """Receive the object the global rank ``src`` sends with :func:`send_to`.

    Returns:
        The object; its tensors are CPU views of one flat buffer per dtype.

    Raises:
        RuntimeError: ``src`` could not send it.
    """
    ranks = _resolve(group, src, "src")
    incoming = _IncomingObject(src, _recv_bytes(src, ranks.group, "the object"))
    _receive_all([incoming.receiver], ranks.group)
    return incoming.result()


def gather_to(
    obj: Any, dst: int, group: ProcessGroup | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[Any] | None:
    """Gather every rank's object on ``dst``; a collective over ``group``.

    Args:
        obj: this rank's object: dicts, lists, tuples and other picklable containers of tensors and small
            picklable leaves. Its tensors travel as raw bytes, to ``dst`` only.
        dst: global rank that receives the objects.
        group: process group whose CPU backend is gloo (see :func:`cpu_group`); ``None`` for the default
            group. Without a process group this is a one-rank gather.
        chunk_bytes: most bytes a sender stages at a time, and the largest message; a sender whose tensors
            hold less than 16 times as much uses 1/16 of their size (1 MiB at least).

    Returns:
        On ``dst``, the objects of all ranks in group-rank order: received tensors are CPU views of one flat
        buffer per (sender, dtype); ``dst``'s own object comes back as is (with CPU copies of any device
        tensors). ``None`` on other ranks.

    Raises:
        ValueError: ``dst`` or this rank is not in ``group``.
        TypeError: on a sender, its object holds a tensor without plain strided data (sparse, meta...).
        RuntimeError: on ``dst``, some rank could not send its object; every sender is drained first, so no
            rank hangs and the group stays usable.

    Note:
        ``torch.save`` of received tensors writes their whole flat buffer: save all of a sender's tensors,
        or clone the ones kept.
    """
    ranks = _resolve(group, dst, "dst")
    if ranks.rank != ranks.root:
        send_to(obj, dst, group, chunk_bytes=chunk_bytes)
        return None
    incoming: dict[int, _IncomingObject] = {}
    failures: dict[int, str] = {}
    for peer in range(ranks.size):
        if peer != ranks.rank:
            try:
                incoming[peer] = _IncomingObject(
                    ranks.peer(peer), _recv_bytes(ranks.peer(peer), ranks.group, "its object")
                )
            except _PeerError as error:
                failures[peer] = str(error)
    _receive_all([item.receiver for item in incoming.values()], ranks.group)
    try:
        own = _to_cpu(obj)
    except Exception as error:  # only now: every sender has been drained, so none of them hangs
        failures[ranks.rank] = f"rank {dst}: {type(error).__name__}: {error}"
    if failures:
        raise RuntimeError("Some ranks could not send their state: " + "; ".join(failures[p] for p in sorted(failures)))
    return [own if peer == ranks.rank else incoming[peer].result() for peer in range(ranks.size)]


def scatter_from(
    objs: Sequence[Any] | None, src: int, group: ProcessGroup | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Any:
    """Send each rank its own object from ``src``; a collective over ``group``, the inverse of :func:`gather_to`.

    Args:
        objs: on ``src``, one object per group rank, in group-rank order; ignored on other ranks.
        src: global rank that holds the objects.
        group: as for :func:`gather_to`.
        chunk_bytes: as for :func:`gather_to`, on ``src``.

    Returns:
        This rank's object; on ranks other than ``src``, its tensors are CPU views of one flat buffer per dtype.

    Raises:
        ValueError: ``src`` or this rank is not in ``group``, or ``objs`` does not hold one object per rank.
        RuntimeError: some object could not be sent; the ranks it was for raise it too instead of hanging.
    """
    ranks = _resolve(group, src, "src")
    if ranks.rank != ranks.root:
        return receive_from(src, group)
    if not isinstance(objs, Sequence) or len(objs) != ranks.size:
        error = ValueError(f"Argument `objs` should hold one object per rank ({ranks.size}), but given {type(objs)}")
        for peer in range(ranks.size):
            if peer != ranks.rank:
                _send_error(error, ranks.peer(peer), ranks.group)
        raise error
    failures: list[str] = []
    for peer in range(ranks.size):
        if peer == ranks.rank:
            continue
        try:
            outgoing = _prepare(objs[peer], chunk_bytes)
        except Exception as error:  # that rank raises the same error; the others are still served
            _send_error(error, ranks.peer(peer), ranks.group)
            failures.append(f"rank {ranks.peer(peer)}: {type(error).__name__}: {error}")
            continue
        _send_object(outgoing, ranks.peer(peer), ranks.group)
    if failures:
        raise RuntimeError("Could not send the state of some ranks: " + "; ".join(failures))
    return objs[ranks.rank]


# --------------------------------------------------------------------------------------------------
# Pieces: regions of full tensors held by ranks (FSDP shards), assembled on one rank


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
    ranks = _resolve(group, dst, "dst")
    manifest = (pieces.regions, pieces.values, pieces.order)
    if ranks.rank != ranks.root:
        _send_bytes(pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL), dst, ranks.group)
        sends = pickle.loads(_recv_bytes(dst, ranks.group, "the plan of the gather"))
        tensors = [pieces.tensors[i] for i in sends]
        _send_stream(tensors, dst, ranks.group, _chunk_bytes_for(tensors, chunk_bytes))
        return None

    manifests: list[Any] = [None] * ranks.size
    manifests[ranks.rank] = manifest
    for peer in range(ranks.size):
        if peer != ranks.rank:
            manifests[peer] = pickle.loads(_recv_bytes(ranks.peer(peer), ranks.group, "its pieces"))
    try:
        order, chosen, chosen_regions, sends = _choose_sources(manifests, ranks.rank)
    except RuntimeError as error:
        for peer in range(ranks.size):
            if peer != ranks.rank:
                _send_error(f"rank {dst}: {error}", ranks.peer(peer), ranks.group)
        raise
    full = {key: torch.empty(region.shape, dtype=region.dtype) for key, region in chosen_regions.items()}
    receivers = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for peer in range(ranks.size):
        if peer == ranks.rank:
            continue
        _send_bytes(pickle.dumps(sends[peer]), ranks.peer(peer), ranks.group)
        destinations = []
        for index in sends[peer]:
            region = manifests[peer][0][index]
            target = region.view(full[region.key])
            if not target.is_contiguous():
                buffer = torch.empty(target.shape, dtype=target.dtype)
                staged.append((target, buffer))
                target = buffer
            destinations.append(target)
        receivers.append(_StreamReceiver(ranks.peer(peer), destinations, _chunk_bytes_for(destinations, chunk_bytes)))
    for key, picks in chosen.items():  # the root's own pieces: copied while nothing else is in flight
        for r, i in picks:
            if r == ranks.rank:
                target = pieces.regions[i].view(full[key])
                target.copy_(pieces.tensors[i].detach().reshape(target.shape))
    _receive_all(receivers, ranks.group)
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
