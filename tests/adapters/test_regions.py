"""Every DTensor layout on 4 gloo ranks with CPU meshes: HSDP ``(Replicate(), Shard(0))``, FSDP2 over tensor
parallelism ``(_StridedShard(0, sf=2), Shard(0))``, FSDP1 hybrid sharding from a mesh and from a pair of process
groups, saved in both modes (one file through the recipient, also asynchronously, or a sharded DCP directory; each
block written once) and loaded across layouts and world sizes: into 1-D FSDP2 and FSDP1 on 2 ranks, into a plain
module in one process, and the other way round.

Every layout trains next to an unsharded twin on the same batches (the same on every rank): what it saves is close to
the twin's state, and a resume on the same layout is bitwise equal to the uninterrupted run. The model has tied
weights, sizes divisible by no mesh dimension, parameters replicated over the tensor-parallel dimension and sharded
over the data-parallel one, and units on different meshes (the tensor-parallel layers on the 2-D mesh, the rest on
its data-parallel submesh, which does not span the world). One 4-rank launch covers all of it, to keep the file fast.

Below them, :func:`~ignite_zero.adapters.regions.gather_pieces` on its own: full tensors assembled on any rank from
flat ranges, slices, blocks, replicas, values and aliases, each block taken from one replica, and pieces that overlap,
leave gaps or disagree refused on every rank.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from fsdp_states import assert_states, full_optimizer_state, gather_fsdp_state, train_same_batches
from ignite.engine import Engine
from launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transported import assert_same

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver, cli
from ignite_zero.adapters import regions as regions_module
from ignite_zero.adapters.regions import Box, Pieces, Region, gather_pieces
from ignite_zero.storage.formats import consolidation
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.formats.consolidation import WINDOW_BYTES
from ignite_zero.storage.formats.file_verification import verify_file
from ignite_zero.transport import DEFAULT_CHUNK_BYTES, Overlap


class Layer(nn.Module):
    """A residual MLP: tensor parallelism splits ``up`` by rows (columns of its output) and ``down`` by columns."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class LayoutNet(nn.Module):
    """An embedding tied to the output projection; 11 and 5 divide by no mesh dimension, 6 by the tensor-parallel
    one only (3 rows per tensor-parallel rank, sharded 2 + 1 over the data-parallel dimension)."""

    def __init__(self, vocab: int = 11, d: int = 5, hidden: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.Sequential(Layer(d, hidden), Layer(d, hidden))
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers(self.emb(x)))


def _fsdp2(model: LayoutNet, mesh: Any) -> nn.Module:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _hsdp(model: LayoutNet) -> nn.Module:
    return _fsdp2(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))


def _tensor_parallel(model: LayoutNet) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _fsdp1(model: LayoutNet, **options: Any) -> nn.Module:
    policy = ModuleWrapPolicy({Layer})
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True, **options
    )


def _hybrid_mesh(model: LayoutNet) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return _fsdp1(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)


