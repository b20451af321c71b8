"""Our writer of torch.save's archive against torch.save itself, record by record; and DCP's files written and read by
us, against DCP's own writer and readers."""

from __future__ import annotations

import io
import pickle
import shutil
import struct
import warnings
import zipfile
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ignite_zero import IntegrityError
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats import torch_zip
from ignite_zero.storage.formats.dcp_files import PlaceStorageReader, PlaceStorageWriter, SavedTensors
from ignite_zero.storage.formats.torch_zip import write_archive
from ignite_zero.storage.places import LocalPlace

_SERIALIZATION_ID = "archive/.data/serialization_id"


def _objects() -> dict[str, object]:
    base = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    return {
        "one tensor": torch.arange(10, dtype=torch.float32),
        "dtypes": {
            "bf16": torch.ones(3, 4, dtype=torch.bfloat16),
            "int64": torch.arange(7),
            "bool": torch.tensor([True, False]),
            "half": torch.full((5,), 0.5, dtype=torch.float16),
        },
        "scalars and values": {"step": torch.tensor(3.0), "lr": 0.1, "name": "adam", "betas": (0.9, 0.999)},
        "views share a storage": {"whole": base, "rows": base[2:4], "transposed": base.t(), "again": base},
        "empty": torch.empty(0, 3),
        "a storage above 1 MiB": torch.randn(300_000),
    }


def _records(data: bytes) -> list[tuple[zipfile.ZipInfo, bytes]]:
    archive = zipfile.ZipFile(io.BytesIO(data))
    return [(info, archive.read(info)) for info in archive.infolist()]


def _without_serialization_id(data: bytes) -> bytes:
    """The archive with its serialization id's content, and the CRC-32 of it in the descriptor and the directory,
    blanked: torch derives that id from its C++ library's string hashes."""
    blanked = bytearray(data)
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(_SERIALIZATION_ID)
    start = info.header_offset + 30 + len(info.filename) + struct.unpack_from("<H", data, info.header_offset + 28)[0]
    blanked[start : start + info.file_size + 8] = bytes(info.file_size + 8)  # the id and the descriptor's CRC-32
    crc = struct.pack("<L", info.CRC)
    directory = data.index(b"PK\x01\x02" + bytes(4) + b"\x08\x08", start)
    at = data.index(crc, directory)
    blanked[at : at + 4] = bytes(4)
    return bytes(blanked)


@pytest.mark.parametrize("name", list(_objects()))
def test_the_archive_is_torch_saves_record_by_record(name):
    _assert_torch_saves(_objects()[name])


def _lone_tensors() -> list[torch.Tensor]:
    base = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    with_attribute = torch.ones(4)
    with_attribute.note = "kept"
    complex_ones = torch.ones(3, dtype=torch.complex64)
    return [
        torch.arange(10, dtype=torch.float32),
        torch.arange(10, dtype=torch.float32) * 2,  # the first one's layout: its pickle kept
        torch.arange(10, dtype=torch.float64),
        base[2:4],
        base[3:5],  # another offset in the same storage
        base.t(),
        base.t().contiguous(),
        torch.ones(5),
        torch.ones(5, requires_grad=True),  # each one after one laid out alike but for what it tells
        complex_ones,
        complex_ones.conj(),
        complex_ones.imag,
        complex_ones.conj().imag,  # the negative bit
        with_attribute,
        torch.nn.Parameter(torch.ones(4)),
    ]


def test_lone_tensors_of_every_layout_are_torch_saves_record_by_record_whenever_their_pickle_is_kept(monkeypatch):
    pickled = []
    dump = torch_zip._Pickler.dump
    monkeypatch.setattr(torch_zip._Pickler, "dump", lambda self, obj: pickled.append(obj) or dump(self, obj))
    monkeypatch.setattr(torch_zip, "_PICKLES", {})
    for tensor in _lone_tensors():
        _assert_torch_saves(tensor)
    assert len(pickled) == len(_lone_tensors()) - 1  # all but the second, laid out as the first
    pickled.clear()
    for tensor in _lone_tensors():  # every plain one's pickle kept: the one with an attribute and the Parameter not
        _assert_torch_saves(tensor)
    assert [type(obj) for obj in pickled] == [torch.Tensor, torch.nn.Parameter] and pickled[0].note == "kept"


