"""fairscale's ``FullyShardedDataParallel`` (``fairscale.nn``): model and optimizer state, whole, on one rank.

fairscale's own routes (0.4.13) do not give a checkpoint that the other ranks need not pay for:

- ``state_dict()`` unshards every unit on every rank's GPU and returns the full state on every rank
  (``state_dict_on_rank_0_only``, fixed at construction, drops it afterwards on all but global rank 0);
- ``gather_full_optim_state_dict(optim)`` all-gathers every unit's optimizer state on every rank's GPU and returns
  it on rank 0 only (it takes no recipient); it handles one parameter group and flattened parameters only, and it
  turns the ``step`` tensors of the live optimizer into floats, after which ``torch.optim.Adam.step()`` raises;
- ``get_shard_from_optim_state_dict`` builds the whole flattened optimizer state on every rank, changes the dict
  it is given, and needs the nesting of units that the state was saved with.

So, as for torch's FSDP1 (:mod:`ignite_zero.adapters.fsdp`), every rank describes its shards as pieces of the full
tensors, from the layout fairscale records for its own shard-to-full consolidation (read through
:mod:`ignite_zero._compat`), and :func:`~ignite_zero.adapters.regions.gather_pieces` assembles them on the
recipient, any rank, which receives each region once. The other ranks send views of their shards and allocate
nothing full, on the GPU or the host. Loading is local: each rank copies its own elements of each full tensor
into its shards and optimizer state, so the full state may be one ``torch.load(..., mmap=True)`` result.

The file format is that of the FSDP1 and FSDP2 adapters: the unwrapped module's ``state_dict()`` (its own names,
plain CPU tensors, tied parameters as one tensor), and the optimizer state keyed by parameter names as
``get_optimizer_state_dict(..., full_state_dict=True)`` gives it. A file saved from fairscale's FSDP loads into
torch's FSDP1 or FSDP2 or into a plain module and optimizer, and one saved from FSDP1 or FSDP2 loads into
fairscale's FSDP, on any world size and with any wrapping into units. One difference is fairscale's own: with
``mixed_precision=True`` it keeps floating buffers in ``buffer_dtype`` (their original dtype is gone), and they are
saved as float32, as its ``state_dict()`` gives them.

fairscale's FSDP runs only where CUDA is: its forward and backward, ``state_dict()`` and its load methods use CUDA
streams or ``torch.cuda.synchronize()``. Without CUDA, :meth:`~ignite_zero.adapters.base.ShardedState.check` (run by
:class:`ignite_zero.Checkpoint` on every rank before any collective), ``part_needed()`` (asked by
``Checkpoint.load_objects`` on every rank before its first collective) and ``check_entry()`` (a load on one rank)
refuse it and name what to use instead. The adapters' own ``state_dict()`` and ``load_state_dict()`` use no CUDA:
the tests run them on CPU, on units built with ``compute_device=torch.device("cpu")``.
"""

from __future__ import annotations

import functools
import math
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ignite_zero import _compat
from ignite_zero.adapters._fsdp_common import ParamLayout, PendingModelLoad, Slot, add_unsharded, clean_name, whole_slot
from ignite_zero.adapters.base import ShardedState

# The optimizer state is the FSDP1/FSDP2 adapters' format: their helpers build, check and split it.
from ignite_zero.adapters.fsdp import OptimizerStateByName, check_optimizer_state, is_fsdp_module, local_optimizer_state
from ignite_zero.adapters.regions import Pieces, gather_pieces
from ignite_zero.agreement import rank_and_world
from ignite_zero.transport import Overlap

__all__ = [
    "FairscaleFSDPModelState",
    "FairscaleFSDPOptimizerState",
    "holds_fairscale_fsdp_parameters",
    "is_fairscale_fsdp_module",
]


