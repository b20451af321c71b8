"""State that differs by rank: RandomState makes a resumed run draw the numbers an uninterrupted one draws, and
PerRank gives each rank its own state back, in both modes and on other world sizes by a documented rule."""

import random

import numpy as np
import pytest
import torch
from ignite.engine import Engine
from launcher import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal

from ignite_zero import Checkpoint, DiskSaver, PerRank, RandomState, ShardedSaver

pytestmark = pytest.mark.distributed


def _seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _training():
    with torch.random.fork_rng():  # the same initial model on every rank, the rank's own generator left as it was
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    model = DistributedDataParallel(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _step(model, optimizer):
    # random data, a dropout mask, and Python's and numpy's generators: all must come back
    x = torch.randn(8, 7) * (1 + random.random()) + float(np.random.rand())
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def _resume_is_bitwise(rank, world_size, dirname, sharded):
    _seed_all(100 + rank)
    model, optimizer = _training()
    for _ in range(6):
        _step(model, optimizer)
    uninterrupted = {k: v.clone() for k, v in model.module.state_dict().items()}, torch.rand(3)

    _seed_all(100 + rank)
    model, optimizer = _training()
    for _ in range(3):
        _step(model, optimizer)
    to_save = {"model": model, "optimizer": optimizer, "rng": RandomState()}
    saver = ShardedSaver(dirname) if sharded else DiskSaver(dirname)
    engine = Engine(lambda e, b: None)
    engine.state.iteration = 3
    Checkpoint(to_save, saver)(engine)

    _seed_all(999)  # a new process would start from other generator states
    model, optimizer = _training()
    Checkpoint.load_objects(
        {"model": model, "optimizer": optimizer, "rng": RandomState()}, saver.location("checkpoint_3." + saver.ext)
    )
    for _ in range(3):
        _step(model, optimizer)
    resumed = model.module.state_dict(), torch.rand(3)
    assert_state_equal(resumed, uninterrupted)
    return uninterrupted[1]


@pytest.mark.parametrize("sharded", [False, True], ids=["consolidated", "sharded"])
def test_a_run_resumed_with_its_random_state_is_bitwise_equal_to_an_uninterrupted_one(tmp_path, sharded):
    draws = run_ranks(_resume_is_bitwise, 2, tmp_path, sharded)
    assert not torch.equal(draws[0], draws[1])  # the ranks' generators differ, and each got its own back


def _save_random_state(rank, world_size, dirname):
    _seed_all(10 + rank)
    engine = Engine(lambda e, b: None)
    Checkpoint({"rng": RandomState()}, DiskSaver(dirname))(engine)
    return torch.rand(2)


def _load_elsewhere(rank, world_size, path):
    with pytest.warns(UserWarning, match="saved on 2 ranks and is loaded on 3: each rank is given a state derived"):
        Checkpoint.load_objects({"rng": RandomState()}, path)
    return torch.rand(2), random.random()


def test_another_world_size_seeds_each_rank_from_the_saved_states(tmp_path):
    run_ranks(_save_random_state, 2, tmp_path)
    saved = torch.load(tmp_path / "rng_0.pt", weights_only=True)
    assert len(saved["by_rank"]) == 2
    first = run_ranks(_load_elsewhere, 3, tmp_path / "rng_0.pt")
    again = run_ranks(_load_elsewhere, 3, tmp_path / "rng_0.pt")
    assert [draw.tolist() for draw, _ in first] == [draw.tolist() for draw, _ in again]  # reproducible
    assert len({tuple(draw.tolist()) for draw, _ in first}) == 3  # distinct per rank


class _Position:
    """A per-rank sampler position."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _per_rank_objects(rank, world_size, dirname, sharded):
    saver = ShardedSaver(dirname) if sharded else DiskSaver(dirname)
    Checkpoint({"position": PerRank(_Position(10 * rank + 1))}, saver)(Engine(lambda e, b: None))
    position = _Position(None)
    Checkpoint.load_objects({"position": PerRank(position)}, saver.location("position_0." + saver.ext))
    return position.value


@pytest.mark.parametrize("sharded", [False, True], ids=["consolidated", "sharded"])
def test_per_rank_objects_get_their_own_state_back(tmp_path, sharded):
    assert run_ranks(_per_rank_objects, 3, tmp_path, sharded) == [1, 11, 21]


def test_on_fewer_ranks_a_per_rank_object_takes_the_state_of_its_rank_modulo_the_saved_ones(tmp_path):
    run_ranks(_per_rank_objects, 3, tmp_path, False)
    position = _Position(None)
    with pytest.warns(UserWarning, match="saved on 3 ranks and is loaded on 1: rank 0 takes the state of saved rank 0"):
        Checkpoint.load_objects({"position": PerRank(position)}, tmp_path / "position_0.pt")
    assert position.value == 1
