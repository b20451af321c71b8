"""Agreement among ranks before and after a collective operation, through the process group's store.

A collective entered by only some ranks blocks until the process-group timeout and then fails with a raw
backend error (``dist.monitored_barrier`` names the missing ranks on rank 0 only, and leaves the group
unusable). A round of :func:`agree` instead works on the store that the default process group was created
with: each rank posts a small payload, then waits for the others with a deadline. Every rank that arrived
either gets all payloads, or raises :class:`CollectiveTimeoutError` naming the missing ranks, and the process
group itself is never touched, so it stays usable.

Whether a round succeeded is decided once, atomically (``compare_set`` on one key): a rank that arrives after
the others gave up raises too, instead of running into the next collective alone.

:func:`post` and :func:`peek` leave and read a value without waiting for anyone: what a rank can tell ranks
that may never come (a save of replicated state called on one rank only).
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ignite_zero import _compat

#: Seconds a rank waits for the others to reach the same save or load. Well below the process-group
#: timeout (30 minutes by default), so that a save called on one rank fails fast and clearly.
DEFAULT_SYNC_TIMEOUT = 120.0

_PREFIX = "ignite_zero/"
_GO, _ABORT = b"go", b"abort"


class CollectiveTimeoutError(RuntimeError):
    """Some ranks did not reach a collective save or load in time.

    Attributes:
        posted: what the ranks that did arrive posted in the round, by rank.
    """

    def __init__(self, message: str, posted: dict[int, Any] | None = None) -> None:
        super().__init__(message)
        self.posted = posted or {}


class RankFailureError(RuntimeError):
    """A rank failed during a collective save or load; raised on every rank, naming the ranks and their errors."""


@dataclass
class _Channel:
    store: dist.Store
    rank: int
    world_size: int
    rounds: dict[str, int] = field(default_factory=dict)
    # ranks that never came to a round that timed out, each with that round's stream and key: while a rank has still
    # not posted there, a later round of the same stream gives up on it at once rather than after a timeout of its own
    lost: dict[int, tuple[str, str]] = field(default_factory=dict)
    # the rounds of each stream whose keys are still in the store, each with what it left beyond every round's keys:
    # this rank's private part, if it had one; on the first rank, the count of the ranks that learnt it gave up
    unforgotten: dict[str, list[tuple[str, tuple[str, ...]]]] = field(default_factory=dict)


# One channel per default process group: a group destroyed and created again starts counting afresh.
_channels: weakref.WeakKeyDictionary[Any, _Channel] = weakref.WeakKeyDictionary()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one.

    Plain ``torch.distributed`` on purpose: the first ``ignite.distributed`` call after
    ``init_process_group`` is itself a collective, which must not run on one rank only.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def round_members(ranks: Sequence[int] | None) -> list[int]:
    """The ranks of a round of :func:`agree` or :func:`settle`, in the order of the payloads it returns: ``ranks``
    sorted, every rank for ``None``."""
    return list(range(rank_and_world()[1])) if ranks is None else sorted(ranks)


def _channel() -> _Channel:
    group = dist.group.WORLD
    channel = _channels.get(group)
    if channel is None:
        channel = _Channel(_compat.default_store(), dist.get_rank(), dist.get_world_size())
        _channels[group] = channel
    return channel


def agree(
    payload: Any, *, what: str, timeout: float, stream: str = "main", ranks: Sequence[int] | None = None
) -> list[Any]:
    """Share ``payload`` with the other ranks of a round; return all payloads in the order of ``ranks``.

    Every rank of ``ranks`` must call it, in the same order as its other rounds on the same ``stream`` and
    ``ranks``. Without a process group, or with one rank, it returns ``[payload]`` at once.

    Args:
        payload: small picklable value posted by this rank.
        what: the operation, e.g. ``"save of checkpoint_3.pt"``; ranks in different operations are an error.
        timeout: seconds to wait after this rank arrived, extended while a missing rank shows it is alive
            and busy (see :func:`busy`).
        stream: independent sequence of rounds, e.g. for a background writer.
        ranks: the global ranks that take part, this one among them; ``None`` for every rank. Rounds among
            other ranks are counted apart, so ranks outside never fall out of step.

    Raises:
        CollectiveTimeoutError: some ranks did not arrive in time, or arrived after the others gave up.
        RankFailureError: ranks called different operations in the same round.
    """
    return _round(payload, None, None, what=what, timeout=timeout, stream=stream, ranks=ranks)[0]


def _round(
    payload: Any, private: Any, to: int | None, *, what: str, timeout: float, stream: str, ranks: Sequence[int] | None
) -> tuple[list[Any], list[Any] | None]:
    """A round of :func:`agree` in which every rank also posts ``private`` for rank ``to`` alone: every payload, and
    on ``to`` every private part (``None`` elsewhere), in the order of ``ranks``."""
    rank, world_size = rank_and_world()
    members = round_members(ranks)
    if rank not in members:
        raise ValueError(f"Rank {rank} takes part in a round among ranks {members} that it is not one of")
    if len(members) == 1:
        return [payload], [private] if to == rank else None
    channel = _channel()
    store = channel.store
    if len(members) < world_size:
        stream = f"{stream}@{','.join(map(str, members))}"
    number = channel.rounds.get(stream, 0)
    channel.rounds[stream] = number + 1
    key = f"{_PREFIX}{stream}/{number}"
    unforgotten = channel.unforgotten.setdefault(stream, [])
    extra: tuple[str, ...] = ()

    privates = None
    try:
        if to is not None:  # before the payload: a rank that finds every payload posted finds every private part too
            store.set(f"{key}/d{rank}", pickle.dumps(private))  # type: ignore[arg-type]  # bytes work too
            extra = (f"d{rank}",)
        store.set(f"{key}/p{rank}", pickle.dumps((what, payload)))  # type: ignore[arg-type]
        store.add(f"{key}/n", 1)
        try:
            lost = {r: at for r, (where, at) in channel.lost.items() if where == stream}
            _wait_for_all(store, key, rank, members, what, timeout, lost)
        except CollectiveTimeoutError as error:
            arrived = [r for r in members if store.check([f"{key}/p{r}"])]
            error.posted = {r: pickle.loads(store.get(f"{key}/p{r}"))[1] for r in arrived}
            for r in members:
                if r not in arrived:
                    channel.lost.setdefault(r, (stream, key))
            # kept until a round that every rank reaches: some may not have read this one yet
            unforgotten.append((key, (*extra, "gave_up") if rank == members[0] else extra))
            _leave_together(store, f"{key}/gave_up", rank, arrived, timeout)  # every rank that came learns it
            raise
        posted = [pickle.loads(raw) for raw in store.multi_get([f"{key}/p{r}" for r in members])]
        if rank == to:
            privates = [pickle.loads(raw) for raw in store.multi_get([f"{key}/d{r}" for r in members])]
        for r in members:  # they came: none of them is lost any more
            channel.lost.pop(r, None)
        for earlier, left in unforgotten:  # every rank reached this round, so all have read those
            _forget(store, earlier, rank, members, left)
        unforgotten[:] = [(key, extra)]
        _leave_together(store, f"{key}/done", rank, members, timeout)
    except dist.DistError as error:  # the store itself is gone (DistNetworkError, DistStoreError)
        raise RankFailureError(
            f"Lost the process group's store during the {what} ({error}). The process hosting it (rank 0 under "
            "`idist.Parallel`, the launcher under torchrun) has probably died."
        ) from error
    operations = {r: op for r, (op, _) in zip(members, posted)}
    if len(set(operations.values())) > 1:
        listing = ", ".join(f"rank {r}: {op}" for r, op in operations.items())
        raise RankFailureError(
            f"Ranks are in different collective operations ({listing}). Save and load checkpoints on every rank, "
            "in the same order."
        )
    return [value for _, value in posted], privates


def post(key: str, value: Any) -> None:
    """Leave ``value`` under ``key`` in the store for other ranks to :func:`peek` at; never waits for a rank.

    A no-op without a process group or with one rank.
    """
    if rank_and_world()[1] == 1:
        return
    _channel().store.set(f"{_PREFIX}posted/{key}", pickle.dumps(value))  # type: ignore[arg-type]


def peek(key: str) -> Any:
    """The value last posted under ``key`` with :func:`post`, or ``None`` if there is none yet; never waits."""
    if rank_and_world()[1] == 1:
        return None
    store = _channel().store
    name = f"{_PREFIX}posted/{key}"
    try:
        return pickle.loads(store.get(name)) if store.check([name]) else None
    except dist.DistError:  # the store's host is gone: nothing to learn from it
        return None


def propose(key: str, value: Any) -> Any:
    """Post ``value`` under ``key`` unless a value is there already; return the value there now, the first one
    proposed on any rank. :func:`peek` reads it too. Never waits for a rank.

    One atomic ``compare_set``, so ranks proposing at the same moment all get the same winner. ``value`` itself
    without a process group or with one rank.
    """
    if rank_and_world()[1] == 1:
        return value
    name = f"{_PREFIX}posted/{key}"
    return pickle.loads(_channel().store.compare_set(name, "", pickle.dumps(value)))  # type: ignore[arg-type]


def settle(
    failure: BaseException | None,
    *,
    what: str,
    timeout: float,
    payload: Any = None,
    stream: str = "main",
    ranks: Sequence[int] | None = None,
    to: int | None = None,
) -> list[Any]:
    """A round of :func:`agree` that also shares whether each rank failed; return all payloads in the order of
    ``ranks``.

    Args:
        failure: the exception this rank hit in its part of the operation, or ``None``.
        what: the operation, for messages.
        timeout: as for :func:`agree`.
        payload: as for :func:`agree`.
        stream: as for :func:`agree`.
        ranks: as for :func:`agree`.
        to: the one rank that reads the payloads, for a round whose payloads only it needs; the others get an empty
            list. Every rank still learns whether any failed. A rank then reads ``ranks`` small reports, not every
            payload: the store serves O(ranks) payloads a round, not O(ranks^2).

    Raises:
        RankFailureError: on every rank, if any rank failed; it lists each failed rank's error, and chains
            this rank's own exception. Without a process group, ``failure`` itself is raised.
    """
    if failure is not None and (rank_and_world()[1] == 1 or (ranks is not None and len(ranks) == 1)):
        raise failure
    own = None if failure is None else f"{type(failure).__name__}: {failure}"
    members = round_members(ranks)
    try:
        if to is None:
            posted = agree((own, payload), what=what, timeout=timeout, stream=stream, ranks=members)
        else:
            shared, payloads = _round(
                (own, None), payload, to, what=what, timeout=timeout, stream=stream, ranks=members
            )
            posted = [(text, value) for (text, _), value in zip(shared, payloads or [None] * len(shared))]
    except CollectiveTimeoutError as timeout_error:
        # e.g. a peer died in the middle of the operation: how it showed on the ranks that arrived
        reports = [f"rank {r}: {text}" for r, (text, _) in sorted(timeout_error.posted.items()) if text is not None]
        if not reports:
            raise
        raise CollectiveTimeoutError(
            f"{timeout_error} Ranks that arrived reported errors: {'; '.join(reports)}", timeout_error.posted
        ) from failure
    failed = [(rank, text) for rank, (text, _) in zip(members, posted) if text is not None]
    if failed:
        by_text: dict[str, list[int]] = {}
        for rank, text in failed:  # ranks that failed alike are named once: a directory none of them sees, say
            by_text.setdefault(text, []).append(rank)
        listing = "; ".join(
            f"{f'rank {alike[0]}' if len(alike) == 1 else f'ranks {alike}'}: {text}" for text, alike in by_text.items()
        )
        raise RankFailureError(f"The {what} failed on {len(failed)} of {len(posted)} ranks: {listing}") from failure
    return [value for _, value in posted] if to is None or to == rank_and_world()[0] else []


class Together:
    """One rank's side of a :func:`together` round: set :attr:`payload` inside the block, read :attr:`payloads`
    after it."""

    def __init__(self) -> None:
        #: what this rank shares with the others, if its part succeeds
        self.payload: Any = None
        #: every rank's payload in the order of the round's ranks, once the round is over (empty off ``to``)
        self.payloads: list[Any] = []


@contextmanager
def together(
    what: str,
    *,
    timeout: float,
    stream: str = "main",
    ranks: Sequence[int] | None = None,
    to: int | None = None,
) -> Iterator[Together]:
    """Run this rank's part of a collective operation, then :func:`settle` it: every rank raises if any failed.

    An exception raised inside the block is what this rank reports; every rank then raises the same
    :class:`RankFailureError`, chained to its own exception on the ranks that failed. Arguments as for
    :func:`settle`.

    Examples:
        .. code-block:: python

            import os

            from ignite_zero.agreement import together

            with together("listing of the checkpoints", timeout=60.0) as listing:
                listing.payload = sorted(os.listdir("."))
            every_listing = listing.payloads  # every rank's, in rank order
    """
    side = Together()
    failure = None
    try:
        yield side
    except Exception as error:  # reported to every rank by the round below, and raised there on every rank
        failure = error
    side.payloads = settle(failure, what=what, timeout=timeout, payload=side.payload, stream=stream, ranks=ranks, to=to)


def _wait_for_all(
    store: dist.Store, key: str, rank: int, members: list[int], what: str, timeout: float, lost: dict[int, str]
) -> None:
    state_key = f"{key}/state"
    deadline = time.monotonic() + timeout
    pauses = _pauses(len(members))
    while True:
        if store.check([state_key]):
            state = store.get(state_key)
            if state == _GO:
                return
            missing, gone = pickle.loads(state[len(_ABORT) :])
            raise _timeout_error(rank, missing, gone, members, what, timeout)
        if store.add(f"{key}/n", 0) >= len(members):
            if store.compare_set(state_key, "", _GO) == _GO:  # type: ignore[arg-type]
                return
            continue
        now = time.monotonic()
        # A host lost in the middle of a save: a rank of it missed the save's round, and the round that shares the
        # outcome gives up at once instead of timing out a second time.
        gone = _lost_and_missing(store, key, members, lost) if lost else []
        if now >= deadline or gone:
            missing = [r for r in members if not store.check([f"{key}/p{r}"])]
            silent_for = min(_silence(store, r) for r in missing) if missing else timeout
            if silent_for < timeout and not gone:
                # A missing rank is alive and still busy (e.g. writing the file): keep waiting for it.
                deadline = now + timeout - silent_for
                continue
            abort = _ABORT + pickle.dumps((missing, gone))
            if store.compare_set(state_key, "", abort) == _GO:  # type: ignore[arg-type]
                return
            raise _timeout_error(rank, missing, gone, members, what, timeout)
        time.sleep(next(pauses))


def _lost_and_missing(store: dist.Store, key: str, members: list[int], lost: dict[int, str]) -> list[int]:
    """The ranks missing from the round ``key`` that missed an earlier round of its stream and have not come to it
    since: they cannot come to this one before that one, which ended without them, so the round cannot succeed."""
    return [
        r for r in members if r in lost and not store.check([f"{key}/p{r}"]) and not store.check([f"{lost[r]}/p{r}"])
    ]


def _timeout_error(
    rank: int, missing: list[int], gone: list[int], members: list[int], what: str, timeout: float
) -> CollectiveTimeoutError:
    """The same explanation on every rank that gave up, or that arrived after the others gave up; ``gone``: the
    missing ranks that had missed an earlier round, for which the others gave up at once."""
    after = f"at once (ranks {gone} missed an earlier round too)" if gone else f"after {timeout:g} s"
    if rank in missing and gone:
        # A round that could not succeed whoever came: this rank, alive and in step, only came after the others had
        # given up on it (the first rank of an earlier round waits a moment more for the others to leave it).
        return CollectiveTimeoutError(
            f"The other ranks gave up waiting for ranks {missing} (this one among them) at the {what} {after}: the "
            f"round could not succeed once ranks {gone} were lost (a host lost in the middle of the operation, say), "
            "and this rank came to it after the others had given up. The errors of the operation tell what happened."
        )
    if rank in missing:
        return CollectiveTimeoutError(
            f"The other ranks gave up waiting for ranks {missing} (this one among them) at the {what} {after}, and "
            "raised an error. Call it on every rank at the same point of the program; raise `sync_timeout` if a rank "
            "is legitimately slower."
        )
    arrived = [r for r in members if r not in missing]
    timed_out = (
        f"Gave up at once (ranks {gone} missed an earlier round too)" if gone else f"Timed out after {timeout:g} s"
    )
    return CollectiveTimeoutError(
        f"{timed_out} waiting for ranks {missing} at the {what} (ranks {arrived} arrived): they "
        "died (a lost host, say), hang, or never call it. It must be called on every rank of the process group: "
        "attach checkpoint handlers on all ranks, never under `if rank == ...`. Raise `sync_timeout` if a rank is "
        "legitimately slower."
    )


def _leave_together(store: dist.Store, counter: str, rank: int, ranks: list[int], timeout: float) -> None:
    """Count this rank out under ``counter``; on the first of ``ranks``, return only once all of them have (or after
    ``timeout``), other ranks return at once.

    The store may live in rank 0's process: ``init_process_group`` starts its TCP store there for ``env://``
    and ``tcp://`` (``idist.Parallel`` does so; torchrun keeps it in its agent instead). If rank 0 finished
    its last round, or gave up on it, and exited, it would take the store away from a rank still reading the
    round's outcome, which would raise a lost store instead of that outcome. A rank that has counted itself out
    needs the store no more, so only the first rank waits.

    It waits a tenth of ``timeout`` (at least 1 s), not ``timeout``: every rank of ``ranks`` has posted already and
    reads the outcome within one pause of the store, so one that has not counted itself out by then died after it
    posted (a host lost in the middle of a round), or is stalled far longer than a pause; waiting the whole
    ``timeout`` for it would double the time in which the others learn that a host is lost.
    """
    if store.add(counter, 1) >= len(ranks) or rank != ranks[0]:
        return
    deadline = time.monotonic() + min(timeout, max(1.0, timeout / 10))
    pauses = _pauses(len(ranks))
    while store.add(counter, 0) < len(ranks) and time.monotonic() < deadline:
        time.sleep(next(pauses))


def _pauses(world_size: int) -> Iterator[float]:
    """Seconds between two looks at the store while waiting for ranks: from 50 us, doubling up to 1 ms a rank (50 ms
    at most), so that the ranks together look about 1,000 times a second (each look costs the store two requests).

    The first pauses are short because ranks that arrive together are apart by well under a millisecond, and every
    round of a save or a load waits at least one pause.
    """
    pause, longest = 5e-5, min(0.05, 0.001 * world_size)
    while True:
        yield pause
        pause = min(pause * 2, longest)


def _silence(store: dist.Store, rank: int) -> float:
    """Seconds since ``rank`` last showed it was busy (see :func:`busy`); infinite if it never did."""
    beat_key = f"{_PREFIX}alive/{rank}"
    if not store.check([beat_key]):
        return float("inf")
    return time.time() - float(store.get(beat_key))


def _forget(store: dist.Store, key: str, rank: int, members: list[int], extra: tuple[str, ...]) -> None:
    """Drop the keys of the round ``key``, which every rank has read, to keep the store small: this rank's payload and
    ``extra`` (its private part, the count of the ranks that gave up), and on the first rank the round's counters and
    outcome. Only keys the round made: each deletion is a request to the store."""
    for name in (f"p{rank}", *extra):
        store.delete_key(f"{key}/{name}")
    if rank == members[0]:
        for name in ("n", "state", "done"):
            store.delete_key(f"{key}/{name}")


@contextmanager
def busy(interval: float) -> Iterator[None]:
    """Show the other ranks that this rank is alive while it works, e.g. while it writes a large file.

    Ranks waiting in :func:`agree` for this rank extend their deadline while it beats. Wall-clock time is
    posted, so clocks of different hosts must agree to well within the timeout (NTP does).
    """
    rank, world_size = rank_and_world()
    if world_size == 1:
        yield
        return
    token = _heart.enter(_channel().store, rank, interval)
    try:
        yield
    finally:
        _heart.leave(token)


class _Heart:
    """The thread that beats for every :func:`busy` block of this process while any runs: at once when one begins,
    then every interval (the shortest of theirs). One thread for the process, started at its first block, not one a
    block: starting and joining a thread at every save cost more than the rest of a small save's rounds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._blocks: dict[int, tuple[dist.Store, int, float]] = {}  # each running block's store, rank and interval
        self._count = 0
        self._thread: threading.Thread | None = None

    def enter(self, store: dist.Store, rank: int, interval: float) -> int:
        """Beat for ``rank`` in ``store`` from now on, every ``interval`` seconds at least; the block's token."""
        with self._lock:
            self._count += 1
            self._blocks[self._count] = (store, rank, interval)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ignite_zero-heartbeat", daemon=True)
                self._thread.start()
            self._changed.notify()
            return self._count

    def leave(self, token: int) -> None:
        with self._lock:
            self._blocks.pop(token, None)  # gone if the process was forked in the block: its child has a heart anew

    def _run(self) -> None:
        with self._lock:
            while True:
                while not self._blocks:
                    self._changed.wait()
                beaten = self._count
                interval = self._beat_every_block()
                if self._count == beaten:  # else a block began as it beat, in a store it may not have beaten in
                    self._changed.wait(interval)  # or less: a block that begins is beaten for at once

    def _beat_every_block(self) -> float:
        """Beat once for every running block, the lock released meanwhile; the shortest of their intervals. The
        stores go with the call: a thread that waits holds none (a destroyed group's store would live on)."""
        beats = {(id(store), rank): (store, rank) for store, rank, _ in self._blocks.values()}
        interval = min(interval for _, _, interval in self._blocks.values())
        self._lock.release()
        try:
            for store, rank in beats.values():
                _beat(store, rank)
        finally:
            self._lock.acquire()
        return interval


def _beat(store: dist.Store, rank: int) -> None:
    try:
        store.set(f"{_PREFIX}alive/{rank}", repr(time.time()))
    except Exception:  # the store's host gone, say: the thread beats on for the blocks that still run
        pass


_heart = _Heart()


def _new_heart() -> None:
    # a child forked while the thread held the lock would find it held for good, and the thread gone
    global _heart
    _heart = _Heart()


os.register_at_fork(after_in_child=_new_heart)
