"""Which ranks keep whose files in a replicated sharded save: partners chosen by host name, and the settings that
cannot work, refused with the same error on every rank (a pure function of what the ranks told each other); the
relay that sends files as they are written, between two ranks of one machine. The saves, loads and faults themselves
run on simulated hosts: see test_hosts.py."""

import json
import os
from pathlib import Path

import pytest
import torch
from launcher import run_ranks

from ignite_zero import ShardedSaver
from ignite_zero.storage.formats import IntegrityError
from ignite_zero.storage.formats.base import crc32
from ignite_zero.storage.formats.torch_zip import tensor_bytes
from ignite_zero.storage.places import LocalPlace
from ignite_zero.storage.replicas import CHUNK_BYTES, Relay, check_arrived, check_host_copy, replica_hosts_of
from ignite_zero.transport.groups import cpu_group


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


def test_replicas_is_a_count(tmp_path):
    with pytest.raises(ValueError, match=r"`replicas` should be a non-negative integer, got -1"):
        ShardedSaver(tmp_path, replicas=-1)


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


def _relay_to_each_other(rank: int, world_size: int, root: Path) -> tuple[dict, list[str]]:
    directory = LocalPlace(root / f"host-{rank}")
    directory.make()
    relay = Relay(directory, [1 - rank], [1 - rank], cpu_group(dedicated="relay"), timeout=30)
    tensor = torch.arange(CHUNK_BYTES // 4 + 1000, dtype=torch.int32) * (rank + 1)  # more than one part

    def dump(stream):
        stream.write(b"a header")
        memory = tensor_bytes(tensor)
        stream.write(memory)  # at once
        for begin in range(0, memory.nbytes, 256 << 10):  # in adjacent slices, as the writer hands them over
            stream.write(memory[begin : begin + (256 << 10)])
        stream.write(bytes(range(256)) * 1000)  # other bytes, many of them

    relay.place.write(f"file-{rank}", dump, atomic=False)

    def failing(stream):
        stream.write(b"a start")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        relay.place.write(f"broken-{rank}", failing, atomic=False)
    return relay.finish(), sorted(os.listdir(directory.location()))


def test_a_relay_sends_files_as_they_are_written(tmp_path):
    received, listed = zip(*run_ranks(_relay_to_each_other, 2, tmp_path))
    for rank in range(2):
        written = (tmp_path / f"host-{1 - rank}" / f"file-{1 - rank}").read_bytes()
        assert (tmp_path / f"host-{rank}" / f"file-{1 - rank}").read_bytes() == written
        assert received[rank] == {f"file-{1 - rank}": (len(written), crc32(written))}  # not the broken one
        assert f"file-{rank}" in listed[rank]


class _FailsOnceWritten(LocalPlace):
    """A host's directory whose write of ``first`` fails once its content is written (a flush or fsync that fails)."""

    def write(self, name, dump, atomic=True):
        super().write(name, dump, atomic)
        if name == "first":
            raise OSError(f"fsync of {name} failed")


def _relay_into_a_failing_flush(rank: int, world_size: int, root: Path) -> tuple[str, list[str]]:
    directory = (_FailsOnceWritten if rank == 1 else LocalPlace)(root / f"host-{rank}")
    directory.make()
    relay = Relay(directory, [1 - rank], [1 - rank], cpu_group(dedicated="relay"), timeout=30)
    if rank == 0:
        for name in ("first", "second"):
            relay.place.write(name, lambda stream: stream.write(b"content"), atomic=False)
    try:
        relay.finish()
        outcome = "finished"
    except OSError as error:
        outcome = str(error)
    return outcome, sorted(os.listdir(directory.location()))


def test_a_copy_whose_flush_fails_is_an_error_and_the_next_file_still_arrives(tmp_path):
    (sent, _), (received, listed) = run_ranks(_relay_into_a_failing_flush, 2, tmp_path)
    assert sent == "finished" and received == "fsync of first failed"
    assert "second" in listed and (tmp_path / "host-1" / "second").read_bytes() == b"content"


def _host_copy(root: Path) -> LocalPlace:
    """One host's directory of a replicated checkpoint ``ckpt`` that lists three files: one intact, one corrupt, and
    one that lives on another host only."""
    directory = root / "ckpt"
    directory.mkdir()
    (directory / "__0_0.distcp").write_bytes(b"intact")
    (directory / "__1_0.distcp").write_bytes(b"rotted")
    files = {
        "__0_0.distcp": {"size": 6, "crc32": crc32(b"intact")},
        "__1_0.distcp": {"size": 6, "crc32": crc32(b"before")},
        "__2_0.distcp": {"size": 6, "crc32": crc32(b"remote")},
    }
    keepers = {"__0_0.distcp": ["a", "b"], "__1_0.distcp": ["b", "a"], "__2_0.distcp": ["c", "b"]}
    manifest = {"format": "ignite_zero-sharded", "files": files, "replicas": 1, "hosts": ["a", "b", "c"]}
    (directory / "ignite_zero.json").write_text(json.dumps({**manifest, "keepers": keepers}))
    return LocalPlace(root)


def test_one_check_of_a_host_copy_serves_a_load_and_verify(tmp_path, caplog):
    place = _host_copy(tmp_path)
    copy = check_host_copy(place, "ckpt", host="a")  # a load: what verifies here, the rest fetched again
    assert copy is not None and copy.good == {"__0_0.distcp"} and copy.elsewhere == {"__2_0.distcp": ["c", "b"]}
    assert "__1_0.distcp is corrupt" in caplog.text
    sizes_only = check_host_copy(place, "ckpt", verify=False, host="a")
    assert sizes_only is not None and sizes_only.good == {"__0_0.distcp", "__1_0.distcp"}
    assert sizes_only.identity == copy.identity  # the manifest's, whatever the host holds
    with pytest.raises(IntegrityError, match=r"__1_0.distcp is corrupt \(CRC-32"):  # verify: the first problem
        check_host_copy(place, "ckpt", strict=True, host="a")
    (tmp_path / "ckpt" / "__1_0.distcp").unlink()
    with pytest.raises(IntegrityError, match=r"__1_0.distcp is missing, and this host \(a\) is one of those"):
        check_host_copy(place, "ckpt", strict=True, host="a")
    kept_elsewhere = check_host_copy(place, "ckpt", strict=True, host="d")  # a host that keeps neither missing file
    assert kept_elsewhere is not None and kept_elsewhere.here == ["__0_0.distcp"]
    assert check_host_copy(place, "elsewhere") is None
