"""The ignite-zero command line, run as a user runs it: a subprocess, its output and exit status."""

import subprocess
import sys

import pytest
import torch
from ignite.engine import Engine
from launcher import run_ranks
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ignite_zero", *map(str, args)], capture_output=True, text=True)


def _checkpoint(tmp_path):
    state = {
        "model": torch.nn.Linear(3, 2).state_dict(),
        "optimizer": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "trainer": {"epoch": 3, "iteration": 30},
    }
    DiskSaver(tmp_path)(state, "checkpoint_30.pt")
    return tmp_path / "checkpoint_30.pt"


def test_inspect_lists_objects_tensors_and_origin(tmp_path):
    result = _cli("inspect", _checkpoint(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"written by ignite_zero 0.1.0 with torch {torch.__version__} on 1 rank(s)" in lines[0]
    assert "model: OrderedDict, 2 tensors, 32 B" in lines
    assert "  weight: float32 2x3 24 B" in lines
    assert "  state.0.step: float32 scalar 4 B" in lines
    assert "  epoch: 3" in lines


def test_verify_passes_a_good_file_and_fails_a_damaged_one(tmp_path):
    path = _checkpoint(tmp_path)
    assert _cli("verify", path).returncode == 0
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    result = _cli("verify", path)
    assert result.returncode == 1
    assert "truncated or padded" in result.stderr
    result = _cli("verify", tmp_path / "missing.pt")
    assert result.returncode == 1 and "does not exist" in result.stderr


def test_verify_of_a_file_without_trailer(tmp_path):
    torch.save({"x": torch.ones(1)}, tmp_path / "plain.pt")
    result = _cli("verify", tmp_path / "plain.pt")
    assert result.returncode == 2 and "no integrity trailer" in result.stdout


def test_help_for_each_command():
    for command in ("inspect", "verify", "consolidate"):
        result = _cli(command, "--help")
        assert result.returncode == 0 and f"usage: ignite-zero {command}" in result.stdout


def _sharded_checkpoint(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    train_step(model, optimizer, rank, 0)
    Checkpoint({"model": model, "optimizer": optimizer}, ShardedSaver(dirname))(Engine(lambda e, b: None))
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if rank == 0 else None


@pytest.mark.distributed
def test_sharded_directories_inspected_verified_and_consolidated(tmp_path):
    optimizer_state = run_ranks(_sharded_checkpoint, 2, tmp_path / "ckpt")[0]
    directory = tmp_path / "ckpt" / "checkpoint_0.dcp"

    result = _cli("inspect", directory)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "sharded, 4 files" in lines[0] and f"with torch {torch.__version__} on 2 rank(s)" in lines[0]
    assert "  0.weight: float32 5x7 140 B, 1 shard(s)" in lines
    assert "  state.0.exp_avg: float32 5x7 140 B, 1 shard(s)" in lines

    assert _cli("verify", directory).returncode == 0
    target = tmp_path / "one.pt"
    result = _cli("consolidate", directory, target)
    assert result.returncode == 0, result.stderr
    consolidated = torch.load(target, weights_only=True)
    assert_state_equal(consolidated["optimizer"], optimizer_state)
    result = _cli("consolidate", directory, target)
    assert result.returncode == 1 and "never overwrites" in result.stderr

    data = bytearray((directory / "__0_0.distcp").read_bytes())
    data[-100] ^= 0xFF
    (directory / "__0_0.distcp").write_bytes(bytes(data))
    result = _cli("verify", directory)
    assert result.returncode == 1 and "file __0_0.distcp is corrupt" in result.stderr
