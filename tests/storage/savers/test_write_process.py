"""The process that writes asynchronous saves: it writes the very bytes a thread writes, from host copies it maps
(a sharded save's files, a consolidated checkpoint of many plain entries), raises the write's own errors and ends with
its parent (not with a forked child); a file whose helper died is written by the thread, and the next write starts
another helper; where none can start, threads write every file."""

import collections
import errno
import logging
import os
import signal
import sys
import time

import pytest
import torch
from ignite.engine import Engine
from launcher import run_ranks
from torch.distributed.fsdp import fully_shard

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver
from ignite_zero.staging import HostBuffers, makes_shared_blocks
from ignite_zero.storage.formats import torch_zip
from ignite_zero.storage.formats.dcp_files import write_entries
from ignite_zero.storage.formats.directory import verify
from ignite_zero.storage.formats.file_trailer import write_sealed
from ignite_zero.storage.places import LocalPlace
from ignite_zero.storage.savers.write_process import WriteProcess, shared_copy


def _tensors():
    generator = torch.Generator().manual_seed(0)
    return [
        torch.tensor(3.5),  # a scalar, as Adam's step
        torch.zeros(0, 4),
        torch.rand(5, 7, generator=generator) > 0.5,
        torch.randn(3, 9, generator=generator).to(torch.bfloat16),
        torch.arange(11, dtype=torch.int64),
        torch.randn(512, 1024, generator=generator),  # 2 MiB: written straight from its memory
        *(torch.randn(8, 8, generator=generator) for _ in range(1500)),  # small ones, in batches
        torch.randn(6, 4, generator=generator).t(),  # not contiguous: copied contiguous
    ]


def _place(path):
    place = LocalPlace(path)
    place.make()
    return place


class _EndsTheHelper(LocalPlace):
    """A place whose unpickling ends the process that receives it: the helper dies while it takes a write."""

    def __reduce__(self):
        return os._exit, (3,)


def test_the_helper_writes_the_bytes_a_thread_writes(tmp_path, caplog):
    buffers = HostBuffers()
    entries = [b"a value's pickled bytes", *buffers.copy(_tensors()), b"another"]
    assert buffers.block is not None
    process = WriteProcess()
    assert process.pid is None
    by_helper = process.write(_place(tmp_path / "helper"), "__0_0.distcp", entries, buffers.block)
    assert process.pid is not None and process.pid != os.getpid()
    by_thread = write_entries(_place(tmp_path / "thread"), "__0_0.distcp", entries)
    assert by_helper[:2] == by_thread[:2] and by_helper.records.tolist() == by_thread.records.tolist()
    assert len(by_helper.records) == len(entries)
    assert (tmp_path / "helper" / "__0_0.distcp").read_bytes() == (tmp_path / "thread" / "__0_0.distcp").read_bytes()

    # the write's own error, raised here; the helper goes on
    helper = process.pid
    with pytest.raises(FileNotFoundError):
        process.write(LocalPlace(tmp_path / "nowhere"), "__0_0.distcp", entries, buffers.block)
    assert process.pid == helper

    # other entries of the same block, in another order: described afresh, not as the last file's
    for number, part in enumerate([entries[::2], entries[::-1], entries[::2]]):
        process.write(_place(tmp_path / f"part{number}"), "p", part, buffers.block)
        write_entries(_place(tmp_path / f"reference{number}"), "p", part)
        assert (tmp_path / f"part{number}" / "p").read_bytes() == (tmp_path / f"reference{number}" / "p").read_bytes()

    # another layout: another block, which the same helper maps
    old_block = buffers.block
    copies = buffers.copy([torch.full((3,), 2.0), torch.ones(2, 2, dtype=torch.float64)])
    assert buffers.block is not old_block
    process.write(_place(tmp_path / "again"), "f", copies, buffers.block)
    assert process.pid == helper
    write_entries(_place(tmp_path / "reference"), "f", copies)
    assert (tmp_path / "again" / "f").read_bytes() == (tmp_path / "reference" / "f").read_bytes()

    # a data loader's worker forked now holds no end of the helper's connection: the helper ends when its parent
    # lets it go (it exits, rather than being killed after a wait), not when the worker does
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    try:
        started = time.monotonic()
        assert process.close() == 0 and time.monotonic() - started < 5
        assert process.pid is None
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    process.write(_place(tmp_path / "again"), "f2", copies, buffers.block)
    helper = process.pid

    # a helper that dies in a write leaves that file to the thread, and the next write starts another
    with caplog.at_level(logging.WARNING, logger="ignite_zero.storage.savers.write_process"):
        process.write(_EndsTheHelper(tmp_path / "again"), "g", copies, buffers.block)
    assert (
        "ended (exit code 3) while it was to write g" in caplog.text and "the next save starts another" in caplog.text
    )
    assert (tmp_path / "again" / "g").read_bytes() == (tmp_path / "again" / "f").read_bytes()
    assert process.pid is None
    process.write(_place(tmp_path / "again"), "h", copies, buffers.block)
    assert process.pid not in (None, helper)
    assert (tmp_path / "again" / "h").read_bytes() == (tmp_path / "again" / "f").read_bytes()


