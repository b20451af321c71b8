"""Which ranks keep whose files in a replicated sharded save (:mod:`ignite_zero.storage.replicas.placement`):
partners chosen by host name, and the settings that cannot work, refused with the same error on every rank (a pure
function of what the ranks told each other). The saves, loads and faults themselves run on simulated hosts: see
test_several_hosts.py."""

import pytest

from ignite_zero.storage.replicas import replica_hosts_of


def test_partners_follow_the_host_names_not_the_ranks():
    # ranks placed on hosts out of rank order: rank 0 on "c", ranks 1 and 4 on "a", ...
    hosts = ["c", "a", "b", "c", "a", "b"]
    replica_hosts = replica_hosts_of(range(6), hosts, 1, "ckpt")
    assert replica_hosts.host_names == ["a", "b", "c"]
    # the first rank of "a" (rank 1) is kept by the first rank of "b" (rank 2), which is kept by the first of "c"
    assert [replica_hosts.partners(rank) for rank in range(6)] == [[1], [2], [0], [4], [5], [3]]
    assert [replica_hosts.leader(rank) for rank in range(6)] == [0, 1, 2, 0, 1, 2]
    assert replica_hosts.kept_on("a") == [0, 1, 3, 4]  # its own ranks, and those of "c", the host before it
    two = replica_hosts_of(range(6), hosts, 2, "ckpt")
    assert two.partners(1) == [2, 0] and two.kept_on("a") == list(range(6))


def test_bad_settings_name_the_problem_and_the_fix():
    with pytest.raises(ValueError, match=r"replicas=2.*on 2 hosts \(a, b\).*at most 1"):
        replica_hosts_of(range(4), ["a", "a", "b", "b"], 2, "ckpt")
    with pytest.raises(ValueError, match=r"different numbers of ranks \(a: 2, b: 1\).*`replicas=0`"):
        replica_hosts_of(range(3), ["a", "a", "b"], 1, "ckpt")


def test_one_host_keeps_one_copy_with_a_warning():
    with pytest.warns(UserWarning, match=r"every rank runs on one host \(a\), so each checkpoint is kept once"):
        replica_hosts = replica_hosts_of(range(2), ["a", "a"], 1, "ckpt")
    assert replica_hosts.replicas == 0 and replica_hosts.partners(1) == []
