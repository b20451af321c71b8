"""Our writer of torch.save's archive against torch.save itself, record by record, with zlib's checksums; and DCP's
files written and read by us, against DCP's own writer and readers."""

from __future__ import annotations

import io
import json
import pickle
import random
import shutil
import struct
import warnings
import zipfile
import zlib

import numpy
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ignite_zero import IntegrityError
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats import scratch, torch_zip
from ignite_zero.storage.formats.dcp_entries import INDEX, EntryRecord, pack_records, unpack_records
from ignite_zero.storage.formats.dcp_files import PlaceStorageReader, PlaceStorageWriter
from ignite_zero.storage.formats.dcp_index import EntryIndex
from ignite_zero.storage.formats.dcp_saved import SavedTensors
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


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_pickle_protocol_gives_torch_saves_archive_with_it(protocol, monkeypatch):
    monkeypatch.setattr(torch_zip, "_PICKLES", {})
    monkeypatch.setattr(torch_zip, "_LONE_TENSOR_ARCHIVES", {})
    for obj in (_objects()["scalars and values"], torch.arange(6.0), torch.arange(6.0) + 1):  # pickles kept too
        _assert_torch_saves(obj, protocol)


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
        torch.arange(20_000, dtype=torch.float32),  # above the size of the archives kept: its pickle kept
        torch.arange(20_000, dtype=torch.float32) * 2,
    ]


def test_lone_tensors_of_every_layout_are_torch_saves_record_by_record_whenever_their_archive_is_kept(monkeypatch):
    """Small lone tensors are written from their layout's archive, kept (their pickle and records), large ones with
    their layout's pickle kept: torch.save's bytes either way, each tensor's own data and checksums."""
    pickled = []
    dump = torch_zip._Pickler.dump
    monkeypatch.setattr(torch_zip._Pickler, "dump", lambda self, obj: pickled.append(obj) or dump(self, obj))
    monkeypatch.setattr(torch_zip, "_PICKLES", {})
    monkeypatch.setattr(torch_zip, "_LONE_TENSOR_ARCHIVES", {})
    for tensor in _lone_tensors():
        _assert_torch_saves(tensor)
    assert len(pickled) == len(_lone_tensors()) - 2  # all but those laid out as the one before them
    pickled.clear()
    for tensor in _lone_tensors():  # every plain one's pickle kept: the one with an attribute and the Parameter not
        _assert_torch_saves(tensor)
    assert [type(obj) for obj in pickled] == [torch.Tensor, torch.nn.Parameter] and pickled[0].note == "kept"


def test_plain_tensors_are_pickled_as_torch_pickles_them_without_its_reduction(monkeypatch):
    with_attribute = torch.ones(2)
    with_attribute.note = "kept"
    complex_ones = torch.ones(3, dtype=torch.complex64)
    plain = [torch.ones(2, 3), torch.arange(6)[1:4], complex_ones.conj(), torch.tensor(True), torch.empty(0)]
    others = [torch.ones(2, requires_grad=True), with_attribute, torch.ones(3, dtype=torch.uint16)]
    state = {"plain": plain, "others": others, "parameter": torch.nn.Parameter(torch.ones(2))}
    _assert_torch_saves(state)
    reduced = []
    reduce_ex = torch.Tensor.__reduce_ex__
    monkeypatch.setattr(
        torch.Tensor, "__reduce_ex__", lambda self, proto: reduced.append(self) or reduce_ex(self, proto)
    )
    torch_zip._pickled(state, torch_zip.PICKLE_PROTOCOL)
    assert [id(tensor) for tensor in reduced] == [id(tensor) for tensor in others]


def test_small_tensors_written_together_are_each_one_written_alone():
    """Archives made together, layouts interleaved, are each the bytes write_archive writes for its tensor alone
    (which the test above holds to torch.save's), with its checksums, in order."""
    generator = torch.Generator().manual_seed(2)
    complex_ones = torch.ones(3, dtype=torch.complex64)
    tensors = [
        *(torch.randn(32, 64, generator=generator) for _ in range(5)),
        *(torch.randn(32, generator=generator) for _ in range(4)),
        torch.randn(6, generator=generator).to(torch.bfloat16),
        torch.tensor(3.0),
        torch.arange(7),
        torch.ones(5, requires_grad=True),
        complex_ones,
        torch.randn(16 << 10, generator=generator),  # 64 KiB, the largest written so
    ]
    tensors = [tensors[i] for i in torch.randperm(len(tensors), generator=generator).tolist()]
    layouts = [torch_zip.small_tensor_layout(tensor) for tensor in tensors]
    alone, expected = bytearray(), []
    for tensor in tensors:
        archive = write_archive(alone.extend, tensor, alignment=64)
        data = archive.record("data/0")
        expected.append((archive.size, archive.crc, data.offset, data.crc))
    together = bytearray()
    assert torch_zip.write_small_tensors(together.extend, tensors, layouts, 64) == expected
    assert together == alone
    offset = 0
    for tensor, (size, crc, data_offset, data_crc) in zip(tensors, expected, strict=True):
        data = together[offset + data_offset : offset + data_offset + tensor.nbytes]
        assert data == torch_zip.tensor_bytes(tensor) and zlib.crc32(data) == data_crc
        assert zlib.crc32(together[offset : offset + size]) == crc
        offset += size
    assert offset == len(together)


