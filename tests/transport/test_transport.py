"""The transport on real gloo ranks: every edge case of objects and tensors, errors that never hang, ZeRO and OSS
states equal to their own consolidation, and regions of full tensors assembled on one rank."""

import itertools
import os
import pickle
import zipfile
from collections import OrderedDict, namedtuple
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from fairscale.optim import OSS
from launcher import run_ranks
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from ignite_zero import pickling
from ignite_zero.adapters import regions as regions_module
from ignite_zero.adapters.regions import Box, Pieces, Region, gather_pieces
from ignite_zero.transport import (
    DEFAULT_CHUNK_BYTES,
    PeerError,
    gather_to,
    post_error,
    post_frame,
    receive_bytes,
    receive_frame,
    receive_from,
    send_bytes,
    send_failure,
    send_to,
    streams,
)
from ignite_zero.transport.groups import cpu_group

# Small chunks force packing, slicing of big tensors and partial rows of non-contiguous ones;
# 100 bytes is not a multiple of 8 or 16 on purpose.
CHUNKS = (64, 100, 1000, DEFAULT_CHUNK_BYTES)

Point = namedtuple("Point", "x y")  # module level so that the skeleton can pickle it


# --------------------------------------------------------------------------------------------------
# Objects and comparisons


def _make_obj(rank: int) -> Any:
    """A rank's object with every edge case; rank 2 owns no state at all."""
    if rank == 2:
        return {}
    g = torch.Generator().manual_seed(rank)
    shared = torch.randn(5, 7, generator=g)
    base = torch.randn(400, generator=g)
    return {
        "fp32": shared,
        "alias": shared,  # the same object twice: must arrive once, as one object
        "bf16": torch.randn(33, generator=g).bfloat16(),
        "fp16": torch.randn(4, 4, generator=g).half(),
        "int64": torch.arange(rank, rank + 10),
        "bool": torch.rand(13, generator=g) > 0.5,
        "complex": torch.randn(6, dtype=torch.complex64, generator=g),
        "step": torch.tensor(float(rank + 1)),  # 0-d, like Adam's `step`
        "step_int": torch.tensor(rank + 3),
        "empty": torch.empty(0),
        "empty_3d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "big": torch.randn(300, generator=g),
        "slice_of_base": base[7:307],  # contiguous, with a storage offset
        "transposed": torch.randn(40, 30, generator=g).t(),
        "strided": torch.arange(200, dtype=torch.float32)[::3],
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "expanded": torch.randn(1, 5, generator=g).expand(4, 5),
        "conj": torch.randn(5, dtype=torch.complex64, generator=g).conj(),
        "param": nn.Parameter(torch.randn(3, generator=g)),
        "needs_grad": torch.randn(4, generator=g, requires_grad=True),
        "nested": [
            1,
            2.5,
            "s",
            None,
            (torch.ones(2), OrderedDict(deep=torch.zeros(1, dtype=torch.int64))),
            Point(torch.tensor([1.0]), 2),
        ],
        "leaves": {"lr": 0.1, "betas": (0.9, 0.999), "name": "adam", "flag": True, "dtype": torch.bfloat16},
        "rank": rank,
    }


