"""No checkpoint runs code when it is loaded, inspected, verified, exported, consolidated or searched, unless its user
vouches for it (``weights_only=False``, ``--trust``); sizes and offsets read from a checkpoint are checked against
its files before anything is allocated from them."""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from ignite.engine import Engine
from launcher import run_ranks
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import (
    Checkpoint,
    DiskSaver,
    IntegrityError,
    RankFailureError,
    ShardedSaver,
    UnsafeCheckpointError,
    cli,
    export,
    find_latest,
)
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats.dcp_entries import INDEX, EntryRecord, pack_records, unpack_records

_MARKER = "planted-by-the-checkpoint"


def _plant(path: str) -> str:
    """What the payload runs when unpickled: it leaves a file behind."""
    Path(path).write_text("ran")
    return "ran"


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (_plant, (str(self.marker),))


class _Extra:
    """An object whose state is a value that runs code when unpickled."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _forge_metadata(directory: Path, marker: Path, manifest: bool, index: bool = False) -> None:
    """Put the payload into ``.metadata``; rewrite the manifest to match, as anyone who can write the directory can,
    without the index of the entries (as a manifest written before it) unless ``index``."""
    path = directory / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    metadata.planner_data = {**(metadata.planner_data or {}), "forged": _Payload(marker)}
    content = pickle.dumps(metadata)
    path.write_bytes(content)
    manifest_path = directory / sharded.MANIFEST
    if not manifest:
        manifest_path.unlink(missing_ok=True)
    else:
        saved = json.loads(manifest_path.read_text())
        crc = zlib.crc32(content)
        saved["files"][".metadata"] = {"size": len(content), "crc32": crc, "records": [[0, len(content), crc, 0, crc]]}
        if not index:
            del saved["files"][INDEX]
            (directory / INDEX).unlink()
        manifest_path.write_text(json.dumps(saved))


def _ours(tmp_path: Path, place: str | None = None, storage_options: Any = None, extra: Any = None) -> str:
    """A sharded checkpoint of a model (and ``extra``) saved in one process: its path or URL."""
    objects: dict[str, Any] = {"model": tiny_model()}
    if extra is not None:
        objects["extra"] = _Extra(extra)
    saver = ShardedSaver(place or tmp_path / "ckpt", require_empty=False, storage_options=storage_options)
    Checkpoint(objects, saver)(Engine(lambda e, b: None))
    return f"{place or tmp_path / 'ckpt'}/{'checkpoint_0.dcp' if extra is not None else 'model_0.dcp'}"


def _foreign(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "foreign.dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": tiny_model().state_dict()}, checkpoint_id=directory, no_dist=True)
    return directory


def _file(tmp_path: Path, marker: Path, sealed: bool) -> Path:
    state = {"model": tiny_model().state_dict(), "extra": {"value": _Payload(marker)}}
    if sealed:
        DiskSaver(tmp_path / "files", require_empty=False)(state, "checkpoint_0.pt")
        return tmp_path / "files" / "checkpoint_0.pt"
    tmp_path.mkdir(parents=True)
    path = tmp_path / "plain.pt"
    torch.save(state, path)
    return path


def _kinds(tmp_path: Path, marker: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each kind of checkpoint with a payload in each place a pickle lives, and what loads from it."""
    kinds: dict[str, tuple[Path, dict[str, Any]]] = {}
    for manifest in (True, False):
        path = Path(_ours(tmp_path / f"metadata-{manifest}"))
        _forge_metadata(path, marker, manifest)
        kinds[f"our directory's .metadata, manifest {manifest}"] = (path, {"model": tiny_model(seed=1)})
    foreign = _foreign(tmp_path)
    _forge_metadata(foreign, marker, manifest=False)
    kinds["a dcp.save directory's .metadata"] = (foreign, {"model": tiny_model(seed=1)})
    value = Path(_ours(tmp_path / "value", extra=_Payload(marker)))
    kinds["a sharded value"] = (value, {"model": tiny_model(seed=1), "extra": _Extra()})
    for sealed in (True, False):
        to_load = {"model": tiny_model(seed=1), "extra": _Extra()}
        kinds[f"a file, sealed {sealed}"] = (_file(tmp_path / f"file-{sealed}", marker, sealed), to_load)
    return kinds


