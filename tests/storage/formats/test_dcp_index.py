"""The index of a sharded checkpoint's entries (ignite_zero.storage.formats.dcp_index), a file sealed by the manifest:
what a load needs of ``.metadata``, read back alike, and checked against the files before anything is allocated from
it."""

from __future__ import annotations

import base64
import json
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ignite.engine import Engine
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from training import assert_state_equal, tiny_model, train_step

from ignite_zero import Checkpoint, IntegrityError, ShardedSaver, _compat, cli, export
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats.dcp_entries import INDEX
from ignite_zero.storage.formats.dcp_index import EntryIndex, EntryPlace
from ignite_zero.storage.formats.trust import load_metadata


def _tensor(dtype: torch.dtype, size: list[int], chunks: list[tuple[list[int], list[int]]]) -> TensorStorageMetadata:
    blocks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in chunks]
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), blocks)


def _metadata() -> Metadata:
    """Tensors of 0 to 3 dimensions and several dtypes, in one chunk or several, a tensor without chunks, and
    values; paths of names and positions."""
    described: dict[str, Any] = {
        "model.layers.0.weight": _tensor(torch.float32, [4, 6], [([0, 0], [2, 6]), ([2, 0], [2, 6])]),
        "model.layers.0.bias": _tensor(torch.bfloat16, [6], [([0], [6])]),
        "model.cube": _tensor(torch.int64, [2, 3, 4], [([0, 0, 0], [2, 3, 2]), ([0, 0, 2], [2, 3, 2])]),
        "optimizer.state.0.step": _tensor(torch.float32, [], [([], [])]),
        "optimizer.state.0.empty": _tensor(torch.float16, [0, 5], []),
        "optimizer.param_groups.0.lr": BytesStorageMetadata(),
        "trainer.epoch": BytesStorageMetadata(),
    }
    places: dict[MetadataIndex, Any] = {}
    offset = 0
    for name, storage in described.items():
        chunks = storage.chunks if isinstance(storage, TensorStorageMetadata) else [None]
        for n, chunk in enumerate(chunks):
            index = MetadataIndex(name) if chunk is None else MetadataIndex(name, chunk.offsets)
            places[index] = _compat.dcp_storage_info(f"__{n}_0.distcp", offset, 100 + len(places))
            offset += 100 + len(places)
    paths = {name: tuple(name.split(".", 1)) for name in described}
    paths["optimizer.state.0.step"] = ("optimizer", "state", 0, "step")
    return Metadata(described, planner_data=paths, storage_data=places)


def _round_trip(index: EntryIndex) -> EntryIndex:
    return EntryIndex.parse(index.to_json(), 100)


def test_the_index_holds_what_metadata_describes_and_reads_back_alike():
    metadata = _metadata()
    for index in (EntryIndex.of_metadata(metadata, "here"), _round_trip(EntryIndex.of_metadata(metadata, "here"))):
        assert index.names == list(metadata.state_dict_metadata)
        assert index.paths == {name: tuple(path) for name, path in metadata.planner_data.items()}
        for name, storage in metadata.state_dict_metadata.items():
            layout = index.layout(name)
            if isinstance(storage, BytesStorageMetadata):
                info = metadata.storage_data[MetadataIndex(name)]
                assert layout is None and index.value_place(name) == _place(info)
                assert index.chunk(name, ()) is None
                continue
            assert layout is not None and index.value_place(name) is None
            assert (layout.dtype, layout.size) == (storage.properties.dtype, storage.size)
            assert layout.nbytes == storage.size.numel() * storage.properties.dtype.itemsize
            assert len(layout.chunks) == len(storage.chunks)
            for chunk, saved in zip(layout.chunks, storage.chunks):
                info = metadata.storage_data[MetadataIndex(name, saved.offsets)]
                assert chunk == (tuple(saved.offsets), tuple(saved.sizes), _place(info))
                assert index.chunk(name, saved.offsets) == (layout.dtype, tuple(saved.sizes), _place(info))
        assert index.chunk("model.layers.0.weight", (1, 0)) is None  # no chunk starts there
        assert index.chunk("model.layers.0.weight", (0,)) is None  # nor with one dimension
        assert index.chunk("nothing", (0,)) is None


def _place(info: Any) -> EntryPlace:
    return EntryPlace(info.relative_path, info.offset, info.length)


