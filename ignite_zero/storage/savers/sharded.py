"""Sharded checkpoints: :class:`ShardedSaver`, every rank writing its own part of a checkpoint directory through
``torch.distributed.checkpoint``, checksummed while written (:mod:`ignite_zero.storage.formats.directory`), then
sealed by one rank: renamed into place on a local file system, committed by its manifest on an object store."""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ignite_zero import tree
from ignite_zero.adapters import ShardedState
from ignite_zero.agreement import (
    DEFAULT_SYNC_TIMEOUT,
    CollectiveTimeoutError,
    RankFailureError,
    rank_and_world,
    round_members,
    settle,
)
from ignite_zero.naming import check_filename
from ignite_zero.storage import replicas as replicas_
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats.dcp_plans import SavePlanning, as_saved
from ignite_zero.storage.places import Place
from ignite_zero.storage.savers.base import SaveRequest
from ignite_zero.storage.savers.destination import (
    DirectorySaver,
    check_room,
    package_version,
    serialized_size,
)
from ignite_zero.transport.groups import cpu_group, discard_group

__all__ = ["ShardedSaver", "share"]

logger = logging.getLogger(__name__)

# Left by the writing rank in the directory of a job's first sharded save, read by every other rank: it tells a
# directory that every rank shares from directories of the same path on several hosts. Hidden, and removed at once.
_PROBE = ".ignite_zero-probe"