def test_where_no_helper_can_start_threads_write_every_file(tmp_path, monkeypatch, caplog):
    buffers = HostBuffers()
    copies = buffers.copy([torch.arange(6.0), torch.ones(3, dtype=torch.int32)])
    process = WriteProcess()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with caplog.at_level(logging.WARNING, logger="ignite_zero.storage.savers.write_process"):
        process.write(_place(tmp_path / "a"), "f", copies, buffers.block)
    assert "its first file" in caplog.text and "threads write every file" in caplog.text
    monkeypatch.undo()  # an interpreter to start again: still none is, once one could not write its first file
    process.write(_place(tmp_path / "a"), "g", copies, buffers.block)
    assert process.pid is None
    write_entries(_place(tmp_path / "reference"), "f", copies)
    for name in ("f", "g"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "reference" / "f").read_bytes()


def _fsdp2_objects(rank):
    torch.manual_seed(0)
    # 50 layers in one unit: about 350 entries a rank, enough for the helper (a smaller part is written by a thread)
    model = fully_shard(torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(50))))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def _saved(handler, engine, iteration):
    """``handler``'s asynchronous save at ``iteration``, once durable."""
    engine.state.iteration = iteration
    handler(engine)
    handler.wait()


def _async_saves(rank, world_size, dirname):
    objects = _fsdp2_objects(rank)
    engine = Engine(lambda e, b: None)
    background = Checkpoint(objects, ShardedSaver(dirname / "async"), n_saved=None, async_save=True)
    helpers = []
    for iteration in (1, 2):
        _saved(background, engine, iteration)
        helpers.append(background.save_handler.kept.write_process.pid)
        if rank == 1 and iteration == 1:  # a helper that died between saves is replaced
            os.kill(helpers[0], signal.SIGKILL)
            os.waitid(os.P_PID, helpers[0], os.WEXITED | os.WNOWAIT)
    Checkpoint(objects, ShardedSaver(dirname / "sync"))(engine)
    # a small part is written by a thread in milliseconds: no helper for it
    small = Checkpoint({"head": torch.nn.Linear(4, 4)}, ShardedSaver(dirname / "small"), async_save=True)
    small(engine)
    small.wait()
    assert small.save_handler.kept.write_process.pid is None
    return helpers


@pytest.mark.distributed
def test_asynchronous_sharded_saves_are_written_by_a_helper_as_a_synchronous_save(tmp_path):
    helpers = run_ranks(_async_saves, 2, tmp_path)
    assert all(pid is not None and pid != os.getpid() for pids in helpers for pid in pids)
    assert helpers[0][0] == helpers[0][1] and helpers[1][0] != helpers[1][1]
    for name in ("checkpoint_1.dcp", "checkpoint_2.dcp"):
        verify(tmp_path / "async" / name)
    for data in ("__0_0.distcp", "__1_0.distcp"):
        synchronous = (tmp_path / "sync" / "checkpoint_2.dcp" / data).read_bytes()
        assert (tmp_path / "async" / "checkpoint_2.dcp" / data).read_bytes() == synchronous


def test_where_the_system_makes_no_memfd_the_copies_are_private(monkeypatch):
    def refused(*args):
        raise OSError(errno.ENOSYS, "Function not implemented")  # a kernel before 3.17, or a sandbox

    monkeypatch.setattr(os, "memfd_create", refused)
    buffers = HostBuffers()
    tensors = [torch.arange(5.0), torch.ones(2, 3, dtype=torch.int8)]
    copies = buffers.copy(tensors)
    assert buffers.block is None
    assert all(torch.equal(copy, tensor) for copy, tensor in zip(copies, tensors))