def _saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A sharded checkpoint of a model, its optimizer and a value, saved in one process; what it saved."""
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters())
    train_step(model, optimizer, 0, 0)
    objects = {"model": model, "optimizer": optimizer}
    Checkpoint(objects, ShardedSaver(tmp_path / "ckpt", require_empty=False))(Engine(lambda e, b: None))
    return tmp_path / "ckpt" / "checkpoint_0.dcp", objects


def test_a_save_indexes_what_its_metadata_describes(tmp_path):
    directory, _ = _saved(tmp_path)
    manifest = sharded.read_manifest(directory)
    assert manifest is not None and manifest["version"] == 3 and INDEX in manifest["files"]
    metadata = load_metadata((directory / ".metadata").read_bytes(), "here", trusted=False)
    index = sharded.read_contents(directory).entry_index
    assert index.to_json() == (directory / INDEX).read_bytes() == EntryIndex.of_metadata(metadata, "x").to_json()


def test_a_manifest_without_index_is_indexed_from_its_metadata(tmp_path):
    """Manifests written before the index (version 2) load and verify as before."""
    directory, objects = _saved(tmp_path)
    manifest_path = directory / sharded.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"][INDEX]
    manifest["version"] = 2
    manifest_path.write_text(json.dumps(manifest))
    index = (directory / INDEX).read_bytes()
    (directory / INDEX).unlink()
    assert sharded.read_contents(directory).entry_index.to_json() == index
    model = tiny_model(seed=1)
    optimizer = torch.optim.Adam(model.parameters())
    Checkpoint.load_objects({"model": model, "optimizer": optimizer}, str(directory))
    assert_state_equal(model.state_dict(), objects["model"].state_dict())
    assert cli.main(["verify", str(directory)]) == 0


def _forge(directory: Path, change: Any) -> None:
    """Rewrite the index with ``change`` (given it and its table), and the manifest to match, as anyone who can write
    the directory can."""
    index = json.loads((directory / INDEX).read_bytes())
    data = zlib.decompress(base64.b64decode(index["table"]))
    table = np.frombuffer(data, dtype="<i8").reshape(-1, 6 + 3 * index["dims"]).copy()
    encoded = index["table"]
    change(index, table)
    if index["table"] == encoded:  # else the change is of the table's encoding
        index["table"] = base64.b64encode(zlib.compress(table.tobytes())).decode()
    _reseal(directory, json.dumps(index).encode())


def _reseal(directory: Path, content: bytes) -> None:
    """Put ``content`` in the index's place, and its size and CRC-32 in the manifest."""
    (directory / INDEX).write_bytes(content)
    manifest_path = directory / sharded.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    crc = zlib.crc32(content)
    manifest["files"][INDEX] = {"size": len(content), "crc32": crc, "records": [[0, len(content), crc, 0, crc]]}
    manifest_path.write_text(json.dumps(manifest))


def _set(column: int, value: int, row: int = -1) -> Any:
    def change(index: dict[str, Any], table: np.ndarray) -> None:
        table[row, column] = value

    return change


def _two_kinds_of_step(index: dict[str, Any], table: np.ndarray) -> None:
    index["paths"][0], index["paths"][1] = ["model", 0], ["model", "weight"]


def _chunk_size(index: dict[str, Any], table: np.ndarray) -> None:
    tensor = int(np.flatnonzero(table[:, 4] >= 0)[0])
    table[tensor, 6 + 2 * index["dims"]] += 1


def _overlap(index: dict[str, Any], table: np.ndarray) -> None:
    first, second = (int(n) for n in np.flatnonzero(table[:, 1] == 0)[:2])
    table[second, 2] = table[first, 2] + 1


def _grow(index: dict[str, Any], table: np.ndarray) -> None:
    table[(table[:, 4] >= 0) & (table[:, 5] >= 1), 6] = 10**9  # every tensor's first dimension


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda index, table: index.update(paths=index["paths"][:-1]), "the index of the entries is corrupt"),
        (lambda index, table: index.update(paths=[["a", 1.5]] + index["paths"][1:]), "index .* is corrupt"),
        (lambda index, table: index.update(paths=[index["paths"][1]] + index["paths"][1:]), "one name"),
        (lambda index, table: index.update(files=index["files"] * 2), "names a file twice"),
        (lambda index, table: index.update(files=["./" + index["files"][0]]), "not names of files of the directory"),
        (lambda index, table: index.update(files=["elsewhere.distcp"]), "which the manifest does not list"),
        (lambda index, table: index.update(dtypes=["system"] * len(index["dtypes"])), "not all torch's"),
        (lambda index, table: index.update(files=[]), "refers to a file"),
        (lambda index, table: index.update(dims=index["dims"] + 1), "not .* rows of"),
        (lambda index, table: index.update(rows=10**9), "claims 1000000000 rows, more than the"),
        (lambda index, table: index.update(table="AAAA"), "not compressed in base64"),
        (_set(4, 99), "refers to a file, a dtype"),
        (_set(0, 0), "not by entry"),
        (_set(2, 10**12, 0), "which has .* bytes: truncated, corrupt or forged"),
        (_set(2, -5, 0), "corrupt or forged"),
        (_overlap, "over each other"),
        (_chunk_size, "lies outside it or its entry"),
        (_grow, "claims more bytes than its chunks hold"),
    ],
)
def test_a_corrupt_or_forged_index_is_an_integrity_error(tmp_path, change, message):
    directory, _ = _saved(tmp_path)
    _forge(directory, change)
    model = tiny_model(seed=1)
    before = dict(model.state_dict())
    with pytest.raises(IntegrityError, match=message):
        Checkpoint.load_objects({"model": model, "optimizer": torch.optim.Adam(model.parameters())}, str(directory))
    assert_state_equal(model.state_dict(), before)  # nothing loaded
    with pytest.raises(IntegrityError, match=message):
        sharded.verify(directory, whole=False)


