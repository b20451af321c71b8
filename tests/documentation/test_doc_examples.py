"""The documentation's examples run: every ``Examples:`` block of ignite_zero's docstrings and every Python block of
README.rst and of the pages under docs/, executed for real on the ranks each one needs.

The collector takes each ``.. code-block:: python`` under ``Examples:`` in the docstring of every module, class,
function, method and property that ignite_zero defines, and each Python block of README.rst and of docs/*.rst, named
by its file and section.
Every one of them has an entry in ``EXAMPLES``: the number of gloo ranks it runs on (``0``: one process without a
process group) and the setup that supplies the names the surrounding prose takes as given. A snippet sees:

- always: ``torch``, ``sys``, ``idist`` (``ignite.distributed``) and ``Events``;
- ``plain``: ``model`` (a tiny ``Sequential`` whose last layer is ``head``), ``optimizer`` (its Adam), ``trainer``
  (an ``Engine`` that trains whichever ``model`` and ``optimizer`` the snippet's namespace holds), ``loader`` (one
  batch an epoch, so that files named by iteration, as they are by default, are named by epoch too), ``to_save``
  (the three), ``net`` (an unwrapped twin of ``model``) and ``device`` (the CPU);
- ``zero``: the same with ``model`` in DDP and a ``ZeroRedundancyOptimizer``;
- ``fsdp``: the same with ``model`` in FSDP1 and its Adam;
- ``object_store``: as ``zero``, with the ``endpoint``, ``key`` and ``secret`` of moto's S3 server on 127.0.0.1,
  whose bucket ``bucket`` the test creates empty;
- a few additions named in their entry (a checkpoint saved beforehand, a ``sampler``, ``checkpoint``, a
  ``dataset``).

One is listed and skipped with the reason: the example of ``FairscaleFSDPModelState`` needs GPUs and NCCL.

Every rank runs the setup, then the snippet (``exec``), in one working directory that all ranks share, so that
relative paths such as ``"ckpt"`` land there. If the snippet uses ``trainer`` but does not run it, the rank runs it
for 2 epochs so that the handlers it attached fire. An entry may then check the namespace on each rank, and the files
that must exist afterwards. A snippet that raises, or leaves the files or values it promises missing, fails.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import pytest
import torch
import torch.distributed as dist
from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP
from ignite.engine import Engine, Events
from launcher import run_ranks
from safetensors.torch import load_file
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset
from training import tiny_model, train_step, zero_adam

import ignite_zero
from ignite_zero import Checkpoint, DiskSaver
from ignite_zero.adapters import FairscaleFSDPOptimizerState, FSDPOptimizerState, ZeROState

README = Path(__file__).parents[2] / "README.rst"
PAGES = sorted((Path(__file__).parents[2] / "docs").glob("*.rst"))
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------
# Collecting the examples


def _indented_under(lines: list[str], index: int) -> list[str]:
    """The lines after ``lines[index]`` up to the next non-blank one indented no deeper than it."""
    indent = len(lines[index]) - len(lines[index].lstrip())
    body: list[str] = []
    for line in lines[index + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return body


def _code_blocks(text: str) -> Iterator[str]:
    """The bodies of the ``.. code-block:: python`` directives in ``text``, dedented."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.strip() == ".. code-block:: python":
            yield inspect.cleandoc("\n".join(_indented_under(lines, index)))


def _examples_section(docstring: str) -> str:
    """The ``Examples:`` section of a docstring."""
    lines = inspect.cleandoc(docstring).splitlines()
    headings = [index for index, line in enumerate(lines) if line.strip() == "Examples:"]
    return "\n".join(_indented_under(lines, headings[0])) if headings else ""


def _documented() -> Iterator[tuple[str, Any]]:
    """(qualified name, object) of every module, and of every class, function, method and property defined there."""
    modules = [ignite_zero]
    for info in pkgutil.walk_packages(ignite_zero.__path__, "ignite_zero."):
        if not info.name.endswith(".__main__"):  # importing it runs the command line
            modules.append(importlib.import_module(info.name))
    for module in modules:
        yield module.__name__, module
        for obj in vars(module).values():
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or obj.__module__ != module.__name__:
                continue
            yield f"{module.__name__}.{obj.__qualname__}", obj
            for name, member in vars(obj).items() if inspect.isclass(obj) else ():
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    yield f"{module.__name__}.{obj.__qualname__}.{name}", member


