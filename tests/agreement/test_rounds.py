"""Agreement rounds among real ranks: payloads, missing and late ranks, liveness, a usable group after errors."""

import re
import time

import pytest
import torch
import torch.distributed as dist
from launcher import run_ranks

from ignite_zero import _compat
from ignite_zero.agreement import (
    CollectiveTimeoutError,
    RankFailureError,
    agree,
    busy,
    settle,
    together,
)

pytestmark = pytest.mark.distributed


def _all_arrive(rank, world_size):
    first = agree({"rank": rank}, what="test", timeout=10)
    second = agree(rank * 10, what="test", timeout=10)
    return first, second


def test_payloads_come_back_in_rank_order():
    for first, second in run_ranks(_all_arrive, 3):
        assert first == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert second == [0, 10, 20]


def _one_rank_calls(rank, world_size):
    outcome = None
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            agree(None, what="checkpoint save", timeout=1.0)
        outcome = (str(info.value), time.monotonic() - started)
    # The process group is untouched and still works for every rank.
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    return outcome, value.item()


def test_missing_rank_is_named_within_timeout_and_group_stays_usable():
    results = run_ranks(_one_rank_calls, 3)
    message, elapsed = results[0][0]
    assert "ranks [1, 2]" in message and "ranks [0] arrived" in message and "sync_timeout" in message
    assert 1.0 <= elapsed < 5.0
    assert [total for _, total in results] == [6.0, 6.0, 6.0]


def _late_rank(rank, world_size):
    if rank == 1:
        time.sleep(2.0)
    try:
        agree(None, what="checkpoint save", timeout=0.5)
    except CollectiveTimeoutError as error:
        return str(error)
    return None


def test_rank_arriving_after_the_others_gave_up_raises_too():
    early, late = run_ranks(_late_rank, 2)
    assert "waiting for ranks [1]" in early
    assert "gave up waiting for ranks [1] (this one among them)" in late


def _busy_rank(rank, world_size):
    if rank == 1:
        with busy(interval=0.1):
            time.sleep(1.5)  # e.g. writing a large file
    return agree(rank, what="checkpoint save outcome", timeout=0.5)


def test_a_busy_rank_extends_the_deadline():
    assert run_ranks(_busy_rank, 2) == [[0, 1], [0, 1]]


def _different_operations(rank, world_size):
    with pytest.raises(RankFailureError, match="rank 0: checkpoint save, rank 1: checkpoint load"):
        agree(None, what="checkpoint save" if rank == 0 else "checkpoint load", timeout=5)


def test_ranks_in_different_operations_fail_together():
    run_ranks(_different_operations, 2)


def _one_rank_fails(rank, world_size):
    failure = ValueError("disk full") if rank == 1 else None
    with pytest.raises(RankFailureError, match=r"failed on 1 of 2 ranks: rank 1: ValueError: disk full") as info:
        settle(failure, what="checkpoint save", timeout=5)
    return info.value.__cause__ is failure


def test_a_failure_on_one_rank_is_raised_on_every_rank():
    assert run_ranks(_one_rank_fails, 2) == [True, True]


def _unpickled_on(rank):
    assert dist.get_rank() == rank, f"unpickled on rank {dist.get_rank()}, not {rank}"
    return f"for rank {rank}"


class _ForOneRank:
    """A payload that only ``rank`` may unpickle."""

    def __init__(self, rank):
        self.rank = rank

    def __reduce__(self):
        return _unpickled_on, (self.rank,)


def _rounds_to_one_rank(rank, world_size):
    gathered = settle(None, what="test", timeout=10, payload=_ForOneRank(1), to=1)
    failure = OSError("no space") if rank == 2 else None
    with pytest.raises(RankFailureError, match=r"failed on 1 of 3 ranks: rank 2: OSError: no space"):
        settle(failure, what="test", timeout=10, payload=_ForOneRank(1), to=1)
    after = agree(rank, what="test", timeout=10)  # the rounds stay in step
    return gathered, after


def test_a_round_to_one_rank_brings_it_every_payload_and_the_others_only_the_failures():
    assert run_ranks(_rounds_to_one_rank, 3) == [
        ([], [0, 1, 2]),
        (["for rank 1"] * 3, [0, 1, 2]),
        ([], [0, 1, 2]),
    ]


def test_without_process_group_agreement_is_immediate_and_errors_are_raised_as_they_are():
    assert agree("x", what="checkpoint save", timeout=1) == ["x"]
    failure = OSError("no space")
    with pytest.raises(OSError, match="no space"):
        settle(failure, what="checkpoint save", timeout=1)


def _a_rank_lost(rank, world_size):
    """Rank 2 never comes (a lost host): the round of the same stream after the one that timed out gives up on it at
    once; a round of another stream waits for it as ever."""
    outcomes = []
    if rank < 2:
        for what in ("checkpoint save", "checkpoint save (outcome)"):
            started = time.monotonic()
            try:
                agree(None, what=what, timeout=1.0, stream="lost")
            except CollectiveTimeoutError as error:
                outcomes.append((str(error), time.monotonic() - started))
    dist.barrier()
    if rank == 2:
        time.sleep(0.5)  # late, but alive: the others wait for it
    return outcomes, agree(rank, what="next", timeout=10.0)