def test_small_tensors_written_together_again_and_again_in_the_memory_kept(monkeypatch):
    """Each call makes its archives in the memory the call before it made its own in, grown where it needs more and
    kept up to a bound (here 64 KiB; past it, memory of the call's own): every call's archives are still the bytes
    each tensor's archive has alone."""
    monkeypatch.setattr(scratch, "KEPT", 64 << 10)
    generator = torch.Generator().manual_seed(3)
    batches = [
        [torch.randn(4, 4, generator=generator) for _ in range(3)],
        [torch.randn(32, 64, generator=generator) for _ in range(6)],  # more than kept: its own memory
        [torch.randn(8, generator=generator) for _ in range(2)] + [torch.tensor(float(n)) for n in range(3)],
        [torch.randn(16, 16, generator=generator).to(torch.bfloat16) for _ in range(5)],
    ]
    for tensors in batches:
        written = bytearray()
        torch_zip.write_small_tensors(written.extend, tensors, list(map(torch_zip.small_tensor_layout, tensors)), 64)
        alone = bytearray()
        for tensor in tensors:
            write_archive(alone.extend, tensor, alignment=64)
        assert written == alone


def test_small_tensors_written_together_take_the_alignment_given():
    tensors = [torch.full((3,), float(i)) for i in range(4)]
    written = bytearray()
    archives = torch_zip.write_small_tensors(
        written.extend, tensors, [torch_zip.small_tensor_layout(tensors[0])] * 4, 256
    )
    offset = 0
    for tensor, archive in zip(tensors, archives, strict=True):
        assert archive.data_offset % 256 == 0
        one = bytes(written[offset : offset + archive.size])
        assert zipfile.ZipFile(io.BytesIO(one)).read("archive/.storage_alignment") == b"256"
        assert torch.equal(torch.load(io.BytesIO(one), weights_only=True), tensor)
        offset += archive.size


def test_only_small_tensors_each_the_whole_of_its_storage_are_written_together():
    base = torch.randn(8, 8)
    complex_ones = torch.ones(4, dtype=torch.complex64)
    for refused in (
        base[2:4],  # part of a storage
        base.t(),  # not contiguous
        complex_ones.conj(),
        complex_ones.conj().imag,  # the negative bit
        torch.randn((16 << 10) + 1),  # above 64 KiB
        torch.empty(0),
        torch.nn.Parameter(torch.ones(3)),
    ):
        assert torch_zip.small_tensor_layout(refused) is None
    assert torch_zip.small_tensor_layout(base) is not None


def test_the_shift_of_crc32s_over_arrays_combines_them_as_zlib():
    """crc32(a + b) is crc32(a) shifted over len(b) bytes, XOR crc32(b): what makes the serialization ids of small
    tensors written together."""
    rng = random.Random(3)
    heads = [rng.randbytes(rng.randrange(1, 50)) for _ in range(100)]
    for length in (0, 1, 7, 40, 8192):
        tail = rng.randbytes(length)
        shifted = torch_zip._crc32_shift(numpy.array([zlib.crc32(head) for head in heads], dtype=numpy.uint64), length)
        assert [crc ^ zlib.crc32(tail) for crc in shifted.tolist()] == [zlib.crc32(head + tail) for head in heads]


def _assert_torch_saves(obj: object, pickle_protocol: int = 2) -> None:
    theirs = io.BytesIO()
    torch.save(obj, theirs, pickle_protocol=pickle_protocol)
    ours = io.BytesIO()
    archive = write_archive(ours, obj, pickle_protocol=pickle_protocol)
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
    # torch's weights_only unpickler reads protocol 2 only (FRAME, opcode 149, is refused)
    loaded = torch.load(io.BytesIO(written), weights_only=pickle_protocol == 2)
    torch.save(loaded, again, pickle_protocol=pickle_protocol)
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


