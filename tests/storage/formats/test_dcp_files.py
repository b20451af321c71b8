"""DCP's files as written by us (ignite_zero.storage.formats.dcp_files): ``.metadata`` pickled once, its storage facts
put in per save, and a file's entries in order; the directories themselves are tested end to end in test_sharded.py
and test_dcp_plans.py."""

import io
import pickle
import zlib

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ignite_zero import _compat
from ignite_zero.storage.formats.dcp_files import MetadataFile, _Output
from ignite_zero.storage.formats.trust import load_metadata


def _metadata(entries):
    described, places, offset = {}, {}, 0
    for n in range(entries):
        name = f"layers.{n}.weight"
        chunks = [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 4])),
        ]
        described[name] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 4]), chunks)
        for rank, chunk in enumerate(chunks):
            places[MetadataIndex(name, chunk.offsets)] = _compat.dcp_storage_info(f"__{rank}_0.distcp", offset, 100 + n)
            offset += 100 + n
    described["step"] = BytesStorageMetadata()
    places[MetadataIndex("step")] = _compat.dcp_storage_info("__0_0.distcp", offset, 7)
    planner_data = {name: tuple(name.split(".", 1)) for name in described}
    return Metadata(described, planner_data=planner_data, storage_data=places)


@pytest.mark.parametrize(
    "checkpoint_id", ["/ckpt/checkpoint_3.dcp", "s3://bucket/" + "deep/" * 80 + "checkpoint.dcp", "/données/ckpt"]
)
def test_metadata_is_the_same_with_each_save_s_storage_facts(checkpoint_id):
    metadata = _metadata(300)
    metadata_file = MetadataFile(metadata)
    for save_id in ("a", "b" * 300):
        content = metadata_file.content(checkpoint_id, save_id)
        for loaded in (pickle.loads(content), load_metadata(content, "here")):
            assert loaded.state_dict_metadata == metadata.state_dict_metadata
            assert loaded.storage_data == metadata.storage_data
            assert loaded.planner_data == metadata.planner_data
            assert (loaded.storage_meta.checkpoint_id, loaded.storage_meta.save_id) == (checkpoint_id, save_id)


def test_metadata_refers_again_to_what_entries_hold_alike():
    loaded = pickle.loads(MetadataFile(_metadata(50)).content("/ckpt", "id"))
    tensors = [entry for entry in loaded.state_dict_metadata.values() if isinstance(entry, TensorStorageMetadata)]
    assert len({id(entry.properties) for entry in tensors}) == 1
    assert len({id(entry.size) for entry in tensors}) == 1
    assert len({id(info.relative_path) for info in loaded.storage_data.values()}) == 2


def test_a_file_s_entries_lie_in_the_order_written_whatever_is_held():
    """Small tensors are held and written together; a value or a large tensor after them still lies after them."""
    stream = io.BytesIO()
    output = _Output(stream)
    small = [torch.full((4,), float(i)) for i in range(3)]
    large = torch.arange(20_000, dtype=torch.float32)  # above 64 KiB: written at once
    entries = [b"value 1", small[0], small[1], b"value 2", large, small[2]]
    for entry in entries:
        if isinstance(entry, bytes):
            output.value(memoryview(entry))
        else:
            output.tensor(entry)
    output.finish()
    written = stream.getvalue()
    assert (output.size, output.crc) == (len(written), zlib.crc32(written))
    offset = 0
    for entry, record in zip(entries, output.records, strict=True):
        assert record.offset == offset
        content = written[record.offset : record.offset + record.length]
        assert zlib.crc32(content) == record.crc
        if isinstance(entry, bytes):
            assert content == entry
        else:
            assert torch.equal(torch.load(io.BytesIO(content), weights_only=True), entry)
            data = written[record.data_offset : record.data_offset + entry.nbytes]
            assert data == entry.numpy().tobytes() and zlib.crc32(data) == record.data_crc
        offset += record.length


def test_a_file_of_many_batches_holds_each_entry_as_written():
    """Several MiB of small tensors (batches made one after another in the same memory, gathered in one buffer written
    again and again, then kept for the next file), values, and archives past the gathered pieces' size: each entry
    reads back as given, in each file."""
    generator = torch.Generator().manual_seed(4)
    entries = []
    for n in range(700):
        if n % 97 == 0:
            entries.append(f"value {n}".encode() * (n % 7 + 1))
        elif n % 211 == 0:
            entries.append(torch.randn(40_000, generator=generator))  # written straight from its memory
        else:
            size = int(torch.randint(1, 4096, (), generator=generator))
            entries.append(torch.randn(size, generator=generator).to(torch.float64 if n % 3 else torch.float32))
    files = []
    for _ in range(2):  # the second file in the buffer and memory that the first left
        stream = io.BytesIO()
        output = _Output(stream)
        for entry in entries:
            output.value(memoryview(entry)) if isinstance(entry, bytes) else output.tensor(entry)
        output.finish()
        files.append(stream.getvalue())
    written = files[0]
    assert files[1] == written
    assert (output.size, output.crc) == (len(written), zlib.crc32(written)) and len(written) > 8 << 20
    for entry, record in zip(entries, output.records, strict=True):
        content = written[record.offset : record.offset + record.length]
        if isinstance(entry, bytes):
            assert content == entry
        else:
            assert torch.equal(torch.load(io.BytesIO(content), weights_only=True), entry)
