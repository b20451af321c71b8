"""Staging: a copy of a rank's part of the state in host memory, so that training goes on while it is saved.

An asynchronous save blocks the training loop only while each rank copies its snapshot (its own shard; on the
recipient, the plain objects too) into host buffers. The buffers are kept from one save to the next and reused
when the tensor at the same position keeps its shape and dtype, so a steady run allocates nothing after its
first save. Buffers for CUDA tensors are pinned, so that device-to-host copies run at full bandwidth,
asynchronously, synchronised once per stage.

The cost is one staged copy of what each rank contributes, held for the life of the handler: the one exception
that asynchronous saves make to the bound on a rank's memory (a rank holds its own part, and a bounded buffer
beyond it).
"""

from __future__ import annotations

import functools
import mmap
import os
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ignite_zero import _compat
from ignite_zero.pickling import join_tensors, rebuilt, split_tensors

__all__ = [
    "PINNED_LIMIT",
    "HostBuffers",
    "SharedBlock",
    "SharedTensor",
    "Stager",
    "Streams",
    "current_streams",
    "detached",
    "makes_shared_blocks",
    "on_host",
    "owns_its_bytes",
    "shared_tensor",
    "to_cpu",
]

#: The CUDA stream current on each device, by device index.
Streams = Mapping[int, Any]

#: The largest tensor :func:`on_host` copies through pinned memory. torch's host allocator keeps each block it
#: pinned, rounded up to a power of two, for the life of the process: at most two such blocks per writing thread.
#: A larger tensor takes a pageable copy.
PINNED_LIMIT = 256 << 20


