"""Exporting weights as safetensors: what safetensors' own loader reads back, from files and sharded directories,
shards with an index, tied weights written once, dtypes, and never an overwrite."""

import json
import subprocess
import sys

import pytest
import torch
from ignite.engine import Engine
from launcher import run_ranks
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from training import assert_state_equal, tiny_model, zero_adam

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver, export


def _tied():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 11, bias=False))
    model[2].weight = model[0].weight  # tied input and output embeddings
    return model


def _saved(tmp_path, model):
    Checkpoint({"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}, DiskSaver(tmp_path))(
        Engine(lambda e, b: None)
    )
    return tmp_path / "checkpoint_0.pt"


def test_a_file_exports_to_one_safetensors_file_with_tied_weights_written_once(tmp_path):
    model = _tied()
    files = export(_saved(tmp_path / "ckpt", model), tmp_path / "hf")
    assert files == [tmp_path / "hf" / "model.safetensors"]
    loaded = load_file(files[0])
    expected = {name: value for name, value in model.state_dict().items() if name != "2.weight"}
    assert_state_equal(loaded, expected)
    with safe_open(files[0], "pt") as f:
        assert json.loads(f.metadata()["ignite_zero.aliases"]) == {"2.weight": "0.weight"}


def test_shards_and_their_index_and_a_dtype(tmp_path):
    model = tiny_model()
    files = export(_saved(tmp_path / "ckpt", model), tmp_path / "hf", max_shard_size=100, dtype=torch.bfloat16)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted({tmp_path / "hf" / name for name in index["weight_map"].values()})
    assert len(shards) > 1 and sorted(files[:-1]) == shards
    assert all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in index["weight_map"].values())
    loaded = {name: value for shard in shards for name, value in load_file(shard).items()}
    assert loaded.keys() == index["weight_map"].keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], value.to(torch.bfloat16))
    assert index["metadata"]["total_size"] == sum(value.numel() * 2 for value in model.state_dict().values())


def _sharded_save(rank, world_size, dirname):
    model = tiny_model()
    Checkpoint({"model": model, "optimizer": zero_adam(model)}, ShardedSaver(dirname))(Engine(lambda e, b: None))
    return model.state_dict()


@pytest.mark.distributed
def test_a_sharded_directory_exports_tensor_by_tensor(tmp_path):
    expected = run_ranks(_sharded_save, 2, tmp_path / "ckpt")[0]
    (path,) = export(tmp_path / "ckpt" / "checkpoint_0.dcp", tmp_path / "hf")
    loaded = load_file(path)
    assert_state_equal({name: loaded[name] for name in expected}, dict(expected))  # in the model's order
    assert loaded.keys() == expected.keys()


def test_bad_input_and_the_command_line(tmp_path):
    source = _saved(tmp_path / "ckpt", tiny_model())
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="never overwrites"):
        export(source, tmp_path / "taken")
    with pytest.raises(KeyError, match=r"no entry 'ema' \(it holds \['model', 'optimizer'\]\)"):
        export(source, tmp_path / "out", only="ema")
    assert not (tmp_path / "out").exists()  # nothing half-written under the target's name
    command = [sys.executable, "-m", "ignite_zero", "export", str(source), str(tmp_path / "cli"), "--dtype", "fp16"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path / 'cli'}: 1 files" in result.stdout
    assert all(value.dtype == torch.float16 for value in load_file(tmp_path / "cli" / "model.safetensors").values())
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 1 and "exists; export never overwrites" in again.stderr
    wrong = subprocess.run([*command[:5], str(tmp_path / "x"), "--only", "ema"], capture_output=True, text=True)
    assert wrong.returncode == 1 and "no entry 'ema'" in wrong.stderr