def docstring_examples() -> dict[str, str]:
    """Every code block of every ``Examples:`` section, by the qualified name of its object (``#2`` for a second)."""
    found: dict[str, str] = {}
    for name, obj in _documented():
        for number, code in enumerate(_code_blocks(_examples_section(obj.__doc__ or "")), 1):
            found[name if number == 1 else f"{name}#{number}"] = code
    return found


def rst_examples(path: Path, label: str) -> dict[str, str]:
    """Every Python block of an rst file, by ``<label>: <section title>`` (``#2`` for a second in a section)."""
    lines = path.read_text().splitlines()
    titles = [
        index
        for index, (line, underline) in enumerate(zip(lines, lines[1:]))
        if line.strip() and len(set(underline)) == 1 and underline[0] in "=-~^" and len(underline) >= len(line)
    ]
    found: dict[str, str] = {}
    for title, end in zip(titles, [*titles[1:], len(lines)]):
        for number, code in enumerate(_code_blocks("\n".join(lines[title + 2 : end])), 1):
            found[f"{label}: {lines[title].strip()}" + ("" if number == 1 else f"#{number}")] = code
    return found


def readme_examples() -> dict[str, str]:
    return rst_examples(README, "README")


def page_examples() -> dict[str, str]:
    """Every Python block of the documentation's pages, by ``docs/<page>.rst: <section title>``."""
    return {name: code for page in PAGES for name, code in rst_examples(page, f"docs/{page.name}").items()}


def test_the_collector_finds_every_examples_section_in_the_source():
    """Each ``Examples:`` heading in the package's source is reached through an object, so none escapes the run."""
    headings = sum(
        len(re.findall(r"^\s*Examples:$", path.read_text(), re.MULTILINE))
        for path in Path(ignite_zero.__file__).parent.rglob("*.py")
    )
    found = {name.split("#")[0] for name in docstring_examples()}
    assert headings == len(found) > 20
    assert README.read_text().count(".. code-block:: python") == len(readme_examples()) == 3
    in_pages = sum(page.read_text().count(".. code-block:: python") for page in PAGES)
    assert in_pages == len(page_examples()) > 10


def test_the_api_reference_documents_every_public_name():
    """docs/api.rst has an autodoc directive (or a ``py:data``) for each name of ``ignite_zero.__all__``, and no
    other; the build (``sphinx-build -W -n``) fails on a name without docstring."""
    api = (README.parent / "docs" / "api.rst").read_text()
    documented = re.findall(r"^\.\. (?:auto\w+|py:data):: (\w+)$", api, re.MULTILINE)
    assert sorted(documented) == sorted(ignite_zero.__all__)


# ---------------------------------------------------------------------------------------------------------------
# What the snippets take as given


class ShuffledSampler:
    """A sampler whose position is per-rank state, as a user's own resumable sampler is."""

    def __init__(self, rank: int) -> None:
        self.seed, self.position = rank, 0

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.position = state["seed"], state["position"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(body=nn.Linear(7, 5), act=nn.ReLU(), head=nn.Linear(5, 1)))


def _trainer(namespace: dict[str, Any], rank: int, model: str = "model", optimizer: str = "optimizer") -> Engine:
    def step(engine: Engine, _: Any) -> float:
        return train_step(namespace[model], namespace[optimizer], rank, engine.state.iteration)

    return Engine(step)


def _with_trainer(namespace: dict[str, Any], rank: int, *pair: str) -> dict[str, Any]:
    namespace.update(trainer=_trainer(namespace, rank, *pair), loader=range(1), device=CPU)
    if "optimizer" in namespace:
        namespace["to_save"] = {"model": namespace["model"], "optimizer": namespace["optimizer"]}
        namespace["to_save"]["trainer"] = namespace["trainer"]
    return namespace