def _checkpoint():
    generator = torch.Generator().manual_seed(1)
    return {
        "model": collections.OrderedDict(
            (f"layers.{n}.weight", torch.randn(8, 8, generator=generator)) for n in range(300)
        ),
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(0, 4)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "large": torch.randn(512, 1024, generator=generator),  # written straight from its memory
        "misc": [torch.Size([2, 3]), torch.float16, torch.device("cpu"), b"bytes", 1 + 2j, "name"],
    }


def test_the_helper_writes_a_consolidated_file_as_the_thread_does(tmp_path, caplog):
    checkpoint = _checkpoint()
    shared = shared_copy(checkpoint, HostBuffers(), lambda: None)
    assert shared is not None and len(shared.tensors) == 303
    facts = {"world_size": 1, "torch": torch.__version__}
    process = WriteProcess()
    assert process.write_archive(
        _place(tmp_path / "helper"), "c.pt", shared, atomic=True, pickle_protocol=2, facts=facts
    )
    assert process.pid is not None and process.pid != os.getpid()

    def archive(stream):
        torch_zip.write_archive(stream, checkpoint, pickle_protocol=2)

    _place(tmp_path / "thread").write("c.pt", lambda f: write_sealed(f, archive, facts))
    assert (tmp_path / "helper" / "c.pt").read_bytes() == (tmp_path / "thread" / "c.pt").read_bytes()
    loaded = torch.load(tmp_path / "helper" / "c.pt")
    assert torch.equal(loaded["large"], checkpoint["large"]) and loaded["misc"] == checkpoint["misc"]
    # its size, estimated for the check of the free space, is an upper bound: here, and for many tiny tensors
    assert (tmp_path / "helper" / "c.pt").stat().st_size <= shared.serialized_size
    tiny = shared_copy(
        {f"step of parameter {n}": torch.tensor(float(n)) for n in range(300)}, HostBuffers(), lambda: None
    )
    process.write_archive(_place(tmp_path / "tiny"), "c.pt", tiny, atomic=True, pickle_protocol=2, facts=facts)
    assert (tmp_path / "tiny" / "c.pt").stat().st_size <= tiny.serialized_size

    # the write's own error, raised here; the helper goes on
    helper = process.pid
    with pytest.raises(FileNotFoundError):
        process.write_archive(
            LocalPlace(tmp_path / "nowhere"), "c.pt", shared, atomic=True, pickle_protocol=2, facts=facts
        )
    assert process.pid == helper

    # a helper that dies in a write leaves the file to the caller
    with caplog.at_level(logging.WARNING, logger="ignite_zero.storage.savers.write_process"):
        written = process.write_archive(
            _EndsTheHelper(tmp_path), "c.pt", shared, atomic=True, pickle_protocol=2, facts=facts
        )
    assert not written and "ended (exit code 3) while it was to write c.pt" in caplog.text
    assert process.pid is None


def _never():
    raise AssertionError("a checkpoint the helper does not write is not made to arrive whole")


class _Opaque:
    """An object of the user's own class, which the helper would have to import."""


def test_only_plain_checkpoints_of_many_entries_are_copied_for_the_helper(monkeypatch):
    buffers = HostBuffers()
    assert shared_copy(_checkpoint(), buffers, lambda: None) is not None
    weight = torch.randn(4, 4)
    for refused in (
        {"user object": _Opaque()},
        {"learning": torch.randn(2, requires_grad=True)},
        {"parameter": torch.nn.Parameter(torch.randn(2), requires_grad=False)},
        {"view": torch.randn(4, 4)[1]},
        {"transposed": torch.randn(4, 3).t()},
        {"strides of its own": torch.randn(1, 4).t()},  # contiguous, but torch.save keeps strides (1, 4)
        {"same memory": [weight, weight.view(16)]},
    ):
        assert shared_copy({**_checkpoint(), **refused}, buffers, _never) is None, refused
    assert shared_copy({"few": [torch.randn(3) for _ in range(10)]}, buffers, _never) is None  # a thread's milliseconds
    monkeypatch.setattr("ignite_zero.storage.savers.write_process.ARCHIVE_BYTES", 1 << 20)
    assert shared_copy(_checkpoint(), buffers, _never) is None  # larger: written as its bytes arrive, never held whole


