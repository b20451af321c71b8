"""Whole objects between real gloo ranks (:mod:`ignite_zero.transport.objects`): every edge case of objects and
tensors, point to point and gathered on any rank, errors that never hang, subgroups, and ZeRO and OSS states equal to
their own consolidation."""

import itertools
import os
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fairscale.optim import OSS
from launcher import run_ranks
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from transported import CHUNKS, assert_same, edge_case_object

from ignite_zero.transport import DEFAULT_CHUNK_BYTES, gather_to, receive_from, send_failure, send_to
from ignite_zero.transport.groups import cpu_group


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _clone_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return type(obj)((k, _clone_tensors(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tensors(v) for v in obj)
    return obj


def _assert_received_layout(obj: Any) -> None:
    """Received tensors are views of one buffer per dtype, and aliases stay aliases."""
    storages: dict[torch.dtype, set[int]] = {}
    for t in _tensors(obj):
        if t.numel():
            storages.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
    assert all(len(ptrs) == 1 for ptrs in storages.values()), storages
    if obj:
        assert obj["alias"] is obj["fp32"]
        assert type(obj["param"]) is torch.Tensor and not obj["param"].requires_grad


def _test_gather_and_send(rank: int, world_size: int) -> None:
    mine = edge_case_object(rank)
    for dst, chunk in itertools.product(range(world_size), CHUNKS):
        result = gather_to(mine, dst, chunk_bytes=chunk)
        if rank != dst:
            assert result is None
            continue
        assert len(result) == world_size
        assert result[dst] is mine  # own object, already on CPU: as is
        for r, obj in enumerate(result):
            assert_same(obj, edge_case_object(r), f"dst={dst} chunk={chunk} rank{r}")
            if r != dst:
                _assert_received_layout(obj)
    # Round trip: gather on one rank, and send each rank its object back, point to point.
    src = world_size - 1
    gathered = gather_to(mine, src)
    for chunk in (100, DEFAULT_CHUNK_BYTES):
        if rank == src:
            for r in range(world_size - 1):
                send_to(gathered[r], r, chunk_bytes=chunk)
        else:
            back = receive_from(src)
            assert_same(back, edge_case_object(rank))
            _assert_received_layout(back)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gather_and_send(world_size: int) -> None:
    """Every dst, several chunk sizes, all edge cases of `edge_case_object`, point-to-point round trips."""
    run_ranks(_test_gather_and_send, world_size)


def _test_errors(rank: int, world_size: int) -> None:
    ok = {"x": torch.full((3,), float(rank))}

    def expect_ok(result: list[Any] | None, dst: int) -> None:
        if rank == dst:
            assert [obj["x"][0].item() for obj in result] == list(range(world_size))

    # A sender with a sparse tensor fails; dst names it; the third rank is unaffected.
    obj = {"bad": torch.eye(3).to_sparse()} if rank == 1 else ok
    if rank == 1:
        with pytest.raises(TypeError, match="only plain strided tensors"):
            gather_to(obj, 0)
    elif rank == 0:
        with pytest.raises(RuntimeError, match=r"rank 1 could not send its object: rank 1: TypeError"):
            gather_to(obj, 0)
    else:
        assert gather_to(obj, 0) is None
    expect_ok(gather_to(ok, 0), 0)  # the group is still usable

    # An unpicklable leaf on a sender, and a bad own object on dst, in one call.
    obj = {"f": lambda: 0} if rank == 2 else ({"meta": torch.empty(2, device="meta")} if rank == 1 else ok)
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"(?s)rank 1: TypeError.*meta.*rank 2 could not send"):
            gather_to(obj, 1)
    elif rank == 2:
        with pytest.raises((AttributeError, pickle.PicklingError)):
            gather_to(obj, 1)
    else:
        assert gather_to(obj, 1) is None
    expect_ok(gather_to(ok, 1), 1)

    # A failure sent in place of an object, and an object that cannot be sent: the receiver raises, never hangs.
    if rank == 0:
        send_failure(ValueError("no part for you"), 1)
        send_to(ok, 2)
    elif rank == 1:
        with pytest.raises(RuntimeError, match=r"rank 0 could not send the object: rank 0: ValueError: no part"):
            receive_from(0)
        with pytest.raises(TypeError, match="only plain strided tensors"):
            send_to({"bad": torch.eye(2).to_sparse()}, 2)
    else:
        assert_same(receive_from(0), {"x": torch.zeros(3)})  # rank 0's own
        with pytest.raises(RuntimeError, match="rank 1 could not send the object: rank 1: TypeError"):
            receive_from(1)
    expect_ok(gather_to(ok, 2), 2)

    # Bad arguments fail the same way on every rank, before any message.
    with pytest.raises(ValueError, match="should be a global rank in the group"):
        gather_to(ok, world_size)
    with pytest.raises(ValueError, match="should be a global rank in the group"):
        receive_from(-1)
    expect_ok(gather_to(ok, 0), 0)


@pytest.mark.distributed
def test_errors() -> None:
    """Serialization failures on any rank raise everywhere with the culprit named, never hang."""
    run_ranks(_test_errors, 3)


def _test_subgroup(rank: int, world_size: int) -> None:
    group = dist.new_group([1, 2, 3])  # a collective: every rank calls it
    if rank == 0:
        return
    mine = edge_case_object(rank)
    result = gather_to(mine, 3, group, chunk_bytes=100)
    if rank == 3:
        assert result[2] is mine
        for obj, r in zip(result, (1, 2, 3), strict=True):
            assert_same(obj, edge_case_object(r))
    if rank == 2:
        send_to(edge_case_object(1), 1, group)
    elif rank == 1:
        assert_same(receive_from(2, group), edge_case_object(1))
    with pytest.raises(ValueError, match="should be a global rank in the group"):
        gather_to(mine, 0, group)


def _test_not_in_group(rank: int, world_size: int) -> None:
    group = dist.new_group([1])
    if rank == 0:
        with pytest.raises(ValueError, match="not part of `group`"):
            gather_to({}, 1, group)
    else:
        assert gather_to({"a": torch.ones(2)}, 1, group)[0]["a"].sum() == 2  # a one-rank group


@pytest.mark.distributed
def test_subgroup() -> None:
    """A group of global ranks 1..3 on 4 ranks: results in group-rank order, dst as a global rank."""
    run_ranks(_test_subgroup, 4)


@pytest.mark.distributed
def test_not_in_group() -> None:
    """A rank outside `group` gets a ValueError; a one-rank group gathers locally."""
    run_ranks(_test_not_in_group, 2)


def _model(dtype: torch.dtype, tiny: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if tiny:  # one parameter: the other ranks own no state at all
        return nn.Sequential(nn.Linear(7, 1, bias=False)).to(dtype)
    # Sizes not divisible by the world size, so that shards differ.
    return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 11), nn.Linear(11, 5), nn.Linear(5, 3)).to(dtype)


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    if len(model) == 1:
        return [{"params": list(model.parameters())}]
    return [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "lr": 0.02, "amsgrad": True},
        {"params": list(model[3].parameters()) + list(model[4].parameters()), "weight_decay": 0.1},
    ]


