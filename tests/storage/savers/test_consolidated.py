"""A consolidated save written while the other ranks' state arrives: the file holds, record by record, what
``torch.save`` writes of the same state gathered beforehand, and torch's readers, stock ignite and ``verify`` read it.
A load reads it back into the tensors it restores.
"""

import contextlib
import os
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from ignite.engine import Engine
from ignite.handlers import Checkpoint as IgniteCheckpoint
from launcher import run_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, mixed_objects, small_net, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver, IntegrityError, ShardedSaver, cli
from ignite_zero.adapters import ZeROState, adapt
from ignite_zero.storage.formats.file_verification import verify_file

pytestmark = pytest.mark.distributed

_SERIALIZATION_ID = "archive/.data/serialization_id"


def _save_both_ways(rank, world_size, tmp_path, kind, recipient):
    to_save = mixed_objects(kind, rank)
    to_save["trainer"].run(range(2), max_epochs=1)  # Adam state and a ZeRO partition on every rank
    Checkpoint(to_save, DiskSaver(tmp_path / "ours"), consolidate_recipient_rank=recipient)(to_save["trainer"])
    # the same state gathered first, outside a save, written by torch.save itself
    adapted = adapt(to_save, recipient)
    full = {name: obj.state_dict() for name, obj in adapted.items()}
    if rank == recipient:  # to a stream, as DiskSaver has torch.save write: records in a folder named "archive"
        with open(tmp_path / "reference.pt", "wb") as f:
            torch.save(full, f)


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_a_consolidated_file_is_torch_saves_record_by_record(tmp_path, kind):
    run_ranks(_save_both_ways, 2, tmp_path, kind, 1)
    ours, reference = tmp_path / "ours" / "checkpoint_2.pt", tmp_path / "reference.pt"
    with zipfile.ZipFile(ours) as written, zipfile.ZipFile(reference) as expected:
        names = [info.filename for info in expected.infolist()]
        assert [info.filename for info in written.infolist()] == names
        for name in names:
            if not name.endswith(_SERIALIZATION_ID):  # torch derives it from its string hashes
                assert written.read(name) == expected.read(name), name  # data.pkl too: the same pickle
        assert written.testzip() is None  # every record's CRC-32
    assert verify_file(ours) is not None
    for mmap in (False, True):
        assert_state_equal(
            torch.load(ours, weights_only=True, mmap=mmap), torch.load(reference, weights_only=True, mmap=mmap)
        )
    # stock ignite loads the consolidated model into a plain one
    plain = small_net()
    IgniteCheckpoint.load_objects({"model": plain}, torch.load(ours, weights_only=True))
    assert_state_equal(plain.state_dict(), torch.load(reference, weights_only=True)["model"])


def _save_and_fail_to_write(rank, world_size, tmp_path):
    to_save = mixed_objects("fsdp2", rank)
    to_save["trainer"].run(range(2), max_epochs=1)
    saver = DiskSaver(tmp_path / "ours")
    if rank == 0:  # the place fails when the writer starts, while the other rank's state is still arriving
        saver.place.write = lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no space left on the device"))
    with pytest.raises(Exception, match="no space left on the device"):
        Checkpoint(to_save, saver, consolidate_recipient_rank=0)(to_save["trainer"])
    # every stream was drained: the process group still works for both ranks
    value = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(value)
    return value.item()


def test_a_failed_write_still_takes_every_byte_sent_and_fails_on_every_rank(tmp_path):
    assert run_ranks(_save_and_fail_to_write, 2, tmp_path) == [3.0, 3.0]
    assert not list((tmp_path / "ours").glob("*.pt"))


def _load_in_place(rank, world_size, tmp_path):
    model = DistributedDataParallel(tiny_model(seed=3))
    optimizer = zero_adam(model)
    train_step(model, optimizer, rank, 7)  # state of another value, in tensors that loading must reuse
    addresses = _addresses(model, optimizer)
    Checkpoint.load_objects({"model": model, "optimizer": optimizer}, tmp_path / "checkpoint_3.pt")
    return addresses == _addresses(model, optimizer), model.module.state_dict(), ZeROState(optimizer).state_dict()


def _addresses(model, optimizer):
    """Where the model's tensors and this rank's optimizer state live."""
    state = [t.data_ptr() for s in optimizer.optim.state.values() for t in s.values() if t.dim()]
    return [t.data_ptr() for t in model.module.state_dict().values()] + state


def test_a_load_reads_modules_and_zero_partitions_into_their_own_tensors(tmp_path):
    run_ranks(_save, 2, tmp_path)
    saved = torch.load(tmp_path / "checkpoint_3.pt", weights_only=True)
    results = run_ranks(_load_in_place, 2, tmp_path)
    for in_place, model_state, _ in results:
        assert in_place  # no tensor was replaced: the bytes were read into those that were there
        assert_state_equal(model_state, saved["model"])
    assert_state_equal(results[0][2], saved["optimizer"])  # consolidated again on rank 0 from what was loaded


def _save(rank, world_size, tmp_path):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    for step in range(3):
        train_step(model, optimizer, rank, step)
    trainer = Engine(lambda e, b: None)
    trainer.state.iteration = 3
    Checkpoint({"model": model, "optimizer": optimizer}, DiskSaver(tmp_path))(trainer)