def _assert_torch_saves(obj: object) -> None:
    theirs = io.BytesIO()
    torch.save(obj, theirs)
    ours = io.BytesIO()
    archive = write_archive(ours, obj)
    expected, written = theirs.getvalue(), ours.getvalue()
    assert len(written) == len(expected) == archive.size
    assert archive.crc == zlib.crc32(written)
    for (their_info, their_data), (our_info, our_data) in zip(_records(expected), _records(written), strict=True):
        assert (our_info.filename, our_info.header_offset, our_info.file_size, our_info.compress_type) == (
            their_info.filename,
            their_info.header_offset,
            their_info.file_size,
            their_info.compress_type,
        )
        if our_info.filename != _SERIALIZATION_ID:
            assert (our_info.CRC, our_data) == (their_info.CRC, their_data), our_info.filename
            record = archive.record(our_info.filename.removeprefix("archive/"))
            assert (record.size, record.crc) == (our_info.file_size, our_info.CRC)
            assert written[record.offset : record.offset + record.size] == our_data
    assert _without_serialization_id(written) == _without_serialization_id(expected)
    assert len(_records(written)[-1][1]) == 40 and _records(written)[-1][1].isdigit()
    again = io.BytesIO()  # what torch.load reads from ours is what was saved: saved again, it is the same archive
    torch.save(torch.load(io.BytesIO(written), weights_only=True), again)
    assert _without_serialization_id(again.getvalue()) == _without_serialization_id(expected)


def _state() -> dict[str, object]:
    generator = torch.Generator().manual_seed(1)
    return {
        "model": {"weight": torch.randn(40, 30, generator=generator), "bias": torch.randn(30, generator=generator)},
        "optimizer": {"step": torch.tensor(4.0), "lr": 0.01, "half": torch.ones(9, dtype=torch.bfloat16)},
        "trainer": {"epoch": 3, "name": "run"},
    }


def _assert_equal(actual: object, expected: object) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys()
        for key in expected:
            _assert_equal(actual[key], expected[key])
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected)
    else:
        assert actual == expected


def _blank(state: dict[str, object]) -> dict[str, object]:
    return {
        key: {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in value.items()}
        for key, value in state.items()
    }


def _save_both(tmp_path):
    state = _state()
    writer = PlaceStorageWriter(LocalPlace(tmp_path / "ours"))
    with sharded.in_one_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
        dcp.save(state, checkpoint_id=tmp_path / "theirs", no_dist=True)
    return state, writer


def test_dcp_files_are_dcps_own_entry_by_entry(tmp_path):
    state, writer = _save_both(tmp_path)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    our_metadata = pickle.loads((ours / ".metadata").read_bytes())
    their_metadata = pickle.loads((theirs / ".metadata").read_bytes())
    assert our_metadata.state_dict_metadata == their_metadata.state_dict_metadata
    assert our_metadata.storage_data == their_metadata.storage_data  # every entry at the same offset and length
    our_file, their_file = (ours / "__0_0.distcp").read_bytes(), (theirs / "__0_0.distcp").read_bytes()
    metadata = (ours / ".metadata").read_bytes()
    assert writer.written == {
        "__0_0.distcp": (len(our_file), zlib.crc32(our_file)),
        ".metadata": (len(metadata), zlib.crc32(metadata)),
    }
    for info in our_metadata.storage_data.values():
        our_entry = our_file[info.offset : info.offset + info.length]
        their_entry = their_file[info.offset : info.offset + info.length]
        if our_entry[:4] == b"PK\x03\x04":  # a tensor's archive
            assert _without_serialization_id(our_entry) == _without_serialization_id(their_entry)
        else:  # a value's pickled bytes
            assert our_entry == their_entry
    for record in writer.records["__0_0.distcp"]:
        assert zlib.crc32(our_file[record.offset : record.offset + record.length]) == record.crc


