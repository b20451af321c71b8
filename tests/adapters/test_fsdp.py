"""FSDP1 and FSDP2 adapters on real gloo ranks: the gathered state equals an unsharded twin's, a resumed run is
bitwise equal to an uninterrupted one, and a state saved on N ranks loads on M ranks or into a plain module.

Every rank trains on the same batches, so FSDP's averaged gradient is the twin's (a plain module with plain
Adam): saved states are compared with the twin's with ``assert_close`` (bf16 compute drifts further), resumed
runs with the uninterrupted one bit for bit. One launch covers every setup, to keep the file fast.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_states import assert_states, full_optimizer_state, gather_fsdp_state, train_same_batches
from launcher import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Partial, Shard
from training import assert_state_equal

from ignite_zero import _compat
from ignite_zero.adapters.fsdp import (
    FSDPModelState,
    FSDPOptimizerState,
    full_optimizer_state_to_plain,
    holds_sharded_parameters,
    is_fsdp_module,
    owns_parameters,
)
from ignite_zero.adapters.regions import Box

# --------------------------------------------------------------------------------------------------
# Models, setups, training


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


class Meta(nn.Module):
    """A module with extra state and no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 1

    def get_extra_state(self) -> dict[str, int]:
        return {"version": self.version}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.version = state["version"]


class Net(nn.Module):
    """Nested units, sizes not divisible by 2 or 3, a parameter with fewer rows than ranks (empty shards),
    persistent, non-persistent and empty buffers, extra state, a bias-free layer."""

    def __init__(self, d: int = 13) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.blocks = nn.Sequential(Block(5, d), Block(d, d), Block(d, d))
        self.head = nn.Linear(d, 3, bias=False)
        self.meta = Meta()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.register_buffer("empty", torch.zeros(0, 3))
        self.tiny = nn.Parameter(torch.randn(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.inp(x)))) * self.scale + self.tiny.sum()


