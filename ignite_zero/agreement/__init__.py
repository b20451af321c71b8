"""Agreement: ranks deciding together, through the process group's store.

==========  ==========================================================================================
``rounds``  who called, with what decision, within a timeout; every failure posted so that every rank raises
            the same error (:func:`together`)
``hosts``   the host of every rank, exchanged once per process group
==========  ==========================================================================================
"""

from ignite_zero.agreement.hosts import Hosts, hosts_of_ranks
from ignite_zero.agreement.rounds import (
    DEFAULT_SYNC_TIMEOUT,
    CollectiveTimeoutError,
    RankFailureError,
    agree,
    busy,
    peek,
    post,
    propose,
    rank_and_world,
    round_members,
    settle,
    together,
)

__all__ = [
    "DEFAULT_SYNC_TIMEOUT",
    "CollectiveTimeoutError",
    "Hosts",
    "RankFailureError",
    "agree",
    "busy",
    "hosts_of_ranks",
    "peek",
    "post",
    "propose",
    "rank_and_world",
    "round_members",
    "settle",
    "together",
]