def assert_same(actual: Any, expected: Any, path: str = "obj") -> None:
    """Same structure, same leaves; tensors: on CPU, same dtype and shape, ``torch.equal`` values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.device.type == "cpu", path
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert torch.equal(actual, expected.detach().cpu()), path
    elif isinstance(expected, dict):
        assert type(actual) is type(expected), path
        assert list(actual) == list(expected), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, path


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


# --------------------------------------------------------------------------------------------------
# Distributed scenarios


def _test_gather_and_send(rank: int, world_size: int) -> None:
    mine = _make_obj(rank)
    for dst, chunk in itertools.product(range(world_size), CHUNKS):
        result = gather_to(mine, dst, chunk_bytes=chunk)
        if rank != dst:
            assert result is None
            continue
        assert len(result) == world_size
        assert result[dst] is mine  # own object, already on CPU: as is
        for r, obj in enumerate(result):
            assert_same(obj, _make_obj(r), f"dst={dst} chunk={chunk} rank{r}")
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
            assert_same(back, _make_obj(rank))
            _assert_received_layout(back)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gather_and_send(world_size: int) -> None:
    """Every dst, several chunk sizes, all edge cases of `_make_obj`, point-to-point round trips."""
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


def _test_frames(rank: int, world_size: int) -> None:
    peer = 1 - rank
    if rank == 0:
        data = torch.arange(10, dtype=torch.uint8)
        works = [*post_frame(data, peer, None), *post_frame(torch.empty(0, dtype=torch.uint8), peer, None)]
        works += post_error(ValueError("unreadable"), peer, None)
        for work in works:
            work.wait()
        send_bytes(b"header", peer, None)
        return
    buffer = torch.full((16,), 255, dtype=torch.uint8)
    received = receive_frame(peer, None, "a part", lambda size: buffer[:size])
    assert received.data_ptr() == buffer.data_ptr() and received.tolist() == list(range(10))
    assert receive_frame(peer, None, "a part").numel() == 0  # an empty frame: its length alone
    with pytest.raises(PeerError, match="rank 0 could not send a part: rank 0: ValueError: unreadable"):
        receive_frame(peer, None, "a part")
    assert receive_bytes(peer, None, "a header") == b"header"  # the frames after an error keep their order


@pytest.mark.distributed
def test_frames() -> None:
    """Frames posted from a tensor's memory arrive in a caller's buffer, empty frames and errors in their order."""
    run_ranks(_test_frames, 2)


def _test_subgroup(rank: int, world_size: int) -> None:
    group = dist.new_group([1, 2, 3])  # a collective: every rank calls it
    if rank == 0:
        return
    mine = _make_obj(rank)
    result = gather_to(mine, 3, group, chunk_bytes=100)
    if rank == 3:
        assert result[2] is mine
        for obj, r in zip(result, (1, 2, 3), strict=True):
            assert_same(obj, _make_obj(r))
    if rank == 2:
        send_to(_make_obj(1), 1, group)
    elif rank == 1:
        assert_same(receive_from(2, group), _make_obj(1))
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


def _test_cpu_group(rank: int, world_size: int) -> None:
    assert cpu_group() is dist.group.WORLD
    real = dist.get_backend_config

    def as_if_nccl(group: dist.ProcessGroup | None = None) -> str:
        return "cuda:nccl" if group in (None, dist.group.WORLD) else real(group)

    dist.get_backend_config = as_if_nccl
    try:
        with pytest.raises(ValueError, match="pass `cpu_group\\(group\\)`"):
            gather_to({}, 0)
        group = cpu_group(timeout=timedelta(seconds=20))
        assert group is not dist.group.WORLD and cpu_group() is group
        assert real(group) == "cpu:gloo,cuda:gloo"
        result = gather_to(_make_obj(rank), 1, group)
        if rank == 1:
            assert_same(result[0], _make_obj(0))
    finally:
        dist.get_backend_config = real


@pytest.mark.distributed
def test_cpu_group() -> None:
    """Gloo default group: reused. NCCL default group (simulated): one cached dedicated gloo group."""
    run_ranks(_test_cpu_group, 2)


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


# --------------------------------------------------------------------------------------------------
# Single process


def test_without_process_group() -> None:
    """No process group: a one-rank gather, as in ignite's serial model."""
    obj = _make_obj(0)
    assert gather_to(obj, 0)[0] is obj
    with pytest.raises(ValueError, match="`dst` must be 0"):
        gather_to(obj, 1)


@pytest.mark.parametrize(
    "src",
    [
        torch.arange(6 * 5 * 4).reshape(6, 5, 4).permute(2, 0, 1),
        torch.arange(7 * 9).reshape(7, 9)[1:, ::2],
        torch.arange(5).expand(3, 5),
        torch.arange(4 * 3 * 2).reshape(4, 3, 2).transpose(0, 2)[:, 1:],
    ],
)
def test_copy_flat_range(src: torch.Tensor) -> None:
    """Every range of a non-contiguous tensor is copied in row-major order."""
    flat = src.reshape(-1)
    for start in range(flat.numel()):
        for stop in range(start + 1, flat.numel() + 1):
            out = torch.full((stop - start,), -1, dtype=src.dtype)
            streams._copy_flat_range(src, start, stop, out)
            assert torch.equal(out, flat[start:stop]), (start, stop)


@pytest.mark.parametrize("chunk", CHUNKS[:3])
def test_plan_covers_each_element_once(chunk: int) -> None:
    """Messages carry every element of every tensor once, in order, within the chunk, aligned in packs."""
    _, tensors = pickling.split_tensors(_make_obj(1))
    metas = [(t.dtype, t.numel()) for t in tensors]
    covered = [0] * len(metas)
    for message in streams._plan(metas, chunk):
        assert message.nbytes <= max(chunk, max(dtype.itemsize for dtype, _ in metas))
        for (index, first, end), offset in zip(message.pieces, message.offsets):
            assert first == covered[index] and end > first
            assert offset % 16 == 0
            covered[index] = end
    assert covered == [numel for _, numel in metas]