def _load(path: Path, to_load: dict[str, Any], **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a directory or file without manifest or trailer loads with a warning
        Checkpoint.load_objects(to_load, str(path), **kwargs)


def test_every_kind_of_checkpoint_refuses_code_at_every_entry_point_unless_trusted(tmp_path, capsys):
    marker = tmp_path / _MARKER
    for kind, (path, to_load) in _kinds(tmp_path / "kinds", marker).items():
        before = {name: dict(obj.state_dict()) for name, obj in to_load.items()}
        with pytest.raises(UnsafeCheckpointError, match=r"refused to unpickle .*weights_only=False.*--trust"):
            _load(path, to_load)
        assert not marker.exists(), kind
        for name, obj in to_load.items():  # nothing changed
            assert_state_equal(dict(obj.state_dict()), before[name])
        handler = Checkpoint(to_load, DiskSaver(path.parent, require_empty=False))
        with pytest.raises(UnsafeCheckpointError):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                handler.load_latest(to_load)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            find_latest(path.parent)  # searching verifies, and unpickles nothing
        # a value of a directory is read by loads and consolidations only: listing and exporting a model read none
        in_structure = kind != "a sharded value"
        for command in (["inspect"], ["inspect", "--json"], ["export"]):
            target = [str(tmp_path / "exported")] if command == ["export"] else []
            assert cli.main([*command, str(path), *target]) == (1 if in_structure else 0), (kind, command)
            assert ("refused to unpickle" in capsys.readouterr().err) == in_structure
            shutil.rmtree(tmp_path / "exported", ignore_errors=True)
        if path.is_dir():
            assert cli.main(["consolidate", str(path), str(tmp_path / "one.pt")]) == 1, kind
            assert "refused to unpickle" in capsys.readouterr().err and not (tmp_path / "one.pt").exists()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cli.main(["verify", str(path)])  # checks checksums, unpickles nothing
        if in_structure:
            with pytest.raises(UnsafeCheckpointError):
                export(path, tmp_path / "exported")
        assert not marker.exists(), kind
        capsys.readouterr()

        # vouched for: loads, and the payload runs, as documented
        _load(path, to_load, weights_only=False)
        assert marker.exists(), kind
        marker.unlink()
        assert cli.main(["inspect", "--trust", str(path)]) == 0, kind
        assert marker.exists() == in_structure, kind
        marker.unlink(missing_ok=True)
        if path.is_dir():
            assert cli.main(["consolidate", "--trust", str(path), str(tmp_path / "one.pt")]) == 0, kind
            (tmp_path / "one.pt").unlink()
            marker.unlink(missing_ok=True)


def test_our_directory_is_read_by_its_index_and_its_metadata_left_unread(tmp_path, capsys):
    """A load, a listing, an export and a consolidation of a directory of ours read the manifest's index of the
    entries, not ``.metadata`` (kept for DCP's own readers): whatever that holds, nothing of it runs."""
    marker = tmp_path / _MARKER
    path = Path(_ours(tmp_path / "ckpt"))
    _forge_metadata(path, marker, manifest=True, index=True)
    fresh = tiny_model(seed=1)
    Checkpoint.load_objects({"model": fresh}, str(path))
    assert_state_equal(fresh.state_dict(), tiny_model().state_dict())
    assert cli.main(["inspect", str(path)]) == 0 and cli.main(["verify", str(path)]) == 0
    assert cli.main(["export", str(path), str(tmp_path / "exported")]) == 0
    assert cli.main(["consolidate", str(path), str(tmp_path / "one.pt")]) == 0
    assert_state_equal(torch.load(tmp_path / "one.pt", weights_only=True)["model"], tiny_model().state_dict())
    assert not marker.exists() and "refused" not in capsys.readouterr().err


def test_a_checkpoint_of_data_alone_loads_as_before(tmp_path):
    """What the package writes holds data alone: RandomState, an engine, schedulers load without trust."""
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters())
    train_step(model, optimizer, 0, 0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    engine = Engine(lambda e, b: None)
    engine.run(range(3))
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "trainer": engine}
    for saver in (ShardedSaver(tmp_path / "sharded"), DiskSaver(tmp_path / "file")):
        Checkpoint(objects, saver)(engine)
    for path in (tmp_path / "sharded" / "checkpoint_3.dcp", tmp_path / "file" / "checkpoint_3.pt"):
        fresh = tiny_model(seed=1)
        fresh_engine = Engine(lambda e, b: None)
        to_load = {
            "model": fresh,
            "optimizer": torch.optim.Adam(fresh.parameters()),
            "scheduler": torch.optim.lr_scheduler.StepLR(torch.optim.Adam(fresh.parameters()), 5),
            "trainer": fresh_engine,
        }
        Checkpoint.load_objects(to_load, str(path))
        assert_state_equal(fresh.state_dict(), model.state_dict())
        assert fresh_engine.state.iteration == 3 and to_load["scheduler"].step_size == 2
        assert cli.main(["inspect", str(path)]) == 0