def plain(rank: int) -> dict[str, Any]:
    model = _net()
    return _with_trainer({"model": model, "optimizer": torch.optim.Adam(model.parameters()), "net": _net()}, rank)


def zero(rank: int) -> dict[str, Any]:
    model = DistributedDataParallel(tiny_model())
    return _with_trainer({"model": model, "optimizer": zero_adam(model)}, rank)


def fsdp(rank: int) -> dict[str, Any]:
    model = FullyShardedDataParallel(_net(), device_id=CPU, use_orig_params=True)
    return _with_trainer({"model": model, "optimizer": torch.optim.Adam(model.parameters()), "net": _net()}, rank)


def parts(rank: int) -> dict[str, Any]:
    """No model yet: ``net`` and ``device`` for the snippet to wrap, and a trainer of what it makes."""
    return _with_trainer({"net": _net()}, rank)


def with_evaluator(rank: int) -> dict[str, Any]:
    """As ``parts``, with an ``evaluator`` whose run sets the metric ``accuracy`` (higher each epoch of the trainer),
    and its ``val_loader``."""
    namespace = parts(rank)
    evaluator = Engine(lambda *_: None)
    trainer = namespace["trainer"]
    evaluator.add_event_handler(Events.COMPLETED, lambda e: e.state.metrics.update(accuracy=trainer.state.epoch / 10))
    namespace.update(evaluator=evaluator, val_loader=range(1))  # in place: the trainer trains this dict's model
    return namespace


def _saved(setup: Callable[[int], dict[str, Any]], dirname: str) -> Callable[[int], dict[str, Any]]:
    """``setup`` after one training step, saved as ``dirname/checkpoint_3.pt``, whose path is ``path``."""

    def saved(rank: int) -> dict[str, Any]:
        namespace = setup(rank)
        train_step(namespace["model"], namespace["optimizer"], rank, 0)
        saver = DiskSaver(dirname, require_empty=False)
        Checkpoint(namespace["to_save"], saver, global_step_transform=lambda *_: 3)(Engine(lambda *_: None))
        namespace["path"] = f"{dirname}/checkpoint_3.pt"
        return namespace

    return saved


def plain_after_fsdp(rank: int) -> dict[str, Any]:
    """``checkpoint_3.pt`` saved from an FSDP model, then a plain model and optimizer to load it into."""
    _saved(fsdp, ".")(rank)
    model = _net()
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters())}


def stager(rank: int) -> dict[str, Any]:
    namespace = zero(rank)
    train_step(namespace["model"], namespace["optimizer"], rank, 0)
    namespace.update(adapter=ZeROState(namespace["optimizer"], recipient_rank=0), group=dist.group.WORLD)
    return namespace


def with_sampler(rank: int) -> dict[str, Any]:
    namespace = zero(rank)
    namespace["sampler"] = ShuffledSampler(rank)
    return namespace


def with_dataset(rank: int) -> dict[str, Any]:
    """As ``zero``, with a ``dataset`` of 256 samples for the snippet's data loader."""
    return {**zero(rank), "dataset": TensorDataset(torch.randn(256, 7), torch.randn(256, 1))}


def with_checkpoint(rank: int) -> dict[str, Any]:
    namespace = plain(rank)
    checkpoint = Checkpoint(namespace["to_save"], DiskSaver("ckpt", require_empty=False))
    namespace["trainer"].add_event_handler(Events.ITERATION_COMPLETED(every=1000), checkpoint)
    namespace["checkpoint"] = checkpoint
    return namespace


def fairscale_fsdp(rank: int) -> dict[str, Any]:
    """fairscale's FSDP built on CPU, which runs no forward there: each rank's shard gets the gradient a backward's
    reduce-scatter would leave, and a step; ``path`` is a file of its full optimizer state, saved beforehand."""
    model = FairscaleFSDP(_net(), compute_device=CPU)
    optimizer = torch.optim.Adam(model.parameters())
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    full = FairscaleFSDPOptimizerState(model, optimizer, recipient_rank=0).state_dict()
    if rank == 0:
        torch.save({"optimizer": full}, "saved.pt")
    dist.barrier()
    return {"model": model, "optimizer": optimizer, "path": "saved.pt"}


