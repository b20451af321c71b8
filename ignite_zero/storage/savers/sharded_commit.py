"""The commit of one sharded save, phase by phase: prepare the directory and agree on DCP's plans, write this rank's
files, check that every rank's files (and their copies on other hosts) are there, seal the directory, and clean up
after a failed replication. Every phase that involves other ranks is a round of agreement, the same in number, order
and name on every rank."""

from __future__ import annotations

import functools
import logging
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ignite_zero.agreement import (
    CollectiveTimeoutError,
    RankFailureError,
    hosts_of_ranks,
    rank_and_world,
    round_members,
    settle,
    together,
)
from ignite_zero.staging import HostBuffers
from ignite_zero.storage import replicas as replicas_
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats.dcp_files import FileWritten, write_entries
from ignite_zero.storage.formats.dcp_plans import Offer, SavePlanning, StagedPart, WrittenPart
from ignite_zero.storage.places import LocalPlace, Place
from ignite_zero.storage.savers.destination import check_room, package_version
from ignite_zero.storage.savers.write_process import WriteProcess, worth_a_process
from ignite_zero.transport.groups import cpu_group, discard_group

if TYPE_CHECKING:
    from ignite_zero.storage.savers.sharded import ShardedSaver

__all__ = ["FilesReport", "KeptBetweenSaves", "PreparationReport", "ShardedCommit"]

logger = logging.getLogger(__name__)

# Left by the writing rank in the directory of a job's first sharded save, read by every other rank: it tells a
# directory that every rank shares from directories of the same path on several hosts. Hidden, and removed at once.
_PROBE = ".ignite_zero-probe"

#: A rank's files as it reports them: name -> (size, CRC-32).
Files = dict[str, tuple[int, int]]


class PreparationReport(NamedTuple):
    """What each rank shares in the preparation round of a save."""

    #: upper estimate of the bytes of its part: objects every rank holds are counted on each, though written once
    size: int
    #: free bytes where it writes, on the writing rank (with replicas, each host's first); ``None`` elsewhere
    free: int | None
    #: the token of the probe it left in the directory at the first save, if it left one
    probe: str | None
    #: its offer in the agreement on DCP's plans
    offer: Offer


class FilesReport(NamedTuple):
    """What each rank shares once it wrote, for the seal."""

    #: its files
    written: Files
    #: the records of each of its files, for the manifest (each a table: quick to pickle)
    records: dict[str, Any]
    #: the files its relay received from ranks on other hosts
    received: Files


class AgreedFiles(NamedTuple):
    """What the check of a save found: every rank's files and their records (on the ranks that seal)."""

    by_rank: dict[int, Files]
    records: dict[str, Any]


@dataclass
class KeptBetweenSaves:
    """What a :class:`~ignite_zero.ShardedSaver` keeps from one commit to the next."""

    #: the hosts of the ranks, learnt at the first replicated save
    replica_hosts: replicas_.ReplicaHosts | None = None
    #: the host copies of each stream's asynchronous saves, reused while the layout holds (two handlers of one saver,
    #: each with its own stream, may have saves in flight at once)
    host_buffers: dict[str, HostBuffers] = field(default_factory=dict)
    #: the process that writes asynchronous saves' files from shared host copies
    write_process: WriteProcess = field(default_factory=WriteProcess)
    #: whether a save found the directory shared by every rank yet
    seen_by_every_rank: bool = False
    #: DCP's plans of each stream's saves
    planning: dict[str, SavePlanning] = field(default_factory=dict)