def test_where_the_system_makes_no_shared_block_nothing_is_copied(monkeypatch):
    def refused(*args):
        raise OSError(errno.ENOSYS, "Function not implemented")

    makes_shared_blocks.cache_clear()
    monkeypatch.setattr(os, "memfd_create", refused)
    try:
        assert shared_copy(_checkpoint(), HostBuffers(), _never) is None  # the state is written as it arrives
    finally:
        monkeypatch.undo()
        makes_shared_blocks.cache_clear()
    assert makes_shared_blocks()


def _model_and_optimizer(layers=40):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(layers)))  # 80 tensors, and Adam's 240
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def test_asynchronous_consolidated_saves_are_written_by_a_helper_as_a_synchronous_save(tmp_path, caplog):
    objects = _model_and_optimizer()
    engine = Engine(lambda e, b: None)
    background = Checkpoint(objects, DiskSaver(tmp_path / "async"), n_saved=None, async_save=True)
    helpers = []
    for iteration in (1, 2):
        _saved(background, engine, iteration)
        helpers.append(background.save_handler._write_process.pid)
    assert helpers[0] is not None and helpers[0] == helpers[1] != os.getpid()
    Checkpoint(objects, DiskSaver(tmp_path / "sync"))(engine)
    synchronous = (tmp_path / "sync" / "checkpoint_2.pt").read_bytes()
    assert (tmp_path / "async" / "checkpoint_2.pt").read_bytes() == synchronous

    # a helper that dies in the write leaves it to the save's thread
    dying = Checkpoint(objects, DiskSaver(_EndsTheHelper(tmp_path / "dying")), async_save=True)
    with caplog.at_level(logging.WARNING, logger="ignite_zero.storage.savers.write_process"):
        dying(engine)
        dying.wait()
    assert "while it was to write checkpoint_2.pt" in caplog.text
    assert (tmp_path / "dying" / "checkpoint_2.pt").read_bytes() == synchronous


def test_where_no_helper_can_start_the_thread_writes_and_keeps_no_copy(tmp_path, monkeypatch, caplog):
    objects = _model_and_optimizer()
    engine = Engine(lambda e, b: None)
    background = Checkpoint(objects, DiskSaver(tmp_path / "async"), n_saved=None, async_save=True)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with caplog.at_level(logging.WARNING, logger="ignite_zero.storage.savers.write_process"):
        _saved(background, engine, 1)
    assert "its first file" in caplog.text
    monkeypatch.undo()
    _saved(background, engine, 2)  # no helper tried again, and no copy made for one
    assert background.save_handler._write_process.pid is None and background.save_handler._shared_copies == {}
    Checkpoint(objects, DiskSaver(tmp_path / "sync"))(engine)
    for name in ("checkpoint_1.pt", "checkpoint_2.pt"):
        assert torch.load(tmp_path / "async" / name).keys() == torch.load(tmp_path / "sync" / "checkpoint_2.pt").keys()
    synchronous = (tmp_path / "sync" / "checkpoint_2.pt").read_bytes()
    assert (tmp_path / "async" / "checkpoint_2.pt").read_bytes() == synchronous


def _consolidated_async_saves(rank, world_size, dirname):
    objects = _fsdp2_objects(rank)  # 400 entries gathered
    engine = Engine(lambda e, b: None)
    background = Checkpoint(objects, DiskSaver(dirname / "async"), async_save=True, consolidate_recipient_rank=1)
    _saved(background, engine, 1)
    Checkpoint(objects, DiskSaver(dirname / "sync"), consolidate_recipient_rank=1)(engine)
    return background.save_handler._write_process.pid


@pytest.mark.distributed
def test_the_recipient_s_helper_writes_what_the_ranks_gathered(tmp_path):
    helpers = run_ranks(_consolidated_async_saves, 2, tmp_path)
    assert helpers[0] is None and helpers[1] not in (None, os.getpid())  # the recipient alone writes
    synchronous = (tmp_path / "sync" / "checkpoint_1.pt").read_bytes()
    assert (tmp_path / "async" / "checkpoint_1.pt").read_bytes() == synchronous
