"""Checked reads of parts of checkpoint files (:mod:`ignite_zero.storage.formats.file_reads`): whole records, or the
blocks of the trailer that hold a part, read through short reads and checked as they arrive."""

import io
import zlib

import pytest
import torch
from sealed_files import sealed_bytes

from ignite_zero import _compat
from ignite_zero.storage.formats import file_reads
from ignite_zero.storage.formats.base import IntegrityError


def test_reads_are_checked_by_whole_records_and_by_blocks_for_parts():
    state = {"big": torch.zeros(200_000), "small": torch.ones(10)}
    for data, has_blocks in ((sealed_bytes(state), True), (_plain_save(state), False)):
        meta = torch.load(io.BytesIO(data), map_location="meta", weights_only=True)
        checks = file_reads.ReadChecks("file", io.BytesIO(data))
        big = _compat.storage_offset_in_file(meta["big"].untyped_storage())
        size = 800_000
        (whole,) = checks.spans(big, size, big, big + size)
        assert whole[:2] == (big, big + size) and whole[2] == zlib.crc32(data[big : big + size])
        part = checks.spans(big, size, big + 300_000, big + 400_000)
        if has_blocks:  # the blocks holding the part, each with the CRC-32 of its bytes
            assert part[0][0] <= big + 300_000 < part[0][0] + (64 << 10) and part[-1][1] >= big + 400_000
            assert all(span.crc32 == zlib.crc32(data[span.start : span.stop]) and span.block for span in part)
        else:  # a file of another tool: the whole record
            assert part == [whole]
        with pytest.raises(IntegrityError, match="no record of 5 bytes"):
            checks.spans(big, 5, big, big + 5)


def _plain_save(state):
    target = io.BytesIO()
    torch.save(state, target)
    return target.getvalue()


class _ShortReads(io.BytesIO):
    """A file that hands out at most 1,000 bytes a read, as a stream from an object store may."""

    def readinto(self, target):
        view = memoryview(target).cast("B")
        return super().readinto(view[:1000])


def test_parts_of_a_record_are_read_whole_and_checked_through_short_reads():
    weight = torch.randn(200_000, generator=torch.Generator().manual_seed(3))  # 781 KiB: blocks of 64 KiB
    data = sealed_bytes({"weight": weight})
    meta = torch.load(io.BytesIO(data), map_location="meta", weights_only=True)["weight"]
    record = _compat.storage_offset_in_file(meta.untyped_storage())
    size = weight.nbytes
    expected = memoryview(weight.numpy()).cast("B")
    for first, last in ((0, size), (4, 300_004), (65_536 * 3, 65_536 * 5), (size - 12, size)):
        out = bytearray(last - first)
        f = _ShortReads(data)
        file_reads.read_into(
            f, file_reads.ReadChecks("file", f), record, size, record + first, record + last, memoryview(out)
        )
        assert out == expected[first:last]
    truncated = _ShortReads(data[: record + 200_000])  # the file ends inside the fourth block of the record
    checks = file_reads.ReadChecks("file", _ShortReads(data))
    with pytest.raises(IntegrityError, match=r"ends inside the block \[\d+, \d+\) of record '.*data/0'"):
        file_reads.read_into(
            truncated, checks, record, size, record + 100_000, record + 300_000, memoryview(bytearray(200_000))
        )
    corrupt = bytearray(data)
    corrupt[record + 250_000] ^= 0x01
    with pytest.raises(IntegrityError, match=r"the block \[\d+, \d+\) of record '.*data/0' is corrupt"):
        f = _ShortReads(bytes(corrupt))
        file_reads.read_into(
            f, checks, record, size, record + 100_000, record + 300_000, memoryview(bytearray(200_000))
        )