def test_an_object_store_checkpoint_refuses_code(tmp_path, bucket, storage_options):
    marker = tmp_path / _MARKER
    url = _ours(tmp_path, f"{bucket}/run", storage_options, extra=_Payload(marker))
    to_load = {"model": tiny_model(seed=1), "extra": _Extra()}
    with pytest.raises(UnsafeCheckpointError, match="refused to unpickle"):
        Checkpoint.load_objects(to_load, url, storage_options=storage_options)
    assert not marker.exists() and to_load["extra"].value is None
    option = ["--storage-option", f"endpoint_url={storage_options['endpoint_url']}"]
    assert cli.main(["consolidate", url, str(tmp_path / "one.pt"), *option]) == 1
    assert not marker.exists()
    Checkpoint.load_objects(to_load, url, storage_options=storage_options, weights_only=False)
    assert marker.exists() and to_load["extra"].value == "ran"


def _load_poisoned(rank, world_size, directory, marker):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    train_step(model, optimizer, rank, 0)
    objects = {"model": model, "optimizer": optimizer, "extra": _Extra(_Payload(marker))}
    Checkpoint(objects, ShardedSaver(directory))(Engine(lambda e, b: None))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    train_step(model, optimizer, rank, 1)
    after = {key: value.clone() for key, value in model.state_dict().items()}
    objects["extra"] = _Extra()
    try:
        Checkpoint.load_objects(objects, directory / "checkpoint_0.dcp")
    except RankFailureError as error:
        assert isinstance(error.__cause__, UnsafeCheckpointError)
        assert_state_equal(model.state_dict(), after)  # unchanged by the refused load
        assert not Path(marker).exists() and objects["extra"].value is None
        assert before.keys() == after.keys()
        return str(error)
    raise AssertionError("the load was not refused")


@pytest.mark.distributed
def test_every_rank_refuses_a_poisoned_sharded_checkpoint(tmp_path):
    errors = run_ranks(_load_poisoned, 2, tmp_path / "ckpt", str(tmp_path / _MARKER))
    assert all("UnsafeCheckpointError" in error and "refused to unpickle" in error for error in errors)


# --- sizes and offsets ----------------------------------------------------------------------------------------------