def test_a_rank_that_missed_a_round_is_given_up_on_at_once_by_the_next_round_of_its_stream():
    for outcomes, payloads in run_ranks(_a_rank_lost, 3)[:2]:
        (first, first_elapsed), (second, second_elapsed) = outcomes
        assert "Timed out after 1 s waiting for ranks [2]" in first and 0.5 <= first_elapsed < 3.0  # from the first
        # rank 2 among the missing, and the other of ranks 0 and 1 too if it was not there yet when one gave up
        assert "at once (ranks [2] missed an earlier round too)" in second and re.search(r"ranks \[(\d, )?2\]", second)
        assert "Call it on every rank" not in second  # a rank that came late to a round that could not succeed
        assert second_elapsed < 0.5
        assert payloads == [0, 1, 2]


def _together(rank, world_size):
    with together("sum of ranks", timeout=10) as side:
        side.payload = rank * 2
    errors = []
    with pytest.raises(RankFailureError) as info:
        with together("listing", timeout=10) as failing:
            if rank == 1:
                raise FileNotFoundError("no such directory: /gone")
            failing.payload = "fine"
    errors.append((str(info.value), type(info.value.__cause__).__name__ if info.value.__cause__ else None))
    return side.payloads, errors


def test_together_shares_payloads_and_raises_one_ranks_failure_on_every_rank():
    results = run_ranks(_together, 3)
    for rank, (payloads, [(text, cause)]) in enumerate(results):
        assert payloads == [0, 2, 4]
        assert "The listing failed on 1 of 3 ranks: rank 1: FileNotFoundError: no such directory: /gone" in text
        assert cause == ("FileNotFoundError" if rank == 1 else None)


def _rounds_of_every_kind(rank, world_size):
    """Rounds with and without private parts, one that rank 1 comes late to (the others give up), then ordinary ones:
    what the store holds of the stream at the end, of every round but the last."""
    settle(None, what="test", timeout=10, payload=rank, stream="kept", to=1)
    agree(rank, what="test", timeout=10, stream="kept")
    if rank == 1:
        time.sleep(1.5)
    with pytest.raises(CollectiveTimeoutError):
        agree(rank, what="test", timeout=0.5, stream="kept")
    dist.barrier()
    settle(None, what="test", timeout=10, payload=rank, stream="kept", to=0)
    agree(rank, what="test", timeout=10, stream="kept")
    agree(rank, what="test", timeout=10, stream="kept")
    dist.barrier()
    store = _compat.default_store()
    names = [f"p{r}" for r in range(world_size)] + [f"d{r}" for r in range(world_size)]
    names += ["n", "state", "done", "gave_up"]
    return [
        f"{number}/{name}"
        for number in range(5)
        for name in names
        if store.check([f"ignite_zero/kept/{number}/{name}"])
    ]


def test_every_round_but_the_last_leaves_nothing_in_the_store():
    assert run_ranks(_rounds_of_every_kind, 2) == [[], []]


def _busy_in_two_threads(rank, world_size):
    """Rank 1 works in two threads at once, each in a busy block, while the others wait for it: they wait as long as
    either block runs. Then it is alive but in no block: they give up on it within the timeout."""
    import os
    import threading

    if rank == 0:
        started = time.monotonic()
        assert agree(rank, what="outcome", timeout=0.5) == [0, 1]
        waited = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError):
            agree(rank, what="late", timeout=0.5)
        return waited, time.monotonic() - started
    heartbeats = []

    def work(seconds):
        with busy(interval=0.1):
            heartbeats.append(sum(t.name == "ignite_zero-heartbeat" for t in threading.enumerate()))
            time.sleep(seconds)

    other = threading.Thread(target=work, args=(1.6,))
    other.start()
    time.sleep(0.1)
    work(0.8)
    other.join()
    agree(rank, what="outcome", timeout=0.5)
    with busy(interval=0.1):  # a child forked in a block beats for none of its parent's blocks
        pid = os.fork()
        if pid == 0:
            from ignite_zero.agreement import rounds

            os._exit(0 if not rounds._heart._blocks else 1)
        _, status = os.waitpid(pid, 0)
    time.sleep(2.0)
    with pytest.raises(CollectiveTimeoutError):
        agree(rank, what="late", timeout=0.5)
    return heartbeats, os.waitstatus_to_exitcode(status)


def test_one_heartbeat_thread_beats_while_any_busy_block_runs_and_stops_after():
    (waited, gave_up_after), (heartbeats, child) = run_ranks(_busy_in_two_threads, 2)
    assert 1.5 < waited < 3.0
    assert gave_up_after < 1.5  # not beaten for once its blocks ended
    assert heartbeats == [1, 1] and child == 0


def _group_made_again_after_a_busy_block(rank, world_size, port):
    """A busy block, then the process group destroyed and made again on the same port: the heartbeat thread, which
    outlives the block, holds no store (rank 0's would keep the port)."""
    for _ in range(2):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        with busy(interval=0.05):
            time.sleep(0.2)
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(0.5)  # the heartbeat thread's wait, past its last beat


def test_a_process_group_can_be_made_again_after_a_busy_block():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_ranks(_group_made_again_after_a_busy_block, 2, port, init=False, timeout=30)
