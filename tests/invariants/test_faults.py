"""Fault injection on real processes: whatever fails, and wherever it fails, the previous checkpoint still loads and
verifies, and every rank learns about the failure instead of hanging.

Each scenario saves a first checkpoint (``checkpoint_1.pt``), trains a step, and injects one fault into the
second save. Ranks run with a short ``sync_timeout`` so that a dead rank is detected in seconds.
"""

import errno
import logging
import os
import signal
import subprocess
import zipfile

import pytest
import torch
import torch.distributed as dist
from ignite.engine import Engine
from launcher import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import (
    Checkpoint,
    CollectiveTimeoutError,
    DiskSaver,
    IntegrityError,
    RankFailureError,
    ShardedSaver,
    verify_file,
)
from ignite_zero.storage.formats import directory as sharded

SYNC_TIMEOUT = 2.0


def _die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


class _FailingFile:
    """File object that passes writes through until ``limit`` bytes, then dies or raises ``error``."""

    def __init__(self, f, limit, error=None):
        self.f, self.limit, self.error, self.written = f, limit, error, 0

    def write(self, data):
        self.written += len(data)
        if self.written > self.limit:
            if self.error is None:
                _die()
            raise self.error
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def _dump_through(saver, limit, error=None):
    original = saver._dump

    def dump(checkpoint, f, func):
        original(checkpoint, _Sealable(f, _FailingFile(f, limit, error)), func)

    return dump