def test_dcps_readers_read_our_files(tmp_path):
    state, _ = _save_both(tmp_path)
    loaded = _blank(state)
    with sharded.in_one_process():
        dcp.load(loaded, checkpoint_id=tmp_path / "ours", no_dist=True)
    _assert_equal(loaded, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(tmp_path / "ours", tmp_path / "full.pt")
    _assert_equal(torch.load(tmp_path / "full.pt", weights_only=True), state)


def _load_ours(tmp_path, writer, template):
    sharded.load(template, LocalPlace(tmp_path / "ours"), writer.records)
    return template


def test_our_reader_reads_into_place_and_reshards(tmp_path):
    state, writer = _save_both(tmp_path)
    template = _blank(state)
    weight = template["model"]["weight"]
    _assert_equal(_load_ours(tmp_path, writer, template), state)
    assert template["model"]["weight"] is weight

    # a part of a saved tensor, as a rank of another world size reads it: the saved tensor read whole, then copied
    class Rows(DefaultLoadPlanner):
        def create_local_plan(self):  # rows 10 to 19 of the weight, into a tensor of 10 rows
            index = MetadataIndex("model.weight", [0, 0])
            part = torch.Size([10, 30])
            item = ReadItem(LoadItemType.TENSOR, index, torch.Size([0, 0]), index, torch.Size([10, 0]), part)
            return LoadPlan([item])

    rows = {"model": {"weight": torch.zeros(10, 30)}}
    with sharded.in_one_process():
        dcp.load(
            rows,
            storage_reader=PlaceStorageReader(LocalPlace(tmp_path / "ours"), writer.records),
            planner=Rows(),
            no_dist=True,
        )
    torch.testing.assert_close(rows["model"]["weight"], state["model"]["weight"][10:20])


def test_a_plan_reads_nothing_and_fills_what_lies_in_one_saved_chunk(tmp_path):
    state, writer = _save_both(tmp_path)
    place = LocalPlace(tmp_path / "ours")
    saved = SavedTensors(place, writer.records, PlaceStorageReader(place, writer.records).read_metadata())
    blank = _blank(state)
    fill = saved.plan(blank)
    assert fill is not None
    _assert_equal(blank, _blank(state))  # nothing read yet
    fill.read_values()
    assert blank["trainer"] == state["trainer"] and torch.equal(blank["model"]["weight"], torch.zeros(40, 30))
    fill.read_tensors()
    _assert_equal(blank, state)
    # a part of a saved tensor (to reshard), a tensor not saved, another dtype: no plan, and nothing read
    for other in (torch.zeros(20, 30), torch.zeros(1), torch.zeros(40, 30, dtype=torch.float64)):
        wanted = {"model": {"weight": other}, "trainer": {"epoch": None}}
        assert saved.plan(wanted) is None and wanted["trainer"]["epoch"] is None and not other.any()
    saved.close()


def test_a_corrupt_byte_anywhere_in_an_entry_read_is_caught(tmp_path):
    state, writer = _save_both(tmp_path)
    path = tmp_path / "ours" / "__0_0.distcp"
    good = path.read_bytes()
    shutil.copy(path, tmp_path / "good")
    for record in writer.records["__0_0.distcp"]:
        # in the headers and pickle, in the tensor's bytes, in the trailing records and directory
        for at in {record.offset + 1, record.data_offset + 2, record.offset + record.length - 3}:
            corrupt = bytearray(good)
            corrupt[at] ^= 0x10
            path.write_bytes(bytes(corrupt))
            with pytest.raises(IntegrityError, match=r"__0_0.distcp, entry .* is corrupt \(CRC-32"):
                _load_ours(tmp_path, writer, _blank(state))
    path.write_bytes(good[:-100])
    with pytest.raises(IntegrityError, match=r"the file ends early \(truncated\?\)"):
        _load_ours(tmp_path, writer, _blank(state))


def test_files_of_several_threads_and_entries_that_torch_save_writes(tmp_path, monkeypatch):
    """Entries of 4 GiB or more take zip64 records that torch.save writes: here every entry, by a lower limit."""
    state = _state()
    monkeypatch.setattr(torch_zip, "fits", lambda nbytes: False)
    writer = PlaceStorageWriter(LocalPlace(tmp_path / "ours"), thread_count=3)
    with sharded.in_one_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    for name in files[1:]:
        content = (tmp_path / "ours" / name).read_bytes()
        assert writer.written[name] == (len(content), zlib.crc32(content))
    assert any(record.data_offset == -1 for records in writer.records.values() for record in records)
    _assert_equal(_load_ours(tmp_path, writer, _blank(state)), state)
    loaded = _blank(state)
    with sharded.in_one_process():
        dcp.load(loaded, checkpoint_id=tmp_path / "ours", no_dist=True)
    _assert_equal(loaded, state)
    # read by name, whole, as the objects that hold them take them: into new tensors, or into tensors that exist
    place = LocalPlace(tmp_path / "ours")
    saved = SavedTensors(place, writer.records, PlaceStorageReader(place, writer.records).read_metadata())
    weight = torch.empty(40, 30)
    assert torch.equal(saved.read("model.weight", weight), state["model"]["weight"])
    assert torch.equal(weight, state["model"]["weight"]) and saved.fits("model.weight", weight)
    assert torch.equal(saved.read("optimizer.half"), state["optimizer"]["half"])
    assert not saved.fits("model.weight", torch.empty(30, 40))
    saved.close()
    with pytest.raises(RuntimeError, match="was closed before this rank read all it loads"):
        saved.read("model.bias")
