"""The ignite-zero command line: its output and exit status, from ``main`` in this process, and as a user runs it
(a subprocess of ``python -m ignite_zero``) where the process itself matters: the version, a pipe closed early."""

import contextlib
import io
import json
import subprocess
import sys
from types import SimpleNamespace

import ignite
import pytest
import torch
from ignite.engine import Engine
from launcher import run_ranks
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, train_step, zero_adam

import ignite_zero
from ignite_zero import Checkpoint, DiskSaver, ShardedSaver
from ignite_zero.cli import main


def _cli(*args):
    """What the command prints and its exit status, as ``subprocess.run`` gives them, without starting a Python."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main([str(arg) for arg in args])
        except SystemExit as exited:  # argparse's errors and --version
            status = exited.code if isinstance(exited.code, int) else 1
    return SimpleNamespace(returncode=status, stdout=out.getvalue(), stderr=err.getvalue())


def _cli_process(*args):
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


def test_inspect_json_lists_the_same_as_the_text(tmp_path):
    path = _checkpoint(tmp_path)
    result = _cli("inspect", "--json", path)
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert {key: value for key, value in listing.items() if key != "objects"} == {
        "schema": 1,
        "path": str(path),
        "format": "file",
        "files": 1,
        "bytes": path.stat().st_size,
        "written_by": {"ignite_zero": "0.1.0", "torch": torch.__version__, "world_size": 1},
    }
    model, optimizer, trainer = listing["objects"]
    assert {key: value for key, value in model.items() if key != "entries"} == {
        "name": "model",
        "type": "OrderedDict",
        "tensors": 2,
        "bytes": 32,
    }
    assert model["entries"][0] == {"key": "weight", "kind": "tensor", "dtype": "float32", "shape": [2, 3], "bytes": 24}
    assert optimizer["entries"][0] == {
        "key": "state.0.step",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [],
        "bytes": 4,
    }
    assert {"key": "param_groups.0.params", "kind": "value", "repr": "[0, 1]", "value": [0, 1]} in optimizer["entries"]
    assert trainer == {
        "name": "trainer",
        "type": "dict",
        "tensors": 0,
        "bytes": 0,
        "entries": [
            {"key": "epoch", "kind": "value", "repr": "3", "value": 3},
            {"key": "iteration", "kind": "value", "repr": "30", "value": 30},
        ],
    }


def test_inspect_json_of_values_json_cannot_hold_and_of_another_tool_s_file(tmp_path):
    torch.save({"score": float("nan"), "when": (2026, 12), "what": {1, 2}}, tmp_path / "plain.pt")
    result = _cli("inspect", "--json", tmp_path / "plain.pt")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert listing["written_by"] is None
    entries = {obj["name"]: obj["entries"] for obj in listing["objects"]}
    assert entries["score"] == [{"key": "", "kind": "value", "repr": "nan"}]
    assert entries["when"] == [{"key": "", "kind": "value", "repr": "(2026, 12)", "value": [2026, 12]}]
    assert entries["what"] == [{"key": "", "kind": "value", "repr": "{1, 2}"}]


def _big_checkpoint(tmp_path):
    """About 400 KB of listing: more than a pipe holds, so the writer is still writing when the reader leaves."""
    path = tmp_path / "big.pt"
    DiskSaver(tmp_path)({"trainer": {f"counter_{i}": i for i in range(20_000)}}, path.name)
    return path


@pytest.mark.parametrize("flag", [[], ["--json"]], ids=["text", "json"])
def test_inspect_into_a_pipe_closed_early_ends_quietly(tmp_path, flag):
    path = _big_checkpoint(tmp_path)
    command = f"{sys.executable} -m ignite_zero inspect {' '.join(flag)} {path} | head -n 3; exit ${{PIPESTATUS[0]}}"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
    assert result.returncode == 141  # as a tool killed by SIGPIPE
    assert len(result.stdout.splitlines()) == 3


def _help(capsys, *args):
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code, capsys.readouterr()


def test_help_for_each_command_documents_its_exit_statuses(capsys):
    for command in ("inspect", "verify", "consolidate", "export"):
        status, output = _help(capsys, command, "--help")
        assert status == 0 and f"usage: ignite-zero {command}" in output.out
        assert "exit status:\n  0    " in output.out and "\n  1    " in output.out
        assert "\n  2    wrong arguments" in output.out and "\n  141  the output was closed early" in output.out
        if command == "inspect":
            assert '"entries": [{"key": str' in output.out  # the JSON schema
    status, output = _help(capsys, "inspect")
    assert status == 2 and "the following arguments are required: path" in output.err


def test_version_names_the_package_torch_and_ignite():
    result = _cli_process("--version")
    assert result.returncode == 0, result.stderr
    expected = f"ignite-zero {ignite_zero.__version__} (torch {torch.__version__}, pytorch-ignite {ignite.__version__})"
    assert result.stdout.strip() == expected


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
    assert "sharded, 5 files" in lines[0] and f"with torch {torch.__version__} on 2 rank(s)" in lines[0]
    assert "  0.weight: float32 5x7 140 B, 1 shard(s)" in lines
    assert "  state.0.exp_avg: float32 5x7 140 B, 1 shard(s)" in lines
    listing = json.loads(_cli("inspect", "--json", directory).stdout)
    assert (listing["format"], listing["files"], listing["written_by"]["world_size"]) == ("sharded", 5, 2)
    objects = {obj["name"]: obj for obj in listing["objects"]}
    assert objects["model"]["type"] is None and objects["model"]["tensors"] == 6
    tensor = {"key": "0.weight", "kind": "tensor", "dtype": "float32", "shape": [5, 7], "bytes": 140, "shards": 1}
    assert tensor in objects["model"]["entries"]

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