class TiedNet(nn.Module):
    """Input embedding tied to the output projection: one parameter under two names."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(Block(d, d), Block(d, d))
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.emb(x)))


BF16 = torch.bfloat16
SETUPS: dict[str, dict[str, Any]] = {
    "fsdp1_orig": {"kind": 1, "use_orig_params": True},
    "fsdp1_flat": {"kind": 1, "use_orig_params": False},
    "fsdp1_no_shard": {"kind": 1, "sharding_strategy": ShardingStrategy.NO_SHARD},
    "fsdp1_grad_op": {"kind": 1, "use_orig_params": True, "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
    "fsdp1_bf16": {"kind": 1, "use_orig_params": True, "mixed_precision": MixedPrecision(param_dtype=BF16)},
    "fsdp2": {"kind": 2},
    "fsdp2_bf16": {"kind": 2, "mp_policy": MixedPrecisionPolicy(param_dtype=BF16)},
    "fsdp2_offload": {"kind": 2, "offload_policy": CPUOffloadPolicy(pin_memory=False)},
    "fsdp2_no_reshard": {"kind": 2, "reshard_after_forward": False},
}
SAVE_STEPS, MORE_STEPS = range(3), range(3, 5)


def _wrap(model: nn.Module, setup: str) -> nn.Module:
    """One unit per ``Block``, and one for the rest."""
    options = dict(SETUPS[setup])
    if options.pop("kind") == 1:
        policy = ModuleWrapPolicy({Block})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), **options)
    for m in model.modules():
        if isinstance(m, Block):
            fully_shard(m, **options)
    return fully_shard(model, **options)


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    decayed = [p for name, p in named if name.endswith("lin.weight")]
    rest = [p for name, p in named if not name.endswith("lin.weight")]
    return torch.optim.Adam([{"params": decayed, "weight_decay": 0.1}, {"params": rest, "lr": 5e-3}], lr=1e-2)


@functools.cache
def _twin_state(steps: int, make_optimizer: Any = _adam) -> dict[str, Any]:
    torch.manual_seed(0)
    twin = Net()
    optimizer = make_optimizer(twin)
    train_same_batches(twin, optimizer, range(steps))
    return {"model": twin.state_dict(), "optimizer": full_optimizer_state(twin, optimizer)}


def _load(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: dict[str, Any]) -> None:
    FSDPModelState(model).load_state_dict(checkpoint["model"])
    FSDPOptimizerState(model, optimizer).load_state_dict(checkpoint["optimizer"])


def _no_warnings() -> None:
    warnings.simplefilter("error")  # our save and load emit none...
    warnings.filterwarnings("ignore", message=".*NO_SHARD.*")  # ...FSDP1 warns at wrap time


# --------------------------------------------------------------------------------------------------
# Save on N ranks, load on N (bitwise), on M (close to the twin), on 1 rank, into a plain module


def _save_and_resume(rank: int, world_size: int, directory: Path, recipient: int, load_from: int | None) -> None:
    _no_warnings()
    for setup in SETUPS:
        bf16 = "bf16" in setup
        torch.manual_seed(0)
        twin = Net()
        model = _wrap(copy.deepcopy(twin), setup)
        fresh = FSDPModelState(model, recipient).state_dict()
        optimizer = _adam(model)
        if rank == recipient:  # right after wrapping: the twin's state exactly, its names in its order
            assert_state_equal(fresh, twin.state_dict())
            tensors = [v for k, v in fresh.items() if k != "meta._extra_state"]
            assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in tensors)
            assert fresh["meta._extra_state"] == {"version": 1}
        else:
            assert fresh == {}
        train_same_batches(model, optimizer, SAVE_STEPS)
        saved = gather_fsdp_state(model, optimizer, recipient)
        path = directory / f"{setup}_{world_size}.pt"
        if rank == recipient:
            assert_states(saved, _twin_state(len(SAVE_STEPS)), exact=False, bf16=bf16)
            torch.save(saved, path)
        train_same_batches(model, optimizer, MORE_STEPS)
        uninterrupted = gather_fsdp_state(model, optimizer, recipient)
        dist.barrier()
        resumed = _resume(setup, path, recipient)
        if rank == recipient:
            assert_states(resumed, uninterrupted, exact=True)
        if load_from is not None:
            resumed = _resume(setup, directory / f"{setup}_{load_from}.pt", recipient)
            if rank == recipient:
                assert_states(resumed, _twin_state(len(SAVE_STEPS) + len(MORE_STEPS)), exact=False, bf16=bf16)


def _resume(setup: str, path: Path, recipient: int) -> dict[str, Any]:
    """Load a fresh, differently initialised model and optimizer from ``path``, check that gathering gives the file
    back, train ``MORE_STEPS`` and gather."""
    torch.manual_seed(1234)
    model = _wrap(Net(), setup)
    optimizer = _adam(model)
    checkpoint = torch.load(path, mmap=True, weights_only=True)
    _load(model, optimizer, checkpoint)
    again = gather_fsdp_state(model, optimizer, recipient)
    if dist.get_rank() == recipient:
        assert_states(again, checkpoint, exact=True)
    train_same_batches(model, optimizer, MORE_STEPS)
    return gather_fsdp_state(model, optimizer, recipient)


def _resume_from(rank: int, world_size: int, directory: Path, saved_on: int, kinds: dict[str, str]) -> None:
    _no_warnings()
    for setup, saved_from in kinds.items():
        resumed = _resume(setup, directory / f"{saved_from}_{saved_on}.pt", 0)
        if rank == 0:
            bf16 = "bf16" in setup or "bf16" in saved_from
            assert_states(resumed, _twin_state(len(SAVE_STEPS) + len(MORE_STEPS)), exact=False, bf16=bf16)


@pytest.fixture(scope="module")
def saved_on_2_and_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every setup saved on 2 ranks (recipient 1) and on 3 ranks (recipient 0), each resumed on the same world
    size bitwise; the 3-rank run also resumes the 2-rank files (2 -> 3)."""
    directory = tmp_path_factory.mktemp("fsdp")
    run_ranks(_save_and_resume, 2, directory, 1, None)
    run_ranks(_save_and_resume, 3, directory, 0, 2)
    return directory


