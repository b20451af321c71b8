"""Bytes between two ranks: a length-prefixed message, or an error message in its place.

A rank that cannot send tells the receiver instead of leaving it waiting (a negative length announces an error
message), so that an error never turns into a hang. An empty frame is its length alone: no message follows a length
of 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["PeerError", "post_error", "post_frame", "receive_bytes", "receive_frame", "send_bytes", "send_error"]


class PeerError(RuntimeError):
    """A peer reported that it could not send what was expected of it."""


def send_bytes(data: bytes, peer: int, group: ProcessGroup | None, length: int | None = None) -> None:
    """Send ``data`` to the global rank ``peer``, its length first (``length`` in its place, if given)."""
    dist.send(torch.tensor([len(data) if length is None else length], dtype=torch.int64), peer, group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, group)


def post_frame(data: torch.Tensor, peer: int, group: ProcessGroup | None) -> list[dist.Work]:
    """Post the send of ``data`` (a contiguous ``uint8`` CPU tensor) to the global rank ``peer`` as one frame,
    straight from its memory, and return at once; the peer receives it as :func:`receive_frame` or
    :func:`receive_bytes` do.

    ``data`` must stay alive and unchanged until every work returned has completed.
    """
    return _post(data, data.numel(), peer, group)


def post_error(error: BaseException | str, peer: int, group: ProcessGroup | None) -> list[dist.Work]:
    """Post :func:`send_error`'s message, and return at once, as :func:`post_frame` does."""
    message = _message_of(error)
    return _post(torch.frombuffer(bytearray(message), dtype=torch.uint8), -len(message), peer, group)


def send_error(error: BaseException | str, peer: int, group: ProcessGroup | None) -> None:
    """Send ``error``'s message where ``peer`` waits in :func:`receive_bytes`, which raises :class:`PeerError`."""
    message = _message_of(error)
    send_bytes(message, peer, group, -len(message))


def _message_of(error: BaseException | str) -> bytes:
    # A negative length announces an error message instead of a header: the peer raises, not hangs.
    text = error if isinstance(error, str) else f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
    return text.encode()


def _post(payload: torch.Tensor, length: int, peer: int, group: ProcessGroup | None) -> list[dist.Work]:
    works = [dist.isend(torch.tensor([length], dtype=torch.int64), peer, group)]
    if length:
        works.append(dist.isend(payload, peer, group))
    if any(work is None for work in works):  # only for a rank outside `group`
        raise RuntimeError("This rank is not part of `group`")
    return [work for work in works if work is not None]


def receive_frame(
    peer: int, group: ProcessGroup | None, what: str, buffer: Callable[[int], torch.Tensor] | None = None
) -> torch.Tensor:
    """Receive one frame from the global rank ``peer``: its bytes, received into ``buffer(length)`` if given (a
    ``uint8`` tensor of that many elements), else into a new tensor; an empty tensor for an empty frame.

    Raises:
        PeerError: the peer sent an error message instead (``what``: what it was expected to send).
    """
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, peer, group)
    n = int(length.item())
    if n < 0:
        message = bytearray(-n)
        dist.recv(torch.frombuffer(message, dtype=torch.uint8), peer, group)
        raise PeerError(f"rank {peer} could not send {what}: {message.decode(errors='replace')}")
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    data = torch.empty(n, dtype=torch.uint8) if buffer is None else buffer(n)
    dist.recv(data, peer, group)
    return data


def receive_bytes(peer: int, group: ProcessGroup | None, what: str) -> bytes:
    """Receive a header; raise :class:`PeerError` if the peer sent an error message instead."""
    return receive_frame(peer, group, what).numpy().tobytes()
