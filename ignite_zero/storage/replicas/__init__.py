"""Sharded checkpoints on node-local disks, kept on several hosts.

A replicated :class:`~ignite_zero.ShardedSaver` (``replicas=k``) writes into a directory that has the same path on
every host and different contents on each (a local NVMe under ``/local``, say). Each rank writes its files on its own
host, and sends them to ``k`` ranks on ``k`` other hosts (:class:`ReplicaHosts`: partners chosen by host name), which
write them on theirs; every host's directory is then sealed with the same manifest. Before a load,
:func:`repair_before_load` completes each host's copy of a checkpoint from the hosts that hold its files, whatever the
format reads of them; :func:`check_host_copy` tells :func:`~ignite_zero.find_latest` which of its files verify on a
host, and ``ignite-zero verify`` what one host's directory holds and which files live elsewhere.

Files travel over the transport's wire in parts of :data:`CHUNK_BYTES`, checked on arrival against the size and
CRC-32 that the writer recorded, and written through the :class:`~ignite_zero.storage.places.Place` of the receiving
host.

=============  =====================================================================================================
``placement``  who keeps whose files: the hosts of the ranks and each rank's partners (:class:`ReplicaHosts`)
``frames``     how the parts of a file travel over the transport's wire, and the threads that move them
``exchange``   files sent to other hosts once written (:func:`exchange`), and the check that they all arrived
``relay``      files sent to other hosts as they are written (:class:`Relay`)
``checking``   what one host's directory holds of a replicated checkpoint (:func:`check_host_copy`)
``repair``     the repair of every host's copy before a load (:func:`repair_before_load`)
=============  =====================================================================================================
"""

from ignite_zero.storage.replicas.checking import HostCopy, check_host_copy
from ignite_zero.storage.replicas.exchange import Transfer, check_arrived, exchange
from ignite_zero.storage.replicas.frames import CHUNK_BYTES
from ignite_zero.storage.replicas.placement import ReplicaHosts, manifest_facts, replica_hosts_of
from ignite_zero.storage.replicas.relay import Relay
from ignite_zero.storage.replicas.repair import repair_before_load

__all__ = [
    "CHUNK_BYTES",
    "HostCopy",
    "ReplicaHosts",
    "Relay",
    "Transfer",
    "check_arrived",
    "check_host_copy",
    "exchange",
    "replica_hosts_of",
    "manifest_facts",
    "repair_before_load",
]