@pytest.mark.distributed
def test_saved_state_equals_twin_resume_is_bitwise_and_2_to_3(saved_on_2_and_3: Path) -> None:
    """The checks run on the ranks the fixture launches; here, the files they wrote."""
    assert sorted(p.name for p in saved_on_2_and_3.iterdir()) == sorted(
        f"{setup}_{n}.pt" for setup in SETUPS for n in (2, 3)
    )


@pytest.mark.distributed
def test_3_to_2_and_across_kinds(saved_on_2_and_3: Path) -> None:
    kinds = {setup: setup for setup in SETUPS}
    run_ranks(_resume_from, 2, saved_on_2_and_3, 3, kinds)
    # The format does not depend on the kind: FSDP1 files load into FSDP2 and the other way round.
    run_ranks(_resume_from, 2, saved_on_2_and_3, 3, {"fsdp2": "fsdp1_flat", "fsdp1_flat": "fsdp2_offload"})


@pytest.mark.distributed
def test_2_to_1_rank(saved_on_2_and_3: Path) -> None:
    """FSDP on one rank (FSDP1 then switches to NO_SHARD: per-parameter state keeps the parameter's shape)."""
    run_ranks(_resume_from, 1, saved_on_2_and_3, 2, {setup: setup for setup in SETUPS})