def _train(model: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype, steps: int = 3) -> None:
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(i)).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
    for group in opt.param_groups:  # a scheduler changed the lr: consolidation must see it
        group["lr"] *= 0.5


def _check_torch_save_and_load(state: dict[str, Any], dtype: torch.dtype, path: Path) -> None:
    """torch.save writes each shared buffer once; weights_only + mmap loading works, also into Adam."""
    torch.save(state, path)
    clones = _clone_tensors(state)  # deepcopy would keep the views' shared storages
    torch.save(clones, path.with_suffix(".clones"))
    with zipfile.ZipFile(path) as zf:
        storages = [n for n in zf.namelist() if "/data/" in n]
    with zipfile.ZipFile(path.with_suffix(".clones")) as zf:
        clone_storages = [n for n in zf.namelist() if "/data/" in n]
    assert len(storages) < len(clone_storages)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    assert os.path.getsize(path) < nbytes + 64 * 1024  # no storage written twice
    loaded = torch.load(path, weights_only=True, mmap=True)
    assert_same(loaded, state)
    twin = _model(dtype)
    adam = torch.optim.Adam(_param_groups(twin), lr=0.01)
    adam.load_state_dict(loaded)
    assert_same(adam.state_dict(), state)
    twin(torch.randn(2, 7).to(dtype)).float().sum().backward()
    adam.step()  # in-place updates of views into the loaded (mmap) buffers