def object_store(rank: int) -> dict[str, Any]:
    """As ``zero``, with the ``endpoint`` of an S3-compatible store and its ``key`` and ``secret``: moto's S3 server
    on 127.0.0.1 (``AWS_ENDPOINT_URL``, which conftest.py points there), whose bucket ``bucket`` exists."""
    return {**zero(rank), "endpoint": os.environ["AWS_ENDPOINT_URL"], "key": "testing", "secret": "testing"}


def _in_the_bucket(*keys: str) -> Callable[[dict[str, Any], int], None]:
    def check(namespace: dict[str, Any], rank: int) -> None:
        import s3fs

        listed = s3fs.S3FileSystem(endpoint_url=namespace["endpoint"], skip_instance_cache=True).find("bucket")
        for key in keys:
            assert any(path.startswith(f"bucket/{key}") for path in listed), (key, listed)

    return check


def ddp_and_sgd(rank: int) -> dict[str, Any]:
    namespace = {"ddp_model": DistributedDataParallel(tiny_model()), "dirname": "models"}
    namespace["sgd"] = torch.optim.SGD(namespace["ddp_model"].parameters(), lr=0.1)
    return _with_trainer(namespace, rank, "ddp_model", "sgd")


# ---------------------------------------------------------------------------------------------------------------
# Checks after a snippet, on each rank


def _global_zero_state(namespace: dict[str, Any], rank: int) -> None:
    if rank == 0:  # the consolidated state of all 6 parameters of tiny_model
        assert len(namespace["optimizer"].state_dict()["state"]) == 6


def _found_the_saved_file(namespace: dict[str, Any], rank: int) -> None:
    assert namespace["path"] == "ckpt/checkpoint_3.pt"


def _bf16_weights(namespace: dict[str, Any], rank: int) -> None:
    expected = namespace["model"].state_dict()
    assert sorted(namespace["weights"]) == sorted(expected)
    for name, tensor in namespace["weights"].items():
        torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16))


def _exported_bf16(namespace: dict[str, Any], rank: int) -> None:
    assert namespace["files"] == [Path("hf/model/model.safetensors")]
    _bf16_weights({**namespace, "weights": load_file(namespace["files"][0])}, rank)


def _full_on_recipient(namespace: dict[str, Any], rank: int) -> None:
    assert ("state" in namespace["full"]) == (rank == 0), namespace["full"].keys()


def _named_optimizer_state(namespace: dict[str, Any], rank: int) -> None:
    _full_on_recipient(namespace, rank)
    if rank == 0:
        assert sorted(namespace["full"]["state"]) == ["body.bias", "body.weight", "head.bias", "head.weight"]


def _adapted(namespace: dict[str, Any], rank: int) -> None:
    assert isinstance(namespace["to_save"]["optimizer"], FSDPOptimizerState)


def _loaded_into_plain(namespace: dict[str, Any], rank: int) -> None:
    assert len(namespace["optimizer"].state_dict()["state"]) == 4


def _full_model_on_rank_0(namespace: dict[str, Any], rank: int) -> None:
    """The best model's file holds every parameter at its full shape, and the training checkpoint loaded back."""
    state = torch.load("best/best_model_2_val_accuracy=0.2000.pt", weights_only=True)
    assert {name: value.shape for name, value in state.items()} == {k: v.shape for k, v in _net().state_dict().items()}
    assert namespace["trainer"].state.iteration == 2


def _ten_epochs_sampled(namespace: dict[str, Any], rank: int) -> None:
    assert namespace["sampler"].state_dict() == {"epoch": 10, "position": 0, "dataset_size": 256}


def _not_stopped(namespace: dict[str, Any], rank: int) -> None:
    assert namespace["stop"].stopped_at is None and namespace["trainer"].state.epoch == 100


@dataclass(frozen=True)
class Example:
    ranks: int  # 0: one process without a process group
    setup: Callable[[int], dict[str, Any]]
    files: tuple[str, ...] = ()  # paths, relative to the shared directory, that must exist afterwards
    check: Callable[[dict[str, Any], int], None] | None = None
    not_here: str = ""  # why this harness cannot run it (gloo ranks on CPU)


