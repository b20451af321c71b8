"""The relay that sends files as they are written (:mod:`ignite_zero.storage.replicas.relay`), between two ranks of
one machine: what arrives is what was written, and a copy whose flush fails is an error that the next file survives."""

import os
from pathlib import Path

import pytest
import torch
from launcher import run_ranks

from ignite_zero.storage.formats.base import crc32
from ignite_zero.storage.formats.torch_zip import tensor_bytes
from ignite_zero.storage.places import LocalPlace
from ignite_zero.storage.replicas import CHUNK_BYTES, Relay
from ignite_zero.transport.groups import cpu_group


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
