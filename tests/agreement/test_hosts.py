"""Every rank's host, exchanged once per process group and shared by every caller."""

import pytest
from launcher import run_ranks

from ignite_zero.agreement import hosts_of_ranks

pytestmark = pytest.mark.distributed


def _hosts_once(rank, world_size):
    from ignite_zero.agreement import hosts as hosts_module

    first = hosts_of_ranks(timeout=10)
    asked = hosts_module.agree

    def refuse(*args, **kwargs):
        raise AssertionError("host names were exchanged twice")

    hosts_module.agree = refuse
    try:
        second = hosts_of_ranks(timeout=10)
    finally:
        hosts_module.agree = asked
    return first, second is first, first.first_rank(rank), first.is_first(rank), first.first_ranks


def test_hosts_are_exchanged_once_per_group_and_name_each_hosts_first_rank():
    results = run_ranks(_hosts_once, 3)
    names = results[0][0].names
    assert len(names) == 3 and len(set(names)) == 1  # one host here: rank 0 acts for it
    for rank, (found, remembered, first, is_first, firsts) in enumerate(results):
        assert found.names == names and remembered
        assert (first, is_first, firsts) == (0, rank == 0, [0])