def is_fairscale_fsdp_module(module: Any) -> bool:
    """Whether ``module`` is, or contains, a fairscale ``FullyShardedDataParallel``.

    fairscale is imported only when a submodule's class comes from it, so other modules cost no import.

    Args:
        module: any object; only ``nn.Module`` instances can be fairscale FSDP modules.

    Examples:
        .. code-block:: python

            from fairscale.nn import FullyShardedDataParallel
            from ignite_zero.adapters.fairscale_fsdp import is_fairscale_fsdp_module

            model = FullyShardedDataParallel(net)
            assert is_fairscale_fsdp_module(model)
            assert not is_fairscale_fsdp_module(torch.nn.Linear(2, 2))

    .. versionadded:: 0.1.0
    """
    return isinstance(module, nn.Module) and any(_compat.is_fairscale_fsdp(m) for m in module.modules())


def holds_fairscale_fsdp_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` updates parameters that a fairscale ``FullyShardedDataParallel`` manages (its flat
    parameters, or its original ones with ``flatten_parameters=False``).

    Such an optimizer holds only this rank's part of the state, laid out like fairscale's shards: saving it needs
    its module (see :class:`FairscaleFSDPOptimizerState`).

    Args:
        optimizer: any optimizer.

    .. versionadded:: 0.1.0
    """
    return any(_compat.is_fairscale_fsdp_param(p) for group in optimizer.param_groups for p in group["params"])


def _prefix(module_name: str) -> str:
    """The prefix of a module's entries in the unwrapped module's ``state_dict()``."""
    name = clean_name(
        ".".join(part for part in module_name.split(".") if part not in _compat.FAIRSCALE_WRAPPER_SEGMENTS)
    )
    return f"{name}." if name else ""


def _slot(held: _compat.FairscaleShardedParam, entry: _compat.FairscaleParamEntry, name: str) -> Slot:
    """Where this rank's elements of ``entry`` sit in ``held.shard`` (1-D, or the parameter's own shape)."""
    numel = math.prod(entry.shape)
    first = max(entry.offset, held.start)
    last = min(entry.offset + numel, held.start + held.length)
    if last <= first:  # this rank holds none of it
        return Slot.flat(name, entry.shape, 0, 0)
    return Slot.flat(name, entry.shape, first - entry.offset, last - first, first - held.start)


@dataclass
class _Param:
    """A parameter of a unit as slots named like the unwrapped module's, with the owner (``id``) of each, and its
    tied parameters as ``(owner id, name, primary's name)``."""

    held: _compat.FairscaleShardedParam
    slots: list[Slot]
    owners: list[int]
    aliases: list[tuple[int, str, str]]


class _Layout:
    """Where this rank's parts of ``module``'s state are: the parameters of its fairscale units, and its plain
    modules (all but fairscale's wrappers) with the prefix of their entries in the unwrapped ``state_dict()``.

    Raises:
        RuntimeError: fairscale's internals are not as :mod:`ignite_zero._compat` reads them.
    """

    def __init__(self, module: nn.Module) -> None:
        self.units: list[Any] = [m for m in module.modules() if _compat.is_fairscale_fsdp(m)]
        wrappers = {id(unit) for unit in self.units} | {id(unit.module) for unit in self.units}
        self.plain = [(m, _prefix(name)) for name, m in module.named_modules() if id(m) not in wrappers]
        prefixes = {id(m): prefix for m, prefix in self.plain}
        self.params = []
        for unit in self.units:
            for held in _compat.fairscale_fsdp_params(unit):
                slots = [_slot(held, entry, prefixes[id(entry.owner)] + entry.name) for entry in held.entries]
                aliases = [
                    (id(s.owner), prefixes[id(s.owner)] + s.name, prefixes[id(s.primary_owner)] + s.primary)
                    for s in held.shared
                ]
                self.params.append(_Param(held, slots, [id(entry.owner) for entry in held.entries], aliases))
        self.managed = {id(param.held.param) for param in self.params}
        # fairscale casts the buffers of mixed-precision units to `buffer_dtype`; its state_dict() gives float32
        self.upcast = {id(m) for unit in self.units if unit.mixed_precision for m in unit.modules()}

    def _replicated(self, m: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``m``'s own parameters that no unit manages, and its persistent buffers: whole on every rank."""
        for name, param in m.named_parameters(recurse=False):
            if id(param) not in self.managed:
                yield name, param
        skipped = _compat.non_persistent_buffer_names(m)
        for name, buffer in m.named_buffers(recurse=False):
            if name not in skipped:
                yield name, buffer

    def model_pieces(self) -> Pieces:
        """This rank's pieces of the full model state, keyed ``(name,)`` in the unwrapped ``state_dict()``'s order."""
        pieces = Pieces()
        # Parameters are found per unit, but the order is per owning module: collect the additions by owner.
        owned: dict[int, list[Callable[[], None]]] = {}
        for param in self.params:
            for owner, slot in zip(param.owners, param.slots):
                owned.setdefault(owner, []).append(
                    functools.partial(slot.add_to, pieces, (slot.name,), param.held.shard)
                )
            for owner, name, primary in param.aliases:  # tied: sent once, one tensor under both names
                owned.setdefault(owner, []).append(functools.partial(pieces.add_alias, (name,), (primary,)))
        for m, prefix in self.plain:
            for add in owned.get(id(m), []):
                add()
            upcast = id(m) in self.upcast
            tensors = [
                (name, value.float() if upcast and value.is_floating_point() else value)
                for name, value in self._replicated(m)
            ]
            add_unsharded(pieces, prefix, m, tensors)
        return pieces

    def plan_model_load(self, owner: str, state_dict: Mapping[str, Any], strict: bool) -> PendingModelLoad:
        """How to copy this rank's part of a full model state into its shards, buffers and extra state; local."""
        plan = PendingModelLoad(owner, state_dict, strict)
        for param in self.params:
            for slot in param.slots:
                value = plan.expect(slot.name, slot.shape)
                if value is not None and slot.length:
                    plan.copy(slot.local_part(param.held.shard), slot.full_part(value))
            for _, name, _ in param.aliases:  # loaded through its primary
                plan.expect(name, None)
        for m, prefix in self.plain:
            plan.expect_unsharded(prefix, m, self._replicated(m))
        for unit in self.units:  # full parameters kept from a forward would hide what was loaded
            plan.call(_compat.fairscale_release_full_params, unit)
        return plan

    def param_layouts(self) -> dict[int, ParamLayout]:
        """The layout of every parameter an optimizer of the module may hold, by ``id``: element-wise state is laid
        out like the parameter's shard."""
        layouts = {
            id(param.held.param): ParamLayout(param.held.param, tuple(param.held.shard.shape), param.slots)
            for param in self.params
        }
        for m, prefix in self.plain:
            for name, param in m.named_parameters(recurse=False):
                if id(param) not in self.managed:
                    slots = [whole_slot(prefix + name, param)]
                    layouts.setdefault(id(param), ParamLayout(param, tuple(param.shape), slots))
        return layouts


class _FairscaleState(ShardedState):
    """What the model and optimizer adapters share: the module, the checks, and the refusal without CUDA."""

    loads_deferred = True

    def __init__(self, obj: Any, module: nn.Module, recipient_rank: int, name: str | None) -> None:
        super().__init__(obj, recipient_rank)
        if not is_fairscale_fsdp_module(module):
            raise TypeError(
                f"{type(module).__name__} contains no fairscale FullyShardedDataParallel: save it and its optimizer "
                "as they are"
            )
        self.module = module
        self.name = name

    @abstractmethod
    def _subject(self) -> str:
        """What messages call the adapted object."""

    def check(self) -> None:
        """Validate locally, without communication, that the state can be gathered.

        Raises:
            ValueError: the recipient is outside the world; the module mixes fairscale's and torch's FSDP, a unit
                shards over a group that is not the whole world, or a unit holds parameters of another
                (``append_shared_param``); CUDA is not available.
            RuntimeError: this fairscale's FSDP lacks the internals read to find its shards.
        """
        super().check()
        _check_module(self.module, rank_and_world()[1])
        self._require_cuda()

    def part_needed(self) -> None:
        """Every rank takes its elements from the whole entry; without CUDA, raise as :meth:`check` does (a load
        asks for this on every rank before any collective).

        Raises:
            ValueError: CUDA is not available.
        """
        self._require_cuda()
        return None

    def _require_cuda(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError(
                f"{self._subject()}: fairscale's FullyShardedDataParallel (fairscale {_compat.fairscale_version()}) "
                "runs only where CUDA is (its forward, backward, state_dict() and load_state_dict() use CUDA streams), "
                "and this process has no CUDA device (torch.cuda.is_available() is False). Shard the model with "
                "torch's FullyShardedDataParallel (torch.distributed.fsdp) or fully_shard (FSDP2) instead: "
                "ignite_zero saves and loads both, on CPU and GPU."
            )


def _check_module(module: nn.Module, world_size: int) -> None:
    if is_fsdp_module(module):
        raise ValueError(
            "The module mixes fairscale's FullyShardedDataParallel with torch's FSDP1 (FullyShardedDataParallel) or "
            "FSDP2 (fully_shard) units; shard it with one of them"
        )
    units: list[Any] = [m for m in module.modules() if _compat.is_fairscale_fsdp(m)]
    for unit in units:
        _compat.check_fairscale_fsdp_layout(unit)
        ranks = dist.get_process_group_ranks(unit.process_group)
        if ranks != list(range(world_size)):
            raise ValueError(
                f"A fairscale FullyShardedDataParallel unit shards over ranks {ranks}, but the world has {world_size} "
                "ranks: sharding over a subgroup (e.g. experts of a mixture of experts) is not supported"
            )
        if _compat.fairscale_shares_across_units(unit):
            raise ValueError(
                "A fairscale FullyShardedDataParallel unit holds parameters of another unit (append_shared_param): "
                "not supported; tie the parameters within one unit"
            )
    _Layout(module)  # raises if a shard is not laid out as fairscale's _get_shard cuts it


class FairscaleFSDPModelState(_FairscaleState):
    """Full state of a fairscale ``FullyShardedDataParallel`` model: the unwrapped module's ``state_dict()``, on one
    rank.

    ``state_dict()`` is a collective: on the recipient, any rank, it returns what the unwrapped module's
    ``state_dict()`` would (its names, in its order, plain CPU tensors, tied parameters as one tensor), and ``{}``
    on every other rank; only the recipient holds the full state, every other rank sends views of its shards.
    ``load_state_dict()`` restores it from a state saved on any number of ranks, with any wrapping into units, by
    torch's FSDP1 or FSDP2 or by the plain module; it is local and only reads the given dict.

    Supported: nested units, ``flatten_parameters=False``, ``mixed_precision`` (floating buffers are saved as
    float32), ``move_params_to_cpu``/``cpu_offload``, ``reshard_after_forward``, tied parameters within a unit.
    Refused by ``check()``, with a clear error on every rank before any collective: no CUDA; units that shard over
    a subgroup of the world; parameters shared between units (``append_shared_param``); a module that also holds
    torch FSDP units. Sharded checkpoints (:class:`~ignite_zero.ShardedSaver`) are not supported yet.

    Args:
        module: the model: a fairscale ``FullyShardedDataParallel``, or a module that contains some.
        recipient_rank: global rank that receives the full state.
        name: how messages name the model, e.g. its path in ``to_save``.

    Examples:
        .. code-block:: python

            from fairscale.nn import FullyShardedDataParallel
            from ignite.handlers import Checkpoint, DiskSaver
            from ignite_zero.adapters import FairscaleFSDPModelState, FairscaleFSDPOptimizerState

            model = FullyShardedDataParallel(net.cuda())
            optimizer = torch.optim.Adam(model.parameters())
            to_save = {
                "model": FairscaleFSDPModelState(model, recipient_rank=0),
                "optimizer": FairscaleFSDPOptimizerState(model, optimizer, recipient_rank=0),
            }
            # stock ignite, on every rank (ignite_zero.Checkpoint does this by itself):
            trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, DiskSaver("ckpt")))

    .. versionadded:: 0.1.0
    """

    def __init__(self, module: nn.Module, recipient_rank: int = 0, *, name: str | None = None) -> None:
        super().__init__(module, module, recipient_rank, name)

    def _subject(self) -> str:
        return f"The model {self.name}" if self.name else f"This {type(self.module).__name__}"

    def snapshot(self) -> Pieces:
        """This rank's shards, buffers and extra state, as pieces of the full tensors (views)."""
        with torch.no_grad():
            return _Layout(self.module).model_pieces()

    def assemble(self, snapshot: Pieces, group: Any, overlap: Overlap | None = None) -> dict[str, Any]:
        """Collective over ``group``: the full model state on the recipient, ``{}`` on every other rank."""
        full = gather_pieces(snapshot, self.recipient_rank, group, overlap=overlap)
        return {} if full is None else {key[0]: value for key, value in full.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Restore this rank's shards, buffers and extra state from a full model state; local. As
        :meth:`~ignite_zero.FSDPModelState.load_state_dict`."""
        _Layout(self.module).plan_model_load(type(self.module).__name__, state_dict, strict).run()

    def check_entry(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Raise as :meth:`load_state_dict` would, changing nothing; and without CUDA, as :meth:`check` does.

        Raises:
            ValueError: CUDA is not available.
            RuntimeError: the state does not fit the module.
        """
        self._require_cuda()
        _Layout(self.module).plan_model_load(type(self.module).__name__, state_dict, strict).check()


class FairscaleFSDPOptimizerState(OptimizerStateByName, _FairscaleState):
    """Full state of the optimizer of a fairscale ``FullyShardedDataParallel`` model, keyed by parameter names, on
    one rank.

    ``state_dict()`` is a collective returning on the recipient the state in the format of
    :class:`~ignite_zero.FSDPOptimizerState` (``get_optimizer_state_dict(..., full_state_dict=True)``'s):
    ``{"state": {name: {"step": ..., "exp_avg": ...}}, "param_groups": [{..., "params": [name, ...]}]}``, plain CPU
    tensors, any number of parameter groups; ``{}`` elsewhere. An optimizer that has not stepped yet gives
    ``"state": {}``. ``load_state_dict()`` restores the optimizer from such a state saved on any number of ranks by
    fairscale's FSDP, torch's FSDP1 or FSDP2, or converted from a plain optimizer; it is local, matches parameters by
    name, and copies into the optimizer's existing state tensors when they fit. Element-wise state (laid out like
    the parameters) and scalar state are supported: Adam, AdamW, SGD with momentum, and the like.

    An optimizer of such a model without the model in ``to_save`` is refused (``ignite_zero.adapters.adapt``):
    its state is this rank's shard only.

    Args:
        module: the fairscale FSDP model whose parameters ``optimizer`` updates.
        optimizer: the optimizer, built on ``module.parameters()`` (or part of them).
        recipient_rank: global rank that receives the full state.
        name: how messages name the optimizer, e.g. its path in ``to_save``.

    Examples:
        .. code-block:: python

            from ignite_zero.adapters import FairscaleFSDPOptimizerState

            state = FairscaleFSDPOptimizerState(model, optimizer, recipient_rank=0, name="optimizer")
            full = state.state_dict()  # on every rank; the full state on rank 0
            ...
            state.load_state_dict(torch.load(path, mmap=True, weights_only=True)["optimizer"])

    .. versionadded:: 0.1.0
    """

    sharded_by = "wrapping"

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, recipient_rank: int = 0, *, name: str | None = None
    ) -> None:
        super().__init__(optimizer, module, recipient_rank, name)

    def _subject(self) -> str:
        optimizer = f"The optimizer {self.name}" if self.name else f"This {type(self.obj).__name__}"
        return f"{optimizer} updates a fairscale FullyShardedDataParallel model"

    def param_layouts(self) -> dict[int, ParamLayout]:
        """The layout of every parameter the optimizer may hold, by ``id``."""
        return _Layout(self.module).param_layouts()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore this rank's part of the optimizer state from a full, name-keyed one; local.

        Raises:
            ValueError: ``state_dict`` is not a full optimizer state, its parameter groups do not match the
                optimizer's, or its state does not fit the parameters; nothing is changed then.
        """
        layouts = _Layout(self.module).param_layouts()
        _compat.load_optimizer_state(self.obj, local_optimizer_state(layouts, self.obj, state_dict, reuse=True))

    def check_entry(self, state_dict: Mapping[str, Any]) -> None:
        """Raise as :meth:`load_state_dict` would, changing nothing; and without CUDA, as :meth:`check` does.

        Raises:
            ValueError: CUDA is not available, or the state does not fit the optimizer.
        """
        self._require_cuda()
        check_optimizer_state(_Layout(self.module).param_layouts(), self.obj, state_dict)
