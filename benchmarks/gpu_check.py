"""Device check of the FSDP adapters: CUDA tensors and NCCL, one GPU, one prepared run.

    python benchmarks/gpu_check.py                 # exits 0 with a message when there is no CUDA device
    python benchmarks/gpu_check.py --device cpu    # the same checks on CPU and gloo, to try the script itself

World size 1 on one GPU: the default process group is NCCL, and the adapters move host data over the gloo
group ``ignite_zero.transport.groups.cpu_group`` makes. For FSDP1 (flat and original parameters), FSDP1 with
``CPUOffload(offload_params=True)``, FSDP2, FSDP2 with ``CPUOffloadPolicy`` and HSDP (FSDP2 on a 1 x 1 device
mesh: placements ``(Replicate(), Shard(0))``, CUDA DTensors), a model and its unsharded twin
(plain module and Adam on the GPU) train alike for 3 steps, then:

- save: ``FSDPModelState``/``FSDPOptimizerState.state_dict()`` return plain CPU tensors only, close to the twin's
  state, and GPU memory (``torch.cuda.max_memory_allocated``) grows during the save by less than the largest
  parameter plus 1 MiB, far below one FSDP unit: nothing is gathered whole on the GPU;
- load: a fresh model and optimizer loaded from the saved state gather it back exactly, hold their optimizer
  state where their parameters are, and train on bitwise equal to the uninterrupted run; loading again into an
  optimizer that has state grows GPU memory by less than the same bound;
- sharded: a ``ShardedSaver`` checkpoint of the trained model and optimizer (device tensors copied into pinned
  memory, each one's copy overlapping the write of the one before) loads into a fresh model and optimizer exactly;
  the line gives the seconds of the second save;
- async: an asynchronous sharded save (its host copies in a shared block, page-locked for CUDA, written by the
  saver's helper process) holds the state at the moment of the call while the model trains on, and loads exactly;
  the line gives the seconds the second one blocked.

fairscale's ``FullyShardedDataParallel`` (plain, nested units, ``flatten_parameters=False``, ``mixed_precision``,
``move_params_to_cpu``) runs in 2 processes that share the GPU over gloo (NCCL refuses two ranks on one device),
and goes through ``ignite_zero.Checkpoint``: the file, written by rank 1, holds plain CPU tensors close to the
twin's state (within 25% in norm with ``mixed_precision``, whose fp16 gradients send Adam's steps apart; the same
format as FSDP1's); the save grows GPU memory on each rank by less than the bound above;
``Checkpoint.load_objects`` into a fresh fairscale model on both ranks gathers back exactly, loading again grows
GPU memory by less than the bound, and the model trains on bitwise equal to the uninterrupted one; the file loads
into a plain module and Adam on the recipient, equal to it.

Prints a line per setup and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

# Deterministic cuBLAS, for the bitwise comparison of resumed runs; set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ignite.engine import Engine  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import (  # noqa: E402
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver, _compat  # noqa: E402
from ignite_zero.adapters import FairscaleFSDPModelState, FairscaleFSDPOptimizerState  # noqa: E402
from ignite_zero.adapters.fsdp import FSDPModelState, FSDPOptimizerState  # noqa: E402

MiB = 2**20
WIDTH, BLOCKS = 1024, 4  # a unit holds 4.2M parameters (16 MiB), its largest parameter 4 MiB


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.layers(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, WIDTH)
        self.blocks = nn.Sequential(*(_Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x))) * self.scale


def _fsdp1(**options: Any) -> Callable[[nn.Module, torch.device], nn.Module]:
    def shard(model: nn.Module, device: torch.device) -> nn.Module:
        policy = ModuleWrapPolicy({_Block})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=device, **options)

    return shard


def _fsdp2(**options: Any) -> Callable[[nn.Module, torch.device], nn.Module]:
    def shard(model: nn.Module, device: torch.device) -> nn.Module:
        for block in model.blocks:
            fully_shard(block, **options)
        return fully_shard(model, **options)

    return shard


def _hsdp(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2 on a 2-D mesh of the one rank (HSDP's placements ``(Replicate(), Shard(0))``), made once the process
    group exists."""
    mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("replicate", "shard"))
    return _fsdp2(mesh=mesh)(model, device)