class _Sealable:
    """Hands torch.save the failing file, and sealing (seek/read after the save) the real one."""

    def __init__(self, f, failing):
        self.f, self.failing = f, failing

    def write(self, data):
        return self.failing.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def _inject(fault, saver, model_size):
    """Patch this process (the recipient, or the rank that dies) so that ``fault`` happens in the next save."""
    if fault == "kill before writing":
        saver._check_room = _die
    elif fault == "kill while writing":
        saver._dump = _dump_through(saver, limit=model_size // 3)
    elif fault == "kill after the rename":
        original = os.replace

        def replace_then_die(src, dst):
            original(src, dst)
            _die()

        os.replace = replace_then_die
    elif fault == "kill before removing the old file":
        saver.remove = _die
    elif fault == "exception in the saver":
        saver._dump = lambda checkpoint, f, func: (_ for _ in ()).throw(ValueError("saver bug"))
    elif fault == "EIO while writing":
        saver._dump = _dump_through(saver, limit=model_size // 3, error=OSError(errno.EIO, "Input/output error"))
    elif fault == "ENOSPC while writing":
        saver._check_room = lambda checkpoint, path: None  # let the write itself hit the full disk
    elif fault == "ENOSPC before writing":
        pass  # the real free-space check refuses the write
    elif fault == "non-recipient dies in the gather":
        calls = []

        def send(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # after its header, before its tensors
                _die()
            return original_send(*args, **kwargs)

        original_send = dist.send
        dist.send = send
    else:
        raise ValueError(fault)


def _model(width):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, 3))


def _save_with_fault(rank, world_size, dirname, fault, faulty_rank, width):
    model = DistributedDataParallel(_model(width))
    optimizer = zero_adam(model)
    saver = DiskSaver(dirname, require_empty=False)
    checkpoint = Checkpoint(
        {"model": model, "optimizer": optimizer},
        saver,
        n_saved=1,
        consolidate_recipient_rank=1,
        sync_timeout=SYNC_TIMEOUT,
    )
    engine = Engine(lambda e, b: None)
    for iteration in (1, 2):
        x = torch.randn(4, width)
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        engine.state.iteration = iteration
        if iteration == 2 and rank == faulty_rank:
            _inject(fault, saver, model_size=sum(p.numel() * 4 for p in model.parameters()))
        try:
            checkpoint(engine)
        except (RankFailureError, CollectiveTimeoutError) as error:
            return type(error).__name__, str(error), str(checkpoint.last_checkpoint)
    return None


def _assert_previous_checkpoint_loads_and_verifies(dirname, width):
    assert verify_file(dirname / "checkpoint_1.pt")["world_size"] == 3
    model = _model(width)
    optimizer = torch.optim.Adam(model.parameters())
    Checkpoint.load_objects({"model": model, "optimizer": optimizer}, dirname / "checkpoint_1.pt")
    assert len(optimizer.state_dict()["state"]) == 4


KILLS = {
    "kill before writing": [],
    "kill while writing": [],
    "kill after the rename": ["checkpoint_2.pt"],
    "kill before removing the old file": ["checkpoint_2.pt"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("fault", KILLS)
def test_recipient_killed_during_a_save(tmp_path, fault):
    results = run_ranks(_save_with_fault, 3, tmp_path, fault, 1, 64, killed=[1], timeout=60)
    for rank in (0, 2):
        kind, message, last = results[rank]
        assert kind == "CollectiveTimeoutError"
        assert "waiting for ranks [1]" in message, message
        assert last == str(tmp_path / "checkpoint_1.pt"), "the failed save is not recorded"
    _assert_previous_checkpoint_loads_and_verifies(tmp_path, 64)
    checkpoints = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert checkpoints == ["checkpoint_1.pt"] + KILLS[fault]
    for name in checkpoints:
        verify_file(tmp_path / name)  # a file under a checkpoint's name is always complete
    # the next save cleans up what the killed one left
    DiskSaver(tmp_path, require_empty=False, save_on_rank=0)({"x": torch.ones(1)}, "checkpoint_3.pt")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


ERRORS = {
    "exception in the saver": "ValueError: saver bug",
    "EIO while writing": "[Errno 5] Input/output error",
}


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ERRORS)
def test_saver_errors_raise_on_every_rank(tmp_path, fault):
    results = run_ranks(_save_with_fault, 3, tmp_path, fault, 1, 64, timeout=60)
    for kind, message, last in results:
        assert kind == "RankFailureError"
        assert "checkpoint save of checkpoint_2.pt failed on 1 of 3 ranks: rank 1:" in message
        assert ERRORS[fault] in message
        assert last == str(tmp_path / "checkpoint_1.pt")
    _assert_previous_checkpoint_loads_and_verifies(tmp_path, 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1.pt"], "no temporary file is left"


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MB tmpfs: room for one checkpoint of the 512-wide model, not for two."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["ENOSPC before writing", "ENOSPC while writing"])
def test_full_disk_raises_on_every_rank(small_disk, fault):
    results = run_ranks(_save_with_fault, 3, small_disk, fault, 1, 512, timeout=60)
    for kind, message, _ in results:
        assert kind == "RankFailureError"
        assert "rank 1:" in message
        if fault == "ENOSPC before writing":
            assert "Not enough disk space for checkpoint" in message and "lower `n_saved`" in message
        else:
            assert "No space left on device" in message
    _assert_previous_checkpoint_loads_and_verifies(small_disk, 512)
    assert sorted(p.name for p in small_disk.iterdir()) == ["checkpoint_1.pt"]


@pytest.mark.distributed
def test_non_recipient_dying_in_the_gather_fails_the_others_within_the_timeout(tmp_path):
    results = run_ranks(_save_with_fault, 3, tmp_path, "non-recipient dies in the gather", 2, 64, killed=[2])
    for rank in (0, 1):
        kind, message, last = results[rank]
        assert kind == "CollectiveTimeoutError"
        assert "waiting for ranks [2]" in message
        # the recipient saw the peer vanish in the middle of the gather, and every rank is told
        assert "Ranks that arrived reported errors: rank 1: RuntimeError" in message
        assert "by peer" in message  # gloo: "Connection closed by peer" or "Connection reset by peer"
    _assert_previous_checkpoint_loads_and_verifies(tmp_path, 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1.pt"]


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _misuse(rank, world_size, dirname, misuse):
    warnings = _Warnings()
    logging.getLogger("ignite_zero").addHandler(warnings)
    model = tiny_model()
    optimizer = zero_adam(model)
    engine = Engine(lambda e, b: None)
    score = (lambda _: 1.0 + rank) if misuse == "rank-dependent score" else (lambda e: float(e.state.iteration))
    checkpoint = Checkpoint(
        {"model": model, "optimizer": optimizer},
        DiskSaver(dirname),
        score_function=score,
        n_saved=1,
        sync_timeout=SYNC_TIMEOUT,
    )
    engine.state.iteration = 1
    checkpoint(engine)
    train_step(model, optimizer, rank, 1)
    engine.state.iteration = 2
    outcome = None
    if misuse == "save on one rank":
        if rank == 0:
            with pytest.raises(CollectiveTimeoutError, match=r"waiting for ranks \[1\] at the checkpoint save"):
                checkpoint(engine)
            outcome = "raised"
    else:
        checkpoint(engine)
        outcome = checkpoint.last_checkpoint.name
    value = torch.ones(1)
    dist.all_reduce(value)  # the process group is still usable
    return outcome, value.item(), warnings.messages


@pytest.mark.distributed
def test_save_called_on_one_rank(tmp_path):
    results = run_ranks(_misuse, 2, tmp_path, "save on one rank", timeout=30)
    assert [result[:2] for result in results] == [("raised", 2.0), (None, 2.0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1.0000.pt"]
    verify_file(tmp_path / "checkpoint_1.0000.pt")


@pytest.mark.distributed
def test_rank_dependent_score_function(tmp_path):
    results = run_ranks(_misuse, 2, tmp_path, "rank-dependent score")
    # rank 0 (recipient) scores 1.0 both times: the second save does not beat the first, on every rank
    assert [result[:2] for result in results] == [("checkpoint_1.0000.pt", 2.0), ("checkpoint_1.0000.pt", 2.0)]
    assert results[0][2] == []
    advice = "following the recipient. Make `score_function` and `global_step_transform` return the same value"
    assert results[1][2] == [
        f"Rank 1 planned checkpoint_2.0000.pt (priority 2.0), rank 0 (the recipient) planned checkpoint_1.0000.pt "
        f"(priority 1.0); {advice} on every rank.",
        f"Rank 1 planned checkpoint_2.0000.pt (priority 2.0), rank 0 (the recipient) planned no save; {advice} on "
        "every rank.",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1.0000.pt"]
    verify_file(tmp_path / "checkpoint_1.0000.pt")


def _saved_model(tmp_path):
    model = tiny_model()
    Checkpoint({"model": model}, DiskSaver(tmp_path))(Engine(lambda e, b: None))
    return model, tmp_path / "model_0.pt"


def test_corrupted_byte_at_load(tmp_path):
    model, path = _saved_model(tmp_path)
    good = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        record = next(info for info in archive.infolist() if info.filename.endswith("data/0"))
    header = good[record.header_offset : record.header_offset + 30]
    name_length, extra_length = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    corrupt = bytearray(good)
    corrupt[record.header_offset + 30 + name_length + extra_length + 3] ^= 0x40  # a byte of the first tensor
    path.write_bytes(bytes(corrupt))
    fresh = tiny_model(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    # found as the record is read, into new tensors: the model is untouched
    with pytest.raises(IntegrityError, match=r"model_0.pt: record 'archive/data/0' is corrupt \(CRC-32"):
        Checkpoint.load_objects({"model": fresh}, path)
    assert_state_equal(fresh.state_dict(), before)
    # plain torch.load would have taken the corrupt value silently
    assert not torch.equal(torch.load(path, weights_only=True)["0.weight"], model.state_dict()["0.weight"])


def test_truncated_file_at_load(tmp_path):
    _, path = _saved_model(tmp_path)
    good = path.read_bytes()
    for length in (len(good) // 2, len(good) - 1):
        path.write_bytes(good[:length])
        with pytest.raises(IntegrityError, match="model_0.pt .*(not a complete checkpoint file|truncated)"):
            Checkpoint.load_objects({"model": tiny_model(1)}, path)


@pytest.mark.parametrize(
    "other, expected",
    [
        (nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3)), "missing keys ['3.weight', '3.bias']"),
        (
            nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 1), nn.Linear(1, 1)),
            "unexpected keys ['4.weight', '4.bias']",
        ),
        (
            nn.Sequential(nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3), nn.Linear(3, 1)),
            "0.weight: checkpoint (6, 7), model (5, 7)",
        ),
    ],
    ids=["missing keys", "unexpected keys", "wrong shapes"],
)
def test_checkpoint_of_a_different_model_loads_nothing(tmp_path, other, expected):
    DiskSaver(tmp_path)({"model": other.state_dict(), "optimizer": {}}, "other.pt")
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="does not fit the model") as info:  # the type torch raises
        Checkpoint.load_objects({"optimizer": optimizer, "model": model}, tmp_path / "other.pt")
    assert expected in str(info.value) and "Nothing was loaded" in str(info.value)
    assert_state_equal(model.state_dict(), before)
    assert optimizer.state_dict()["state"] == {}


def _optimizer_of_another_model(rank, world_size, path):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(RankFailureError, match=r"parameter groups of \[4\] parameters, this ZeroRedundancyOptimizer"):
        Checkpoint.load_objects({"model": model, "optimizer": optimizer}, path)
    assert_state_equal(model.module.state_dict(), before)  # the model's entry fitted, yet nothing was loaded
    assert optimizer.optim.state_dict()["state"] == {}


@pytest.mark.distributed
def test_an_unfit_optimizer_entry_loads_nothing_at_all(tmp_path):
    other = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 1))
    optimizer = torch.optim.Adam(other.parameters())
    other(torch.randn(2, 7)).sum().backward()
    optimizer.step()
    state = {"model": tiny_model(seed=8).state_dict(), "optimizer": optimizer.state_dict()}
    DiskSaver(tmp_path)(state, "mixed.pt")
    run_ranks(_optimizer_of_another_model, 2, tmp_path / "mixed.pt")


def _sharded_save_with_fault(rank, world_size, dirname, fault, width):
    model = DistributedDataParallel(_model(width))
    optimizer = zero_adam(model)
    checkpoint = Checkpoint(
        {"model": model, "optimizer": optimizer},
        ShardedSaver(dirname, require_empty=False),
        n_saved=1,
        consolidate_recipient_rank=1,
        sync_timeout=SYNC_TIMEOUT,
    )
    engine = Engine(lambda e, b: None)
    for iteration in (1, 2):
        model(torch.randn(4, width)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.state.iteration = iteration
        if iteration == 2 and fault == "EIO while writing" and rank == 0:

            def failing_write(self, plan, resolve):
                raise OSError(errno.EIO, "Input/output error")

            sharded.DirectoryWriter.write_plan = failing_write
        try:
            checkpoint(engine)
        except (RankFailureError, CollectiveTimeoutError) as error:
            return type(error).__name__, str(error), str(checkpoint.last_checkpoint)
    return None


@pytest.mark.distributed
def test_a_failed_sharded_write_raises_on_every_rank(tmp_path):
    results = run_ranks(_sharded_save_with_fault, 2, tmp_path, "EIO while writing", 64, timeout=60)
    for kind, message, last in results:
        assert kind == "RankFailureError" and "Input/output error" in message
        assert last == str(tmp_path / "checkpoint_1.dcp")
    sharded.verify(tmp_path / "checkpoint_1.dcp")
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["checkpoint_1.dcp"]


@pytest.mark.distributed
def test_a_full_disk_fails_a_sharded_save_before_writing(small_disk):
    results = run_ranks(_sharded_save_with_fault, 2, small_disk, "ENOSPC before writing", 512, timeout=60)
    for kind, message, _ in results:
        assert kind == "RankFailureError" and "Not enough disk space for checkpoint" in message
    sharded.verify(small_disk / "checkpoint_1.dcp")
    model = _model(512)
    Checkpoint.load_objects({"model": model}, small_disk / "checkpoint_1.dcp")
