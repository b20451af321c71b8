"""ignite's own helpers (``setup_common_training_handlers``, ``save_best_model_by_val_score``,
``gen_save_best_models_by_val_score``) build ignite's ``Checkpoint`` themselves; with the adapters in ``to_save`` they
save FSDP2 and ZeRO state whole on 2 ranks, and ignite's own ``Checkpoint.load_objects`` resumes from the files."""

import pytest
import torch
import torch.distributed as dist
from ignite.contrib.engines.common import (
    gen_save_best_models_by_val_score,
    save_best_model_by_val_score,
    setup_common_training_handlers,
)
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint as IgniteCheckpoint
from ignite.handlers import DiskSaver as IgniteDiskSaver
from launcher import run_ranks
from torch import nn
from training import assert_state_equal, shard, small_net, tiny_model, train_step, zero_adam

from ignite_zero import FSDPModelState, FSDPOptimizerState, ZeROState

pytestmark = pytest.mark.distributed

SCORES = [0.5, 0.9]  # the best model is the last epoch's


def _fsdp2(rank):
    model = shard(small_net(), "fsdp2")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = Engine(lambda engine, _: _fsdp_step(model, optimizer, engine.state.iteration))
    to_save = {"model": FSDPModelState(model), "optimizer": FSDPOptimizerState(model, optimizer), "trainer": trainer}
    return to_save, trainer


def _fsdp_step(model, optimizer, step):
    generator = torch.Generator().manual_seed(step)  # the same batch on every rank, as FSDP's data parallelism allows
    x, y = torch.randn(4, 7, generator=generator), torch.randn(4, 3, generator=generator)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()  # the helpers' TerminateOnNan reads it


def _zero(rank):
    model = tiny_model()
    optimizer = zero_adam(model)
    trainer = Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))
    return {"model": model, "optimizer": ZeROState(optimizer), "trainer": trainer}, trainer


def _states(to_save):
    """Every object's full state (on rank 0; ``{}`` elsewhere for the adapters), each a collective."""
    return {name: obj.state_dict() for name, obj in to_save.items() if name != "trainer"}


def _train_with_helpers(rank, world_size, tmp_path):
    to_save, trainer = _fsdp2(rank)
    setup_common_training_handlers(
        trainer, to_save=to_save, output_path=str(tmp_path / "fsdp2"), save_every_iters=2, with_pbars=False
    )
    evaluator = Engine(lambda engine, _: None)
    evaluator.add_event_handler(
        Events.COMPLETED, lambda engine: engine.state.metrics.update(acc=SCORES[trainer.state.epoch - 1])
    )
    best = {"model": FSDPModelState(to_save["model"].module)}
    save_best_model_by_val_score(str(tmp_path / "best"), evaluator, best, "acc", n_saved=1, trainer=trainer)
    gen_save_best_models_by_val_score(
        IgniteDiskSaver(str(tmp_path / "gen"), require_empty=False), evaluator, best, "acc", n_saved=1, trainer=trainer
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(range(1)))
    trainer.run(range(3), max_epochs=2)  # saves at iterations 2, 4, 6

    zero_save, zero_trainer = _zero(rank)
    setup_common_training_handlers(
        zero_trainer, to_save=zero_save, output_path=str(tmp_path / "zero"), save_every_iters=3, with_pbars=False
    )
    zero_trainer.run(range(3), max_epochs=2)  # saves at iterations 3 and 6
    expected = {"fsdp2": _states(to_save), "zero": _states(zero_save)}
    dist.barrier()  # rank 0 alone wrote the files

    resumed = {"fsdp2": _fsdp2(rank)[0], "zero": _zero(rank)[0]}
    for kind, to_load in resumed.items():
        IgniteCheckpoint.load_objects(to_load, tmp_path / kind / "training_checkpoint_6.pt")
    loaded = {kind: _states(to_load) for kind, to_load in resumed.items()}
    iterations = [to_load["trainer"].state.iteration for to_load in resumed.values()]
    return expected, loaded, iterations


def test_ignite_helpers_save_sharded_state_whole_and_ignite_loads_it_back(tmp_path):
    results = run_ranks(_train_with_helpers, 2, tmp_path)
    for expected, loaded, iterations in results:
        assert_state_equal(loaded, expected)  # on 2 FSDP2 and ZeRO ranks, through ignite's load_objects
        assert iterations == [6, 6]
    expected = results[0][0]
    assert sorted(p.name for p in (tmp_path / "fsdp2").iterdir()) == ["training_checkpoint_6.pt"]

    plain = small_net()  # one process, no process group: the plain model
    nn.init.zeros_(plain[0].weight)
    IgniteCheckpoint.load_objects({"model": plain}, tmp_path / "fsdp2" / "training_checkpoint_6.pt")
    assert_state_equal(plain.state_dict(), expected["fsdp2"]["model"])
    plain_zero = tiny_model(seed=3)
    IgniteCheckpoint.load_objects({"model": plain_zero}, tmp_path / "zero" / "training_checkpoint_6.pt")
    assert_state_equal(plain_zero.state_dict(), expected["zero"]["model"])

    full = {name: tensor.shape for name, tensor in small_net().state_dict().items()}
    for directory in ("best", "gen"):
        (path,) = (tmp_path / directory).iterdir()
        assert path.name == "best_model_2_val_acc=0.9000.pt"
        state = torch.load(path, weights_only=True)
        assert {name: tensor.shape for name, tensor in state.items()} == full  # every parameter, full shapes
        assert all(type(tensor) is torch.Tensor for tensor in state.values())
        assert_state_equal(state, expected["fsdp2"]["model"])
