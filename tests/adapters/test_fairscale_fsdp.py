"""fairscale's FullyShardedDataParallel on real gloo ranks, on CPU.

fairscale's FSDP cannot run a forward or its own ``state_dict()`` without CUDA (CUDA streams), but it builds on
CPU with ``compute_device=torch.device("cpu")``. So the tests give each rank the shard of a known gradient (cut
by fairscale's own ``_get_shard``) and step the optimizer, as the reduce-scatter of a backward would leave it,
and run the adapters' ``state_dict()`` and ``load_state_dict()`` directly: the gathered state equals an unsharded
twin's (and the model fairscale's own consolidation), and a state saved on 2 ranks loads on 3 into fairscale's FSDP,
torch's FSDP1 and FSDP2, and into a plain model. Through ``Checkpoint`` a CPU-only host gets a clear error on
every rank before any collective (benchmarks/gpu_check.py saves and loads through it on a GPU).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP
from ignite.engine import Engine
from launcher import run_ranks
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from training import assert_state_equal

from ignite_zero import Checkpoint, DiskSaver, RankFailureError
from ignite_zero.adapters import (
    FairscaleFSDPModelState,
    FairscaleFSDPOptimizerState,
    FSDPModelState,
    FSDPOptimizerState,
    adapt,
)

pytestmark = pytest.mark.distributed
CPU = torch.device("cpu")
cuda_absent = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on hosts without CUDA")


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.norm = nn.BatchNorm1d(d_out)  # running statistics: buffers, an integer one among them


class Meta(nn.Module):
    """Extra state, no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 1

    def get_extra_state(self) -> dict[str, int]:
        return {"version": self.version}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.version = state["version"]


class Net(nn.Module):
    """Sizes not divisible by 2 or 3, a parameter of 2 elements (an empty shard on 3 ranks when not flattened),
    persistent and non-persistent buffers, extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.blocks = nn.Sequential(Block(5, 13), Block(13, 13))
        self.head = nn.Linear(13, 3, bias=False)
        self.meta = Meta()
        self.tiny = nn.Parameter(torch.randn(1, 2))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class TiedNet(nn.Module):
    """An embedding tied to the output projection: one parameter under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight


# name -> (nested units, fairscale options); nested setups put the blocks' parameters in a second group
SETUPS: dict[str, tuple[bool, dict[str, Any]]] = {
    "flat": (False, {}),
    "nested": (True, {}),
    "no_flatten": (True, {"flatten_parameters": False}),
    "tied": (False, {}),
    "mixed": (False, {"mixed_precision": True}),
}
STEPS = range(2)


def _twin(setup: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TiedNet() if setup == "tied" else Net()


def _wrap(setup: str, net: nn.Module) -> nn.Module:
    nested, options = SETUPS[setup]
    options = {"compute_device": CPU, **options}
    if nested:
        for index, block in enumerate(net.blocks):
            net.blocks[index] = FairscaleFSDP(block, **options)
    model = FairscaleFSDP(net, **options)
    if options.get("mixed_precision"):
        model._lazy_init()  # what a first forward does: casts the buffers to fp16
    return model


def _groups(params: list[tuple[bool, nn.Parameter]]) -> list[dict[str, Any]]:
    """Parameters of the blocks in a second group, with their own learning rate."""
    rest = [p for second, p in params if not second]
    blocks = [p for second, p in params if second]
    return [{"params": rest}] + ([{"params": blocks, "lr": 0.02}] if blocks else [])


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Adam over a fairscale model's parameters: the inner units' ones in a second group."""
    inner = {
        id(p) for unit in model.modules() if isinstance(unit, FairscaleFSDP) and unit is not model for p in unit.params
    }
    return torch.optim.Adam(_groups([(id(p) in inner, p) for p in model.parameters()]), lr=0.01)


def _twin_optimizer(setup: str, twin: nn.Module) -> torch.optim.Optimizer:
    nested, _ = SETUPS[setup]
    named = [(nested and name.startswith("blocks."), p) for name, p in twin.named_parameters()]
    return torch.optim.Adam(_groups(named), lr=0.01)


def _gradients(twin: nn.Module, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(p.shape, generator=generator) for name, p in twin.named_parameters()}


def _shards(model: nn.Module, full: dict[str, torch.Tensor]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Every fairscale parameter of ``model`` with this rank's shard of ``full`` (tensors by original name), cut
    by fairscale itself: its metadata and ``_get_shard``."""
    units = [m for m in model.modules() if isinstance(m, FairscaleFSDP)]
    shards = []
    for unit, metadata in zip(units, model.local_metadata_dict()["param_metadata"]):
        prefix = f"{metadata['fsdp_path']}." if metadata["fsdp_path"] else ""
        for param, info in zip(unit.params, metadata["params"].values()):
            flat = torch.cat([full[prefix + name].reshape(-1) for name in info["names"]])
            shards.append((param, unit._get_shard(flat)[0] if param._is_sharded else flat.view(param.shape)))
    return shards


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, gradients: dict[str, torch.Tensor]) -> None:
    """Give every fairscale parameter this rank's shard of the gradient, as a backward would, then step."""
    for param, shard in _shards(model, gradients):
        param.grad = shard
    optimizer.step()


