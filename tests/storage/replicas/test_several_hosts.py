"""Two simulated hosts of two ranks each, every host with its own node-local disk at the same path (``hosts.py``).

- A consolidated file on node-local disks is written on the recipient's host only, and loads on every rank of both
  hosts, by path and by ``load_latest``.
- A sharded save needs one directory that every rank shares. To node-local disks it fails at the job's first save,
  on every rank, naming the ranks that cannot see the directory; when a host stops seeing a shared directory later,
  the save fails before it is sealed, and the checkpoint before it still loads.
- A host lost during a save, as its ranks enter it or while they write a sharded one: the other host's ranks raise
  within ``sync_timeout``, and the earlier checkpoint is intact.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hosts import refusal, start_hosts, wait_for
from training import assert_state_equal, tiny_model

from ignite_zero import Checkpoint, cli
from ignite_zero.storage.formats import IntegrityError
from ignite_zero.storage.places import LocalPlace
from ignite_zero.storage.replicas import check_host_copy

REFUSAL = refusal()
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(REFUSAL is not None, reason=REFUSAL or "")]

WORLD_SIZE = 4
NOT_SHARED = "is not shared by every rank"


def _results(workdir: Path, ranks: range = range(WORLD_SIZE)) -> list[Any]:
    outcomes = {rank: pickle.loads((workdir / f"result-{rank}.pkl").read_bytes()) for rank in ranks}
    failed = {rank: value for rank, (ok, value) in outcomes.items() if not ok}
    assert not failed, "\n".join(f"rank {rank} raised:\n{value}" for rank, value in failed.items())
    return [value for _, value in outcomes.values()]


def _same_error_on_every_rank(attempts: list[tuple[str | None, str, float]], within: float) -> str:
    assert len({(kind, text) for kind, text, _ in attempts}) == 1, attempts
    kind, text, _ = attempts[0]
    assert kind is not None, "no rank raised"
    assert all(elapsed < within for _, _, elapsed in attempts), [elapsed for _, _, elapsed in attempts]
    return text


def test_node_local_disks_under_idist_parallel(tmp_path: Path, free_port: int) -> None:
    wait_for(start_hosts("node_local", tmp_path, port=free_port), timeout=180)
    seen = _results(tmp_path)
    node_local = tmp_path / "node-local"

    # the file is on the recipient's host alone, and every rank of both hosts loaded it (in the scenario)
    assert [s["files"] for s in seen] == [["checkpoint_1.pt", "checkpoint_2.pt"]] * 2 + [None] * 2
    assert {s["latest"] for s in seen} == {str(node_local / "files" / "checkpoint_2.pt")}

    text = _same_error_on_every_rank([s["sharded"] for s in seen], within=5)
    assert NOT_SHARED in text and "ranks [2, 3] cannot see what rank 0 wrote" in text, text
    assert "DiskSaver" in text and "Nothing was sealed" in text
    assert [s["sharded files"] for s in seen] == [[]] * 2 + [None] * 2  # nothing sealed, nothing left on host 1

    text = _same_error_on_every_rank([s["unshared"] for s in seen], within=5)
    assert NOT_SHARED in text and "rank 0 cannot see the files that ranks [2, 3] wrote" in text, text
    assert [s["shared files"] for s in seen] == [["checkpoint_3.dcp"]] * WORLD_SIZE  # the earlier one, loaded too


def test_node_local_disks_under_torchrun(tmp_path: Path, free_port: int) -> None:
    wait_for(start_hosts("sharded_on_node_local", tmp_path, port=free_port, launcher="torchrun"), timeout=180)
    seen = _results(tmp_path)
    assert [s["hostname"] for s in seen] == ["host-0", "host-0", "host-1", "host-1"]
    text = _same_error_on_every_rank([s["sharded"] for s in seen], within=5)
    assert NOT_SHARED in text and "ranks [2, 3] cannot see" in text, text


def _one_timeout(elapsed: float, sync_timeout: float) -> bool:
    """Whether a rank gave up after one ``sync_timeout``, not one per round. A round's timeout runs from the first rank
    that came to it, and whichever rank's wait ends first posts the end to all: a rank that came a moment later sees
    the round end a moment less than ``sync_timeout`` after it came."""
    return sync_timeout - 1 <= elapsed < 1.5 * sync_timeout


def _lose_the_second_host(hosts: list, tmp_path: Path, marks: tuple[str, ...]) -> None:
    """Kill the second host once its ranks have left ``marks`` (files in ``tmp_path``) where it is to go; wait for
    the first host to end."""
    deadline = time.monotonic() + 120
    while not all((tmp_path / mark).exists() for mark in marks):
        assert time.monotonic() < deadline and hosts[1].process.poll() is None, hosts[1].output()
        time.sleep(0.01)
    hosts[1].kill()
    wait_for(hosts[:1], timeout=60)


def _lose_the_second_host_at_a_save(hosts: list, tmp_path: Path) -> None:
    """Kill the second host once its ranks (2 and 3) have entered a save; wait for the first host to end."""
    _lose_the_second_host(hosts, tmp_path, ("at-save-2", "at-save-3"))


def test_a_host_lost_at_a_save(tmp_path: Path, free_port: int) -> None:
    _lose_the_second_host_at_a_save(start_hosts("host_lost", tmp_path, port=free_port), tmp_path)
    seen = _results(tmp_path, range(2))

    sync_timeout = 5
    for kind, text, elapsed in (s["lost"] for s in seen):
        assert kind == "CollectiveTimeoutError" and "waiting for ranks [2, 3]" in text, text
        assert _one_timeout(elapsed, sync_timeout), elapsed  # one timeout, not one per round
    assert [s["files"] for s in seen] == [["checkpoint_1.pt"]] * 2
    earlier = tmp_path / "disk-0" / "files" / "checkpoint_1.pt"
    assert cli.main(["verify", str(earlier)]) == 0
    model = tiny_model(seed=5)
    Checkpoint.load_objects({"model": model}, earlier)
    assert_state_equal(model.state_dict(), torch.load(earlier, weights_only=True)["model"])


def test_a_host_lost_while_writing_a_sharded_save(tmp_path: Path, free_port: int) -> None:
    hosts = start_hosts("host_lost_mid_write", tmp_path, port=free_port)
    _lose_the_second_host(hosts, tmp_path, ("writing-2",))  # the save planned among every rank, rank 2 writing
    seen = _results(tmp_path, range(2))

    sync_timeout = 5
    for kind, text, elapsed in (s["lost"] for s in seen):
        # the round after the writes timed out on the rank writing when its host went (and on the host's other rank,
        # if it had not come to the round yet); the round that shares the outcome then gave up at once
        assert kind == "CollectiveTimeoutError", text
        writing = r"Timed out after 5 s waiting for ranks \[2(, 3)?\] at the writing of checkpoint_2.dcp"
        assert re.search(writing, text), text
        assert re.search(r"at once \(ranks \[2(, 3)?\] missed an earlier round too\)", text), text
        assert "Call it on every rank" not in text, text  # no living rank is blamed for coming late
        assert _one_timeout(elapsed, sync_timeout), elapsed
    # the half-written save is no checkpoint; the one before it is whole
    assert [s["checkpoints"] for s in seen] == [["checkpoint_1.dcp"]] * 2
    earlier = tmp_path / "shared" / "checkpoint_1.dcp"
    assert cli.main(["verify", str(earlier)]) == 0
    model = tiny_model(seed=5)
    Checkpoint.load_objects({"model": model}, earlier)
    assert_state_equal(model.state_dict(), torch.load(tmp_path / "model-1.pt", weights_only=True))


def test_replicas_on_node_local_disks(tmp_path: Path, free_port: int) -> None:
    """Two hosts of one rank, then of two, then the survivor alone: replicated saves, resumes from whatever
    survives, bad settings, and a host lost as its ranks enter a save."""
    wait_for(start_hosts("replicated", tmp_path, nproc_per_node=1, port=free_port), timeout=180)
    seen = _results(tmp_path, range(2))
    fast, durable = tmp_path / "node-local" / "fast", tmp_path / "durable"
    every_file = [".metadata", "__0_0.distcp", "__1_0.distcp", "ignite_zero.json", "ignite_zero_index.json"]

    # each host holds its own files and the other's: every file, n_saved on each
    assert [s["saved"] for s in seen] == [{"checkpoint_2.dcp": every_file, "checkpoint_3.dcp": every_file}] * 2
    text = _same_error_on_every_rank([s["too many"] for s in seen], within=5)
    assert "replicas=2" in text and "2 hosts" in text and "at most 1" in text, text
    text = _same_error_on_every_rank([s["shared"] for s in seen], within=5)
    assert "is shared by the hosts" in text and "`replicas=0`" in text and "Nothing was sealed" in text, text
    assert [s["shared files"] for s in seen] == [[]] * 2
    assert [s["async"] for s in seen] == [{"checkpoint_3.dcp": every_file}] * 2

    # the second host replaced by an empty one: the newest of both tiers, its files fetched from the first host
    assert {s["resumed"] for s in seen} == {str(fast / "checkpoint_3.dcp")}
    assert seen[1]["repaired"] == {"checkpoint_3.dcp": every_file}
    # a file lost on both hosts: skipped, naming it; the one before, on the first host alone, loads on both
    assert {s["after loss"] for s in seen} == {str(fast / "checkpoint_2.dcp")}
    assert any("checkpoint_3.dcp" in line and "['__1_0.distcp'] survive on no host" in line for line in seen[0]["log"])
    assert seen[1]["fetched"]["checkpoint_2.dcp"] == every_file
    assert [s["next"]["checkpoint_4.dcp"] for s in seen] == [every_file] * 2
    # retention from what both hosts held at the resume: checkpoint_2 removed from both, though the recipient's
    # replaced host listed only checkpoint_3 then
    assert [sorted(s["next"]) for s in seen] == [["checkpoint_3.dcp", "checkpoint_4.dcp"]] * 2
    assert sorted(os.listdir(durable)) == ["checkpoint_2.pt"]
    # a rank slower than sync_timeout to relay its files fails that save on every rank; the next relays anew
    assert all(s["straggler"][0] is not None for s in seen), [s["straggler"] for s in seen]
    assert [s["after straggler"][0] for s in seen] == [None, None], [s["after straggler"] for s in seen]
    assert [s["straggler files"] for s in seen] == [{"checkpoint_5.dcp": every_file}] * 2
    assert seen[0]["threads"] == seen[1]["threads"] and "__1_1.distcp" in seen[0]["threads"]["checkpoint_5.dcp"]

    # more ranks: two a host, the second host's disk emptied; then that host lost at a save
    for entry in (tmp_path / "disk-1").iterdir():
        shutil.rmtree(entry)
    _lose_the_second_host_at_a_save(start_hosts("grown", tmp_path, port=free_port), tmp_path)
    seen = _results(tmp_path, range(2))
    assert {s["resumed"] for s in seen} == {str(fast / "checkpoint_4.dcp")}
    four_ranks = [
        ".metadata",
        *(f"__{rank}_0.distcp" for rank in range(4)),
        "ignite_zero.json",
        "ignite_zero_index.json",
    ]
    assert [s["saved"]["checkpoint_5.dcp"] for s in seen] == [four_ranks] * 2
    sync_timeout = 5
    for kind, text, elapsed in (s["lost"] for s in seen):
        # the ranks of the lost host that had not come to the round where the others gave up: both, or one of them
        assert kind == "CollectiveTimeoutError" and re.search(r"waiting for ranks \[(2|3|2, 3)\]", text), text
        # one timeout: the rounds after it give up at once, and none waits out a rank that died after it posted
        assert _one_timeout(elapsed, sync_timeout), elapsed
    assert [sorted(s["files"]) for s in seen] == [["checkpoint_4.dcp", "checkpoint_5.dcp"]] * 2

    # the first host alone, two ranks: the checkpoint of four ranks, from its disk
    for name in ("at-save-2", "at-save-3", "result-0.pkl", "result-1.pkl"):
        (tmp_path / name).unlink()
    wait_for(start_hosts("shrunk", tmp_path, nnodes=1, port=free_port), timeout=120)
    assert [s["resumed"] for s in _results(tmp_path, range(2))] == [str(fast / "checkpoint_5.dcp")] * 2


def test_verify_on_each_of_three_hosts(tmp_path: Path, free_port: int) -> None:
    """Three hosts of one rank, ``replicas=1``: each host holds its own files and the host's before it by name;
    ``ignite-zero verify`` of its directory checks those and names the files that live elsewhere."""
    wait_for(start_hosts("three_hosts", tmp_path, nnodes=3, nproc_per_node=1, port=free_port), timeout=120)
    seen = _results(tmp_path, range(3))
    rank_0 = [".metadata", "__0_0.distcp", "ignite_zero_index.json"]  # the coordinator's files
    held = [[*rank_0, "__2_0.distcp"], [*rank_0, "__1_0.distcp"], ["__1_0.distcp", "__2_0.distcp"]]
    assert [s["files"]["checkpoint_0.dcp"] for s in seen] == [sorted([*files, "ignite_zero.json"]) for files in held]
    for host, (status, printed) in enumerate(s["verify"] for s in seen):
        assert status == 0, printed
        assert f"OK on host-{host}: {len(held[host])} of 5 files here, sizes and CRC-32 match" in printed, printed
        assert "replicated on 3 hosts, host-0, host-1, host-2, with replicas=1" in printed, printed
    assert "only on other hosts: __1_0.distcp (host-1, host-2)" in seen[0]["verify"][1]
    assert "only on other hosts: .metadata (host-0, host-1); __0_0.distcp (host-0, host-1)" in seen[2]["verify"][1]

    # here, where no host of the checkpoint runs: what a directory holds is checked, whatever host keeps it
    name = "checkpoint_0.dcp"
    directory = tmp_path / "disk-2" / "fast" / name
    assert cli.main(["verify", str(directory)]) == 0
    with (directory / "__1_0.distcp").open("r+b") as f:  # a copy that rotted on its disk
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cli.main(["verify", str(directory)]) == 1
    # a file that the host keeps, lost: an error on that host
    (tmp_path / "disk-0" / "fast" / name / "__2_0.distcp").unlink()
    with pytest.raises(IntegrityError, match=r"__2_0.distcp is missing, and this host \(host-0\) is one of those"):
        check_host_copy(LocalPlace(tmp_path / "disk-0" / "fast"), name, strict=True, host="host-0")
