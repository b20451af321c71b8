"""The CRC-32 of sharded checkpoints is zlib's, to the bit: manifests written before and after stay comparable; and
the block checksums of checkpoint files, which check reads of parts of records."""

from __future__ import annotations

import io
import json
import random
import zipfile
import zlib

import pytest
import torch

from ignite_zero import _compat
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats import file as integrity
from ignite_zero.storage.formats import file_reads, file_trailer
from ignite_zero.storage.formats.torch_zip import write_archive
from ignite_zero.storage.places import LocalPlace

# both sides of the 5 KiB above which the GIL is released, and chunks DCP writes
SIZES = [0, 1, 3, 64, 5 * 1024, 5 * 1024 + 1, 65_537, 1 << 20, 3_000_001]


@pytest.mark.parametrize("size", SIZES)
def test_crc32_is_zlibs(size):
    data = random.Random(size).randbytes(size)
    assert sharded.crc32(data) == zlib.crc32(data)
    for start in (0, 1, 0xFFFFFFFF, 0x1234ABCD):
        assert sharded.crc32(data, start) == zlib.crc32(data, start)


def test_crc32_is_zlibs_incrementally():
    rng = random.Random(0)
    data = rng.randbytes(4_000_000)
    view = memoryview(data)
    crc, position = 0, 0
    while position < len(data):
        end = position + rng.choice([1, 7, 4096, 5 * 1024 + 3, 100_000, 1_500_000])
        crc = sharded.crc32(view[position:end], crc)
        position = end
    assert crc == zlib.crc32(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_crc32_of_tensor_memory(dtype):
    tensor = (torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    view = memoryview(tensor.view(torch.uint8).numpy())
    assert sharded.crc32(view) == zlib.crc32(view)
    assert sharded.crc32(view[1000:], sharded.crc32(view[:1000])) == zlib.crc32(view)


def test_archive_and_file_checksums_are_zlibs(tmp_path):
    rng = random.Random(1)
    sizes = [rng.choice([0, 5, 8192, 700_000]) for _ in range(40)]  # records of several 256 KiB slices among them
    tensors = [
        torch.frombuffer(bytearray(rng.randbytes(size)), dtype=torch.uint8) if size else torch.empty(0)
        for size in sizes
    ]
    target = io.BytesIO()
    archive = write_archive(target, tensors)
    written = target.getvalue()
    assert (archive.size, archive.crc) == (len(written), zlib.crc32(written))
    for record in archive.records:
        assert record.crc == zlib.crc32(written[record.offset : record.offset + record.size])
    (tmp_path / "file").write_bytes(written)
    assert sharded.file_crc(LocalPlace(tmp_path), "file") == zlib.crc32(written)


def _sealed(state, **facts):
    target = io.BytesIO()
    stream = integrity.SealingStream(target)
    torch.save(state, stream)
    stream.seal(**facts)
    return target.getvalue()


def _blocks_of(data):
    return integrity.Blocks.from_json(json.loads(zipfile.ZipFile(io.BytesIO(data)).comment)["blocks"])


def _expected_crcs(data, blocks):
    starts = range(0, blocks.end, blocks.size)
    return tuple(zlib.crc32(data[start : min(start + blocks.size, blocks.end)]) for start in starts)


def test_sealed_files_record_the_crc32_of_every_block_of_their_records():
    state = {"weight": torch.randn(300_001, generator=torch.Generator().manual_seed(0)), "step": torch.tensor(3.0)}
    data = _sealed(state)
    blocks = _blocks_of(data)
    directory = zipfile.ZipFile(io.BytesIO(data))
    assert blocks.size == 64 << 10 and blocks.end == data.index(b"PK\x01\x02")  # up to the central directory
    assert blocks.crc32 == _expected_crcs(data, blocks)
    assert len(blocks.crc32) == -(-blocks.end // blocks.size) and directory.testzip() is None


def test_blocks_double_in_size_to_fit_the_zip_comment(monkeypatch):
    monkeypatch.setattr(file_trailer, "_FIRST_BLOCK", 1024)
    monkeypatch.setattr(file_trailer, "_MAX_BLOCKS", 16)
    data = _sealed({"weight": torch.randn(50_000, generator=torch.Generator().manual_seed(1))})  # 200 KB: 196 KiB
    blocks = _blocks_of(data)
    assert blocks.size == 16 << 10 and len(blocks.crc32) <= 16  # 1, 2, 4, 8 then 16 KiB: combined, never re-read
    assert blocks.crc32 == _expected_crcs(data, blocks)
    assert torch.load(io.BytesIO(data), weights_only=True)["weight"].shape == (50_000,)


def test_reads_are_checked_by_whole_records_and_by_blocks_for_parts():
    state = {"big": torch.zeros(200_000), "small": torch.ones(10)}
    for data, has_blocks in ((_sealed(state), True), (_plain_save(state), False)):
        meta = torch.load(io.BytesIO(data), map_location="meta", weights_only=True)
        checks = integrity.ReadChecks("file", io.BytesIO(data))
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
        with pytest.raises(integrity.IntegrityError, match="no record of 5 bytes"):
            checks.spans(big, 5, big, big + 5)


def _plain_save(state):
    target = io.BytesIO()
    torch.save(state, target)
    return target.getvalue()


def test_a_trailer_without_blocks_is_verified_record_by_record(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity.Blocks, "to_json", lambda self: None)  # as files sealed before blocks were
    path = tmp_path / "older.pt"
    path.write_bytes(_sealed({"weight": torch.randn(100_000, generator=torch.Generator().manual_seed(2))}))
    with zipfile.ZipFile(path) as archive:
        record = next(info for info in archive.infolist() if info.filename.endswith("data/0"))
        assert json.loads(archive.comment)["blocks"] is None
    assert integrity.verify_file(path) is not None
    data = bytearray(path.read_bytes())
    data[record.header_offset + 4096] ^= 0x01  # inside the tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(integrity.IntegrityError, match=r"record '.*data/0' is corrupt"):
        integrity.verify_file(path)


class _ShortReads(io.BytesIO):
    """A file that hands out at most 1,000 bytes a read, as a stream from an object store may."""

    def readinto(self, target):
        view = memoryview(target).cast("B")
        return super().readinto(view[:1000])


def test_parts_of_a_record_are_read_whole_and_checked_through_short_reads():
    weight = torch.randn(200_000, generator=torch.Generator().manual_seed(3))  # 781 KiB: blocks of 64 KiB
    data = _sealed({"weight": weight})
    meta = torch.load(io.BytesIO(data), map_location="meta", weights_only=True)["weight"]
    record = _compat.storage_offset_in_file(meta.untyped_storage())
    size = weight.nbytes
    expected = memoryview(weight.numpy()).cast("B")
    for first, last in ((0, size), (4, 300_004), (65_536 * 3, 65_536 * 5), (size - 12, size)):
        out = bytearray(last - first)
        f = _ShortReads(data)
        file_reads.read_into(
            f, integrity.ReadChecks("file", f), record, size, record + first, record + last, memoryview(out)
        )
        assert out == expected[first:last]
    truncated = _ShortReads(data[: record + 200_000])  # the file ends inside the fourth block of the record
    checks = integrity.ReadChecks("file", _ShortReads(data))
    with pytest.raises(integrity.IntegrityError, match=r"ends inside the block \[\d+, \d+\) of record '.*data/0'"):
        file_reads.read_into(
            truncated, checks, record, size, record + 100_000, record + 300_000, memoryview(bytearray(200_000))
        )
    corrupt = bytearray(data)
    corrupt[record + 250_000] ^= 0x01
    with pytest.raises(integrity.IntegrityError, match=r"the block \[\d+, \d+\) of record '.*data/0' is corrupt"):
        f = _ShortReads(bytes(corrupt))
        file_reads.read_into(
            f, checks, record, size, record + 100_000, record + 300_000, memoryview(bytearray(200_000))
        )