def _trained_twin(setup: str, steps: range = STEPS) -> tuple[nn.Module, torch.optim.Optimizer]:
    twin = _twin(setup)
    optimizer = _twin_optimizer(setup, twin)
    for step in steps:
        for name, param in twin.named_parameters():
            param.grad = _gradients(twin, step)[name]
        optimizer.step()
    return twin, optimizer


def _trained(setup: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    twin = _twin(setup)
    model = _wrap(setup, copy.deepcopy(twin))
    optimizer = _optimizer(model)
    for step in STEPS:
        _step(model, optimizer, _gradients(twin, step))
    return model, optimizer


def _by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A plain optimizer's state keyed by its model's parameter names."""
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {names[id(params[index])]: value for index, value in optimizer.state_dict()["state"].items()}


def _gather(model: nn.Module, optimizer: torch.optim.Optimizer, recipient: int) -> dict[str, Any]:
    return {
        "model": FairscaleFSDPModelState(model, recipient).state_dict(),
        "optimizer": FairscaleFSDPOptimizerState(model, optimizer, recipient).state_dict(),
    }


# --------------------------------------------------------------------------------------------------
# Saving on 2 ranks


def _fairscale_consolidation(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """fairscale's own offline consolidation, on rank 0: ``consolidate_shard_weights`` of every rank's
    ``local_state_dict()``, parameters only (its buffer names include non-persistent buffers, which no state dict
    holds). fairscale's ``gather_full_optim_state_dict`` is no reference on CPU: it gathers every entry into one
    buffer, and ``.cpu()`` copies nothing there, so ``exp_avg`` comes back as ``exp_avg_sq``."""
    shards: list[Any] = [None] * dist.get_world_size()
    metadata: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, model.local_state_dict())
    dist.all_gather_object(metadata, model.local_metadata_dict())
    if dist.get_rank() != 0:
        return None
    return FairscaleFSDP.consolidate_shard_weights(shards, metadata, with_module_buffers=False)


def _save(rank: int, world_size: int, directory: Path, recipient: int) -> dict[str, Any]:
    consolidations = {}
    for setup in SETUPS:
        model, optimizer = _trained(setup)
        state = _gather(model, optimizer, recipient)
        if rank == recipient:
            torch.save(state, directory / f"{setup}.pt")
        else:
            assert state == {"model": {}, "optimizer": {}}
        consolidations[setup] = _fairscale_consolidation(model)
    return consolidations


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("fairscale")
    return directory, run_ranks(_save, 2, directory, 1)[0]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_saved_state_equals_the_unsharded_twin(saved, setup):
    directory, _ = saved
    state = torch.load(directory / f"{setup}.pt", weights_only=True)
    twin, twin_optimizer = _trained_twin(setup)
    # the unwrapped module's own names, in its order; tied parameters once, under both names
    assert list(state["model"]) == list(twin.state_dict())
    # float32 everywhere: fairscale keeps mixed-precision buffers in fp16, and they are saved as its state_dict() does
    torch.testing.assert_close(state["model"], twin.state_dict(), atol=0, rtol=0)
    if setup == "tied":
        assert state["model"]["out.weight"] is state["model"]["emb.weight"]
    torch.testing.assert_close(state["optimizer"]["state"], _by_name(twin, twin_optimizer), atol=1e-6, rtol=1e-5)
    expected_groups = [
        sorted(name for name, p in twin.named_parameters() if any(p is q for q in group["params"]))
        for group in twin_optimizer.param_groups
    ]
    assert [sorted(group["params"]) for group in state["optimizer"]["param_groups"]] == expected_groups
    assert [group["lr"] for group in state["optimizer"]["param_groups"]] == [
        group["lr"] for group in twin_optimizer.param_groups
    ]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_saved_model_equals_fairscales_own_consolidation(saved, setup):
    directory, consolidations = saved
    state = torch.load(directory / f"{setup}.pt", weights_only=True)
    theirs = consolidations[setup]
    assert set(theirs) == {name for name, _ in _twin(setup).named_parameters(remove_duplicate=False)}
    torch.testing.assert_close({name: state["model"][name] for name in theirs}, theirs, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------
# Loading on 3 ranks, into fairscale's FSDP, torch's FSDP1 and FSDP2; into a plain model without a process group


def _torch_fsdp(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    net = Net()
    if kind == "fsdp1":
        policy = ModuleWrapPolicy({Block})
        model = FullyShardedDataParallel(net, auto_wrap_policy=policy, device_id=CPU, use_orig_params=True)
    else:
        for block in net.blocks:
            fully_shard(block)
        model = fully_shard(net)
    named = [("blocks." in name, p) for name, p in model.named_parameters()]
    return model, torch.optim.Adam(_groups(named), lr=0.01)


def _load(rank: int, world_size: int, directory: Path) -> None:
    recipient = 2
    for setup in SETUPS:
        saved = torch.load(directory / f"{setup}.pt", mmap=True, weights_only=True)
        model = _wrap(setup, _twin(setup, seed=1))  # other values everywhere
        optimizer = _optimizer(model)
        FairscaleFSDPModelState(model).load_state_dict(saved["model"])
        FairscaleFSDPOptimizerState(model, optimizer).load_state_dict(saved["optimizer"])
        twin, _ = _trained_twin(setup)
        for param, shard in _shards(model, dict(twin.state_dict())):  # the shards fairscale cuts from the twin
            torch.testing.assert_close(param.data, shard, atol=0, rtol=0)
        again = _gather(model, optimizer, recipient)
        if rank == recipient:
            assert_state_equal(again, saved)
        _step(model, optimizer, _gradients(twin, STEPS.stop))  # the optimizer goes on from the loaded state
        after = _gather(model, optimizer, recipient)
        if rank == recipient:
            twin, twin_optimizer = _trained_twin(setup, range(STEPS.stop + 1))
            torch.testing.assert_close(after["model"], twin.state_dict(), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(
                after["optimizer"]["state"], _by_name(twin, twin_optimizer), atol=1e-6, rtol=1e-5
            )

    saved = torch.load(directory / "nested.pt", mmap=True, weights_only=True)
    for kind in ("fsdp1", "fsdp2"):
        model, optimizer = _torch_fsdp(kind)
        FSDPModelState(model).load_state_dict(saved["model"])
        FSDPOptimizerState(model, optimizer).load_state_dict(saved["optimizer"])
        again = {
            "model": FSDPModelState(model, recipient).state_dict(),
            "optimizer": FSDPOptimizerState(model, optimizer, recipient).state_dict(),
        }
        if rank == recipient:
            assert_state_equal(again, saved)


def test_loads_on_three_ranks_into_fairscale_fsdp_and_into_torch_fsdp1_and_fsdp2(saved):
    directory, _ = saved
    run_ranks(_load, 3, directory)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_loads_into_a_plain_model_without_process_group(saved, setup):
    directory, _ = saved
    plain = _twin(setup, seed=1)
    optimizer = _twin_optimizer(setup, plain)
    state = torch.load(directory / f"{setup}.pt", weights_only=True)
    Checkpoint.load_objects({"model": plain, "optimizer": optimizer}, state)
    twin, twin_optimizer = _trained_twin(setup)
    torch.testing.assert_close(plain.state_dict(), twin.state_dict(), atol=0, rtol=0)
    torch.testing.assert_close(_by_name(plain, optimizer), _by_name(twin, twin_optimizer), atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Detection, and what is refused


def _detect(rank: int, world_size: int) -> None:
    model, optimizer = _trained("nested")
    plain = nn.Linear(2, 2)
    plain_optimizer = torch.optim.Adam(plain.parameters())
    objects = {"model": model, "optimizer": optimizer, "plain": plain, "plain_optimizer": plain_optimizer}
    adapted = adapt(objects, 1)
    assert type(adapted["model"]) is FairscaleFSDPModelState and adapted["model"].module is model
    assert type(adapted["optimizer"]) is FairscaleFSDPOptimizerState and adapted["optimizer"].obj is optimizer
    assert adapted["optimizer"].module is model and adapted["optimizer"].recipient_rank == 1
    assert adapted["plain"] is plain and adapted["plain_optimizer"] is plain_optimizer

    # a plain module that holds a fairscale unit: its other parameters are whole on every rank
    torch.manual_seed(0)
    twin = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    outer = copy.deepcopy(twin)
    outer[0] = FairscaleFSDP(outer[0], compute_device=CPU)
    state = adapt({"outer": outer}, 0)["outer"]
    assert type(state) is FairscaleFSDPModelState
    full = state.state_dict()
    if rank == 0:
        assert_state_equal(full, twin.state_dict())


def test_adapt_finds_fairscale_models_and_their_optimizers():
    run_ranks(_detect, 2)


def _plain_objects_import_no_fairscale(rank: int, world_size: int) -> list[str]:
    for name in [name for name in sys.modules if name == "fairscale" or name.startswith("fairscale.")]:
        del sys.modules[name]
    model = nn.Sequential(nn.Linear(2, 2))
    adapt({"model": model, "optimizer": torch.optim.Adam(model.parameters()), "nested": [{"x": torch.ones(1)}]}, 0)
    return [name for name in sys.modules if name.startswith("fairscale")]


def test_plain_objects_import_no_fairscale():
    assert run_ranks(_plain_objects_import_no_fairscale, 1, init=False) == [[]]


REFUSAL = r"The model \['model'\]: fairscale's FullyShardedDataParallel .* runs only where CUDA is"
REMEDY = "torch's FullyShardedDataParallel (torch.distributed.fsdp) or fully_shard (FSDP2)"


def _misuse(rank: int, world_size: int, directory: Path, path: Path) -> float:
    model, optimizer = _trained("nested")
    engine = Engine(lambda e, b: None)
    started = time.monotonic()
    with pytest.raises(RankFailureError, match=REFUSAL) as refused:
        to_save = {"model": model, "optimizer": optimizer, "trainer": engine}
        Checkpoint(to_save, DiskSaver(directory / "ckpt"), consolidate_recipient_rank=1)(engine)
    assert "failed on 2 of 2 ranks" in str(refused.value) and REMEDY in str(refused.value)
    with pytest.raises(ValueError, match=REFUSAL):
        Checkpoint.load_objects({"model": model, "optimizer": optimizer}, path)
    assert time.monotonic() - started < 10, "refused at once, not after a timeout"

    with pytest.raises(RankFailureError, match=r"The optimizer \['optimizer'\] updates parameters of a fairscale"):
        Checkpoint({"optimizer": optimizer}, DiskSaver(directory / "ckpt"))(engine)
    value = torch.ones(1)
    dist.all_reduce(value)  # the process group is still usable
    return value.item()


@cuda_absent
def test_without_cuda_saves_and_loads_are_refused_on_every_rank_and_an_optimizer_needs_its_model(saved, tmp_path):
    directory, _ = saved
    assert run_ranks(_misuse, 2, tmp_path, directory / "nested.pt") == [2.0, 2.0]
    assert list((tmp_path / "ckpt").iterdir()) == []


def _load_alone(rank: int, world_size: int, path: Path) -> None:
    model, optimizer = _trained("flat")
    with pytest.raises(ValueError, match=REFUSAL):
        Checkpoint.load_objects({"model": model, "optimizer": optimizer}, path)


@cuda_absent
def test_without_cuda_a_load_on_one_rank_is_refused(saved):
    directory, _ = saved
    run_ranks(_load_alone, 1, directory / "flat.pt")


def _refusals(rank: int, world_size: int) -> None:
    groups = [dist.new_group([r]) for r in range(world_size)]
    alone = FairscaleFSDP(Net(), process_group=groups[rank], compute_device=CPU)
    with pytest.raises(ValueError, match=r"shards over ranks \[\d\], but the world has 2 ranks"):
        FairscaleFSDPModelState(alone).check()
    mixed = nn.Sequential(
        FairscaleFSDP(nn.Linear(2, 2), compute_device=CPU), FullyShardedDataParallel(nn.Linear(2, 2), device_id=CPU)
    )
    with pytest.raises(ValueError, match="mixes fairscale's FullyShardedDataParallel with torch's FSDP1"):
        adapt({"model": mixed}, 0)["model"].check()


def test_subgroups_and_a_mix_with_torch_fsdp_are_refused():
    run_ranks(_refusals, 2)