def test_plan_packs_small_tensors_and_sends_big_ones_alone() -> None:
    """Adam over big layers: the 0-d steps share one message; each moment goes alone, so it is sent in place."""
    metas = ([(torch.float32, 1)] + [(torch.float32, 2**20)] * 2) * 3 + [(torch.bfloat16, 5)]
    messages = streams._plan(metas, DEFAULT_CHUNK_BYTES)
    assert [[index for index, _, _ in m.pieces] for m in messages] == [[0, 3, 6, 9], [1], [2], [4], [5], [7], [8]]
    assert [m.own for m in messages] == [False] + [True] * 6


def _pieces_of(rank: int, world_size: int, full: dict[str, torch.Tensor]) -> Pieces:
    """What rank `rank` holds of the full tensors, in every way FSDP1, FSDP2, HSDP and tensor parallelism hold them."""
    pieces = Pieces()
    # flat ranges, uneven, the last rank possibly empty (torch.chunk semantics on the flattened tensor)
    flat = full["flat"].reshape(-1)
    chunk = -(-flat.numel() // world_size)
    start = min(rank * chunk, flat.numel())
    piece = flat[start : start + chunk]
    pieces.add(("flat",), Box.range(full["flat"].shape, start, piece.numel()), piece)
    # a slice along dim 1 (FSDP2 Shard(1)): one run per row on the recipient
    rows, columns = full["columns"].shape
    width = -(-columns // world_size)
    first = min(rank * width, columns)
    piece = full["columns"][:, first : first + width]
    pieces.add(("columns",), Box((rows, columns), (0, first), tuple(piece.shape)), piece)
    # two blocks per rank, sharded along both dimensions (FSDP2 over a row-wise parallel layer)
    height = -(-full["grid"].shape[0] // world_size)
    top = min(rank * height, full["grid"].shape[0])
    for left in (0, 2):
        piece = full["grid"][top : top + height, left : left + 2]
        pieces.add(("grid",), Box(tuple(full["grid"].shape), (top, left), tuple(piece.shape)), piece)
    # blocks held by several ranks at 3 ranks (HSDP's replicate dimension): each comes from one of them
    half = full["halves"][:2] if rank % 2 == 0 else full["halves"][2:]
    pieces.add(("halves",), Box((3, 4), (0 if rank % 2 == 0 else 2, 0), tuple(half.shape)), half)
    # replicated on every rank (NO_SHARD, buffers, Adam's step): travels once, if at all
    pieces.add_whole(("replica",), full["replica"])
    empty = full["empty"].reshape(-1)  # no elements at all: every rank holds an empty piece
    pieces.add(("empty",), Box.range(full["empty"].shape, 0, 0), empty)
    pieces.add_whole(("lr",), 0.5)
    pieces.add_alias(("tied",), ("flat",))
    if rank == world_size - 1:  # a key only one non-recipient holds
        pieces.add_whole(("only_last",), full["only_last"])
    return pieces


def _full() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "flat": torch.randn(7, 5, generator=generator),
        "columns": torch.randn(3, 11, generator=generator).bfloat16(),
        "grid": torch.randn(5, 4, generator=generator),
        "halves": torch.randn(3, 4, generator=generator),
        "replica": torch.arange(4),
        "only_last": torch.randn(2, 2, 2, generator=generator),
        "empty": torch.empty(3, 0),
    }


def _test_gather_pieces(rank: int, world_size: int) -> None:
    full = _full()
    for dst, chunk in itertools.product(range(world_size), (100, DEFAULT_CHUNK_BYTES)):
        result = gather_pieces(_pieces_of(rank, world_size, full), dst, chunk_bytes=chunk)
        if rank != dst:
            assert result is None
            continue
        names = ["flat", "columns", "grid", "halves", "replica", "empty", "lr", "tied", "only_last"]
        assert list(result) == [(name,) for name in names]
        for name, tensor in full.items():
            assert_same(result[(name,)], tensor)
        assert result[("tied",)] is result[("flat",)] and result[("lr",)] == 0.5


def _test_inconsistent_pieces(rank: int, world_size: int) -> None:
    pieces = Pieces()
    pieces.add(("w",), Box.range((4,), 1 if rank == 1 else 0, 2), torch.ones(2))  # ranks 0 and 1 overlap
    with pytest.raises(RuntimeError, match=r"Pieces of w overlap"):
        gather_pieces(pieces, 1)
    pieces = Pieces()
    pieces.add(("w",), Box.range((4,) if rank else (5,), 2 * rank, 2), torch.ones(2))
    with pytest.raises(RuntimeError, match=r"Ranks disagree on w"):
        gather_pieces(pieces, 0)
    ok = Pieces()
    ok.add_whole(("x",), torch.ones(2))
    result = gather_pieces(ok, 0)  # the group is still usable
    assert rank != 0 or torch.equal(result[("x",)], torch.ones(2))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_pieces_assembles_full_tensors_on_any_rank(world_size: int) -> None:
    """Flat ranges, column slices, 2-D blocks, replicas, values, aliases and keys held by one rank only."""
    run_ranks(_test_gather_pieces, world_size)


@pytest.mark.distributed
def test_inconsistent_pieces_raise_on_every_rank() -> None:
    run_ranks(_test_inconsistent_pieces, 2)


def _hsdp_manifest(rank: int, layout: Any = None) -> Any:
    """Rank ``rank`` of a 2 x 2 HSDP mesh: ``w`` (5 x 3) sharded over the two ranks of its row, replicated over rows."""
    shard = rank % 2
    box = Box((5, 3), (0, 0), (3, 3)) if shard == 0 else Box((5, 3), (3, 0), (2, 3))
    return (
        [Region(("w",), torch.float32, box, layout), Region(("b",), torch.float32, Box.whole((3,)))],
        {},
        [("w",), ("b",)],
    )


def test_each_block_comes_from_one_replica_the_recipients_own_first() -> None:
    """HSDP on 4 ranks: rank 1 gathers; it holds ``w``'s second block and ``b`` itself, so only the first block
    travels, from one of its two replicas (ranks 0 and 2)."""
    order, chosen, regions, sends = regions_module._choose_sources([_hsdp_manifest(r) for r in range(4)], root=1)
    assert order == [("w",), ("b",)]
    assert chosen[("w",)] == [(0, 0), (1, 0)] and chosen[("b",)] == [(1, 1)]
    assert sends == [[0], [], [], []]
    # without a copy of its own, the recipient takes each tensor from one replica, and the replicas share the sending
    both = [Region(("a",), torch.float32, Box.whole((2,))), Region(("b",), torch.float32, Box.whole((2,)))]
    _, chosen, _, sends = regions_module._choose_sources([([], {}, []), (both, {}, [("a",), ("b",)])] * 2, root=0)
    assert chosen == {("a",): [(1, 0)], ("b",): [(3, 1)]} and sends == [[], [0], [], [1]]


def test_blocks_that_overlap_leave_gaps_or_disagree_are_errors() -> None:
    def manifests(*boxes: Box, layouts: tuple[Any, ...] = (None, None)) -> list[Any]:
        return [([Region(("w",), torch.float32, box, layout)], {}, [("w",)]) for box, layout in zip(boxes, layouts)]

    with pytest.raises(RuntimeError, match=r"Pieces of w overlap"):
        regions_module._choose_sources(manifests(Box((4, 4), (0, 0), (3, 2)), Box((4, 4), (2, 1), (2, 3))), 0)
    with pytest.raises(RuntimeError, match=r"Pieces of w cover 12 of its 16 elements"):
        regions_module._choose_sources(manifests(Box((4, 4), (0, 0), (2, 4)), Box((4, 4), (2, 0), (2, 2))), 0)
    with pytest.raises(RuntimeError, match=r"some hold flat ranges of it, others blocks"):
        regions_module._choose_sources(manifests(Box((4, 4), (0, 0), (2, 4)), Box.range((4, 4), 8, 8)), 0)

    class Layout(NamedTuple):
        ranks: tuple[int, ...]

    # a strided shard whose local tensor is not one block: torch's first offset and local shape overlap a peer's
    strided = (Layout((0, 1)), Layout((0, 1)))
    with pytest.raises(RuntimeError, match=r"overlap: .* \(held as Layout.*\); is each rank's local tensor one block"):
        regions_module._choose_sources(manifests(Box((4,), (0,), (2,)), Box((4,), (1,), (2,)), layouts=strided), 0)
    # rank 0 holds w on a mesh of ranks (0, 1) and rank 1 on a mesh of its own: they must agree
    with pytest.raises(RuntimeError, match=r"Ranks disagree on how they hold w: .* on rank 0, .* on rank 1"):
        regions_module._choose_sources(
            manifests(Box((4, 4), (0, 0), (2, 4)), Box((4, 4), (2, 0), (2, 4)), layouts=(Layout((0, 1)), Layout((1,)))),
            0,
        )