@pytest.mark.distributed
@pytest.mark.parametrize("saved_on", [2, 3])
def test_into_plain_module_without_process_group(saved_on_2_and_3: Path, saved_on: int) -> None:
    expected = _twin_state(len(SAVE_STEPS) + len(MORE_STEPS))
    for setup in SETUPS:
        torch.manual_seed(7)
        model = Net()
        optimizer = _adam(model)
        checkpoint = torch.load(saved_on_2_and_3 / f"{setup}_{saved_on}.pt", mmap=True, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(full_optimizer_state_to_plain(model, optimizer, checkpoint["optimizer"]))
        train_same_batches(model, optimizer, MORE_STEPS)
        actual = {"model": model.state_dict(), "optimizer": full_optimizer_state(model, optimizer)}
        assert_states(actual, expected, exact=False, bf16="bf16" in setup)


# --------------------------------------------------------------------------------------------------
# Layouts: tied weights, Shard(1), bf16 parameters, parameter groups, ignored modules; the given dict is only read


def _against_twin(
    rank: int,
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = _adam,
    tokens: bool = False,
) -> dict[str, Any]:
    """Shard a copy of ``build()`` and train it and the twin alike: gathering creates no optimizer state, the
    gathered state (on rank 1) is close to the twin's, and a fresh sharded model loaded with the twin's state
    gathers (on rank 0) to it exactly. Returns what rank 1 gathered."""
    torch.manual_seed(0)
    twin = build()
    model = shard(copy.deepcopy(twin))
    twin_optimizer, optimizer = make_optimizer(twin), make_optimizer(model)
    fresh = FSDPOptimizerState(model, optimizer, 1).state_dict()
    assert not optimizer.state  # torch's get_optimizer_state_dict would run a fake step here
    assert fresh["state"] == {} if rank == 1 else fresh == {}
    train_same_batches(model, optimizer, range(2), tokens)
    train_same_batches(twin, twin_optimizer, range(2), tokens)
    _sharded_like_torch(model, optimizer)
    expected = {"model": twin.state_dict(), "optimizer": full_optimizer_state(twin, twin_optimizer)}
    saved = gather_fsdp_state(model, optimizer, 1)
    if rank == 1:
        assert_states(saved, expected, exact=False)
    torch.manual_seed(7)
    model = shard(build())
    optimizer = make_optimizer(model)
    _load(model, optimizer, expected)
    again = gather_fsdp_state(model, optimizer, 0)
    if rank == 0:
        assert_states(again, expected, exact=True)
    return saved


def _same_tensor(ours: Any, theirs: Any) -> bool:
    """Whether two views are of the same elements, laid out alike, both out of autograd (``state_dict()`` detaches
    anew each call)."""
    if isinstance(ours, torch.Tensor) and (type(ours), ours.requires_grad) != (type(theirs), theirs.requires_grad):
        return False
    if isinstance(ours, DTensor):
        if (ours.device_mesh, ours.placements) != (theirs.device_mesh, theirs.placements):
            return False
        ours, theirs = _compat.dtensor_local(ours), _compat.dtensor_local(theirs)
        if ours.requires_grad != theirs.requires_grad:
            return False
    if not isinstance(ours, torch.Tensor):
        return type(ours) is type(theirs) and ours == theirs
    laid_out = (ours.shape, ours.stride(), ours.dtype, ours.storage_offset())
    return laid_out == (theirs.shape, theirs.stride(), theirs.dtype, theirs.storage_offset()) and (
        ours.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
    )


def _sharded_like_torch(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The sharded state dicts are torch's (the same names in the same order, views of the same elements, the very
    optimizer state tensors), and loading them restores the state, matching the optimizer's parameter groups by
    the parameters they hold, whatever their order."""
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return  # FSDP1's are torch's own
    sharded = StateDictOptions(full_state_dict=False)
    model_theirs = get_model_state_dict(model, options=sharded)
    optimizer_theirs = get_optimizer_state_dict(model, optimizer, options=sharded)
    model_state, optimizer_state = FSDPModelState(model), FSDPOptimizerState(model, optimizer)
    model_ours, optimizer_ours = model_state.sharded_state_dict(), optimizer_state.sharded_state_dict()
    assert list(model_ours) == list(model_theirs)
    assert all(_same_tensor(model_ours[name], value) for name, value in model_theirs.items())
    assert list(optimizer_ours["state"]) == list(optimizer_theirs["state"])
    for name, values in optimizer_theirs["state"].items():
        assert all(optimizer_ours["state"][name][key] is value for key, value in values.items())
    assert optimizer_ours["param_groups"] == optimizer_theirs["param_groups"]
    kept = copy.deepcopy((model_ours, optimizer_ours))
    with torch.no_grad():
        for tensor in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]:
            tensor.zero_()
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    reordered = {**kept[1], "param_groups": kept[1]["param_groups"][::-1]}
    model_state.load_sharded(kept[0])
    optimizer_state.load_sharded(reordered)
    assert all(
        torch.equal(_local(value), _local(model_ours[name]))
        for name, value in kept[0].items()
        if _local(value) is not None
    )
    again = optimizer_state.sharded_state_dict()
    assert again["param_groups"] == optimizer_ours["param_groups"]
    for name, values in again["state"].items():
        assert all(torch.equal(_local(value), _local(kept[1]["state"][name][key])) for key, value in values.items())
    if len(optimizer.param_groups) > 1:  # a parameter saved in another group
        moved = copy.deepcopy(kept[1])
        moved["param_groups"][1]["params"].append(moved["param_groups"][0]["params"].pop())
        with pytest.raises(ValueError, match="Parameter group 0 of this Adam holds .* no parameter group of the"):
            optimizer_state.load_sharded(moved)


def _local(value: Any) -> torch.Tensor | None:
    if isinstance(value, DTensor):
        return _compat.dtensor_local(value)
    return value if isinstance(value, torch.Tensor) else None


def _layouts(rank: int, world_size: int) -> None:
    for setup in ("fsdp2", "fsdp1_orig", "fsdp1_flat"):
        saved = _against_twin(rank, TiedNet, functools.partial(_wrap, setup=setup), tokens=True)
        if rank == 1:  # still tied: torch.save writes it once
            assert saved["model"]["out.weight"] is saved["model"]["emb.weight"]

    for setup in ("fsdp2", "fsdp1_orig"):
        saved = _against_twin(rank, Net, functools.partial(_wrap, setup=setup), _two_groups)
        if rank == 1:
            assert [len(group["params"]) for group in saved["optimizer"]["param_groups"]] == [3, 13]

    # torch.compile's wrapper adds a segment to every name under it, of the whole model or of a part, whose entries
    # torch's state dict then moves to the end (nothing is compiled: the model is not called)
    model = _wrap(Net(), "fsdp2")
    optimizer = _two_groups(model)
    train_same_batches(model, optimizer, range(1))
    _sharded_like_torch(torch.compile(model), optimizer)
    model.blocks[1] = torch.compile(model.blocks[1])
    _sharded_like_torch(model, optimizer)

    def columns(param: nn.Parameter) -> Shard | None:
        return Shard(1) if param.dim() == 2 and param.shape[1] % world_size == 0 else None

    def shard_columns(model: nn.Module) -> nn.Module:
        for m in model:
            if isinstance(m, Block):
                fully_shard(m, shard_placement_fn=columns)
        model = fully_shard(model, shard_placement_fn=columns)
        assert any(p.placements == (Shard(1),) for p in model.parameters())
        return model

    # FSDP2 `Shard(1)`: a rank's piece is not one flat range (the recipient stages it)
    _against_twin(
        rank, lambda: nn.Sequential(nn.Linear(7, 6), Block(6, 6), Block(6, 6), nn.Linear(6, 3)), shard_columns
    )

    # FSDP1 leaves ignored modules alone: their parameters are whole on every rank
    def ignoring_head(model: nn.Module) -> nn.Module:
        policy = ModuleWrapPolicy({Block})
        return FullyShardedDataParallel(
            model, auto_wrap_policy=policy, device_id=torch.device("cpu"), ignored_modules=[model.head]
        )

    _against_twin(rank, Net, ignoring_head)

    # bf16 parameters travel as bf16
    for setup in ("fsdp2", "fsdp1_flat"):
        torch.manual_seed(0)
        twin = Net().to(BF16)
        saved = FSDPModelState(_wrap(copy.deepcopy(twin), setup), 1).state_dict()
        if rank == 1:
            assert_state_equal(saved, twin.state_dict())

    # optimizer state loaded by name is a DTensor of the very tensor filled, of its own dtype, not a copy: one that
    # `DTensor.from_local` makes on the mesh's device type, where a CPU-offloaded parameter's state lives elsewhere
    param = next(_wrap(Net(), "fsdp2").parameters())
    local = torch.ones_like(_compat.dtensor_local(param), dtype=torch.float64)
    made = _compat.dtensor_of_local(param, local)
    assert _compat.dtensor_local(made) is local and made.dtype == torch.float64 and not made.requires_grad
    laid_out = (made.device_mesh, made.placements, made.shape, made.stride())
    assert laid_out == (param.device_mesh, param.placements, param.shape, param.stride())
    assert torch.equal(made.full_tensor(), torch.ones(param.shape, dtype=torch.float64))


def _storages(value: Any) -> set[int]:
    """Addresses of the memory that the tensors of ``value`` (local tensors, for DTensors) live in."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()} if value.numel() else set()
    if isinstance(value, dict):
        return set().union(*(_storages(v) for v in value.values()))
    if isinstance(value, (list, tuple)):
        return set().union(*(_storages(v) for v in value))
    return set()


def _only_read(rank: int, world_size: int, path: Path) -> None:
    """Loading leaves the given dict (an mmap'd file) as it was, and the optimizer holds no tensor of it."""
    for setup in ("fsdp1_orig", "fsdp1_flat", "fsdp2"):
        checkpoint = torch.load(path, mmap=True, weights_only=True)
        before = copy.deepcopy(checkpoint)
        tensors = {id(v) for v in checkpoint["model"].values()}
        torch.manual_seed(3)
        model = _wrap(Net(), setup)
        optimizer = _adam(model)
        train_same_batches(model, optimizer, range(1))  # existing state is reused
        _load(model, optimizer, checkpoint)
        _load(model, optimizer, checkpoint)  # twice: the first load's tensors are reused
        assert not _storages(optimizer.state_dict()["state"]) & _storages(checkpoint)
        train_same_batches(model, optimizer, range(2))
        assert_state_equal(checkpoint, before)
        assert {id(v) for v in checkpoint["model"].values()} == tensors


@pytest.mark.distributed
def test_layouts(tmp_path: Path) -> None:
    """Tied weights (FSDP1 both ways, FSDP2), FSDP2 ``Shard(1)``, bf16 parameters, two parameter groups, FSDP1
    ignored modules, and a dict that loading only reads."""
    run_ranks(_layouts, 2)
    torch.save(_twin_state(2), tmp_path / "twin.pt")
    run_ranks(_only_read, 2, tmp_path / "twin.pt")


# --------------------------------------------------------------------------------------------------
# Checks and pairing


def _checks(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    plain = Net()
    fsdp1 = _wrap(Net(), "fsdp1_flat")
    fsdp1_orig = _wrap(Net(), "fsdp1_orig")
    fsdp2 = _wrap(Net(), "fsdp2")
    fsdp2_part = copy.deepcopy(plain)
    fully_shard(fsdp2_part.blocks[0])  # only a submodule sharded: the rest is whole on every rank
    models = {"plain": plain, "fsdp1": fsdp1, "fsdp1_orig": fsdp1_orig, "fsdp2": fsdp2, "fsdp2_part": fsdp2_part}
    assert {name: is_fsdp_module(m) for name, m in models.items()} == {**dict.fromkeys(models, True), "plain": False}
    assert not is_fsdp_module(_adam(plain))
    saved = FSDPModelState(fsdp2_part, 1).state_dict()
    if rank == 1:
        assert_state_equal(saved, plain.state_dict())

    optimizers = {name: _adam(m) for name, m in models.items()}
    assert {name: holds_sharded_parameters(o) for name, o in optimizers.items()} == {
        **dict.fromkeys(models, True),
        "plain": False,
    }
    assert owns_parameters(fsdp1, optimizers["fsdp1"]) and not owns_parameters(fsdp2, optimizers["fsdp1"])
    assert owns_parameters(fsdp1_orig, optimizers["fsdp1_orig"]) and not owns_parameters(
        fsdp1, optimizers["fsdp1_orig"]
    )
    assert owns_parameters(fsdp2, optimizers["fsdp2"]) and not owns_parameters(plain, optimizers["fsdp2"])
    # FSDP2 kept unsharded after a forward (reshard_after_forward=False): still paired with its optimizer
    unsharded = _wrap(Net(), "fsdp2_no_reshard")
    unsharded_optimizer = _adam(unsharded)
    unsharded(torch.randn(2, 7))
    assert owns_parameters(unsharded, unsharded_optimizer)
    FSDPOptimizerState(unsharded, unsharded_optimizer).check()
    # and its state named while it is unsharded: by the names of the parameters its optimizer holds
    unsharded(torch.randn(2, 7)).sum().backward()
    unsharded_optimizer.step()
    unsharded(torch.randn(2, 7))
    assert not all(isinstance(param, DTensor) for param in unsharded.parameters())
    named_state = FSDPOptimizerState(unsharded, unsharded_optimizer).sharded_state_dict()["state"]
    assert list(named_state) == [name for name, _ in Net().named_parameters()]
    assert all(isinstance(state["exp_avg"], DTensor) for state in named_state.values())

    for adapter in (
        FSDPModelState(fsdp1, 1),
        FSDPModelState(fsdp2_part),
        FSDPOptimizerState(fsdp2, optimizers["fsdp2"]),
    ):
        adapter.check()
    with pytest.raises(TypeError, match="contains no FSDP1 or FSDP2 module"):
        FSDPModelState(plain)
    with pytest.raises(ValueError, match="do not belong to the FSDPNet it is paired with"):
        FSDPOptimizerState(fsdp2, optimizers["fsdp1"]).check()
    with pytest.raises(ValueError, match="outside the process group of 2 ranks"):
        FSDPModelState(fsdp2, 2).check()
    mixed = Net()
    fully_shard(mixed.blocks[0])
    mixed.blocks[1] = FullyShardedDataParallel(mixed.blocks[1], device_id=torch.device("cpu"))
    with pytest.raises(ValueError, match="mixes FSDP1"):
        FSDPModelState(mixed).check()

    # 2-D meshes, hybrid sharding and sharding over a subgroup: each block taken from one of its replicas
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    columns = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "shard"))
    replicated = {
        "fsdp1 hybrid, mesh": lambda net: FullyShardedDataParallel(
            net, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"), device_mesh=mesh
        ),
        "fsdp1 subgroup": lambda net: FullyShardedDataParallel(net, device_id=torch.device("cpu"), process_group=alone),
        "fsdp2 hsdp": lambda net: fully_shard(net, mesh=columns),
        "fsdp2 subgroup": lambda net: fully_shard(net, mesh=columns["shard"]),
    }
    for shard_it in replicated.values():
        torch.manual_seed(0)
        model = shard_it(Net())
        FSDPModelState(model).check()
        saved = FSDPModelState(model, 1).state_dict()
        if rank == 1:
            assert_state_equal(saved, plain.state_dict())

    # Pending reductions, custom placements and meshes that differ between ranks of one mesh: errors on every rank
    # that name the parameter and its placements
    one_d = init_device_mesh("cpu", (world_size,))
    partial = _wrap(Net(), "fsdp2")
    partial.head.weight = nn.Parameter(DTensor.from_local(torch.ones(3, 13), one_d, [Partial()]))
    with pytest.raises(ValueError, match=r"head.weight has placements \(Partial\(sum\),\) .* pending reduction"):
        FSDPModelState(partial).check()
    with pytest.raises(ValueError, match=r"head.weight has placements \(Partial\(sum\),\) .* pending reduction"):
        FSDPOptimizerState(partial, _adam(partial)).check()  # its state would be laid out alike

    class Halves(Shard):
        """A custom placement: a Shard subclass whose layout only its author knows."""

    custom = _wrap(Net(), "fsdp2")
    custom.head.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 13), one_d, [Halves(0)], run_check=False))
    if type(custom.head.weight.placements[0]) is Halves:
        with pytest.raises(ValueError, match=r"head.weight has placements .* custom placement \(.*Halves\)"):
            FSDPModelState(custom).check()
    else:  # torch 2.14.1 gives the parameter plain Shard placements (2.13.0 keeps the subclass): nothing custom left
        assert type(custom.head.weight.placements[0]) is Shard
        FSDPModelState(custom).check()

    # rank 0 shards over a mesh of both ranks, rank 1 believes it holds everything on a mesh of its own
    names = ("replicate", "shard")
    meshes = [
        init_device_mesh("cpu", (1, world_size), mesh_dim_names=names),
        init_device_mesh("cpu", (world_size, 1), mesh_dim_names=names),
    ]
    differing = fully_shard(Net(), mesh=meshes[rank])
    disagree = (
        r"Ranks disagree on how they hold tiny: .* on a \(1, 2\) mesh .* on rank 0, .* \(2, 1\) mesh .* on rank 1"
    )
    with pytest.raises(RuntimeError, match=disagree):
        FSDPModelState(differing).state_dict()
    value = torch.ones(1)
    dist.all_reduce(value)  # the group is still usable
    assert value.item() == world_size