FAIRSCALE_CUDA = (
    "it wraps a CUDA module and saves through a Checkpoint, which runs fairscale's FSDP forward and its gathers with "
    "CUDA streams: it needs GPUs and NCCL (benchmarks/gpu_check.py saves and loads it there)"
)


def _every_listing(namespace: dict[str, Any], rank: int) -> None:
    assert len(namespace["every_listing"]) == dist.get_world_size()


EXAMPLES: dict[str, Example] = {
    "ignite_zero.agreement.rounds.together": Example(2, plain, check=_every_listing),
    "ignite_zero.staging.Stager": Example(2, stager, check=_full_on_recipient),
    "ignite_zero.handlers.ConsolidateZeROHandler": Example(2, zero, ("optimizer.pt",), _global_zero_state),
    "ignite_zero.handlers.SaveOnSignal": Example(0, plain, check=_not_stopped),
    "ignite_zero.storage.savers.disk.DiskSaver": Example(
        2, object_store, ("ckpt/checkpoint_1.pt", "ckpt/checkpoint_2.pt")
    ),
    "ignite_zero.storage.savers.sharded.ShardedSaver": Example(2, zero, ("ckpt/checkpoint_3.dcp/ignite_zero.json",)),
    "ignite_zero.checkpoint.Checkpoint": Example(2, zero, ("ckpt/checkpoint_2.pt", "ckpt/checkpoint_3.pt")),
    "ignite_zero.checkpoint.Checkpoint.load_latest": Example(2, zero, ("ckpt/checkpoint_2.pt",)),
    "docs/several-hosts.rst: Two tiers": Example(
        2, zero, ("local/ckpt/checkpoint_2.dcp/ignite_zero.json", "shared/ckpt/checkpoint_3.pt")
    ),
    "ignite_zero.model_checkpoint.ModelCheckpoint": Example(0, plain, ("models/run_checkpoint_2.pt",)),
    "ignite_zero.loading.latest.find_latest": Example(2, _saved(zero, "ckpt"), check=_found_the_saved_file),
    "ignite_zero.exporting.export": Example(0, _saved(plain, "ckpt"), ("hf/model/model.safetensors",), _bf16_weights),
    "ignite_zero.rng.RandomState": Example(2, zero, ("ckpt/checkpoint_2.pt",)),
    "ignite_zero.sampling.ResumableDistributedSampler": Example(2, with_dataset, check=_ten_epochs_sampled),
    "ignite_zero.adapters.zero.ZeROState": Example(2, zero, ("ckpt/checkpoint_2.pt",)),
    "ignite_zero.adapters.per_rank.PerRank": Example(2, with_sampler, ("ckpt/checkpoint_2.pt",)),
    "ignite_zero.adapters.fairscale_fsdp.is_fairscale_fsdp_module": Example(1, parts),
    "ignite_zero.adapters.fairscale_fsdp.FairscaleFSDPModelState": Example(2, parts, not_here=FAIRSCALE_CUDA),
    "ignite_zero.adapters.fairscale_fsdp.FairscaleFSDPOptimizerState": Example(
        2, fairscale_fsdp, check=_full_on_recipient
    ),
    "ignite_zero.adapters.fsdp.is_fsdp_module": Example(1, parts),
    "ignite_zero.adapters.fsdp.owns_parameters": Example(1, fsdp, check=_adapted),
    "ignite_zero.adapters.fsdp.FSDPModelState": Example(2, fsdp, ("ckpt/checkpoint_2.pt",)),
    "ignite_zero.adapters.fsdp.FSDPOptimizerState": Example(2, _saved(fsdp, "ckpt"), check=_named_optimizer_state),
    "ignite_zero.adapters.fsdp.full_optimizer_state_to_plain": Example(1, plain_after_fsdp, check=_loaded_into_plain),
    "README: Usage": Example(2, zero, ("ckpt/checkpoint_2.pt", "ckpt/checkpoint_3.pt")),
    "README: Usage#2": Example(2, parts, ("ckpt/checkpoint_2.pt",)),
    "README: Usage#3": Example(2, object_store, check=_in_the_bucket("run/checkpoint_2.dcp/ignite_zero.json")),
    "docs/getting-started.rst: First checkpoint": Example(2, zero, ("ckpt/checkpoint_2.pt", "ckpt/checkpoint_3.pt")),
    "docs/saving-and-loading.rst: Consolidated checkpoints": Example(
        2, zero, ("ckpt/checkpoint_2.pt", "ckpt/checkpoint_3.pt")
    ),
    "docs/saving-and-loading.rst: Sharded checkpoints": Example(2, zero, ("ckpt/checkpoint_3.dcp/ignite_zero.json",)),
    "docs/saving-and-loading.rst: Which ranks a save waits for": Example(
        2, ddp_and_sgd, ("models/run_checkpoint_2.pt",)
    ),
    "docs/fsdp.rst: FSDP, HSDP and tensor parallelism": Example(2, parts, ("ckpt/checkpoint_2.pt",)),
    "docs/fsdp.rst: What is saved": Example(2, parts, ("ckpt/checkpoint_2.pt",)),
    "docs/zero.rst: ZeRO and OSS": Example(2, zero, ("ckpt/checkpoint_2.pt",)),
    "docs/zero.rst: Consolidation": Example(2, zero, check=_global_zero_state),
    "docs/zero.rst: With ignite's helpers": Example(
        2,
        with_evaluator,
        (
            "ckpt/training_checkpoint_2.pt",
            "best/best_model_2_val_accuracy=0.2000.pt",
            "best-gen/best_model_2_val_accuracy=0.2000.pt",
        ),
        _full_model_on_rank_0,
    ),
    "docs/object-storage.rst: Object storage": Example(
        2, object_store, check=_in_the_bucket("run/checkpoint_2.pt", "sharded")
    ),
    "docs/export-and-cli.rst: Export and the command line": Example(
        0, _saved(plain, "ckpt"), ("hf/model/model.safetensors",), _exported_bf16
    ),
    "docs/long-runs.rst: Resume from the newest valid checkpoint": Example(2, zero, ("ckpt/checkpoint_2.pt",)),
    "docs/long-runs.rst: Resume in the middle of an epoch": Example(2, with_dataset, check=_ten_epochs_sampled),
    "docs/long-runs.rst: Saving on a signal": Example(0, with_checkpoint, check=_not_stopped),
}