class ShardedSaver(DirectorySaver):
    """Sharded saver: every rank writes its own part of a checkpoint directory, in parallel, through
    ``torch.distributed.checkpoint`` (DCP).

    Give it to :class:`~ignite_zero.Checkpoint` as ``save_handler``: the policy (names, scores, ``n_saved``,
    ``last_checkpoint``, agreement among ranks) is the same, but nothing is gathered on one rank. Each checkpoint
    is a directory named like the file would be, with the extension ``.dcp``. ZeRO and OSS ranks write the state
    of the parameters they own, FSDP1 and FSDP2 ranks their shards, and objects that every rank holds are written
    once; :meth:`Checkpoint.load_objects <ignite_zero.Checkpoint.load_objects>` reads it on any number of ranks,
    each rank reading only what it needs, and ``ignite-zero consolidate`` turns it into a single file.

    Durability: every file's CRC-32 is computed while it is written, DCP writes its ``.metadata`` last, and
    ``save_on_rank`` (the checkpoint's recipient) then seals the directory with a manifest of them; older checkpoints
    are removed only after that. How the directory appears whole is the storage's (see
    :meth:`Place.begin_directory <ignite_zero.storage.places.Place.begin_directory>`): locally the ranks write into a
    hidden temporary directory, flushed and renamed into place once sealed, so that a directory under a checkpoint's
    name is always complete; on an object store, which has no rename, they write into the checkpoint's own prefix,
    which is complete exactly when its manifest, written last, exists. Listings, loads and
    :func:`~ignite_zero.find_latest` take no unsealed prefix for a checkpoint, and the next save removes what an
    interrupted one left. Every rank must see the same ``dirname`` (a shared file system, or an object store), unless
    the checkpoints are replicated.

    Node-local disks (``replicas=k``): ``dirname`` is then a path that every host has, each on its own disk (a local
    NVMe). Each rank writes its files on its own host and, as it writes them, sends them over the process group to
    ``k`` ranks on ``k`` other hosts (the next ones in the order of their host names, the rank at the same position
    on each), which write them on theirs, checked against their size and CRC-32 before the seal. Once every rank's
    files and their ``k`` copies are durable, the first rank of every host seals its host's directory with the same
    manifest, and older checkpoints are removed on every host only after all of them did. A checkpoint then
    survives the loss of any ``k`` hosts. Loading reads from the rank's own host: a host that lacks files of the
    checkpoint (a host replaced by one with an empty disk, a job on other hosts or on fewer) first fetches them from
    the hosts that hold them, over the process group, so the load works on any number of ranks, from what survives;
    :func:`~ignite_zero.find_latest` takes the newest checkpoint whose every file verifies on at least one host. It
    costs ``k`` more copies of every byte on the disks and over the network: on 2 hosts of one rank sharing 2 cores
    (300 MB of ZeRO state, tmpfs, loopback, ``benchmarks/replicas.py``), a save with ``replicas=1`` took a median
    2.8x an unreplicated one (0.32 s against 0.12 s), a replaced host's recovery 3.3x a load from a shared
    directory. ``replicas`` must be below the number of hosts, and every host must run as many ranks; on a single
    host a warning says that each checkpoint is kept once. A directory that the hosts share is refused: use
    ``replicas=0`` there.

    Args:
        dirname: directory in which checkpoint directories are written: a path, or an fsspec URL
            (``s3://bucket/run``).
        create_dir: if True, create ``dirname`` when it does not exist.
        require_empty: if True, raise when ``dirname`` already holds ``.dcp`` checkpoints.
        save_on_rank: the rank that seals and removes checkpoints. ``None`` (default) lets
            :class:`~ignite_zero.Checkpoint` pick its ``consolidate_recipient_rank``; on its own, rank 0.
        thread_count: threads that write each rank's files.
        storage_options: options of the URL's file system (for S3: ``endpoint_url``, ``key``, ``secret``...),
            as fsspec takes them; for URLs only.
        replicas: copies of each rank's files on other hosts, for a ``dirname`` on node-local disks; 0 (default)
            for a directory that every rank shares.

    Examples:
        .. code-block:: python

            from ignite_zero import Checkpoint, ShardedSaver

            checkpoint = Checkpoint(to_save, ShardedSaver("ckpt", require_empty=False), n_saved=2)  # seen by all
            trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
            trainer.run(loader, max_epochs=3)
            # later, on any number of ranks:
            Checkpoint.load_objects(to_load=to_save, checkpoint="ckpt/checkpoint_3.dcp")

    .. versionadded:: 0.1.0
    """

    ext = "dcp"

    def __init__(
        self,
        dirname: str | Path | Place,
        create_dir: bool = True,
        require_empty: bool = True,
        save_on_rank: int | None = None,
        thread_count: int = 1,
        storage_options: Mapping[str, Any] | None = None,
        replicas: int = 0,
    ) -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"Argument `thread_count` should be a positive integer, got {thread_count!r}")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ValueError(f"Argument `replicas` should be a non-negative integer, got {replicas!r}")
        self.thread_count = thread_count
        self.replicas = replicas
        self._layout: replicas_.Layout | None = None  # the hosts of the ranks, learnt at the first replicated save
        self._async_writer: Any = None  # kept, with its host copies, between saves
        self._seen_by_every_rank = False  # whether a save found the directory shared by every rank yet
        self._planning: dict[str, SavePlanning] = {}  # DCP's plans of each stream's saves, kept between them
        super().__init__(dirname, create_dir, require_empty, save_on_rank, storage_options)

    @property
    def is_writer(self) -> bool:
        """Whether this process prepares, seals and removes checkpoints: ``save_on_rank``; with replicas, the first
        rank of each host, for its host's directory."""
        if self.replicas and self._layout is not None:
            return self._layout.leader(rank_and_world()[0]) == rank_and_world()[0]
        return super().is_writer

    def remove(self, filename: str) -> None:
        """Remove the checkpoint ``filename``; with replicas, every host's copy, and quietly where a host never held
        it (one replaced, or added, since it was saved)."""
        if self._layout is not None and self.is_writer and filename not in self.place.entries():
            return
        super().remove(filename)

    def list(self) -> list[str]:
        """Names of the complete checkpoints: on an object store, those sealed by their manifest."""
        return [name for name in super().list() if self.place.child(name).is_whole(sharded.MANIFEST)]

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        """Collective: save ``checkpoint`` (this rank's part of it) as the directory ``filename``."""
        self.save_state(checkpoint, filename)

    def save(self, objects: Any, request: SaveRequest) -> None:
        state = self._part(objects, request)
        if state is None:
            return
        self.save_state(
            state,
            request.filename,
            timeout=request.timeout,
            stream=request.stream,
            ranks=request.ranks,
        )
        self._remove_displaced(request)

    def stage(self, objects: Any, request: SaveRequest) -> Callable[[], None]:
        """Copy this rank's part into host memory kept for the next save; the returned work writes it and seals the
        directory."""
        state = self._part(objects, request)
        if state is None:
            return lambda: None
        finish = self.save_state_async(
            state,
            request.filename,
            group=cpu_group(dedicated=request.stream) if request.collective else None,
            timeout=request.timeout,
            stream=request.stream,
            ranks=request.ranks,
        )

        def work() -> None:
            finish()
            self._remove_displaced(request)

        return work

    def _part(self, objects: Any, request: SaveRequest) -> dict[str, Any] | None:
        """This rank's part of the checkpoint: sharded objects' own parts, and its share of the objects every rank
        holds; ``None`` when it writes nothing (a save of replicated state, written by the recipient alone)."""
        rank, world_size = rank_and_world()
        if request.collective and len(request.ranks) != world_size:
            raise ValueError(
                f"A sharded checkpoint is written by every rank, but the sharded objects of this save live on ranks "
                f"{list(request.ranks)} of {world_size}. Save them with a DiskSaver instead."
            )
        if not request.collective:
            if not request.is_recipient:
                return None
            rank, world_size = 0, 1

        def part(_: tree.Path, obj: Any) -> Any:
            if isinstance(obj, ShardedState):
                return obj.sharded_state_dict()
            return share(obj.state_dict(), rank, world_size, request.recipient if request.collective else 0)

        try:
            state = tree.map_tree(part, objects)
        except Exception as error:  # this rank's first round would be the preparation, where the others wait for it
            if request.collective:
                what = f"preparation of {request.filename}"
                settle(error, what=what, timeout=request.timeout, stream=request.stream, ranks=request.ranks)
            raise
        state = {} if state is tree.OMIT else state
        if request.is_recipient:
            state.update(request.extra)
        return state

    def _remove_displaced(self, request: SaveRequest) -> None:
        for filename in request.removed:
            self.remove(filename)

    def save_state(
        self,
        state: Mapping,
        filename: str,
        *,
        timeout: float = DEFAULT_SYNC_TIMEOUT,
        stream: str = "main",
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Collective: write every rank's ``state`` as the checkpoint directory ``filename``, and seal it.

        Args:
            state: this rank's part: plain tensors and values, ``DTensor``s and ``ShardedTensor``s.
            filename: name of the directory.
            timeout: seconds ranks wait for each other around the write.
            stream: stream of agreement rounds (see :func:`ignite_zero.agreement.agree`).
            ranks: the ranks that write; one rank alone writes the whole directory without collectives.
        """
        state = as_saved(state)
        writer, planning = self._begin(state, filename, timeout, stream, ranks, cache=False)
        relay = self._relay(writer, timeout, stream)
        started = time.perf_counter()
        wrote = self._write(planning, writer)
        # files sent once written go over the relays' group: a wait there that times out closes its connections for
        # good, which must not be the group of every rank (the default one, in a gloo job)
        layout = self._layout
        replicas_group = self._replicas_group(stream) if layout and layout.replicas and relay is None else None
        self._commit(filename, writer, planning, wrote, timeout, stream, ranks, started, replicas_group, relay)

    def save_state_async(
        self, state: Mapping, filename: str, *, group: Any, timeout: float, stream: str, ranks: Sequence[int] | None
    ) -> Callable[[], None]:
        """Collective: plan the save and stage this rank's ``state`` into host memory (what blocks); return the
        function that writes it and seals the directory, to run in another thread.

        The host copies are kept for the next save; ``group`` is the gloo group that replicas travel over, one of
        the stream's own (see :func:`ignite_zero.transport.groups.cpu_group`), since they travel beside training.
        """
        state = as_saved(state)
        writer, planning = self._begin(state, filename, timeout, stream, ranks, cache=True)
        started = time.perf_counter()
        staged: Mapping[str, Any] | Exception
        try:
            staged = writer.stage(state)
        except Exception as error:  # e.g. no host memory left: reported with the writes, so that no rank waits for it
            staged = error
        planning.release()  # the write reads the host copies: the state itself may change meanwhile

        def finish() -> None:
            wrote = staged if isinstance(staged, Exception) else self._write(planning, writer, staged)
            self._commit(filename, writer, planning, wrote, timeout, stream, ranks, started, group)

        return finish

    @staticmethod
    def _write(
        planning: SavePlanning, writer: Any, staged: Mapping[str, Any] | None = None
    ) -> Sequence[Any] | Exception:
        """This rank's files, as planned: DCP's write results, or the failure to share in the next round."""
        try:
            return planning.write(writer, staged)
        except Exception as error:
            return error
        finally:
            planning.release()

    def _begin(
        self, state: Mapping, filename: str, timeout: float, stream: str, ranks: Sequence[int] | None, cache: bool
    ) -> tuple[Any, SavePlanning]:
        """Collective: the writing rank clears what an interrupted save left and makes the directory the ranks write
        into; every rank learns whether the parts of all ranks fit on the disk, and DCP's plans of the save are agreed.
        Returns this rank's DCP writer and the stream's planning."""
        check_filename(filename)
        if self.replicas and self._layout is None:
            self._arrange(filename, timeout, stream, ranks)
        target = self.place.writing_directory(filename)
        # where the first save leaves its probe: where the ranks write, or beside it for replicas, where every host's
        # first rank clears what interrupted saves left in a directory that may turn out to be one for all
        probed = self.place if self._layout is not None else target
        if not cache:
            writer = sharded.writer_for(target, self.thread_count)
        else:  # one writer for every asynchronous save: its host copies are reused
            if self._async_writer is None:
                self._async_writer = sharded.writer_for(target, self.thread_count, cache_staged_state_dict=True)
            writer = self._async_writer
            writer.reset(target.location())
        writer.written.clear()
        planning = self._planning.setdefault(stream, SavePlanning())
        failure, free, probe, offer = None, None, None, None
        try:
            offer = planning.offer(state, writer, round_members(ranks), rank_and_world()[0])
        except Exception as error:  # a state DCP cannot plan: the others wait for this rank's report
            failure = error
        if self.is_writer and failure is None:
            try:
                self._prepare()
                self._remove_temporaries()
                self.place.begin_directory(filename)
                if not self._seen_by_every_rank and len(round_members(ranks)) > 1 and self._probes(ranks):
                    token = secrets.token_hex(16)
                    # not through a temporary name: in a directory the hosts share (what the probe finds out), another
                    # host's first rank clears temporary files there as this one writes, and took the probe's
                    probed.write(_PROBE, lambda f: f.write(token.encode()), atomic=False)
                    probe = token
                free = self.place.free_space()
            except Exception as error:
                failure = error
        # an upper estimate: objects that every rank holds are counted on each, though written once
        reports = settle(
            failure,
            what=f"preparation of {filename}",
            timeout=timeout,
            stream=stream,
            payload=(serialized_size(state), free, probe, offer),
            ranks=ranks,
        )
        probe = next((token for _, _, token, _ in reports if token is not None), None)
        if probe is not None:
            self._check_seen_by_every_rank(probed, probe, filename, timeout, stream, ranks)
        self._check_room(filename, reports, ranks)
        if not planning.agree([offer for _, _, _, offer in reports], writer):  # plans kept from different agreements
            offers = settle(
                None,
                what=f"planning of {filename}",
                timeout=timeout,
                stream=stream,
                payload=planning.full_offer(),
                ranks=ranks,
            )
            planning.agree(offers, writer)
        return writer, planning

    def _relay(self, writer: Any, timeout: float, stream: str) -> replicas_.Relay | None:
        """Collective, in a synchronous replicated save: make ``writer`` write through a relay that sends this rank's
        files to its partners as they are written, and writes its sources' files here meanwhile.

        ``None`` (the files are sent once written, by :meth:`_replicate`) without replicas, and where a relay does not
        fit: in an asynchronous save, whose staging may fail on one rank after the others began to relay (their
        partners would wait for files that never come), and with several writing threads (a relay carries one file at
        a time)."""
        layout = self._layout
        if layout is None or not layout.replicas or self.thread_count > 1:
            return None
        rank = rank_and_world()[0]
        sources = [source for source in layout.members if rank in layout.partners(source)]
        relay = replicas_.Relay(writer.place, layout.partners(rank), sources, self._replicas_group(stream), timeout)
        writer.reset(relay.place)
        return relay

    def _replicas_group(self, stream: str) -> Any:
        """The gloo group that replicas travel over in a synchronous save, apart from the default group; a new one
        after a save whose replication failed, since a gloo wait that timed out closes its connections for good."""
        return cpu_group(dedicated=_replicas_use(stream))

    def _arrange(self, filename: str, timeout: float, stream: str, ranks: Sequence[int] | None) -> None:
        """Collective, at the first replicated save: learn the host of every rank, and so which ranks keep whose
        files; bad settings raise here, on every rank alike."""
        members = round_members(ranks)
        hosts = settle(
            None,
            what=f"preparation of {filename} (hosts)",
            timeout=timeout,
            stream=stream,
            payload=socket.gethostname(),
            ranks=ranks,
        )
        self._layout = replicas_.layout_of(members, hosts, self.replicas, self.dirname)
        self._prepared = False  # every host's first rank checks its own directory

    def _probes(self, ranks: Sequence[int] | None) -> bool:
        """Whether this rank leaves the probe of the first save: the writing rank; with replicas, the first rank."""
        if self._layout is None:
            return True
        return rank_and_world()[0] == round_members(ranks)[0] and len(self._layout.host_names) > 1

    def _check_room(
        self, filename: str, reports: Sequence[tuple[int, int | None, Any, Any]], ranks: Sequence[int] | None
    ) -> None:
        """Every rank learns whether the parts of all ranks fit on the disk of the writing rank; with replicas, on
        each host's disk, the parts it keeps."""
        sizes = dict(zip(round_members(ranks), (size for size, _, _, _ in reports)))
        free = dict(zip(round_members(ranks), (space for _, space, _, _ in reports)))
        if self._layout is None:
            space = next((space for space in free.values() if space is not None), None)
            check_room(self.place, filename, sum(sizes.values()), space, needs="its parts need up to")
            return
        for host in self._layout.host_names:
            leader = self._layout.ranks_on(host)[0]
            needed = sum(sizes[rank] for rank in self._layout.kept_on(host))
            check_room(self.place, filename, needed, free[leader], needs=f"the parts that host {host} keeps need up to")

    def _check_seen_by_every_rank(
        self, target: Place, probe: str, filename: str, timeout: float, stream: str, ranks: Sequence[int] | None
    ) -> None:
        """Collective, at the first save: every rank reads the probe that the writing rank left where they are about
        to write, so that a directory the ranks do not share fails the job's first save, not its first resume. With
        replicas, the other way round: the ranks of other hosts must not see it."""
        members = round_members(ranks)
        prober = members[0] if self._layout is not None else self.save_on_rank
        here = rank_and_world()[0]
        failure, sees = None, True
        if here != prober:
            try:
                sees = target.read(_PROBE) == probe.encode()
            except FileNotFoundError:
                sees = False
            except Exception as error:  # e.g. a directory this rank may not read: a failure of its own
                failure = error
        try:
            seen = settle(
                failure,
                what=f"check of {filename}'s directory",
                timeout=timeout,
                stream=stream,
                payload=sees,
                ranks=ranks,
            )
        finally:
            if here == prober:
                target.remove(_PROBE, recursive=False)
        if self._layout is None:
            blind = [rank for rank, sees in zip(members, seen) if not sees]
            if blind:
                raise self._not_shared(filename, blind, f"ranks {blind} cannot see what rank {prober} wrote")
        else:
            host = self._layout.host_of(prober)
            elsewhere = [rank for rank, sees in zip(members, seen) if sees and self._layout.host_of(rank) != host]
            if elsewhere:
                raise self._shared(filename, elsewhere, prober)
        self._seen_by_every_rank = True

    def _check_every_part_is_there(
        self, written: Place, filename: str, files: Sequence[Mapping[str, tuple[int, int]]], members: Sequence[int]
    ) -> None:
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
            detail = f"rank {self.save_on_rank} cannot see the files that ranks {blind} wrote"
            raise self._not_shared(filename, blind, detail)

    def _shared(self, filename: str, seers: Sequence[int], prober: int) -> ValueError:
        return ValueError(
            f"The replicated checkpoint {self.place.location(filename)} cannot be saved: the directory {self.dirname} "
            f"is shared by the hosts (ranks {list(seers)}, on other hosts than rank {prober}, see what it wrote "
            f"there), while `replicas={self.replicas}` keeps each rank's files on the node-local disk of its own host "
            f"and of {self.replicas} others. For a directory that every rank shares, pass `replicas=0`: the storage "
            "keeps the checkpoint whole. Nothing was sealed; earlier checkpoints are kept."
        )

    def _not_shared(self, filename: str, blind: Sequence[int], detail: str) -> ValueError:
        return ValueError(
            f"The sharded checkpoint {self.place.location(filename)} cannot be saved: the directory {self.dirname} is "
            f"not shared by every rank ({detail}). A sharded checkpoint is one directory that every rank writes its "
            "part into: give ShardedSaver a directory that every rank shares, on a shared file system or an object "
            "store (s3://...), or save single files with a DiskSaver, which only the recipient writes (node-local "
            "disks too). Nothing was sealed; earlier checkpoints are kept."
        )

    def _commit(
        self,
        filename: str,
        writer: Any,
        planning: SavePlanning,
        wrote: Sequence[Any] | Exception,
        timeout: float,
        stream: str,
        ranks: Sequence[int] | None,
        started: float,
        group: Any = None,
        relay: replicas_.Relay | None = None,
    ) -> None:
        """Collective, once this rank wrote its files (``wrote``: DCP's results, or the failure): every rank's results
        to the coordinator, which writes ``.metadata``; then every rank's files to the writing rank, which seals the
        directory and puts it in place. With replicas, each rank's files also go to its partners on other hosts
        (through ``relay`` as they were written, else now), then every host's first rank seals its host's directory,
        and every rank learns that all of them did."""
        failure: BaseException | None = wrote if isinstance(wrote, Exception) else None
        results: Sequence[Any] = [] if isinstance(wrote, Exception) else wrote
        outcome: BaseException | None = None  # a failure every rank learnt in the round of results
        members = round_members(ranks)
        try:
            every_rank = settle(
                failure,
                what=f"writing of {filename}",
                timeout=timeout,
                payload=results,
                stream=stream,
                ranks=ranks,
                to=members[0],
            )
            if planning.is_coordinator:  # the first member; through the relay too, like any file
                planning.finish(writer, every_rank)
        except (RankFailureError, CollectiveTimeoutError) as error:
            outcome = error
        except Exception as error:  # the coordinator's .metadata; a lone rank's own failure, which settle raises
            failure = error
        received: dict[str, tuple[int, int]] = {}
        if relay is not None:
            try:
                received = relay.finish()
            except Exception as error:
                failure = failure if failure is not None else error
        if outcome is not None:
            if relay is not None:
                discard_group(_replicas_use(stream))
            raise outcome
        # without replicas, only the writing rank needs every rank's files (with replicas, every rank checks them)
        sealer = self.save_on_rank if self._layout is None and self.save_on_rank in members else None
        try:
            reports = settle(
                failure,
                what=f"sharded save of {filename}",
                timeout=timeout,
                payload=(dict(writer.written), dict(writer.records), received),
                stream=stream,
                ranks=ranks,
                to=sealer,
            )
        except Exception:
            if relay is not None:  # raised on every rank alike
                discard_group(_replicas_use(stream))
            raise
        files = [written for written, _, _ in reports]
        records = {name: entries for _, rank_records, _ in reports for name, entries in rank_records.items()}
        by_rank = dict(zip(round_members(ranks), files))
        written = self.place.writing_directory(filename)
        layout = self._layout
        if layout is not None and relay is not None:  # the same verdict on every rank, from the same reports
            arrived = dict(zip(round_members(ranks), (received for _, _, received in reports)))
            replicas_.check_arrived(layout, by_rank, arrived, self.place.location(filename))
        elif layout is not None:
            try:
                self._replicate(filename, by_rank, written, group, timeout, stream, ranks)
            except Exception:  # raised on every rank alike
                discard_group(_replicas_use(stream))
                raise
        failure = None
        if self.is_writer:
            try:
                self._seal(filename, by_rank, records, written)
            except Exception as error:
                if layout is None:
                    raise
                failure = error
        if layout is not None:  # older checkpoints go only once every host holds the new one
            settle(failure, what=f"commit of {filename} on every host", timeout=timeout, stream=stream, ranks=ranks)
        if self.is_writer:
            listed = [record for rank_files in files for record in rank_files.values()]
            logger.info(
                "Saved %s (%.1f MB, %d files, %d replicas) in %.2f s",
                self.place.location(filename),
                sum(size for size, _ in listed) / 1e6,
                len(listed),
                0 if layout is None else layout.replicas,
                time.perf_counter() - started,
            )

    def _replicate(
        self,
        filename: str,
        by_rank: Mapping[int, Mapping[str, tuple[int, int]]],
        written: Place,
        group: Any,
        timeout: float,
        stream: str,
        ranks: Sequence[int] | None,
    ) -> None:
        """Collective, once the files are written (where no relay sent them as they were): every rank sends its files to
        its partners on other hosts, which write them into their host's directory; every rank learns whether all
        arrived whole."""
        layout = self._layout
        assert layout is not None
        transfers = [
            replicas_.Transfer(source, target, name, size, crc)
            for source, files in by_rank.items()
            for target in layout.partners(source)
            for name, (size, crc) in sorted(files.items())
        ]
        if not transfers:
            return
        failure = None
        try:
            replicas_.exchange(transfers, written, written, cpu_group() if group is None else group, timeout)
        except Exception as error:
            failure = error
        settle(failure, what=f"replication of {filename}", timeout=timeout, stream=stream, ranks=ranks)

    def _seal(
        self,
        filename: str,
        by_rank: Mapping[int, Mapping[str, tuple[int, int]]],
        records: Mapping[str, Any],
        written: Place,
    ) -> None:
        """On the writing rank (with replicas, each host's first): check that the files its directory keeps are
        there, and seal it with the manifest of every file."""
        layout = self._layout
        kept = list(by_rank) if layout is None else layout.kept_on(layout.host_of(rank_and_world()[0]))
        self._check_every_part_is_there(written, filename, [by_rank[rank] for rank in kept], kept)
        listed = {name: record for rank_files in by_rank.values() for name, record in rank_files.items()}
        facts = {"world_size": len(by_rank), "torch": torch.__version__, "ignite_zero": package_version()}
        if layout is not None:
            facts.update(replicas_.manifest_facts(layout, by_rank))
        self.place.commit_directory(filename, lambda written: sharded.seal(written, listed, records, **facts))


def share(state: Any, rank: int, world_size: int, keeper: int) -> Any:
    """This rank's share of a state that every rank holds alike (a DDP model, a trainer): its tensors are dealt over
    the ranks, each to the rank with the fewest bytes dealt so far; everything else is kept by ``keeper``.

    Every rank then writes, and an asynchronous save stages, about ``1/world_size`` of the bytes of such objects
    instead of all of them. Dealt by size, not in turn: a model of linear layers dealt in turn over 2 ranks gives one
    rank every weight and the other every bias (12 x ``Linear(2048, 2048)``: 201 MB against 98 KB), and the save
    waits for the first. Lists holding tensors stay whole with ``keeper`` (their positions are part of the names).

    Returns:
        The share, :data:`ignite_zero.tree.OMIT` in place of what this rank does not keep.
    """
    dealt = [0] * world_size

    def deal(_: tree.Path, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            to = dealt.index(min(dealt))
            dealt[to] += value.numel() * value.element_size()
            return value if to == rank else tree.OMIT
        return value if rank == keeper else tree.OMIT

    def whole(value: Any) -> bool:  # only mappings that hold tensors are dealt item by item
        return not (
            isinstance(value, Mapping) and any(isinstance(leaf, torch.Tensor) for _, leaf in tree.leaves(value))
        )

    return tree.map_tree(deal, state, is_leaf=whole)


def _replicas_use(stream: str) -> str:
    return f"{stream}|replicas"