def test_metadata_that_claims_more_than_the_files_hold_is_an_integrity_error(tmp_path):
    for forge, message in (
        (lambda m: _grow_tensor(m, 10**11), "claims more bytes than its chunks hold"),
        (lambda m: _move_entry(m, 10**12), "which has .* bytes: truncated, corrupt or forged"),
        (lambda m: _move_entry(m, -5), "corrupt or forged"),
        (lambda m: _overlap_entries(m), "over each other"),
    ):
        directory = Path(_ours(tmp_path / str(len(message)) / message[:8].replace(" ", "-")))
        path = directory / ".metadata"
        metadata = pickle.loads(path.read_bytes())
        forge(metadata)
        content = pickle.dumps(metadata)
        path.write_bytes(content)
        (directory / sharded.MANIFEST).unlink()  # read as another tool's directory: only the sizes are checked
        with pytest.raises(IntegrityError, match=message), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Checkpoint.load_objects({"model": tiny_model(seed=1)}, str(directory))


def _grow_tensor(metadata: Any, numel: int) -> None:
    name = next(name for name in metadata.state_dict_metadata if name.endswith("weight"))
    metadata.state_dict_metadata[name].size = torch.Size([numel, 7])


def _move_entry(metadata: Any, offset: int) -> None:
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].offset = offset


def _overlap_entries(metadata: Any) -> None:
    first, second = list(metadata.storage_data.values())[:2]
    second.offset = first.offset + 1


def test_manifest_records_outside_their_file_are_an_integrity_error(tmp_path):
    directory = Path(_ours(tmp_path))
    manifest_path = directory / sharded.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    name = next(name for name in manifest["files"] if name.endswith(".distcp"))
    table = unpack_records(manifest["files"][name]["records"]).copy()
    table[0, 1] = 10**12  # an entry's length
    manifest["files"][name]["records"] = pack_records([EntryRecord._make(row) for row in table.tolist()])
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="outside its .* bytes or over another entry"):
        sharded.entry_records(sharded.read_manifest(directory))
    with pytest.raises(IntegrityError):
        Checkpoint.load_objects({"model": tiny_model(seed=1)}, str(directory))


def test_a_file_whose_pickle_claims_more_than_the_file_is_an_integrity_error(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(70_000)}, path)
    data = path.read_bytes()
    claimed = b"J" + (70_000).to_bytes(4, "little")
    assert claimed in data
    path.write_bytes(data.replace(claimed, b"J" + (0x7FFFFFFF).to_bytes(4, "little")))  # 8 GB of float32
    with pytest.raises(IntegrityError, match="lies past the end of the file"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Checkpoint.load_objects({"w": _Holder()}, str(path))


class _Holder:
    def load_state_dict(self, state: Any) -> None:
        raise AssertionError("nothing may be loaded from a forged file")

    def state_dict(self) -> dict[str, Any]:
        return {}


def test_the_consolidation_of_a_copy_is_unaffected(tmp_path):
    """A directory copied whole keeps loading: the checks compare with the files, not with where they were."""
    directory = Path(_ours(tmp_path))
    copy = tmp_path / "copy.dcp"
    shutil.copytree(directory, copy)
    model = tiny_model(seed=1)
    Checkpoint.load_objects({"model": model}, str(copy))
    assert_state_equal(model.state_dict(), tiny_model().state_dict())


def test_reload_objects_refuses_code_unless_trusted(tmp_path):
    marker = tmp_path / _MARKER
    objects = {"model": tiny_model(), "extra": _Extra(_Payload(marker))}
    handler = Checkpoint(objects, ShardedSaver(tmp_path / "ckpt"), global_step_transform=lambda *_: 1)
    handler(Engine(lambda e, b: None))
    to_load = {"model": tiny_model(seed=1), "extra": _Extra()}
    with pytest.raises(UnsafeCheckpointError, match="refused to unpickle"):
        handler.reload_objects(to_load, global_step=1)
    assert not marker.exists() and to_load["extra"].value is None
    handler.reload_objects(to_load, load_kwargs={"weights_only": False}, global_step=1)
    assert marker.exists() and to_load["extra"].value == "ran"


def test_metadata_of_a_directory_that_lacks_files_is_read(tmp_path):
    """One host's directory of a replicated checkpoint holds some of its files: what it lacks bounds nothing."""
    directory = Path(_ours(tmp_path))
    for path in directory.glob("*.distcp"):
        path.unlink()
    assert sharded.read_contents(directory).entry_index.names