def _test_zero(
    rank: int, world_size: int, dst: int, bucket_view: bool, dtype: torch.dtype, variant: str, tmp: str
) -> None:
    model = _model(dtype, tiny=variant == "tiny")
    opt = ZeroRedundancyOptimizer(
        _param_groups(model), optimizer_class=torch.optim.Adam, lr=0.01, parameters_as_bucket_view=bucket_view
    )
    _train(model, opt, dtype, steps=0 if variant == "no step" else 3)
    # Ours first: sync param groups as consolidate_state_dict does, gather, let torch merge.
    ZeroRedundancyOptimizer._sync_param_groups(opt.param_groups, opt.optim.param_groups)
    gathered = gather_to(opt.optim.state_dict(), dst, cpu_group())
    ours = None
    if rank == dst:
        opt._all_state_dicts = gathered
        ours = opt.state_dict()
    opt.consolidate_state_dict(to=dst)
    if rank == dst:
        theirs = opt.state_dict()
        assert_same(ours, theirs)
        if variant == "no step":
            assert ours["state"] == {}
            return
        assert len(ours["state"]) == len(list(model.parameters()))
        if variant == "tiny":
            assert [len(s["state"]) for s in gathered] == [1, 0, 0]
        else:
            _check_torch_save_and_load(ours, dtype, Path(tmp) / f"zero_{bucket_view}_{dtype}.pt")


@pytest.mark.parametrize(
    ("world_size", "dst", "bucket_view", "dtype", "variant"),
    [
        (2, 1, False, torch.float32, "mlp"),
        (3, 0, True, torch.float32, "mlp"),
        (3, 2, False, torch.bfloat16, "mlp"),
        (3, 2, True, torch.float32, "tiny"),
        (2, 0, False, torch.float32, "no step"),
    ],
)
@pytest.mark.distributed
def test_zero(world_size: int, dst: int, bucket_view: bool, dtype: torch.dtype, variant: str, tmp_path: Path) -> None:
    """ZeroRedundancyOptimizer, Adam: our gather + torch's merge == torch's own consolidation.

    mlp: 3 param groups, amsgrad in one, lr changed after the steps; tiny: one parameter, so two ranks
    own no state; no step: no state anywhere yet.
    """
    run_ranks(_test_zero, world_size, dst, bucket_view, dtype, variant, str(tmp_path))


def _test_oss(rank: int, world_size: int, dst: int) -> None:
    model = _model(torch.float32)
    opt = OSS(_param_groups(model), optim=torch.optim.Adam, lr=0.01)
    _train(model, opt, torch.float32)
    OSS._sync_param_groups(opt.param_groups, opt.optim.param_groups)
    gathered = gather_to(opt.optim.state_dict(), dst)
    ours = None
    if rank == dst:
        opt._all_states = gathered
        ours = opt.state_dict()
    opt.consolidate_state_dict(recipient_rank=dst)
    if rank == dst:
        assert_same(ours, opt.state_dict())
        assert len(ours["state"]) == len(list(model.parameters()))


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "dst"), [(2, 0), (3, 1)])
def test_fairscale_oss(world_size: int, dst: int) -> None:
    """fairscale OSS: our gather + fairscale's merge == fairscale's own consolidation."""
    run_ranks(_test_oss, world_size, dst)


def _test_cuda_sender(rank: int, world_size: int) -> None:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    obj = {"a": torch.randn(1000, 37, device="cuda").t(), "b": torch.arange(10, device="cuda"), "s": torch.tensor(1.0)}
    result = gather_to(obj, 0, chunk_bytes=1000)
    expected = gather_to({k: v.cpu() for k, v in obj.items()}, 0)
    if rank == 0:
        assert result[0] is not obj and result[0]["a"].device.type == "cpu"
        for a, e in zip(result, expected, strict=True):
            assert_same(a, e)
    if rank == 0:
        send_to({"a": torch.ones(3, device="cuda")}, 1)
    else:
        assert torch.equal(receive_from(0)["a"], torch.ones(3))


@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sender() -> None:
    """CUDA tensors on senders travel through the pinned staging chunk; dst's own move to CPU."""
    run_ranks(_test_cuda_sender, 2)


def test_without_process_group() -> None:
    """No process group: a one-rank gather, as in ignite's serial model."""
    obj = edge_case_object(0)
    assert gather_to(obj, 0)[0] is obj
    with pytest.raises(ValueError, match="`dst` must be 0"):
        gather_to(obj, 1)