def all_examples() -> dict[str, str]:
    return {**docstring_examples(), **readme_examples(), **page_examples()}


def test_every_example_has_an_entry_and_every_entry_an_example():
    assert sorted(all_examples()) == sorted(EXAMPLES)


def _run(rank: int, world_size: int, code: str, example: Example) -> None:
    namespace = example.setup(rank)  # the trainer trains what this very dict holds when it runs
    namespace.update(torch=torch, sys=sys, idist=idist, Events=Events)
    exec(compile(code, "<example>", "exec"), namespace)
    trainer = namespace.get("trainer")
    if "trainer" in code and isinstance(trainer, Engine) and trainer.state.iteration == 0:
        trainer.run(namespace["loader"], max_epochs=2)
    if example.check is not None:
        example.check(namespace, rank)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_runs(name, tmp_path, monkeypatch, request):
    example = EXAMPLES[name]
    if example.not_here:
        pytest.skip(example.not_here)
    if example.setup is object_store:  # the store's server, and an empty bucket, before the ranks start
        import s3fs

        client = s3fs.S3FileSystem(endpoint_url=request.getfixturevalue("s3_endpoint"), skip_instance_cache=True)
        if client.exists("bucket"):
            client.rm("bucket", recursive=True)
        client.mkdir("bucket")
    monkeypatch.chdir(tmp_path)  # the ranks inherit it: one directory for all
    run_ranks(_run, max(example.ranks, 1), all_examples()[name], example, init=example.ranks > 0)
    missing = [path for path in example.files if not (tmp_path / path).exists()]
    assert not missing, f"{name} should have written {missing}; there are {sorted(map(str, tmp_path.rglob('*')))}"