@pytest.mark.distributed
def test_checks_and_pairing() -> None:
    run_ranks(_checks, 2)


def _kept_slots(rank: int, world_size: int) -> None:
    import gc

    from torch.distributed.tensor import Replicate, distribute_tensor

    from ignite_zero.adapters import _fsdp2

    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    slot = _fsdp2.dtensor_slot("w", sharded)
    assert slot.box == Box((4, 3), (2 * rank, 0), (2, 3))
    assert _fsdp2.dtensor_slot("w", sharded).box is slot.box, "kept while its layout holds"
    renamed = _fsdp2.dtensor_slot("v", sharded)
    assert renamed.name == "v" and renamed.box is slot.box
    replicated = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Replicate()])
    assert _fsdp2.dtensor_slot("w", replicated).box == Box((4, 3), (0, 0), (4, 3)), "another tensor: its own slot"
    kept = id(sharded)
    del sharded
    gc.collect()
    assert kept not in _fsdp2._boxes, "let go with its tensor"


@pytest.mark.distributed
def test_blocks_are_kept_for_each_dtensor_while_it_lives() -> None:
    run_ranks(_kept_slots, 2)


def _prepared_loads(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _wrap(Net(), "fsdp2")
    optimizer = _adam(model)
    train_same_batches(model, optimizer, range(1))

    def local() -> Any:  # this rank's shards and optimizer state, copied
        return copy.deepcopy(({n: p.detach().to_local() for n, p in model.named_parameters()}, optimizer.state_dict()))

    before = local()
    model_state, optimizer_state = FSDPModelState(model), FSDPOptimizerState(model, optimizer)
    expected = _twin_state(2)
    unfit = {name: value for name, value in expected["model"].items() if name != "inp.weight"}
    with pytest.raises(RuntimeError, match='Missing key.s. in state_dict: "inp.weight"'):
        model_state.prepare_load(unfit)
    loads = [model_state.prepare_load(expected["model"]), optimizer_state.prepare_load(expected["optimizer"])]
    assert_state_equal(local(), before)  # checked and planned: nothing changed yet
    for load in loads:
        load()
    loaded = gather_fsdp_state(model, optimizer, 0)
    if rank == 0:
        assert_states(loaded, expected, exact=True)


@pytest.mark.distributed
def test_a_prepared_load_changes_nothing_until_it_runs() -> None:
    """``prepare_load`` checks an entry and plans its copies into this rank's shards, changing nothing; what it
    returns loads the entry. Loading prepares every object this way before it loads any."""
    run_ranks(_prepared_loads, 2)


def test_plain_optimizer_from_full_state_without_process_group() -> None:
    """The plain path: a full, name-keyed state into a plain optimizer; no process group, nothing shared."""
    expected = _twin_state(2, _two_groups)
    before = copy.deepcopy(expected)
    model = Net()
    optimizer = _two_groups(model)
    plain = full_optimizer_state_to_plain(model, optimizer, expected["optimizer"])
    optimizer.load_state_dict(plain)
    assert not _storages(optimizer.state_dict()) & _storages(expected)
    assert_state_equal(full_optimizer_state(model, optimizer), expected["optimizer"])
    train_same_batches(model, optimizer, range(2))
    assert_state_equal(expected, before)

    with pytest.raises(ValueError, match="by index"):
        full_optimizer_state_to_plain(model, optimizer, optimizer.state_dict())
    with pytest.raises(ValueError, match="parameter groups it was saved with"):
        full_optimizer_state_to_plain(model, _adam(model), expected["optimizer"])
    with pytest.raises(TypeError, match="contains no FSDP1 or FSDP2 module"):
        FSDPOptimizerState(model, optimizer)
