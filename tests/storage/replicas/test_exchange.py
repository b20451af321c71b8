"""Files sent to the hosts that keep them (:mod:`ignite_zero.storage.replicas.exchange`): copies that arrived
otherwise than they were written are named."""

import pytest

from ignite_zero.storage.formats import IntegrityError
from ignite_zero.storage.replicas import check_arrived, replica_hosts_of


def test_copies_that_arrived_otherwise_than_written_are_named():
    # two hosts of one rank, each keeping the other's files: what each rank wrote, and what each received
    replica_hosts = replica_hosts_of(range(2), ["a", "b"], 1, "ckpt")
    written = {0: {".metadata": (10, 1), "__0_0.distcp": (100, 2)}, 1: {"__1_0.distcp": (100, 3)}}
    arrived = {0: {"__1_0.distcp": (100, 3)}, 1: {".metadata": (10, 1), "__0_0.distcp": (100, 2)}}
    check_arrived(replica_hosts, written, arrived, "ckpt/checkpoint_1.dcp")
    arrived[1]["__0_0.distcp"] = (100, 7)  # another CRC-32
    del arrived[0]["__1_0.distcp"]  # never arrived
    with pytest.raises(IntegrityError, match=r"__0_0.distcp of rank 0 on rank 1, __1_0.distcp of rank 1 on rank 0"):
        check_arrived(replica_hosts, written, arrived, "ckpt/checkpoint_1.dcp")
