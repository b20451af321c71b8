"""The frames of replica files on the wire (ignite_zero.storage.replicas.frames): a send given up on keeps its memory
alive while gloo may still read it, for as long as its group and no longer."""

import gc
import weakref

import torch
import torch.distributed as dist
from launcher import run_ranks

from ignite_zero.storage.replicas.frames import Posted


def _give_up_on_a_peer_that_never_receives(rank, world_size):
    group = dist.new_group([0, 1], backend="gloo")
    outcome = []
    if rank == 0:
        posted = Posted(group, 0.5, lambda peer: TimeoutError(f"Rank {peer} took no file"))
        data = torch.ones(8, dtype=torch.uint8)
        kept = weakref.ref(data)
        posted.post(data, [1])
        outcome.append(str(posted.drain()))
        del posted, data
        gc.collect()
        outcome.append(kept() is not None)  # gloo may still read it
    dist.barrier()
    dist.destroy_process_group(group)
    del group
    gc.collect()
    if rank == 0:
        outcome.append(kept() is not None)
    return outcome


def test_a_send_given_up_on_keeps_its_memory_as_long_as_its_group():
    outcome, _ = run_ranks(_give_up_on_a_peer_that_never_receives, 2, timeout=30)
    assert outcome == ["Rank 1 took no file", True, False]