# --- past 4 GiB: zip64 records, written as they arrive -------------------------------------------------------------

_ROWS, _COLUMNS = 16_384, 22_000  # three parameters of 1.44 GB: 4.33 GB in all, past 4 GiB (4.29 GB)


class _Large(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(_ROWS, _COLUMNS)) for _ in range(3))


def _fill(tensor: torch.Tensor, index: int, first_row: int) -> torch.Tensor:
    """Each element of parameter ``index`` from its row and column, without a temporary of the tensor's size."""
    rows = torch.arange(first_row, first_row + tensor.shape[0], dtype=torch.float32).unsqueeze(1)
    return tensor.copy_(rows.mul_(3.0).add_(index).expand_as(tensor)).add_(torch.arange(_COLUMNS) / _COLUMNS)


def _large_sharded() -> nn.Module:
    with torch.device("meta"):
        model = _Large()
    fully_shard(model)
    model.to_empty(device="cpu")
    for index, weight in enumerate(model.weights):
        local = weight.to_local()
        first_row = -(-_ROWS // dist.get_world_size()) * dist.get_rank()  # FSDP2's even chunks of dim 0
        with torch.no_grad():
            _fill(local, index, first_row)
    return model


def _assert_filled(model: nn.Module) -> None:
    for index, weight in enumerate(model.weights):
        local, first_row = weight, 0
        if isinstance(weight, DTensor):
            local, first_row = weight.to_local(), -(-_ROWS // dist.get_world_size()) * dist.get_rank()
        for start in range(0, local.shape[0], 2048):  # in pieces, as the expected values take memory
            piece = local[start : start + 2048]
            assert torch.equal(piece, _fill(torch.empty_like(piece), index, first_row + start)), (index, start)


def _save_large(rank, world_size, directory):
    model = _large_sharded()
    before = psutil.Process().memory_info().rss
    with _peak_resident() as peak:
        Checkpoint({"model": model}, DiskSaver(directory), consolidate_recipient_rank=0)(Engine(lambda e, b: None))
    return peak() - before


def _load_large(rank, world_size, path):
    model = _large_sharded() if dist.is_initialized() else _Large()
    Checkpoint.load_objects({"model": model}, path)
    _assert_filled(model)


@contextlib.contextmanager
def _peak_resident() -> Iterator[Callable[[], int]]:
    """The highest resident memory of this process seen every 10 ms while inside."""
    process, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield lambda: peak[0]
    finally:
        done.set()
        sampler.join()


@pytest.mark.large
def test_past_4_gib_consolidated_saves_and_consolidations_stream_and_load_anywhere(tmp_path):
    # tmpfs where there is one: 4.3 GB written and read back four times, then saved sharded and consolidated
    scratch = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp_path))
    try:
        growth = run_ranks(_save_large, 2, scratch, timeout=240)
        (path,) = scratch.glob("*.pt")
        assert path.stat().st_size > 4 << 30
        assert growth[0] < 300 << 20, growth  # through the slots: not the 4.3 GB it receives and writes
        with zipfile.ZipFile(path) as archive:
            assert max(info.header_offset for info in archive.infolist()) > 0xFFFFFFFF
            saved = _storages(archive)
        assert verify_file(path) is not None
        for world_size in (1, 2, 3):
            run_ranks(_load_large, world_size, path, timeout=240, init=world_size > 1)
        # torch's own reader, mapped: every parameter as saved
        loaded = torch.load(path, weights_only=True, mmap=True)  # a single object: its state itself
        for index in range(3):
            _assert_filled_plain(loaded[f"weights.{index}"], index)
        del loaded
        # a corrupt byte past the 4 GiB mark: verify and a load name it
        with open(path, "r+b") as f:
            f.seek((4 << 30) + 12345)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(IntegrityError, match="corrupt"):
            verify_file(path)
        with pytest.raises(IntegrityError, match="corrupt"):
            _load_large(0, 1, path)
        path.unlink()

        # the same state saved sharded, then consolidated by the command line in bounded memory: the same storages
        run_ranks(_save_large_sharded, 2, scratch / "sharded", timeout=240)
        (directory,) = (scratch / "sharded").glob("*.dcp")
        target = scratch / "one.pt"
        before = psutil.Process().memory_info().rss
        with _peak_resident() as peak:
            assert cli.main(["consolidate", str(directory), str(target)]) == 0
        assert peak() - before < 300 << 20  # a window of rows, not the 4.3 GB it writes
        shutil.rmtree(directory)
        assert verify_file(target) is not None
        with zipfile.ZipFile(target) as archive:
            assert _storages(archive) == saved
    finally:
        shutil.rmtree(scratch)


def _save_large_sharded(rank, world_size, directory):
    Checkpoint({"model": _large_sharded()}, ShardedSaver(directory))(Engine(lambda e, b: None))


def _storages(archive: zipfile.ZipFile) -> list[tuple[int, int]]:
    """The size and CRC-32 of each storage an archive holds, in order."""
    return [(info.file_size, info.CRC) for info in archive.infolist() if "/data/" in info.filename]


def _assert_filled_plain(weight: torch.Tensor, index: int) -> None:
    for start in range(0, weight.shape[0], 2048):
        piece = weight[start : start + 2048]
        assert torch.equal(piece, _fill(torch.empty_like(piece), index, start)), (index, start)