class Stager:
    """Copies the tensors of nested states into host buffers that it keeps from one save to the next.

    Examples:
        .. code-block:: python

            from ignite_zero.staging import Stager

            stager = Stager()
            staged = stager.stage(adapter.snapshot())  # the loop may go on as soon as this returns
            full = adapter.assemble(staged, group)     # in the background
    """

    def __init__(self) -> None:
        self._buffers: dict[str, list[torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Host memory held by the staging buffers."""
        return sum(buffer.numel() * buffer.element_size() for kept in self._buffers.values() for buffer in kept)

    def stage(self, state: Any, name: str = "") -> Any:
        """A copy of ``state`` whose tensors are the staging buffers of ``name``; containers are rebuilt.

        Args:
            state: nested containers of tensors and other picklable values.
            name: which buffers to use: one set per object saved.
        """

        def copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            buffers = self._buffers[name] = self._kept(name, tensors)
            accelerated = any(tensor.is_cuda for tensor in tensors)
            _compat.copy_each(buffers, tensors, non_blocking=accelerated)  # one call: thousands of small copies
            if accelerated:
                torch.cuda.synchronize()  # the copies were issued without blocking, one after the other
            return buffers

        return rebuilt(state, copies)

    def _kept(self, name: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A buffer for each of ``tensors``: ``name``'s kept one at its place, a new one where there is none or its
        shape or dtype changed."""
        kept = self._buffers.get(name, [])
        return [
            kept[index]
            if index < len(kept) and kept[index].shape == tensor.shape and kept[index].dtype == tensor.dtype
            else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            for index, tensor in enumerate(tensors)
        ]


def to_cpu(state: Any) -> Any:
    """``state`` with its tensors on the CPU: itself where they all are already, else its structure rebuilt around
    copies (tensors it shares stay shared).

    Raises:
        TypeError: it holds a tensor without plain strided data (sparse, quantized, meta).
    """
    structure, tensors = split_tensors(state)
    if all(tensor.device.type == "cpu" for tensor in tensors):
        return state
    return join_tensors(structure, [tensor.cpu() for tensor in tensors])


def current_streams() -> dict[int, Any]:
    """The CUDA stream current in this thread on each device (none without CUDA): what another thread's copies of
    tensors made here must wait for."""
    if not torch.cuda.is_initialized():
        return {}
    return {index: torch.cuda.current_stream(index) for index in range(torch.cuda.device_count())}


def on_host(values: Iterable[Any], producers: Streams) -> Iterator[Any]:
    """Each of ``values`` in turn, on the host: a tensor as a contiguous CPU tensor that owns exactly its bytes (so
    that a reader reads it straight into place), anything else as it is.

    A CUDA tensor up to :data:`PINNED_LIMIT` is copied into pinned memory on a stream of its own once the work of
    its device's stream in ``producers`` is done, and the next one's copy runs while the caller writes this one,
    since a pageable ``.cpu()`` per tensor is far slower than pinned copies. A caller that drops each tensor before
    it asks for the next holds at most two copies; one that holds small ones (a writer that writes them together)
    holds those too.

    Args:
        values: tensors on any device, and other values.
        producers: the streams the tensors were made on, by device (see :func:`current_streams`).
    """
    pending: tuple[torch.Tensor, Any] | None = None
    streams: dict[torch.device, Any] = {}
    for value in values:
        copy = _pinned_copy(detached(value), streams, producers) if _pinned(value) else None
        if pending is not None:
            host, copied = pending
            pending = None
            copied.synchronize()
            yield host
            del host
        if copy is not None:
            pending = copy
        else:
            yield _owning(detached(value)) if isinstance(value, torch.Tensor) else value
    if pending is not None:
        pending[1].synchronize()
        yield pending[0]


def _pinned(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_cuda and value.nbytes <= PINNED_LIMIT


def detached(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.detach()``, or ``tensor`` itself where that is alike: a plain tensor out of autograd, without
    attributes of its own; a save of many small tensors would pay a dispatch for each."""
    if type(tensor) is torch.Tensor and not tensor.requires_grad and not tensor.__dict__:
        return tensor
    return tensor.detach()


def _pinned_copy(
    tensor: torch.Tensor, streams: dict[torch.device, Any], producers: Streams
) -> tuple[torch.Tensor, Any] | None:
    """Start copying ``tensor`` into pinned memory: the copy and its event; ``None`` where memory cannot be pinned
    (the caller copies it the usual way)."""
    device = tensor.device
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    producer = producers.get(device.index if device.index is not None else torch.cuda.current_device())
    stream.wait_stream(producer if producer is not None else torch.cuda.current_stream(device))
    try:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    except RuntimeError:  # no pinned memory left
        return None
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    tensor.record_stream(stream)  # its memory is not reused before the copy ends
    return host, copied


def owns_its_bytes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is contiguous and the whole of its storage: its bytes are all a writer takes of it."""
    return tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its bytes, contiguous."""
    tensor = tensor if tensor.is_cpu else tensor.cpu()
    return tensor if owns_its_bytes(tensor) else tensor.clone(memory_format=torch.contiguous_format)


#: Where each tensor starts in a shared block: a multiple of this, as torch aligns what it allocates.
_ALIGNMENT = 64


class SharedTensor(NamedTuple):
    """A tensor in a :class:`SharedBlock`, as another process that maps the block rebuilds it."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@functools.cache
def makes_shared_blocks() -> bool:
    """Whether this system makes shared blocks (:class:`SharedBlock`: ``memfd``, Linux 3.17 and later, unless a sandbox
    refuses it); asked once."""
    if not hasattr(os, "memfd_create"):
        return False
    try:
        os.close(os.memfd_create("ignite_zero-probe", os.MFD_CLOEXEC))
    except OSError:
        return False
    return True


class SharedBlock:
    """One block of host memory that another process can map: a ``memfd`` of ``size`` bytes, named by ``token``.

    The tensors made in it each own exactly their bytes (:func:`shared_tensor`), as a reader wants them.
    """

    def __init__(self, size: int) -> None:
        self.size = max(size, 1)
        self.token = uuid.uuid4().hex
        self.fd = os.memfd_create("ignite_zero-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        weakref.finalize(self, os.close, self.fd)  # the mapping itself lives as long as the tensors made in it
        self._base = torch.frombuffer(self.map, dtype=torch.uint8).data_ptr()

    def page_lock(self) -> None:
        """Page-lock the block for CUDA, as pinned memory is, so that copies from a device into it run asynchronously
        at full bandwidth; undone when the block goes (the mapping outlives it).

        Raises:
            RuntimeError: CUDA refused (no page-locked memory left, say).
        """
        cudart = torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(self._base, self.size, 0))
        if error:
            raise RuntimeError(
                f"CUDA could not page-lock the {self.size} bytes of host memory that stage this rank's device tensors "
                f"for an asynchronous save (cudaHostRegister: error {error}): free host memory, or save synchronously "
                "(async_save=False)"
            )
        weakref.finalize(self, cudart.cudaHostUnregister, self._base)

    def where(self, tensor: torch.Tensor) -> SharedTensor:
        """Where ``tensor``, one made in this block, lies in it."""
        return SharedTensor(tensor.data_ptr() - self._base, tensor.nbytes, tensor.dtype, tuple(tensor.shape))


def shared_tensor(block: mmap.mmap, where: SharedTensor) -> torch.Tensor:
    """The tensor at ``where`` in the mapped ``block``, owning exactly its bytes."""
    if where.nbytes == 0:
        return torch.empty(where.shape, dtype=where.dtype)
    data = torch.frombuffer(block, dtype=torch.uint8, count=where.nbytes, offset=where.offset)
    return data.view(where.dtype).view(where.shape)


class HostBuffers:
    """Host copies of the tensors of an asynchronous save, kept for the next save while the tensors keep their shapes
    and dtypes (a steady run allocates nothing after its first save).

    The copies of a part lie in one :class:`SharedBlock` where the system makes one (``memfd``, Linux), so that
    another process can write them out without copying them again; where the part holds CUDA tensors, the block is
    page-locked, as pinned memory is, for copies at full bandwidth. Elsewhere they are private buffers (pinned for
    CUDA tensors), which only this process reads.
    """

    def __init__(self) -> None:
        self._kept: tuple[list[tuple[torch.Size, torch.dtype]], bool] | None = None
        self._buffers: list[torch.Tensor] = []
        #: the block the buffers lie in; ``None`` when they are not shared
        self.block: SharedBlock | None = None

    def copy(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` in the kept buffers (new ones where their shapes or dtypes changed)."""
        accelerated = not all(tensor.is_cpu for tensor in tensors)
        layout = ([(tensor.shape, tensor.dtype) for tensor in tensors], accelerated)
        if layout != self._kept:
            self._buffers, self.block, self._kept = [], None, None  # the old buffers go before the new ones are made
            self._buffers, self.block = self._allocate(tensors, accelerated)
            self._kept = layout
        _compat.copy_each(self._buffers, tensors, non_blocking=accelerated)
        if accelerated and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies were issued without blocking, one after the other
        return self._buffers

    @staticmethod
    def _allocate(tensors: Sequence[torch.Tensor], accelerated: bool) -> tuple[list[torch.Tensor], SharedBlock | None]:
        pin = accelerated and torch.cuda.is_available()
        if makes_shared_blocks():
            places, size = [], 0
            for tensor in tensors:
                nbytes = tensor.numel() * tensor.element_size()
                places.append(SharedTensor(size, nbytes, tensor.dtype, tuple(tensor.shape)))
                size += -(-nbytes // _ALIGNMENT) * _ALIGNMENT
            try:
                block = SharedBlock(size)
            except OSError:  # a kernel without memfd_create (before 3.17), or a sandbox refusing it: private copies
                pass
            else:
                if pin:
                    block.page_lock()
                return [shared_tensor(block.map, where) for where in places], block
        return [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors], None
