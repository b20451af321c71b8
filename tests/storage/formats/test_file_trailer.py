"""The integrity trailer of checkpoint files (:mod:`ignite_zero.storage.formats.file_trailer`): the CRC-32 of every
block of their records, in blocks that double in size to fit the zip comment."""

import io
import json
import zipfile
import zlib

import pytest
import torch
from sealed_files import sealed_bytes

from ignite_zero.storage.formats import file_reads, file_trailer
from ignite_zero.storage.formats.base import IntegrityError
from ignite_zero.storage.formats.file_verification import verify_file


def _blocks_of(data):
    return file_trailer.Blocks.from_json(json.loads(zipfile.ZipFile(io.BytesIO(data)).comment)["blocks"], "file")


def _expected_crcs(data, blocks):
    starts = range(0, blocks.end, blocks.size)
    return tuple(zlib.crc32(data[start : min(start + blocks.size, blocks.end)]) for start in starts)


def test_sealed_files_record_the_crc32_of_every_block_of_their_records():
    state = {"weight": torch.randn(300_001, generator=torch.Generator().manual_seed(0)), "step": torch.tensor(3.0)}
    data = sealed_bytes(state)
    blocks = _blocks_of(data)
    directory = zipfile.ZipFile(io.BytesIO(data))
    assert blocks.size == 64 << 10 and blocks.end == data.index(b"PK\x01\x02")  # up to the central directory
    assert blocks.crc32 == _expected_crcs(data, blocks)
    assert len(blocks.crc32) == -(-blocks.end // blocks.size) and directory.testzip() is None


def test_blocks_double_in_size_to_fit_the_zip_comment(monkeypatch):
    monkeypatch.setattr(file_trailer, "_FIRST_BLOCK", 1024)
    monkeypatch.setattr(file_trailer, "_MAX_BLOCKS", 16)
    data = sealed_bytes({"weight": torch.randn(50_000, generator=torch.Generator().manual_seed(1))})  # 200 KB: 196 KiB
    blocks = _blocks_of(data)
    assert blocks.size == 16 << 10 and len(blocks.crc32) <= 16  # 1, 2, 4, 8 then 16 KiB: combined, never re-read
    assert blocks.crc32 == _expected_crcs(data, blocks)
    assert torch.load(io.BytesIO(data), weights_only=True)["weight"].shape == (50_000,)


def _with_trailer(data, trailer):
    """The sealed file ``data`` with ``trailer`` in place of its own: the zip comment, and its length before it."""
    comment = zipfile.ZipFile(io.BytesIO(data)).comment
    replaced = json.dumps(trailer).encode()
    return data[: -len(comment) - 2] + len(replaced).to_bytes(2, "little") + replaced


def test_a_trailer_without_blocks_is_refused(tmp_path):
    """Every trailer lists the CRC-32 of the blocks of its records: a file whose trailer does not is refused, whole
    or in parts, never checked some other way."""
    data = sealed_bytes({"weight": torch.randn(100_000, generator=torch.Generator().manual_seed(2))})
    trailer = json.loads(zipfile.ZipFile(io.BytesIO(data)).comment)
    path = tmp_path / "checkpoint.pt"
    for blocks in ({}, {"blocks": None}):
        path.write_bytes(_with_trailer(data, {**{k: v for k, v in trailer.items() if k != "blocks"}, **blocks}))
        lacks = r"checkpoint.pt: its trailer lacks the CRC-32 of the blocks of its records, .* save it again"
        for records in (True, lambda name: "/data/" not in name):
            with pytest.raises(IntegrityError, match=lacks):
                verify_file(path, records)
        with open(path, "rb") as f, pytest.raises(IntegrityError, match=lacks):
            file_reads.ReadChecks(path, f)
    path.write_bytes(_with_trailer(data, trailer))  # the same bytes: only the trailer made the difference
    assert path.read_bytes() == data and verify_file(path) == trailer