def _through_a_value(index: dict[str, Any], table: np.ndarray) -> None:
    index["paths"][1] = [*index["paths"][0], "inside"]


def _far_position(index: dict[str, Any], table: np.ndarray) -> None:
    index["paths"][0] = ["model", 10**15]


@pytest.mark.parametrize("change", [_two_kinds_of_step, _through_a_value, _far_position])
def test_paths_that_make_no_state_are_an_integrity_error(tmp_path, change):
    """Found when the state is nested again: entries of one object at a position and at a key, a path that runs
    through another entry's value, a position that would grow a list past what entries fill."""
    directory, _ = _saved(tmp_path)
    _forge(directory, change)
    model = tiny_model(seed=1)
    before = dict(model.state_dict())
    with pytest.raises(IntegrityError, match="paths do not make one state"):
        Checkpoint.load_objects({"model": model, "optimizer": torch.optim.Adam(model.parameters())}, str(directory))
    assert_state_equal(model.state_dict(), before)


def _past_the_data(index: dict[str, Any], table: np.ndarray) -> None:
    """A vector as long as its whole entry: within it, but past the room its bytes have after its headers."""
    vector = int(np.flatnonzero((table[:, 4] >= 0) & (table[:, 5] == 1))[0])
    table[vector, 6] = table[vector, 6 + 2 * index["dims"]] = table[vector, 3] // 4  # float32


def test_a_tensor_past_its_data_is_an_integrity_error(tmp_path):
    directory, _ = _saved(tmp_path)
    _forge(directory, _past_the_data)
    with pytest.raises(IntegrityError, match="bytes of data do not fit its entry"):
        export(directory, tmp_path / "exported")


def test_an_index_of_json_too_deep_or_missing_is_an_integrity_error(tmp_path):
    directory, _ = _saved(tmp_path)
    _reseal(directory, b"[" * 100_000)
    with pytest.raises(IntegrityError, match="the index of the entries is corrupt"):
        sharded.verify(directory, whole=False)
    (directory / INDEX).unlink()
    with pytest.raises(IntegrityError, match=f"file {INDEX} is missing"):
        sharded.verify(directory, whole=False)


def test_an_index_not_as_sealed_is_an_integrity_error(tmp_path):
    directory, _ = _saved(tmp_path)
    path = directory / INDEX
    content = path.read_bytes()
    for changed, message in (
        (content[:-1], rf"file {INDEX} has \d+ bytes, \d+ expected \(truncated\?\)"),
        (content[:-1] + b" ", rf"{INDEX} is corrupt \(CRC-32"),
    ):
        path.write_bytes(changed)
        with pytest.raises(IntegrityError, match=message):
            Checkpoint.load_objects({"model": tiny_model(seed=1)}, str(directory))
        with pytest.raises(IntegrityError, match=message):
            sharded.verify(directory, whole=False)


def test_a_tensor_whose_chunks_hold_less_than_it_is_an_integrity_error():
    metadata = _metadata()
    metadata.state_dict_metadata["model.layers.0.bias"].size = torch.Size([7])
    index = _round_trip(EntryIndex.of_metadata(metadata, "here"))
    with pytest.raises(IntegrityError, match="tensor model.layers.0.bias claims more bytes than its chunks hold"):
        index.check_bounds({}, "here")
    metadata = _metadata()
    metadata.state_dict_metadata["optimizer.state.0.empty"].size = torch.Size([1, 5])  # no chunk holds it
    with pytest.raises(IntegrityError, match="optimizer.state.0.empty claims more bytes"):
        EntryIndex.of_metadata(metadata, "here").check_bounds({}, "here")
    metadata = _metadata()  # no element, but dimensions that no tensor can have
    metadata.state_dict_metadata["optimizer.state.0.empty"].size = torch.Size([0, 2**40, 2**40])
    with pytest.raises(IntegrityError, match="optimizer.state.0.empty claims more bytes"):
        EntryIndex.of_metadata(metadata, "here").check_bounds({}, "here")
    metadata = _metadata()
    del metadata.storage_data[MetadataIndex("trainer.epoch")]
    with pytest.raises(IntegrityError, match="value trainer.epoch has no entry"):
        EntryIndex.of_metadata(metadata, "here")


def test_a_foreign_directory_is_indexed_from_its_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "theirs", no_dist=True)
        contents = sharded.read_contents(tmp_path / "theirs")
        assert contents.records is None
        assert sorted(contents.entry_index.names) == sorted(f"model.{name}" for name in model.state_dict())
        fresh = tiny_model(seed=1)
        Checkpoint.load_objects({"model": fresh}, str(tmp_path / "theirs"))
    assert_state_equal(fresh.state_dict(), model.state_dict())