# name -> (how to shard, whether the parameters live on the CPU, whether it needs an accelerator)
SETUPS: dict[str, tuple[Callable[[nn.Module, torch.device], nn.Module], bool, bool]] = {
    "fsdp1": (_fsdp1(), False, False),
    "fsdp1_orig_params": (_fsdp1(use_orig_params=True), False, False),
    "fsdp1_cpu_offload": (_fsdp1(cpu_offload=CPUOffload(offload_params=True)), True, True),
    "fsdp2": (_fsdp2(), False, False),
    "fsdp2_cpu_offload": (_fsdp2(offload_policy=CPUOffloadPolicy()), True, True),
    "hsdp": (_hsdp, False, False),
}


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, device: torch.device) -> None:
    for step in steps:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _gather(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": FSDPModelState(model).state_dict(), "optimizer": FSDPOptimizerState(model, optimizer).state_dict()}


def _load(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    FSDPModelState(model).load_state_dict(state["model"])
    FSDPOptimizerState(model, optimizer).load_state_dict(state["optimizer"])


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _plain_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The twin's optimizer state keyed by parameter names."""
    names = [name for name, _ in model.named_parameters()]
    state = optimizer.state_dict()
    return {names[index]: value for index, value in state["state"].items()}


def _assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Bitwise equal model and optimizer state, equal parameter groups."""
    torch.testing.assert_close(actual["model"], expected["model"], atol=0, rtol=0)
    torch.testing.assert_close(actual["optimizer"]["state"], expected["optimizer"]["state"], atol=0, rtol=0)
    assert actual["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"], "parameter groups differ"


def _assert_near(actual: Any, expected: Any, relative: float, path: str = "state") -> float:
    """Every tensor of ``actual`` (nested dicts) within ``relative`` of ``expected``'s in norm: close to the twin as a
    whole, where a few elements may differ, and far from another rank's part or zeros (an error of 1 or more).
    Returns the largest error."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{path}: keys {sorted(actual)} differ from {sorted(expected)}"
        return max(
            (_assert_near(actual[key], value, relative, f"{path}[{key!r}]") for key, value in expected.items()),
            default=0.0,
        )
    if isinstance(expected, torch.Tensor):
        expected = expected.to("cpu", torch.float64)
        error = float((actual.to("cpu", torch.float64) - expected).norm() / expected.norm().clamp_min(1e-12))
        assert error <= relative, f"{path}: relative error {error:.2e} from the twin's (at most {relative})"
        return error
    assert actual == expected, f"{path}: {actual!r} differs from the twin's {expected!r}"
    return 0.0


@contextmanager
def _gpu_growth(device: torch.device) -> Iterator[list[int]]:
    """Yield a list that holds, after the block, the peak growth of allocated GPU memory during it (0 on CPU)."""
    growth = [0]
    if device.type != "cuda":
        yield growth
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    yield growth
    torch.cuda.synchronize(device)
    growth[0] = torch.cuda.max_memory_allocated(device) - before


def _check(name: str, device: torch.device) -> str:
    """Run one setup's checks; return a summary line, raise AssertionError on a failed check."""
    shard, offloaded, _ = SETUPS[name]
    torch.manual_seed(0)
    twin = _Net().to(device)
    model = shard(copy.deepcopy(twin).to("cpu" if offloaded else device), device)
    twin_optimizer, optimizer = _adam(twin), _adam(model)
    _train(twin, twin_optimizer, range(3), device)
    _train(model, optimizer, range(3), device)
    bound = max(p.numel() * p.element_size() for p in twin.parameters()) + MiB

    with _gpu_growth(device) as save_growth:
        saved = _gather(model, optimizer)
    assert save_growth[0] < bound, f"the save allocated {save_growth[0] / MiB:.1f} MiB on the GPU (bound {bound / MiB})"
    placed = [(type(t).__name__, t.device.type) for t in _tensors(saved)]
    assert all(p == ("Tensor", "cpu") for p in placed), f"saved tensors are not all plain CPU tensors: {set(placed)}"
    tolerance = {"atol": 1e-4, "rtol": 1e-3}
    torch.testing.assert_close(saved["model"], {k: v.cpu() for k, v in twin.state_dict().items()}, **tolerance)
    twin_state = _plain_optimizer_state(twin, twin_optimizer)
    torch.testing.assert_close(saved["optimizer"]["state"], twin_state, **tolerance, check_device=False)

    torch.manual_seed(1)
    fresh = shard(_Net().to("cpu" if offloaded else device), device)
    fresh_optimizer = _adam(fresh)
    _load(fresh, fresh_optimizer, saved)
    again = _gather(fresh, fresh_optimizer)
    _assert_same(again, saved)
    for param, state in fresh_optimizer.state.items():
        home = param.to_local().device if isinstance(param, DTensor) else param.device
        for key, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            assert key == "step" or local.device == home, (
                f"optimizer state {key} on {local.device}, parameter on {home}"
            )
    with _gpu_growth(device) as load_growth:
        _load(fresh, fresh_optimizer, saved)
    assert load_growth[0] < bound, f"loading allocated {load_growth[0] / MiB:.1f} MiB on the GPU (bound {bound / MiB})"

    _train(model, optimizer, range(3, 5), device)
    _train(fresh, fresh_optimizer, range(3, 5), device)
    _assert_same(_gather(fresh, fresh_optimizer), _gather(model, optimizer))
    sharded_seconds = _check_sharded(shard, offloaded, model, optimizer, device, asynchronous=False)
    blocked_seconds = _check_sharded(shard, offloaded, model, optimizer, device, asynchronous=True)
    return (
        f"GPU growth: save {save_growth[0] / MiB:.1f} MiB, load {load_growth[0] / MiB:.1f} MiB "
        f"(bound {bound / MiB:.0f} MiB, one unit {sum(p.numel() for p in _Block().parameters()) * 4 / MiB:.0f} MiB); "
        f"sharded save {sharded_seconds:.3f} s; async blocked {blocked_seconds:.3f} s"
    )


def _check_sharded(
    shard: Callable[[nn.Module, torch.device], nn.Module],
    offloaded: bool,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    asynchronous: bool,
) -> float:
    """A sharded checkpoint of ``model`` and ``optimizer`` loads into a fresh model and optimizer exactly; return the
    seconds the second save took, or with ``asynchronous`` blocked the loop.

    A synchronous save stages device tensors through pinned memory, one tensor's copy ahead of the write. An
    asynchronous one (over 64 MiB: written by the saver's helper process from a shared block, page-locked for
    device copies) holds the state at the moment of the call, though the model trains on by a step at once."""
    with tempfile.TemporaryDirectory() as directory:
        saver = ShardedSaver(directory)
        checkpoint = Checkpoint({"model": model, "optimizer": optimizer}, saver, async_save=asynchronous)
        engine = Engine(lambda e, b: None)
        checkpoint(engine)  # the first save warms up the pinned memory, and starts the helper
        checkpoint.wait()
        engine.state.iteration = 1
        expected = _gather(model, optimizer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        checkpoint(engine)
        seconds = time.perf_counter() - start
        if asynchronous:
            _train(model, optimizer, range(5, 6), device)  # while the save is written
            checkpoint.wait()
            assert saver.kept.write_process.pid is not None, "the helper process wrote no file"
        torch.manual_seed(2)
        other = shard(_Net().to("cpu" if offloaded else device), device)
        other_optimizer = _adam(other)
        Checkpoint.load_objects({"model": other, "optimizer": other_optimizer}, checkpoint.last_checkpoint)
        _assert_same(_gather(other, other_optimizer), expected)
    return seconds


# --------------------------------------------------------------------------------------------------
# fairscale's FullyShardedDataParallel: 2 processes on the one GPU, saved and loaded through ignite_zero.Checkpoint

# name -> options of fairscale's FullyShardedDataParallel; "nested" wraps each block in a unit of its own
FAIRSCALE_SETUPS: dict[str, dict[str, Any]] = {
    "fairscale_fsdp": {},
    "fairscale_nested": {"nested": True},
    "fairscale_no_flatten": {"nested": True, "flatten_parameters": False},
    "fairscale_mixed": {"mixed_precision": True},
    "fairscale_cpu_offload": {"move_params_to_cpu": True},
}
FAIRSCALE_RECIPIENT = 1  # not rank 0: fairscale's own routes gather to rank 0 only
FAIRSCALE_TIMEOUT_S = 420  # for all setups; ranks still running then are killed and reported


def _fairscale(name: str, net: _Net, device: torch.device) -> nn.Module:
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP  # type: ignore[import-untyped]

    options = dict(FAIRSCALE_SETUPS[name])
    nested = options.pop("nested", False)
    net = net.to("cpu" if options.get("move_params_to_cpu") else device)  # offloaded parameters start on the CPU
    # No reduce-scatter buckets: a bucket goes to the collective as a (ranks, elements) tensor, which NCCL takes and
    # gloo (the two processes share one GPU) refuses; unbucketed, fairscale hands over a flat tensor, which both take.
    options["bucket_cap_mb"] = 0
    if nested:
        for index, block in enumerate(net.blocks):
            net.blocks[index] = FairscaleFSDP(block, compute_device=device, **options)
    return FairscaleFSDP(net, compute_device=device, **options)


def _fairscale_gather(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": FairscaleFSDPModelState(model, FAIRSCALE_RECIPIENT).state_dict(),
        "optimizer": FairscaleFSDPOptimizerState(model, optimizer, FAIRSCALE_RECIPIENT).state_dict(),
    }


def _check_fairscale(name: str, rank: int, directory: Path) -> str:
    """Run one fairscale setup on this rank; on the recipient, check it and return a summary line (every collective
    comes first, so that a failed check leaves no rank waiting)."""
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    twin = _Net().to(device)
    model = _fairscale(name, copy.deepcopy(twin), device)
    twin_optimizer, optimizer = _adam(twin), _adam(model)
    # the same batches on both ranks: the averaged gradient is the twin's
    _train(twin, twin_optimizer, range(3), device)
    _train(model, optimizer, range(3), device)
    bound = max(p.numel() * p.element_size() for p in twin.parameters()) + MiB

    checkpoint = Checkpoint(
        {"model": model, "optimizer": optimizer},
        DiskSaver(directory, require_empty=False),
        consolidate_recipient_rank=FAIRSCALE_RECIPIENT,
    )
    with _gpu_growth(device) as save_growth:
        checkpoint(Engine(lambda engine, batch: None))
    path = checkpoint.last_checkpoint
    assert path is not None, "no checkpoint was written"

    torch.manual_seed(1)
    fresh = _fairscale(name, _Net(), device)
    fresh_optimizer = _adam(fresh)
    Checkpoint.load_objects({"model": fresh, "optimizer": fresh_optimizer}, path)
    again = _fairscale_gather(fresh, fresh_optimizer)
    with _gpu_growth(device) as load_growth:  # into an optimizer that has state: nothing new on the GPU
        Checkpoint.load_objects({"model": fresh, "optimizer": fresh_optimizer}, path)
    _train(model, optimizer, range(3, 5), device)
    _train(fresh, fresh_optimizer, range(3, 5), device)
    resumed, uninterrupted = _fairscale_gather(fresh, fresh_optimizer), _fairscale_gather(model, optimizer)
    assert save_growth[0] < bound, f"the save allocated {save_growth[0] / MiB:.1f} MiB on the GPU (bound {bound / MiB})"
    assert load_growth[0] < bound, f"loading allocated {load_growth[0] / MiB:.1f} MiB on the GPU (bound {bound / MiB})"
    if rank != FAIRSCALE_RECIPIENT:
        assert again == resumed == uninterrupted == {"model": {}, "optimizer": {}}, "a non-recipient got state"
        return ""

    saved = torch.load(path, weights_only=True)
    placed = [(type(t).__name__, t.device.type) for t in _tensors(saved)]
    assert all(p == ("Tensor", "cpu") for p in placed), f"saved tensors are not all plain CPU tensors: {set(placed)}"
    twin_model = {k: v.cpu() for k, v in twin.state_dict().items()}
    twin_state = _plain_optimizer_state(twin, twin_optimizer)
    if FAIRSCALE_SETUPS[name].get("mixed_precision", False):
        # fp16 gradients, where the twin's are fp32: Adam's steps, about lr each whatever the gradient's size, go apart
        # where a gradient rounds to another sign (up to 9.6% of a tensor's norm after 3 steps, measured on an H200);
        # zeros or another rank's part are 100% or more apart, and a stale state is caught below, by the exact resume
        apart = max(
            _assert_near(saved["model"], twin_model, relative=0.25),
            _assert_near(saved["optimizer"]["state"], twin_state, relative=0.25),
        )
    else:
        apart = 0.0
        torch.testing.assert_close(saved["model"], twin_model, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(saved["optimizer"]["state"], twin_state, atol=1e-4, rtol=1e-3, check_device=False)
    _assert_same(again, saved)
    for param, state in fresh_optimizer.state.items():
        for key, value in state.items():
            assert key == "step" or value.device == param.device, (
                f"optimizer state {key} on {value.device}, parameter on {param.device}"
            )
    _assert_same(resumed, uninterrupted)

    plain = _Net().to(device)  # the file into a plain module and optimizer: a local load, on this rank only
    plain_optimizer = _adam(plain)
    Checkpoint.load_objects({"model": plain, "optimizer": plain_optimizer}, path)
    torch.testing.assert_close({k: v.cpu() for k, v in plain.state_dict().items()}, saved["model"], atol=0, rtol=0)
    plain_state = _plain_optimizer_state(plain, plain_optimizer)
    torch.testing.assert_close(plain_state, saved["optimizer"]["state"], atol=0, rtol=0, check_device=False)
    growth = f"save {save_growth[0] / MiB:.1f} MiB, load {load_growth[0] / MiB:.1f} MiB"
    twin = f"; at most {apart:.1e} from the fp32 twin in norm" if apart else ""
    return f"GPU growth: {growth} (bound {bound / MiB:.0f} MiB){twin}"


def _fairscale_rank(rank: int, directory: str) -> None:
    """One of the 2 processes: run every fairscale setup, and write the agreed result lines to ``result{rank}``."""
    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated")  # fairscale's own storage calls
    store = f"file://{Path(directory) / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2, timeout=timedelta(minutes=3))
    lines = []
    try:
        for name in FAIRSCALE_SETUPS:
            outcome: tuple[str, str | None] = ("", None)
            try:
                outcome = (_check_fairscale(name, rank, Path(directory) / name), None)
            except Exception:
                outcome = ("", traceback.format_exc())
            outcomes: list[Any] = [None, None]
            dist.all_gather_object(outcomes, outcome)  # both ranks report the same: one failure fails the setup
            failures = [f"rank {r}:\n{failure}" for r, (_, failure) in enumerate(outcomes) if failure]
            summary = outcomes[FAIRSCALE_RECIPIENT][0]
            lines.append(f"{name:20} FAILED\n" + "\n".join(failures) if failures else f"{name:20} ok    {summary}")
    finally:
        (Path(directory) / f"result{rank}").write_text(json.dumps(lines))
        dist.destroy_process_group()


def _run_fairscale() -> int:
    """Run the fairscale setups in 2 spawned processes; print a line per setup; return the number that failed."""
    if _compat.fairscale_fsdp_class() is None:
        print(f"{'fairscale':20} skipped: fairscale is not installed")
        return 0
    context = multiprocessing.get_context("spawn")  # this process has started CUDA: no fork
    with tempfile.TemporaryDirectory() as tmp:
        processes = [context.Process(target=_fairscale_rank, args=(rank, tmp)) for rank in range(2)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + FAIRSCALE_TIMEOUT_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        result = Path(tmp) / f"result{FAIRSCALE_RECIPIENT}"
        lines = json.loads(result.read_text()) if result.exists() else []
        codes = [process.exitcode for process in processes]
    for line in lines:
        print(line)
    missing = len(FAIRSCALE_SETUPS) - len(lines)
    if hung or missing:
        print(f"{'fairscale':20} FAILED: {missing} setup(s) unreported, ranks {hung} hung, exit codes {codes}")
    return missing + sum(" FAILED" in line.splitlines()[0] for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        print(
            f"SKIPPED: no CUDA device with NCCL (torch {torch.__version__}, CUDA available: "
            f"{torch.cuda.is_available()}, NCCL available: {dist.is_nccl_available()}); nothing was checked"
        )
        return 0
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
    warnings.filterwarnings("ignore", message=".*switching to use `NO_SHARD`")  # FSDP1 on one rank
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            print(f"torch {torch.__version__}, {backend}, device {device}")
            for name, (_, _, needs_accelerator) in SETUPS.items():
                if needs_accelerator and device.type != "cuda":
                    print(f"{name:20} skipped: needs a GPU")
                    continue
                try:
                    print(f"{name:20} ok    {_check(name, device)}")
                except Exception:
                    failures += 1
                    print(f"{name:20} FAILED\n{traceback.format_exc()}")
        finally:
            dist.destroy_process_group()
    if device.type == "cuda":
        failures += _run_fairscale()
    else:
        print(f"{'fairscale':20} skipped: needs a GPU")
    print("all checks passed" if not failures else f"{failures} setup(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