class ShardedCommit:
    """One collective save of a :class:`~ignite_zero.ShardedSaver`, in phases that every rank runs in turn:
    :meth:`prepare`, then :meth:`write` (after :meth:`relay` or :meth:`stage`), then :meth:`finish`, which is
    :meth:`check` then :meth:`seal`; :meth:`clean` runs where a replication failed.

    Args:
        saver: the saver that saves.
        filename: name of the checkpoint directory.
        timeout: seconds ranks wait for each other in each round.
        stream: stream of agreement rounds (see :func:`ignite_zero.agreement.agree`).
        ranks: the ranks that write; one rank alone writes the whole directory without collectives.
    """

    def __init__(
        self, saver: ShardedSaver, filename: str, *, timeout: float, stream: str, ranks: Sequence[int] | None
    ) -> None:
        self.saver, self.place, self.kept = saver, saver.place, saver.kept
        self.filename, self.timeout, self.stream, self.ranks = filename, timeout, stream, ranks
        self.members = round_members(ranks)
        self.writer: Any = None  # DCP's storage writer, from the preparation on
        self.planning = self.kept.planning.setdefault(stream, SavePlanning())
        self.relayed: replicas_.Relay | None = None
        self.started: float | None = None

    def _round(self) -> dict[str, Any]:
        return {"timeout": self.timeout, "stream": self.stream, "ranks": self.ranks}

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Collective: the writing rank clears what an interrupted save left and makes the directory the ranks write
        into; every rank learns whether the parts of all ranks fit on the disk, and DCP's plans of the save are
        agreed.

        Args:
            state: this rank's part, as DCP saves it.
        """
        if self.saver.replicas and self.kept.replica_hosts is None:
            self._arrange()
        target = self.place.writing_directory(self.filename)
        # where the first save leaves its probe: where the ranks write, or beside it for replicas, where every host's
        # first rank clears what interrupted saves left in a directory that may turn out to be one for all
        probed = self.place if self.kept.replica_hosts is not None else target
        self.writer = sharded.writer_for(target, self.saver.thread_count)
        self.writer.written.clear()
        with together(f"preparation of {self.filename}", **self._round()) as preparation:
            offer = self.planning.offer(state, self.writer, self.members, rank_and_world()[0])
            free, probe = self._open_directory(probed) if self.saver.is_writer else (None, None)
            preparation.payload = PreparationReport(self.planning.part_bytes, free, probe, offer)
        reports: list[PreparationReport] = preparation.payloads
        probe = next((report.probe for report in reports if report.probe is not None), None)
        if probe is not None:
            self._check_seen_by_every_rank(probed, probe)
        self._check_room(reports)
        offers = [report.offer for report in reports]
        if not self.planning.make_global_plans(offers, self.writer):  # kept from other agreements
            what = f"planning of {self.filename}"
            full_offers = settle(None, what=what, payload=self.planning.full_offer(), **self._round())
            self.planning.make_global_plans(full_offers, self.writer)

    def _arrange(self) -> None:
        """Collective, at the first replicated save: learn the host of every rank, and so which ranks keep whose
        files; bad settings raise here, on every rank alike."""
        settle(None, what=f"preparation of {self.filename} (hosts)", **self._round())
        if len(self.members) == 1:  # a save of this rank alone: asking the others would wait for them
            hosts = [socket.gethostname()]
        else:
            known = hosts_of_ranks(self.timeout)
            hosts = [known.of(rank) for rank in self.members]
        self.saver.use_replica_hosts(
            replicas_.replica_hosts_of(self.members, hosts, self.saver.replicas, self.saver.dirname)
        )

    def _open_directory(self, probed: Place) -> tuple[int | None, str | None]:
        """On the writing rank: clear what interrupted saves left, begin the directory, and leave the probe of the
        first save in ``probed``; the free space and the probe's token."""
        self.saver.prepare_directory(self.filename)
        probe = None
        if not self.kept.seen_by_every_rank and len(self.members) > 1 and self._probes():
            token = secrets.token_hex(16)
            # not through a temporary name: in a directory the hosts share (what the probe finds out), another host's
            # first rank clears temporary files there as this one writes, and took the probe's
            probed.write(_PROBE, lambda f: f.write(token.encode()), atomic=False)
            probe = token
        return self.place.free_space(), probe

    def _probes(self) -> bool:
        """Whether this rank leaves the probe of the first save: the writing rank; with replicas, the first rank."""
        if self.kept.replica_hosts is None:
            return True
        return rank_and_world()[0] == self.members[0] and len(self.kept.replica_hosts.host_names) > 1

    def _check_room(self, reports: Sequence[PreparationReport]) -> None:
        """Every rank learns whether the parts of all ranks fit on the disk of the writing rank; with replicas, on
        each host's disk, the parts it keeps."""
        sizes = dict(zip(self.members, (report.size for report in reports)))
        free = dict(zip(self.members, (report.free for report in reports)))
        replica_hosts = self.kept.replica_hosts
        if replica_hosts is None:
            space = next((space for space in free.values() if space is not None), None)
            check_room(self.place, self.filename, sum(sizes.values()), space, needs="its parts need up to")
            return
        for host in replica_hosts.host_names:
            leader = replica_hosts.ranks_on(host)[0]
            needed = sum(sizes[rank] for rank in replica_hosts.kept_on(host))
            needs = f"the parts that host {host} keeps need up to"
            check_room(self.place, self.filename, needed, free[leader], needs=needs)

    def _check_seen_by_every_rank(self, target: Place, probe: str) -> None:
        """Collective, at the first save: every rank reads the probe that the writing rank left where they are about
        to write, so that a directory the ranks do not share fails the job's first save, not its first resume. With
        replicas, the other way round: the ranks of other hosts must not see it."""
        replica_hosts = self.kept.replica_hosts
        prober = self.members[0] if replica_hosts is not None else self.saver.save_on_rank
        here = rank_and_world()[0]
        try:
            with together(f"check of {self.filename}'s directory", **self._round()) as check:
                check.payload = here == prober or _sees(target, probe)
        finally:
            if here == prober:
                target.remove(_PROBE, recursive=False)
        if replica_hosts is None:
            blind = [rank for rank, sees in zip(self.members, check.payloads) if not sees]
            if blind:
                raise self._not_shared(blind, f"ranks {blind} cannot see what rank {prober} wrote")
        else:
            host = replica_hosts.host_of(prober)
            elsewhere = [
                rank for rank, sees in zip(self.members, check.payloads) if sees and replica_hosts.host_of(rank) != host
            ]
            if elsewhere:
                raise self._shared(elsewhere, prober)
        self.kept.seen_by_every_rank = True

    def relay(self) -> None:
        """Collective, in a synchronous replicated save: make the writer write through a relay that sends this
        rank's files to its partners as they are written, and writes its sources' files here meanwhile.

        No relay (the files are sent once written, by :meth:`check`) without replicas, and where a relay does not
        fit: in an asynchronous save, whose staging may fail on one rank after the others began to relay (their
        partners would wait for files that never come), and with several writing threads (a relay carries one file
        at a time)."""
        replica_hosts = self.kept.replica_hosts
        if replica_hosts is None or not replica_hosts.replicas or self.saver.thread_count > 1:
            return
        rank = rank_and_world()[0]
        sources = [source for source in replica_hosts.members if rank in replica_hosts.partners(source)]
        group = self.replicas_group()
        self.relayed = replicas_.Relay(self.writer.place, replica_hosts.partners(rank), sources, group, self.timeout)
        self.writer.reset(self.relayed.place)

    def replicas_group(self) -> Any:
        """The gloo group that replicas travel over in a synchronous save, apart from the default group; a new one
        after a save whose replication failed, since a gloo wait that timed out closes its connections for good."""
        return cpu_group(dedicated=_replicas_use(self.stream))

    def group_after_write(self) -> Any:
        """The group that a synchronous save sends its files over once written: the replicas' own where no relay
        sent them, since a wait there that times out must not close the connections of every rank's group."""
        replica_hosts = self.kept.replica_hosts
        return self.replicas_group() if replica_hosts and replica_hosts.replicas and self.relayed is None else None

    def stage(self) -> StagedPart | Exception:
        """Copy what this rank writes into the saver's kept host memory: the copy, or the failure to report with the
        writes (no host memory left, say), so that no rank waits for it."""
        self.started = self.started or time.perf_counter()
        try:
            return self.planning.stage(self.kept.host_buffers.setdefault(self.stream, HostBuffers()))
        except Exception as error:
            return error
        finally:
            self.planning.release()  # the write reads the host copies: the state itself may change meanwhile

    def write(self, staged: StagedPart | None = None) -> WrittenPart | Exception:
        """This rank's files, as planned (from ``staged``, its host copy, if given): where each item went, or the
        failure to share in the next round.

        A host copy in shared memory bound for a local directory, and large enough for the writing to slow the
        training loop, is written by the saver's :class:`~ignite_zero.storage.savers.write_process.WriteProcess`, which
        leaves this process's interpreter to the loop."""
        self.started = self.started or time.perf_counter()
        try:
            if staged is None:
                return self.planning.write(self.writer)
            write_file: Callable[[Place, str, list[Any]], FileWritten] = write_entries
            block = staged.block
            if (
                block is not None
                and isinstance(self.writer.place, LocalPlace)
                and worth_a_process(staged.values, block)
            ):
                write_file = functools.partial(self.kept.write_process.write, block=block)
            return self.planning.write_staged(self.writer, staged, write_file)
        except Exception as error:
            return error
        finally:
            self.planning.release()

    def finish(self, wrote: WrittenPart | Exception, group: Any = None) -> None:
        """Collective, once this rank wrote its files (``wrote``: where each item went, or the failure): :meth:`check`,
        then :meth:`seal`. ``group``: the gloo group that replicas travel over where no relay sent them."""
        self.seal(self.check(wrote, group))

    def check(self, wrote: WrittenPart | Exception, group: Any = None) -> AgreedFiles:
        """Collective: every rank's results to the coordinator, which writes ``.metadata``; then every rank's files
        to the writing rank. With replicas, each rank's files also go to its partners on other hosts (through the
        relay as they were written, else now), and every rank learns that all of them arrived.

        Returns:
            Every rank's files and their records, on the ranks that seal.
        """
        outcome, failure = self._gather_results(wrote)
        received: Files = {}
        if self.relayed is not None:
            try:
                received = self.relayed.finish()
            except Exception as error:
                failure = failure if failure is not None else error
        if outcome is not None:
            if self.relayed is not None:
                self.clean()
            raise outcome
        reports = self._report_files(failure, received)
        files = [report.written for report in reports]
        records = {name: entries for report in reports for name, entries in report.records.items()}
        by_rank = dict(zip(self.members, files))
        replica_hosts = self.kept.replica_hosts
        if (
            replica_hosts is not None and self.relayed is not None
        ):  # the same verdict on every rank, from the same reports
            arrived = dict(zip(self.members, (report.received for report in reports)))
            replicas_.check_arrived(replica_hosts, by_rank, arrived, self.place.location(self.filename))
        elif replica_hosts is not None:
            try:
                self._replicate(by_rank, group)
            except Exception:  # raised on every rank alike
                self.clean()
                raise
        return AgreedFiles(by_rank, records)

    def _gather_results(self, wrote: WrittenPart | Exception) -> tuple[Exception | None, BaseException | None]:
        """Collective: every rank's write results to the coordinator, which writes ``.metadata``.

        Returns:
            The failure that every rank learnt in this round, to raise once the relay is done; and this rank's own,
            to report in the next round.
        """
        failure: BaseException | None = wrote if isinstance(wrote, Exception) else None
        written = None if isinstance(wrote, Exception) else wrote
        what = f"writing of {self.filename}"
        try:
            every_rank = settle(failure, what=what, payload=written, to=self.members[0], **self._round())
            if self.planning.is_coordinator:  # the first member; through the relay too, like any file
                self.planning.finish(self.writer, every_rank)
        except (RankFailureError, CollectiveTimeoutError) as error:
            return error, failure
        except Exception as error:  # the coordinator's .metadata; a lone rank's own failure, which settle raises
            return None, error
        return None, failure

    def _report_files(self, failure: BaseException | None, received: Files) -> list[FilesReport]:
        """Collective: every rank's files, and whether it failed, to the ranks that check them: the writing rank;
        with replicas, every rank."""
        # without replicas, only the writing rank needs every rank's files (with replicas, every rank checks them)
        writing = self.saver.save_on_rank
        sealer = writing if self.kept.replica_hosts is None and writing in self.members else None
        payload = FilesReport(dict(self.writer.written), dict(self.writer.record_tables), received)
        try:
            return settle(failure, what=f"sharded save of {self.filename}", payload=payload, to=sealer, **self._round())
        except Exception:
            if self.relayed is not None:  # raised on every rank alike
                self.clean()
            raise

    def _replicate(self, by_rank: Mapping[int, Files], group: Any) -> None:
        """Collective, once the files are written (where no relay sent them as they were): every rank sends its
        files to its partners on other hosts, which write them into their host's directory; every rank learns
        whether all arrived whole."""
        replica_hosts = self.kept.replica_hosts
        assert replica_hosts is not None
        transfers = [
            replicas_.Transfer(source, target, name, size, crc)
            for source, files in by_rank.items()
            for target in replica_hosts.partners(source)
            for name, (size, crc) in sorted(files.items())
        ]
        if not transfers:
            return
        written = self.place.writing_directory(self.filename)
        with together(f"replication of {self.filename}", **self._round()):
            replicas_.exchange(transfers, written, written, cpu_group() if group is None else group, self.timeout)

    def seal(self, agreed: AgreedFiles) -> None:
        """Collective: the writing rank (with replicas, each host's first) seals its directory and puts it in place;
        with replicas, every rank then learns that every host did, before older checkpoints go."""
        if self.kept.replica_hosts is None:
            if self.saver.is_writer:
                self._seal_here(agreed)
        else:
            with together(f"commit of {self.filename} on every host", **self._round()):
                if self.saver.is_writer:
                    self._seal_here(agreed)
        if self.saver.is_writer:
            listed = [record for rank_files in agreed.by_rank.values() for record in rank_files.values()]
            logger.info(
                "Saved %s (%.1f MB, %d files, %d replicas) in %.2f s",
                self.place.location(self.filename),
                sum(size for size, _ in listed) / 1e6,
                len(listed),
                0 if self.kept.replica_hosts is None else self.kept.replica_hosts.replicas,
                time.perf_counter() - (self.started or 0.0),
            )

    def _seal_here(self, agreed: AgreedFiles) -> None:
        """On a rank that seals: check that the files its directory keeps are there, and seal it with the manifest
        of every file."""
        replica_hosts, by_rank = self.kept.replica_hosts, agreed.by_rank
        written = self.place.writing_directory(self.filename)
        kept = (
            list(by_rank)
            if replica_hosts is None
            else replica_hosts.kept_on(replica_hosts.host_of(rank_and_world()[0]))
        )
        self._check_every_part_is_there(written, [by_rank[rank] for rank in kept], kept)
        listed = {name: record for rank_files in by_rank.values() for name, record in rank_files.items()}
        facts = {"world_size": len(by_rank), "torch": torch.__version__, "ignite_zero": package_version()}
        if replica_hosts is not None:
            facts.update(replicas_.manifest_facts(replica_hosts, by_rank))
        records = agreed.records
        self.place.commit_directory(self.filename, lambda written: sharded.seal(written, listed, records, **facts))

    def _check_every_part_is_there(self, written: Place, files: Sequence[Files], members: Sequence[int]) -> None:
        """Before sealing: every rank's files are where the writing rank seals them, with the size written.

        A directory that stopped being shared after the first save (a mount lost on some hosts) would otherwise
        be sealed without their parts, and fail only at the resume.
        """
        present = written.file_sizes()
        blind = [
            rank
            for rank, written in zip(members, files)
            if any(present.get(name) != size for name, (size, _) in written.items())
        ]
        if blind:
            detail = f"rank {self.saver.save_on_rank} cannot see the files that ranks {blind} wrote"
            raise self._not_shared(blind, detail)

    def clean(self) -> None:
        """After a save whose replication failed: drop the replicas' gloo group, whose connections a wait that timed
        out closes for good; the next save makes a new one."""
        discard_group(_replicas_use(self.stream))

    def _shared(self, seers: Sequence[int], prober: int) -> ValueError:
        saver = self.saver
        return ValueError(
            f"The replicated checkpoint {self.place.location(self.filename)} cannot be saved: the directory "
            f"{saver.dirname} is shared by the hosts (ranks {list(seers)}, on other hosts than rank {prober}, see what "
            f"it wrote there), while `replicas={saver.replicas}` keeps each rank's files on the node-local disk of its "
            f"own host and of {saver.replicas} others. For a directory that every rank shares, pass `replicas=0`: the "
            "storage keeps the checkpoint whole. Nothing was sealed; earlier checkpoints are kept."
        )

    def _not_shared(self, blind: Sequence[int], detail: str) -> ValueError:
        return ValueError(
            f"The sharded checkpoint {self.place.location(self.filename)} cannot be saved: the directory "
            f"{self.saver.dirname} is not shared by every rank ({detail}). A sharded checkpoint is one directory that "
            "every rank writes its part into: give ShardedSaver a directory that every rank shares, on a shared file "
            "system or an object store (s3://...), or save single files with a DiskSaver, which only the recipient "
            "writes (node-local disks too). Nothing was sealed; earlier checkpoints are kept."
        )


def _sees(target: Place, probe: str) -> bool:
    """Whether this rank reads the probe where the writing rank left it; another failure is this rank's own (a
    directory it may not read, say)."""
    try:
        return target.read(_PROBE) == probe.encode()
    except FileNotFoundError:
        return False


def _replicas_use(stream: str) -> str:
    return f"{stream}|replicas"