def _save_both(tmp_path, state=None):
    state = _state() if state is None else state
    writer = PlaceStorageWriter(LocalPlace(tmp_path / "ours"))
    with sharded.in_one_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
        dcp.save(state, checkpoint_id=tmp_path / "theirs", no_dist=True)
    return state, writer


def _many_small_tensors() -> dict[str, object]:
    """More small tensors than are written together at once (by count, then by bytes), among large ones and values."""
    generator = torch.Generator().manual_seed(4)
    return {
        "tiny": [torch.randn(4, generator=generator) for _ in range(1500)],
        "among large": [  # runs of 99 tensors of 16 KiB: 64 of them make 1 MiB
            torch.randn(100_000, generator=generator) if i % 100 == 7 else torch.randn(64, 64, generator=generator)
            for i in range(400)
        ],
        "values": [i / 7 for i in range(30)],
    }


@pytest.mark.parametrize("make_state", [_state, _many_small_tensors], ids=["a state", "many small tensors"])
def test_dcp_files_are_dcps_own_entry_by_entry(tmp_path, make_state, monkeypatch):
    batches = []
    write_small_tensors = torch_zip.write_small_tensors
    monkeypatch.setattr(
        torch_zip,
        "write_small_tensors",
        lambda write, tensors, *args: batches.append(tensors) or write_small_tensors(write, tensors, *args),
    )
    state, writer = _save_both(tmp_path, make_state())
    if make_state is _many_small_tensors:  # held until 1,024 of them, or 1 MiB of them
        assert len(batches[0]) == 1024 and any(sum(t.nbytes for t in batch) == 1 << 20 for batch in batches)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert sorted(p.name for p in ours.iterdir()) == sorted([INDEX, *(p.name for p in theirs.iterdir())])
    our_metadata = pickle.loads((ours / ".metadata").read_bytes())
    their_metadata = pickle.loads((theirs / ".metadata").read_bytes())
    assert our_metadata.state_dict_metadata == their_metadata.state_dict_metadata
    assert our_metadata.storage_data == their_metadata.storage_data  # every entry at the same offset and length
    our_file, their_file = (ours / "__0_0.distcp").read_bytes(), (theirs / "__0_0.distcp").read_bytes()
    metadata, index = (ours / ".metadata").read_bytes(), (ours / INDEX).read_bytes()
    assert writer.written == {
        "__0_0.distcp": (len(our_file), zlib.crc32(our_file)),
        ".metadata": (len(metadata), zlib.crc32(metadata)),
        INDEX: (len(index), zlib.crc32(index)),
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
    saved = SavedTensors(place, writer.records, _index(writer))
    blank = _blank(state)
    reads = saved.in_place_reads(blank)
    assert reads is not None
    _assert_equal(blank, _blank(state))  # nothing read yet
    reads.read_values()
    assert blank["trainer"] == state["trainer"] and torch.equal(blank["model"]["weight"], torch.zeros(40, 30))
    reads.read_tensors()
    _assert_equal(blank, state)
    # a part of a saved tensor (to reshard), a tensor not saved, another dtype: no plan, and nothing read
    for other in (torch.zeros(20, 30), torch.zeros(1), torch.zeros(40, 30, dtype=torch.float64)):
        wanted = {"model": {"weight": other}, "trainer": {"epoch": None}}
        assert saved.in_place_reads(wanted) is None and wanted["trainer"]["epoch"] is None and not other.any()
    saved.close()


def _index(writer):
    """The index of the entries that ``writer`` wrote, as the manifest holds it."""
    return EntryIndex.parse(writer.place.read(INDEX), sum(map(len, writer.records.values())))


def _read_in_place(tmp_path, writer, blank):
    place = LocalPlace(tmp_path / "ours")
    saved = SavedTensors(place, writer.records, _index(writer))
    try:
        reads = saved.in_place_reads(blank)
        assert reads is not None and len(reads.tensors) > 1
        reads.read_tensors()
    finally:
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
            if record.data_offset != record.offset:  # a tensor's: read with its neighbours, the corrupt one named
                with pytest.raises(IntegrityError, match=rf"__0_0.distcp, entry \S+ at {record.offset} is corrupt"):
                    _read_in_place(tmp_path, writer, _blank(state))
    path.write_bytes(good)
    blank = _blank(state)
    _read_in_place(tmp_path, writer, blank)
    for tensors in ("model", "optimizer"):  # the tensors only: values are read apart
        for key, value in state[tensors].items():
            assert not isinstance(value, torch.Tensor) or torch.equal(blank[tensors][key], value)
    path.write_bytes(good[:-100])  # found before anything is read: its last entries lie past its end
    with pytest.raises(IntegrityError, match=r"__0_0.distcp, which has \d+ bytes: truncated, corrupt or forged"):
        _load_ours(tmp_path, writer, _blank(state))


def test_files_of_several_threads(tmp_path):
    state = _state()
    writer = PlaceStorageWriter(LocalPlace(tmp_path / "ours"), thread_count=3)
    with sharded.in_one_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp", INDEX]
    for name in files[1:-1]:
        content = (tmp_path / "ours" / name).read_bytes()
        assert writer.written[name] == (len(content), zlib.crc32(content))
    _assert_equal(_load_ours(tmp_path, writer, _blank(state)), state)
    loaded = _blank(state)
    with sharded.in_one_process():
        dcp.load(loaded, checkpoint_id=tmp_path / "ours", no_dist=True)
    _assert_equal(loaded, state)
    # read by name, whole, as the objects that hold them take them: into new tensors, or into tensors that exist
    place = LocalPlace(tmp_path / "ours")
    saved = SavedTensors(place, writer.records, _index(writer))
    weight = torch.empty(40, 30)
    assert torch.equal(saved.read("model.weight", weight), state["model"]["weight"])
    assert torch.equal(weight, state["model"]["weight"]) and saved.fits("model.weight", weight)
    assert torch.equal(saved.read("optimizer.half"), state["optimizer"]["half"])
    assert not saved.fits("model.weight", torch.empty(30, 40))
    saved.close()
    with pytest.raises(RuntimeError, match="was closed before this rank read all it loads"):
        saved.read("model.bias")


def test_a_manifest_without_where_an_entrys_data_lies_is_refused(tmp_path):
    """Every manifest records where the data of each entry lies: one that does not (-1) is refused by a load and a
    verification, never read some other way."""
    place = LocalPlace(tmp_path / "ours")
    writer = PlaceStorageWriter(place)
    with sharded.in_one_process():
        dcp.save(_state(), storage_writer=writer, no_dist=True)
    sharded.seal(place, writer.written, writer.records)
    assert sharded.entry_records(sharded.read_manifest(place)) == writer.records
    manifest = json.loads(place.read(sharded.MANIFEST))
    listed = manifest["files"]["__0_0.distcp"]
    table = unpack_records(listed["records"]).copy()
    table[-1, 3] = -1  # the data offset of a tensor's entry
    listed["records"] = pack_records([EntryRecord._make(row) for row in table.tolist()])
    place.write(sharded.MANIFEST, lambda f: f.write(json.dumps(manifest).encode()))
    lacks = r"lacks where the data of the entry of __0_0.distcp at \[\d+, \d+\) lies \(it says -1, .* save it again"
    with pytest.raises(IntegrityError, match=lacks):
        sharded.DirectoryReader(place).load(weights_only=True)
    for whole in (True, False):
        with pytest.raises(IntegrityError, match=lacks):
            sharded.DirectoryReader(place).verify(whole)


def test_a_manifest_of_records_as_lists_still_loads_and_verifies(tmp_path):
    """Manifests that ignite_zero wrote before the table of records (version 1: a list of five integers per entry)
    still verify, and the entries load checked by their records: a corrupt byte of an entry is caught."""
    place = LocalPlace(tmp_path / "ours")
    writer = PlaceStorageWriter(place)
    state = _state()
    with sharded.in_one_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
    sharded.seal(place, writer.written, writer.records)
    manifest = json.loads(place.read(sharded.MANIFEST))
    assert manifest["version"] == 3 and all(isinstance(f["records"], str) for f in manifest["files"].values())
    manifest["version"] = 1
    for name, listed in manifest["files"].items():
        listed["records"] = [list(record) for record in writer.records[name]]
    place.write(sharded.MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    assert sharded.entry_records(sharded.read_manifest(place)) == writer.records
    reader = sharded.DirectoryReader(place)
    assert reader.verify().checked
    _assert_equal(reader.load(weights_only=True), state)
    record = writer.records["__0_0.distcp"][-1]
    path = tmp_path / "ours" / "__0_0.distcp"
    content = bytearray(path.read_bytes())
    content[record.data_offset] ^= 1
    path.write_bytes(bytes(content))
    with pytest.raises(IntegrityError, match="is corrupt"):
        sharded.DirectoryReader(place).load(weights_only=True)


class _Image(io.RawIOBase):
    """A stream that keeps what it is given in pages of 4 KiB, only those that are not all zeros, and reads back like
    a file: the layout of an archive of gigabytes of zeros, in a few pages of memory."""

    PAGE = 4096

    def __init__(self) -> None:
        super().__init__()
        self.size = 0
        self.position = 0
        self.pages: dict[int, bytearray] = {}

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = numpy.frombuffer(memoryview(data).cast("B"), dtype=numpy.uint8)
        done = 0
        while done < len(view):
            page, within = divmod(self.size + done, self.PAGE)
            if within or len(view) - done < self.PAGE:
                chunk = view[done : done + min(self.PAGE - within, len(view) - done)]
                if chunk.any() or page in self.pages:
                    self.pages.setdefault(page, bytearray(self.PAGE))[within : within + len(chunk)] = chunk.tobytes()
                done += len(chunk)
                continue
            count = (len(view) - done) // self.PAGE
            block = view[done : done + count * self.PAGE].reshape(count, self.PAGE)
            for index in numpy.flatnonzero(block.any(axis=1)):
                self.pages[page + int(index)] = bytearray(block[index].tobytes())
            done += count * self.PAGE
        self.size += len(view)
        return len(view)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, size: int = -1) -> bytes:
        stop = self.size if size < 0 else min(self.size, self.position + size)
        out = bytearray(max(0, stop - self.position))
        for page in range(self.position // self.PAGE, -(-stop // self.PAGE)):
            if page in self.pages:
                start = page * self.PAGE
                lo, hi = max(start, self.position), min(start + self.PAGE, stop)
                out[lo - self.position : hi - self.position] = self.pages[page][lo - start : hi - start]
        self.position = stop
        return bytes(out)

    def without_serialization_id(self) -> dict[int, bytes]:
        """The pages, with the serialization id blanked as :func:`_without_serialization_id` does."""
        self.seek(0)
        info = zipfile.ZipFile(self).getinfo(_SERIALIZATION_ID)
        self.seek(info.header_offset + 28)
        start = info.header_offset + 30 + len(info.filename) + struct.unpack("<H", self.read(2))[0]
        blanks = [(start, start + info.file_size + 8)]  # the id and the descriptor's CRC-32
        self.seek(0)
        directory = zipfile.ZipFile(self).start_dir
        self.seek(directory)
        entries = self.read(self.size - directory)
        at = directory + entries.index(b"archive/.data/serialization_id") - 46 + 16  # the entry's CRC-32
        blanks.append((at, at + 4))
        pages = {index: bytearray(page) for index, page in self.pages.items()}
        for lo, hi in blanks:
            for position in range(lo, hi):
                page, within = divmod(position, self.PAGE)
                if page in pages:
                    pages[page][within] = 0
        return {index: bytes(page) for index, page in pages.items() if any(page)}


def _assert_torch_saves_at_size(obj: object) -> None:
    theirs, ours = _Image(), _Image()
    torch.save(obj, theirs)
    archive = write_archive(ours, obj)
    assert ours.size == theirs.size == archive.size
    assert ours.without_serialization_id() == theirs.without_serialization_id()
    ours.seek(0)
    theirs.seek(0)
    expected, written = zipfile.ZipFile(theirs).infolist(), zipfile.ZipFile(ours).infolist()
    assert [(i.filename, i.header_offset, i.file_size, i.CRC) for i in written if i.filename != _SERIALIZATION_ID] == [
        (i.filename, i.header_offset, i.file_size, i.CRC) for i in expected if i.filename != _SERIALIZATION_ID
    ]
    records = {record.name: record for record in archive.records}
    assert [(info.file_size, info.CRC) for info in written] == [
        (records[info.filename.removeprefix("archive/")].size, records[info.filename.removeprefix("archive/")].crc)
        for info in written
    ]


_GIB = 1 << 30


@pytest.mark.large
@pytest.mark.parametrize(
    "shapes",
    [
        pytest.param([(4 * _GIB + 1000) // 4], id="a record past 4 GiB"),
        pytest.param([1000, (2 * _GIB + 4096) // 4, (2 * _GIB + 4096) // 4, 7], id="an archive past 4 GiB"),
        pytest.param([(4 * _GIB + 4096) // 4, (_GIB + 4096) // 4, 3], id="a record past 4 GiB beyond 4 GiB"),
    ],
)
def test_archives_past_4_gib_are_torch_saves_with_zip64_fields(shapes):
    # untouched memory: zeros that take no room, read from the kernel's zero page
    _assert_torch_saves_at_size([torch.empty(numel, dtype=torch.float32) for numel in shapes])


@pytest.mark.large
def test_an_archive_of_more_than_65535_records_is_torch_saves():
    _assert_torch_saves_at_size([torch.full((2,), float(i)) for i in range(65_600)])


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
