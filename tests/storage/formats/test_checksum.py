"""Files sealed before the trailer held a table of blocks: verified record by record."""

import json
import zipfile

import pytest
import torch
from sealed_files import sealed_bytes as _sealed

from ignite_zero.storage.formats import file as integrity


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