def _hybrid_groups(model: LayoutNet) -> nn.Module:
    rank = dist.get_rank()
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = (shard_groups[rank // 2], replicate_groups[rank % 2])
    return _fsdp1(model, sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2, process_group=groups)


LAYOUTS: dict[str, Callable[[LayoutNet], nn.Module]] = {
    "hsdp": _hsdp,
    "tp": _tensor_parallel,
    "fsdp1_hybrid": _hybrid_mesh,
    "fsdp1_zero2_groups": _hybrid_groups,
    "fsdp2": lambda model: _fsdp2(model, init_device_mesh("cpu", (dist.get_world_size(),))),
    "fsdp1": _fsdp1,
}
SAVE_STEPS, MORE_STEPS = range(2), range(2, 4)
MODES = ("pt", "dcp")


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)


@functools.cache
def _twin(steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    twin = LayoutNet()
    optimizer = _adam(twin)
    train_same_batches(twin, optimizer, range(steps), tokens=True)
    return {"model": twin.state_dict(), "optimizer": full_optimizer_state(twin, optimizer)}


def _build(layout: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LAYOUTS[layout](LayoutNet())
    return model, _adam(model)


def _save(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, recipient: int, background: bool = False
) -> None:
    """Both modes, as users save: one file written by the recipient, and a sharded directory; with ``background``,
    also the file saved asynchronously, in ``directory / "async"``."""
    engine = Engine(lambda e, b: None)
    engine.state.iteration = 1
    to_save = {"model": model, "optimizer": optimizer}
    Checkpoint(to_save, DiskSaver(directory, require_empty=False), consolidate_recipient_rank=recipient)(engine)
    Checkpoint(to_save, ShardedSaver(directory, require_empty=False), consolidate_recipient_rank=recipient)(engine)
    if background:
        saver = DiskSaver(directory / "async")
        checkpoint = Checkpoint(to_save, saver, consolidate_recipient_rank=recipient, async_save=True)
        checkpoint(engine)
        checkpoint.wait()


def _path(directory: Path, layout: str, mode: str) -> Path:
    return directory / layout / f"checkpoint_1.{mode}"


def _load(layout: str, path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh, differently initialised ``layout`` loaded from ``path``."""
    model, optimizer = _build(layout, seed=1234)
    Checkpoint.load_objects({"model": model, "optimizer": optimizer}, path)
    return model, optimizer


def _save_layout(rank: int, layout: str, directory: Path, recipient: int) -> None:
    """Train next to the twin and save both modes; resume from each on the same layout, bitwise."""
    model, optimizer = _build(layout, seed=0)
    train_same_batches(model, optimizer, SAVE_STEPS, tokens=True)
    saved = gather_fsdp_state(model, optimizer, recipient)
    if rank == recipient:
        assert_states(saved, _twin(len(SAVE_STEPS)), exact=False)
        assert saved["model"]["out.weight"] is saved["model"]["emb.weight"]  # tied: one tensor
    _save(model, optimizer, directory / layout, recipient, background=True)
    if rank == recipient:
        assert_states(torch.load(_path(directory, layout, "pt"), weights_only=True), saved, exact=True)
        in_background = torch.load(directory / layout / "async" / "checkpoint_1.pt", weights_only=True)
        assert_states(in_background, saved, exact=True)
        _assert_written_once(_path(directory, layout, "dcp"))
    train_same_batches(model, optimizer, MORE_STEPS, tokens=True)
    uninterrupted = gather_fsdp_state(model, optimizer, recipient)
    for mode in MODES:
        resumed, resumed_optimizer = _load(layout, _path(directory, layout, mode))
        again = gather_fsdp_state(resumed, resumed_optimizer, recipient)
        train_same_batches(resumed, resumed_optimizer, MORE_STEPS, tokens=True)
        after = gather_fsdp_state(resumed, resumed_optimizer, recipient)
        if rank == recipient:
            assert_states(again, saved, exact=True)
            assert_states(after, uninterrupted, exact=True)


def _assert_written_once(directory: Path) -> None:
    """The blocks of every tensor in a sharded checkpoint add up to the tensor: replicas wrote nothing twice."""
    index = sharded.read_contents(directory).entry_index
    for name in index.names:
        if (layout := index.layout(name)) is not None:
            written = sum(math.prod(chunk.sizes) for chunk in layout.chunks)
            assert written == math.prod(layout.size), f"{name}: {written} elements written of {math.prod(layout.size)}"


def _resume_across(rank: int, target: str, directory: Path, source: str) -> None:
    """Load ``source``'s checkpoints (both modes) into ``target``, train on: close to the twin."""
    for mode in MODES:
        model, optimizer = _load(target, _path(directory, source, mode))
        train_same_batches(model, optimizer, MORE_STEPS, tokens=True)
        resumed = gather_fsdp_state(model, optimizer, 0)
        if rank == 0:
            assert_states(resumed, _twin(len(SAVE_STEPS) + len(MORE_STEPS)), exact=False)


def _on_4_ranks(rank: int, world_size: int, directory: Path) -> None:
    # the recipient is a replica of another rank's shards (HSDP), or holds a tensor-parallel part only
    for layout, recipient in (("hsdp", 3), ("tp", 1), ("fsdp1_hybrid", 2), ("fsdp1_zero2_groups", 0)):
        _save_layout(rank, layout, directory, recipient)
    model, _ = _build("tp", seed=0)
    placements = {name: p.placements for name, p in model.named_parameters()}
    assert placements["layers.0.up.weight"][0].__class__.__name__ == "_StridedShard"
    assert placements["layers.0.down.bias"] == (Shard(0), Replicate())  # replicated over tp, sharded over dp
    assert placements["emb.weight"] == (Shard(0),)  # on the data-parallel submesh
    for target, source in (
        ("tp", "hsdp"),
        ("hsdp", "tp"),
        ("hsdp", "fsdp1_hybrid"),
        ("fsdp1_hybrid", "tp"),
        ("hsdp", "fsdp2"),  # saved on 2 ranks with a 1-D mesh
        ("tp", "fsdp2"),
        ("hsdp", "plain"),  # saved in one process, without a process group
        ("tp", "plain"),
    ):
        _resume_across(rank, target, directory, source)


def _on_2_ranks(rank: int, world_size: int, directory: Path, step: str) -> None:
    if step == "save":
        _save_layout(rank, "fsdp2", directory, 1)
        return
    for target, source in (("fsdp2", "hsdp"), ("fsdp2", "tp"), ("fsdp1", "hsdp"), ("fsdp1", "fsdp1_zero2_groups")):
        _resume_across(rank, target, directory, source)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain module saved in one process, 1-D FSDP2 on 2 ranks; then every 2-D layout saved on 4 ranks, resumed
    bitwise, and loaded into the others and from the plain and 2-rank checkpoints."""
    directory = tmp_path_factory.mktemp("layouts")
    torch.manual_seed(0)
    model = LayoutNet()
    optimizer = _adam(model)
    train_same_batches(model, optimizer, SAVE_STEPS, tokens=True)
    _save(model, optimizer, directory / "plain", 0)
    run_ranks(_on_2_ranks, 2, directory, "save")
    run_ranks(_on_4_ranks, 4, directory, timeout=240)
    return directory


@pytest.mark.distributed
def test_every_layout_saves_resumes_bitwise_and_loads_across_layouts(saved: Path) -> None:
    """The checks run on the ranks the fixture launches; here, what they wrote."""
    for layout in ("hsdp", "tp", "fsdp1_hybrid", "fsdp1_zero2_groups", "fsdp2"):
        assert _path(saved, layout, "pt").is_file() and _path(saved, layout, "dcp").is_dir()


@pytest.mark.distributed
def test_2d_layouts_load_into_1d_fsdp2_and_fsdp1_on_2_ranks(saved: Path) -> None:
    run_ranks(_on_2_ranks, 2, saved, "load")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_2d_layouts_load_into_a_plain_module_without_process_group(saved: Path, mode: str) -> None:
    expected = _twin(len(SAVE_STEPS) + len(MORE_STEPS))
    for layout in ("hsdp", "tp", "fsdp1_hybrid"):
        torch.manual_seed(7)
        model = LayoutNet()
        optimizer = _adam(model)
        Checkpoint.load_objects({"model": model, "optimizer": optimizer}, _path(saved, layout, mode))
        train_same_batches(model, optimizer, MORE_STEPS, tokens=True)
        actual = {"model": model.state_dict(), "optimizer": full_optimizer_state(model, optimizer)}
        assert_states(actual, expected, exact=False)
        assert model.out.weight is model.emb.weight


@pytest.mark.distributed
@pytest.mark.parametrize("window", [WINDOW_BYTES, 48], ids=["window", "rows a few at a time"])
@pytest.mark.parametrize("layout", ["hsdp", "tp", "fsdp1_hybrid", "fsdp2"])
def test_consolidate_writes_what_the_consolidated_save_wrote(saved, layout, window, tmp_path, monkeypatch):
    """``ignite-zero consolidate`` streams every layout's shards (rows split over files, over tensor-parallel parts)
    into the state that the consolidated save of the same moment holds."""
    monkeypatch.setattr(consolidation, "WINDOW_BYTES", window)
    target = tmp_path / "one.pt"
    assert cli.main(["consolidate", str(_path(saved, layout, "dcp")), str(target)]) == 0
    assert verify_file(target) is not None
    expected = _in_name_order(torch.load(_path(saved, layout, "pt"), weights_only=True))
    for mmap in (False, True):
        assert_states(_in_name_order(torch.load(target, weights_only=True, mmap=mmap)), expected, exact=True)
    torch.manual_seed(7)
    model = LayoutNet()
    optimizer = _adam(model)
    Checkpoint.load_objects({"model": model, "optimizer": optimizer}, target)
    actual = {"model": model.state_dict(), "optimizer": full_optimizer_state(model, optimizer)}
    assert_states(_in_name_order(actual), expected, exact=True)


def _in_name_order(state: Any) -> Any:
    """Every mapping's entries by name: a directory's metadata lists them in an order of its own, not the state's."""
    if isinstance(state, dict):
        return {key: _in_name_order(state[key]) for key in sorted(state, key=str)}
    return [_in_name_order(value) for value in state] if isinstance(state, list) else state


@pytest.mark.distributed
def test_consolidate_refuses_a_corrupt_entry_and_leaves_nothing(saved, tmp_path, capsys):
    directory = tmp_path / "corrupt.dcp"
    shutil.copytree(_path(saved, "tp", "dcp"), directory)
    records = sharded.entry_records(sharded.read_manifest(directory))
    name, record = next(
        (name, record) for name, part in records.items() for record in part if record.data_offset > record.offset
    )
    with open(directory / name, "r+b") as f:
        f.seek(record.data_offset + 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    target_directory = tmp_path / "out"
    target_directory.mkdir()
    assert cli.main(["consolidate", str(directory), str(target_directory / "one.pt")]) == 1
    assert "is corrupt" in capsys.readouterr().err
    assert list(target_directory.iterdir()) == []  # no target, no temporary file


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
        assert result[("replica",)].data_ptr() != full["replica"].data_ptr(), "a result of its own, not a view"
    with Overlap() as arriving:  # a consolidated save: the recipient writes its own whole tensors from where they are
        pieces = _pieces_of(rank, world_size, full)
        learning, bigger = torch.ones(2, 3, requires_grad=True), torch.arange(6.0)
        pieces.add_whole(("learning",), learning)
        pieces.add_whole(("part",), bigger[:3])
        result = gather_pieces(pieces, 0, overlap=arriving)
        if result is not None:
            arriving.finish()
    if rank == 0:
        for name, tensor in full.items():
            assert_same(result[(name,)], tensor)
        assert result[("replica",)].data_ptr() == full["replica"].data_ptr()
        assert type(result[("learning",)]) is torch.Tensor and not result[("learning",)].requires_grad
        assert result[("learning",)].data_ptr() == learning.data_ptr()
        assert torch.equal(result[("part",)], bigger[:3])
        assert result[("part",)].data_ptr() != bigger.data_ptr(), "a view of more memory: copied, whole in the file"


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


def _gathered(
    rank: int, world_size: int, full: dict[str, torch.Tensor], lr: float = 0.5, root_only: Any = None
) -> list[Any]:
    """Gather ``full`` as :func:`_pieces_of` holds it (the recipient, rank 0, also ``root_only``), check it there;
    the plans kept then."""
    pieces = _pieces_of(rank, world_size, full)
    pieces.values[("lr",)] = lr
    if rank == 0 and root_only is not None:
        pieces.add_whole(("root_only",), root_only)
    result = gather_pieces(pieces, 0)
    if rank == 0:
        for name, tensor in full.items():
            assert_same(result[(name,)], tensor)
        assert result[("lr",)] == lr and result[("tied",)] is result[("flat",)]
        if root_only is not None:
            assert_same(result[("root_only",)], root_only)
    return list(regions_module._PLANS.values())


def _test_a_plan_is_kept_while_the_layout_holds(rank: int, world_size: int) -> None:
    regions_module._PLANS.clear()
    full = _full()
    plans = _gathered(rank, world_size, full)
    assert len(plans) == (1 if rank == 0 else 0)  # the recipient alone plans
    # the same layout, other bytes and values: the very plan, the new bytes and values gathered
    doubled = {name: tensor * 2 for name, tensor in full.items()}
    kept = _gathered(rank, world_size, doubled, lr=0.25)
    assert len(kept) == len(plans) and all(a is b for a, b in zip(kept, plans))
    # a tensor of another dtype, of another shape, pieces of the recipient alone changed: each planned afresh
    columns = torch.randn(3, 13, generator=torch.Generator().manual_seed(1)).bfloat16()
    for state, root_only in (
        ({**full, "flat": full["flat"].double()}, None),
        ({**full, "columns": columns}, None),
        (full, torch.ones(3)),
    ):
        kept = _gathered(rank, world_size, state, root_only=root_only)
        assert rank != 0 or sum(all(new is not plan for plan in plans) for new in kept) == 1
        plans = kept
    # the recipient's very pieces, added to after their gather: planned afresh all the same
    pieces = _pieces_of(rank, world_size, full)
    gather_pieces(pieces, 0)
    if rank == 0:
        pieces.add_whole(("late",), torch.ones(2))
    result = gather_pieces(pieces, 0)
    assert rank != 0 or torch.equal(result[("late",)], torch.ones(2))
    # pieces that overlap once plans are kept: refused on every rank all the same
    overlapping = Pieces()
    overlapping.add(("w",), Box.range((world_size + 1,), rank, 2), torch.ones(2))
    with pytest.raises(RuntimeError, match=r"Pieces of w overlap"):
        gather_pieces(overlapping, 0)
    _gathered(rank, world_size, full)  # the group is still usable


@pytest.mark.distributed
def test_a_gather_keeps_its_plan_while_the_layout_holds() -> None:
    """Plans once: the recipient chooses the sources of each block again only where a rank's pieces changed."""
    run_ranks(_test_a_plan_is_kept_while_the_layout_holds, 3)  # replicas at 3 ranks: the plan chooses among them


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
    with pytest.raises(RuntimeError, match=r"some hold flat ranges of it, others blocks"):  # the root's whole too
        regions_module._choose_sources(manifests(Box.whole((4, 4)), Box.range((4, 4), 0, 16)), 0)

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


@pytest.mark.parametrize("compared_in_python", [0, 64])
def test_overlapping_boxes_are_found_pair_by_pair_and_vectorised_alike(monkeypatch, compared_in_python) -> None:
    monkeypatch.setattr(regions_module, "_COMPARED_IN_PYTHON", compared_in_python)
    generator = random.Random(7)
    found = 0
    for _ in range(300):
        boxes = []
        for _ in range(generator.randint(2, 12)):
            offsets = tuple(generator.randint(0, 6) for _ in range(2))
            sizes = tuple(generator.randint(1, 3) for _ in range(2))
            boxes.append(Box((10, 10), offsets, sizes))
        expected = [
            (a, b) for a in range(len(boxes)) for b in range(a + 1, len(boxes)) if _shared_cells(boxes[a], boxes[b])
        ]
        overlapping = regions_module._first_overlap(boxes)
        assert (overlapping is None) == (not expected)
        if overlapping is not None:
            found += 1
            assert tuple(sorted(overlapping)) in expected
    assert found > 50


def _shared_cells(first: Box, second: Box) -> bool:
    """Whether two boxes of a 2-D tensor share a cell, counted cell by cell."""
    cells = [
        {
            (i, j)
            for i in range(box.offsets[0], box.offsets[0] + box.sizes[0])
            for j in range(box.offsets[1], box.offsets[1] + box.sizes[1])
        }
        for box in (first, second)
    ]
    return bool(cells[0] & cells[1])
