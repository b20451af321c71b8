"""Sharded checkpoints: :class:`ShardedSaver`, every rank writing its own part of a checkpoint directory through
``torch.distributed.checkpoint``, checksummed while written (:mod:`ignite_zero.storage.formats.directory`), then
sealed by one rank: renamed into place on a local file system, committed by its manifest on an object store."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ignite_zero import tree
from ignite_zero.adapters import ShardedState
from ignite_zero.agreement import DEFAULT_SYNC_TIMEOUT, rank_and_world, settle
from ignite_zero.naming import check_filename
from ignite_zero.storage import replicas as replicas_
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats.dcp_plans import as_saved
from ignite_zero.storage.places import Place
from ignite_zero.storage.savers.base import SaveRequest
from ignite_zero.storage.savers.destination import DirectorySaver
from ignite_zero.storage.savers.sharded_commit import KeptBetweenSaves, ShardedCommit
from ignite_zero.transport.groups import cpu_group

__all__ = ["ShardedSaver", "share"]


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
    costs ``k`` more copies of every byte on the disks and over the network, so a replicated save, and a replaced
    host's recovery, take a few times an unreplicated save or a load from a shared directory (see
    :doc:`the benchmarks page </benchmarks>`). ``replicas`` must be below the number of hosts, and every host must
    run as many ranks; on a single host a warning says that each checkpoint is kept once. A directory that the hosts
    share is refused: use ``replicas=0`` there.

    Args:
        dirname: directory in which checkpoint directories are written: a path, or an fsspec URL
            (``s3://bucket/run``).
        create_dir: if True, create ``dirname`` when it does not exist.
        require_empty: if True, raise when ``dirname`` already holds ``.dcp`` checkpoints,
            unless :meth:`Checkpoint.load_latest <ignite_zero.Checkpoint.load_latest>` resumed from them.
        save_on_rank: the rank that seals and removes checkpoints. ``None`` (default) lets
            :class:`~ignite_zero.Checkpoint` pick its ``consolidate_recipient_rank``; on its own, rank 0.
        thread_count: threads that write each rank's files.
        storage_options: options of the URL's file system (for S3: ``endpoint_url``, ``key``, ``secret``...),
            as fsspec takes them; for URLs only.
        replicas: copies of each rank's files on other hosts, for a ``dirname`` on node-local disks; 0 (default)
            for a directory that every rank shares.
        defer_require_empty: if True, ``require_empty`` is checked by
            :meth:`Checkpoint.load_latest <ignite_zero.Checkpoint.load_latest>`, after it allowed the checkpoints
            it resumed from, or else by the first save; not when the saver is made.

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
        *,
        defer_require_empty: bool = False,
    ) -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"Argument `thread_count` should be a positive integer, got {thread_count!r}")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ValueError(f"Argument `replicas` should be a non-negative integer, got {replicas!r}")
        self.thread_count = thread_count
        self.replicas = replicas
        #: what the commits of this saver keep from one save to the next (the hosts of the ranks, DCP's plans...)
        self.kept = KeptBetweenSaves()
        super().__init__(
            dirname, create_dir, require_empty, save_on_rank, storage_options, defer_require_empty=defer_require_empty
        )

    @property
    def is_writer(self) -> bool:
        """Whether this process prepares, seals and removes checkpoints: ``save_on_rank``; with replicas, the first
        rank of each host, for its host's directory."""
        replica_hosts = self.kept.replica_hosts
        if self.replicas and replica_hosts is not None:
            return replica_hosts.leader(rank_and_world()[0]) == rank_and_world()[0]
        return super().is_writer

    def remove(self, filename: str) -> None:
        """Remove the checkpoint ``filename``; with replicas, every host's copy, and quietly where a host never held
        it (one replaced, or added, since it was saved)."""
        if self.kept.replica_hosts is not None and self.is_writer and filename not in self.place.entries():
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
        check_filename(filename)
        commit = ShardedCommit(self, filename, timeout=timeout, stream=stream, ranks=ranks)
        with self.writing(filename):
            commit.prepare(state)
            commit.relay()
            wrote = commit.write()
            commit.finish(wrote, commit.group_after_write())

    def save_state_async(
        self, state: Mapping, filename: str, *, group: Any, timeout: float, stream: str, ranks: Sequence[int] | None
    ) -> Callable[[], None]:
        """Collective: plan the save and stage this rank's ``state`` into host memory (what blocks); return the
        function that writes it and seals the directory, to run in another thread.

        The host copies are kept for the next save; ``group`` is the gloo group that replicas travel over, one of
        the stream's own (see :func:`ignite_zero.transport.groups.cpu_group`), since they travel beside training.
        """
        state = as_saved(state)
        check_filename(filename)
        commit = ShardedCommit(self, filename, timeout=timeout, stream=stream, ranks=ranks)
        writing = contextlib.ExitStack()
        writing.enter_context(self.writing(filename))  # until the write in the background ends
        try:
            commit.prepare(state)
            staged = commit.stage()
        except BaseException:
            writing.close()
            raise

        def finish() -> None:
            with writing:
                commit.finish(staged if isinstance(staged, Exception) else commit.write(staged), group)

        return finish

    def prepare_directory(self, filename: str) -> None:
        """On the writing rank of a save (with replicas, each host's first): check the directory, clear what
        interrupted saves left, and begin the directory ``filename``."""
        self._prepare()
        self._remove_temporaries()
        self.place.begin_directory(filename)

    def use_replica_hosts(self, replica_hosts: replicas_.ReplicaHosts) -> None:
        """Keep the hosts of the ranks learnt at the first replicated save; every host's first rank then checks its
        own directory."""
        self.kept.replica_hosts = replica_hosts
        self._prepared = False


def share(state: Any, rank: int, world_size: int, keeper: int) -> Any:
    """This rank's share of a state that every rank holds alike (a DDP model, a trainer): its tensors are dealt over
    the ranks, each to the rank with the fewest bytes dealt so far; everything else is kept by ``keeper``.

    Every rank then writes, and an asynchronous save stages, about ``1/world_size`` of the bytes of such objects
    instead of all of them. Dealt by size, not in turn: a model of linear layers dealt in turn over 2 ranks gives one
    rank every weight and the other every bias, and the save waits for the first. Lists holding tensors stay whole
    with ``keeper`` (their positions are part of the names).

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
