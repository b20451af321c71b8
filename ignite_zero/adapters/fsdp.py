"""FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``) model and optimizer state, whole, on one rank.

Saving: every rank describes what it holds as pieces of full tensors, and
:func:`~ignite_zero.adapters.regions.gather_pieces` assembles them on the recipient, which receives each region once
(its own first) straight into place. Other ranks send views of their shards: their memory does not grow beyond the
transport's staging buffer, and nothing full is ever built on a GPU. torch's own routes do worse on this: FSDP1's
full state dicts unshard every unit on every rank (and on CPU crash or hang with ``cpu_offload``), its sharded ones
clone each rank's shard, and ``get_optimizer_state_dict`` runs a fake ``step()`` on an optimizer without state.

Loading is local: each rank copies its own region of each full tensor into its shards and optimizer state, so
the full state may be one ``torch.load(..., mmap=True)`` result whose pages the ranks of a host share.

The full state is the same for both kinds and any world size: the unsharded module's ``state_dict()``, and the
optimizer state keyed by parameter names as ``get_optimizer_state_dict(..., full_state_dict=True)`` gives it.
A file saved from FSDP1 loads into FSDP2 and the other way round, and into a plain module and optimizer
(:func:`full_optimizer_state_to_plain`).
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import FlatParameter, FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from ignite_zero import _compat, tree
from ignite_zero.adapters import _fsdp1, _fsdp2, deferred
from ignite_zero.adapters._fsdp_common import (
    ParamLayout,
    Slot,
    add_value,
    clean_name,
    quiet_state_dict_apis,
    whole_slot,
)
from ignite_zero.adapters.base import ShardedState
from ignite_zero.adapters.regions import Pieces, gather_pieces
from ignite_zero.transport import Overlap

__all__ = [
    "FSDPModelState",
    "FSDPOptimizerState",
    "full_optimizer_state_to_plain",
    "holds_sharded_parameters",
    "is_fsdp_module",
    "owns_parameters",
]


def is_fsdp_module(module: Any) -> bool:
    """Whether ``module`` is, or contains, an FSDP1 (``FullyShardedDataParallel``) or FSDP2 (``fully_shard``) module.

    Args:
        module: any object; only ``nn.Module`` instances can be FSDP modules.

    Examples:
        .. code-block:: python

            from torch.distributed.fsdp import FullyShardedDataParallel
            from ignite_zero.adapters.fsdp import is_fsdp_module

            model = FullyShardedDataParallel(net, device_id=device)
            assert is_fsdp_module(model)
            assert not is_fsdp_module(net.head)  # a part left out of the wrapper

    .. versionadded:: 0.1.0
    """
    return isinstance(module, nn.Module) and any(
        isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in module.modules()
    )


def owns_parameters(module: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter ``optimizer`` updates is a parameter of ``module`` (by identity).

    This pairs an FSDP optimizer with its module whatever it holds: FSDP1's flat parameters
    (``use_orig_params=False``), its views of them (``use_orig_params=True``, which only the module can tell
    from plain parameters) or FSDP2's ``DTensor`` parameters. Where the module does not show them all, its FSDP2
    modules are resharded (locally) and it is asked again: a module kept unsharded after a forward
    (``reshard_after_forward=False``) shows its unsharded parameters, not the ones its optimizer holds.

    Args:
        module: the model, FSDP or not.
        optimizer: any optimizer.

    Examples:
        .. code-block:: python

            from ignite_zero.adapters.fsdp import FSDPOptimizerState, is_fsdp_module, owns_parameters

            to_save = {"model": model, "optimizer": optimizer}
            if is_fsdp_module(model) and owns_parameters(model, optimizer):
                to_save["optimizer"] = FSDPOptimizerState(model, optimizer)

    .. versionadded:: 0.1.0
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owned = {id(p) for p in module.parameters()}
    if all(id(p) in owned for p in params):
        return True
    _fsdp2.reshard(module)  # only now: every save asks, and resharding walks every unit
    owned = {id(p) for p in module.parameters()}
    return all(id(p) in owned for p in params)


def holds_sharded_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` updates parameters sharded by FSDP: FSDP1 flat parameters, FSDP1 original
    parameters (``use_orig_params=True``, marked by FSDP1 as flattened) or FSDP2 ``DTensor`` parameters.

    Such an optimizer has only this rank's part of the state: saving it needs its module (see
    :func:`owns_parameters` and :class:`FSDPOptimizerState`).

    Args:
        optimizer: any optimizer.

    .. versionadded:: 0.1.0
    """
    return any(
        isinstance(p, (FlatParameter, DTensor)) or _compat.is_fsdp_flattened(p)
        for group in optimizer.param_groups
        for p in group["params"]
    )


def _kind(module: nn.Module) -> ModuleType:
    """The module that knows where ``module``'s shards are: ``_fsdp1`` or ``_fsdp2``.

    Raises:
        ValueError: ``module`` holds both kinds.
    """
    one = two = False
    for m in module.modules():  # one walk: a model of many units has no FSDP1 unit to stop at
        one = one or isinstance(m, FullyShardedDataParallel)
        two = two or isinstance(m, FSDPModule)
    if one and two:
        raise ValueError(
            "The module mixes FSDP1 (FullyShardedDataParallel) and FSDP2 (fully_shard) units; shard it with one of them"
        )
    return _fsdp1 if one else _fsdp2


def _param_layouts(module: nn.Module) -> dict[int, ParamLayout]:
    if is_fsdp_module(module):
        return _kind(module).param_layouts(module)
    return {id(p): ParamLayout(p, tuple(p.shape), [whole_slot(clean_name(n), p)]) for n, p in module.named_parameters()}


class _FSDPState(ShardedState):
    """What the model and optimizer adapters share: the module, its kind, and the checks."""

    loads_deferred = True

    def __init__(self, obj: Any, module: nn.Module, recipient_rank: int) -> None:
        super().__init__(obj, recipient_rank)
        if not is_fsdp_module(module):
            raise TypeError(
                f"{type(module).__name__} contains no FSDP1 or FSDP2 module: save it and its optimizer as they are"
            )
        self.module = module
        self._kind: ModuleType | None = None

    @property
    def kind(self) -> ModuleType:
        """The module that knows where :attr:`module`'s shards are (``_fsdp1`` or ``_fsdp2``), found at the first use:
        every save and load asks it several times, and finding it walks every submodule.

        Raises:
            ValueError: the module holds both kinds.
        """
        if self._kind is None:
            self._kind = _kind(self.module)
        return self._kind

    def check(self) -> None:
        """Validate locally, without communication, that the state can be gathered.

        Raises:
            ValueError: the recipient is outside the world; the module mixes FSDP1 and FSDP2, or holds a DTensor
                with a ``Partial`` (pending reduction) or custom placement.
            RuntimeError: this torch's FSDP1 lacks the internals read to find its shards.
        """
        super().check()
        self._check_layout(self.kind)

    def _check_layout(self, kind: ModuleType) -> None:
        kind.check(self.module)


class FSDPModelState(_FSDPState):
    """Full state of an FSDP1 or FSDP2 model: the unsharded module's ``state_dict()``, on one rank.

    ``state_dict()`` is a collective: on the recipient it returns what the unwrapped module's ``state_dict()``
    would (same names without wrapper segments, same order, plain CPU tensors, tied parameters as one tensor),
    and ``{}`` on every other rank. Only the recipient holds the full state; every other rank sends views of
    its shards, each block once, from one of its replicas. ``load_state_dict()`` restores it from a state saved
    on any number of ranks and any layout (or by the plain module); it is local and only reads the given dict,
    which may be an ``mmap``'d ``torch.load`` result shared by the ranks of a host.

    Args:
        module: the model: an FSDP1 ``FullyShardedDataParallel`` (any sharding strategy, hybrid ones included), or
            a module with FSDP2 (``fully_shard``) modules on any device mesh: 1-D, HSDP, FSDP2 over tensor
            parallelism, units on different meshes.
        recipient_rank: global rank that receives the full state.

    Examples:
        .. code-block:: python

            from ignite.handlers import Checkpoint, DiskSaver
            from ignite_zero.adapters.fsdp import FSDPModelState, FSDPOptimizerState

            to_save = {
                "model": FSDPModelState(model, recipient_rank=0),
                "optimizer": FSDPOptimizerState(model, optimizer, recipient_rank=0),
            }
            # stock ignite, on every rank:
            trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, DiskSaver("ckpt")))

    .. versionadded:: 0.1.0
    """

    def __init__(self, module: nn.Module, recipient_rank: int = 0) -> None:
        super().__init__(module, module, recipient_rank)

    def snapshot(self) -> Pieces:
        """This rank's shards, buffers and extra state, as pieces of the full tensors (views)."""
        with torch.no_grad():
            return self.kind.model_pieces(self.module)

    def assemble(self, snapshot: Pieces, group: Any, overlap: Overlap | None = None) -> dict[str, Any]:
        """Collective over ``group``: the full model state on the recipient, ``{}`` on every other rank."""
        full = gather_pieces(snapshot, self.recipient_rank, group, overlap=overlap)
        # Without an overlap every tensor was allocated by the gather: never a view of live parameters.
        return {} if full is None else {key[0]: value for key, value in full.items()}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards as ``torch.distributed.checkpoint.state_dict`` gives them (``DTensor`` for FSDP2,
        ``ShardedTensor`` for FSDP1), by the unwrapped module's names."""
        return self.kind.sharded_model_state(self.module)

    def sharded_template(self, saved: set[tuple[Any, ...]], live: bool = False) -> dict[str, Any]:
        """This rank's shards (FSDP2's own parameters when ``live``), or new tensors laid out alike: reading fills
        them, loading copies them in (onto themselves, at no cost)."""
        return _template(self.sharded_state_dict(), live)

    def load_sharded(self, state: Any) -> None:
        self.kind.load_sharded_model(self.module, state)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Restore this rank's shards, buffers and extra state from a full model state; local.

        Args:
            state_dict: the full state; only read.
            strict: as for ``nn.Module.load_state_dict``: refuse missing and unexpected names.

        Raises:
            RuntimeError: as ``nn.Module.load_state_dict`` raises, before anything is changed.
        """
        self.prepare_load(state_dict, strict)()

    def check_entry(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Raise as :meth:`load_state_dict` would, changing nothing."""
        self.prepare_load(state_dict, strict)

    def prepare_load(self, state_dict: Mapping[str, Any], strict: bool = True) -> Callable[[], None]:
        """:meth:`check_entry`, and the plan of the copies into this rank's shards that loads the entry: made
        once, not at the check and again at the load."""
        plan = self.kind.plan_model_load(self.module, state_dict, strict)
        plan.check()
        return plan.run


class OptimizerStateByName(ShardedState):
    """What the adapters of an optimizer of a sharded model share (torch's FSDP1 and FSDP2, fairscale's FSDP): the
    optimizer is built on the model's parameters, and its state is laid out like them and keyed by their names."""

    module: nn.Module
    #: how the model was made sharded, for the message of an optimizer built before that
    sharded_by = "sharding"

    @abstractmethod
    def param_layouts(self) -> dict[int, ParamLayout]:
        """The layout of every parameter the optimizer may hold, by ``id``."""

    def check(self) -> None:
        """As the model's adapter checks, of what the optimizer's state is laid out like; also raises
        ``ValueError`` if some parameter of the optimizer does not belong to the module."""
        super().check()
        if not owns_parameters(self.module, self.obj):
            raise ValueError(
                f"Some parameters of this {type(self.obj).__name__} do not belong to the {type(self.module).__name__} "
                f"it is paired with: build the optimizer on that module's parameters, after {self.sharded_by} it"
            )

    def snapshot(self) -> tuple[Pieces, list[dict[str, Any]]]:
        """This rank's part of the optimizer state as pieces of the full tensors (views), and the parameter groups
        by name."""
        return optimizer_pieces(self.obj, self.param_layouts())

    def assemble(
        self, snapshot: tuple[Pieces, list[dict[str, Any]]], group: Any, overlap: Overlap | None = None
    ) -> dict[str, Any]:
        """Collective over ``group``: the full optimizer state on the recipient, ``{}`` on every other rank."""
        return assemble_optimizer_state(snapshot, self.recipient_rank, group, overlap)


class FSDPOptimizerState(OptimizerStateByName, _FSDPState):
    """Full state of the optimizer of an FSDP1 or FSDP2 model, keyed by parameter names, on one rank.

    ``state_dict()`` is a collective returning on the recipient what
    ``get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))`` gives,
    with plain CPU tensors: ``{"state": {name: {"step": ..., "exp_avg": ...}}, "param_groups": [{...,
    "params": [name, ...]}]}``, and ``{}`` elsewhere. Unlike that function it never creates state: an optimizer
    that has not stepped yet gives ``"state": {}``. ``load_state_dict()`` restores the optimizer from such a
    state saved on any number of ranks, or converted from a plain optimizer; it is local, matches parameters by
    name, copies into the optimizer's existing state tensors when they fit, and leaves no reference to the
    given dict in the optimizer.

    Element-wise state (laid out like the parameters) and scalar state are supported: Adam, AdamW, SGD with
    momentum, and the like.

    Args:
        module: the FSDP model whose parameters ``optimizer`` updates.
        optimizer: the optimizer, built on ``module.parameters()`` (or part of them).
        recipient_rank: global rank that receives the full state.

    Examples:
        .. code-block:: python

            from ignite_zero.adapters.fsdp import FSDPOptimizerState

            state = FSDPOptimizerState(model, optimizer, recipient_rank=0)
            full = state.state_dict()  # on every rank; the full state on rank 0
            ...
            state.load_state_dict(torch.load(path, mmap=True, weights_only=True)["optimizer"])

    .. versionadded:: 0.1.0
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, recipient_rank: int = 0) -> None:
        super().__init__(optimizer, module, recipient_rank)

    def param_layouts(self) -> dict[int, ParamLayout]:
        """The layout of every parameter the optimizer may hold, by ``id``."""
        return self.kind.param_layouts(self.module)

    def _check_layout(self, kind: ModuleType) -> None:
        kind.check_optimizer(self.module, self.obj)  # the model's adapter checks the rest of the module

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state by parameter names, as ``get_optimizer_state_dict`` gives it,
        sharded like the parameters. An optimizer without state yet writes its parameter groups only (that
        function would create the state with a step)."""
        if not self.obj.state:
            return {"state": {}, "param_groups": self.snapshot()[1]}
        return self.kind.sharded_optimizer_state(self.module, self.obj)

    def sharded_template(self, saved: set[tuple[Any, ...]], live: bool = False) -> dict[str, Any] | None:
        """This rank's optimizer state (its own tensors when ``live``), or new tensors laid out alike; ``None`` when
        the checkpoint holds no state, or holds it by index (a plain optimizer's, read whole and then put by
        name)."""
        names = self.kind.param_names(self.module)
        if not any(path[:1] == ("state",) and path[1] in names for path in saved if len(path) > 1):
            return None
        if self.obj.state:
            return _template(self.kind.sharded_optimizer_state(self.module, self.obj), live)
        with quiet_state_dict_apis():  # an optimizer without state gets it from torch's step with zero gradients
            return _template(
                get_optimizer_state_dict(self.module, self.obj, options=StateDictOptions(full_state_dict=False)), live
            )

    def load_sharded(self, state: Any) -> None:
        if not state.get("state"):
            self.load_state_dict(state)
            return
        self.kind.load_sharded_optimizer(self.module, self.obj, state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore this rank's part of the optimizer state from a full, name-keyed one; local.

        Raises:
            ValueError: ``state_dict`` is not a full optimizer state, its parameter groups do not match the
                optimizer's, or its state does not fit the parameters; nothing is changed then.
        """
        self.prepare_load(state_dict)()

    def check_entry(self, state_dict: Mapping[str, Any]) -> None:
        """Raise as :meth:`load_state_dict` would, changing nothing."""
        self.prepare_load(state_dict)

    def prepare_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        """:meth:`check_entry`, and what loads the entry, with the parameters' layouts found once."""
        layouts = self.kind.param_layouts(self.module)
        check_optimizer_state(layouts, self.obj, state_dict)
        return lambda: _compat.load_optimizer_state(
            self.obj, local_optimizer_state(layouts, self.obj, state_dict, reuse=True)
        )


def _template(state: Any, live: bool) -> Any:
    """``state`` itself when ``live``, else with new, empty tensors of the same layout: reading a checkpoint into them
    changes nothing live. Live, FSDP2's sharded state reads into its parameters and optimizer state, which spares the
    page faults of new tensors (the benchmarks page of the docs has figures)."""
    if live:
        return state

    def fresh(_: tree.Path, value: Any) -> Any:
        if isinstance(value, DTensor):
            return _compat.dtensor_of_local(value, torch.empty_like(_compat.dtensor_local(value)))
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, nn.Parameter):
            return torch.empty_like(value)
        return value  # ShardedTensor (FSDP1 clones its shards already), and plain values

    return tree.map_tree(fresh, state)


def full_optimizer_state_to_plain(
    module: nn.Module, optimizer: torch.optim.Optimizer, full_state: Mapping[str, Any]
) -> dict[str, Any]:
    """The state dict a plain optimizer's ``load_state_dict`` takes, from a full state keyed by parameter names.

    This restores a checkpoint of an FSDP (or any name-keyed, ``get_optimizer_state_dict``-style) optimizer into
    an optimizer of a plain, unsharded module, e.g. in one process without a process group. Parameters are
    matched by their names in ``module``, so the optimizer's parameter groups may list them in any order. The
    result shares nothing with ``full_state``.

    Args:
        module: the plain module whose parameters ``optimizer`` updates (a DDP wrapper's ``module``).
        optimizer: the plain optimizer.
        full_state: ``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}``; only read.

    Returns:
        ``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``.

    Raises:
        TypeError: ``module`` is an FSDP module (use :class:`FSDPOptimizerState`).
        ValueError: as :meth:`FSDPOptimizerState.load_state_dict`.

    Examples:
        .. code-block:: python

            from ignite_zero.adapters.fsdp import full_optimizer_state_to_plain

            checkpoint = torch.load("checkpoint_3.pt", mmap=True, weights_only=True)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(full_optimizer_state_to_plain(model, optimizer, checkpoint["optimizer"]))

    .. versionadded:: 0.1.0
    """
    if is_fsdp_module(module):
        raise TypeError(f"{type(module).__name__} is an FSDP module: load its optimizer through FSDPOptimizerState")
    return local_optimizer_state(_param_layouts(module), optimizer, full_state, reuse=False)


def plain_optimizer_state_to_full(module: nn.Module, plain_state: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter names, from the index-keyed state of a plain optimizer over the
    unsharded model (as ``torch.save(optimizer.state_dict())`` writes it): the inverse of
    :func:`full_optimizer_state_to_plain`.

    Indices are positions in the plain model's ``parameters()``, which FSDP2 and FSDP1 with ``use_orig_params=True``
    keep in the same order under the same names.

    Raises:
        ValueError: ``module`` is FSDP1 with flattened parameters, whose original order is not its own.
    """
    named = list(module.named_parameters())
    if any(isinstance(parameter, FlatParameter) for _, parameter in named):
        raise ValueError(
            "A plain optimizer's state lists parameters by position, and this FSDP1 model flattens them "
            "(use_orig_params=False): load it into FSDP2 or FSDP1 with use_orig_params=True, or convert it by name"
        )
    names = [clean_name(name) for name, _ in named]
    positions = [index for group in plain_state["param_groups"] for index in group["params"]]
    if sorted(positions) != list(range(len(names))):
        raise ValueError(
            f"The saved optimizer state covers {len(positions)} parameters, this model has {len(names)}: save and "
            "load the same model"
        )
    return {
        "state": {names[index]: value for index, value in plain_state["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]} for group in plain_state["param_groups"]
        ],
    }


# --------------------------------------------------------------------------------------------------
# Optimizer state: element-wise state follows its parameter's slots; anything else is the same on every rank


def optimizer_pieces(
    optimizer: torch.optim.Optimizer, layouts: dict[int, ParamLayout]
) -> tuple[Pieces, list[dict[str, Any]]]:
    """This rank's part of a name-keyed optimizer state, as pieces of the full tensors (views), and its parameter
    groups by name; ``layouts`` places each parameter (by ``id``) in its full tensors."""
    pieces = Pieces()
    groups = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            names = []
            for param in group["params"]:
                layout = layouts[id(param)]
                names += [slot.name for slot in layout.slots]
                if not layout.keeps_state:
                    continue
                for key, value in optimizer.state.get(param, {}).items():  # `get`: never creates state
                    for slot in layout.slots:
                        _add_state(pieces, ("state", slot.name, key), layout, slot, value)
            groups.append({**_hyperparameters(group), "params": names})
    return pieces, groups


def assemble_optimizer_state(
    snapshot: tuple[Pieces, list[dict[str, Any]]], recipient_rank: int, group: Any, overlap: Overlap | None = None
) -> dict[str, Any]:
    """Collective over ``group``: the full name-keyed optimizer state from every rank's :func:`optimizer_pieces`
    on the recipient, ``{}`` on every other rank; given ``overlap``, its tensors' bytes travel in its background."""
    pieces, groups = snapshot
    full = gather_pieces(pieces, recipient_rank, group, overlap=overlap)
    if full is None:
        return {}
    state: dict[str, dict[str, Any]] = {}
    for (_, name, key), value in full.items():
        state.setdefault(name, {})[key] = value
    ordered = {name: state[name] for group in groups for name in group["params"] if name in state}
    return {"state": ordered, "param_groups": groups}


def _add_state(pieces: Pieces, key: tuple[str, ...], layout: ParamLayout, slot: Slot, value: Any) -> None:
    """Add one entry of a parameter's optimizer state, as the part of ``slot``'s original parameter."""
    if isinstance(value, DTensor):
        param = layout.param
        if not isinstance(param, DTensor) or not _laid_out_alike(value, param):
            raise ValueError(f"Optimizer state {key[2]!r} of {slot.name} is not laid out like its parameter")
        _fsdp2.dtensor_pieces(pieces, key, slot, value)
    elif isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == layout.local_shape:
        slot.add_to(pieces, key, value)
    elif isinstance(value, torch.Tensor) and value.dim() > 0 and not slot.is_whole:
        raise ValueError(
            f"Optimizer state {key[2]!r} of {slot.name} has shape {tuple(value.shape)}: neither a scalar nor laid "
            f"out like this rank's shard of the parameter {layout.local_shape}, so it cannot be consolidated"
        )
    else:
        add_value(pieces, key, value)


def _laid_out_alike(value: DTensor, param: DTensor) -> bool:
    """Whether ``value`` has the shape and placements of ``param``, read from their specs: DTensor's properties cost
    more, for each of thousands of entries."""
    value_meta, value_placements, _ = _compat.dtensor_layout(value)
    param_meta, param_placements, _ = _compat.dtensor_layout(param)
    return value_placements == param_placements and value_meta.shape == param_meta.shape


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter group without its parameters, copied, with any tensor (e.g. a ``capturable`` ``lr``) on the CPU."""
    return {
        key: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for key, value in group.items()
        if key != "params"
    }


def _check_full_state(state: Any) -> None:
    if not (isinstance(state, Mapping) and isinstance(state.get("state"), Mapping)):
        raise ValueError(
            "Expected a full optimizer state {'state': {name: ...}, 'param_groups': [...]}, got "
            f"{type(state).__name__} with keys {sorted(state)[:10] if isinstance(state, Mapping) else '-'}"
        )
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
        raise ValueError("Expected `param_groups` to be a list of dicts with `params` in the full optimizer state")
    names = [name for group in groups for name in group["params"]]
    if not all(isinstance(name, str) for name in names):
        raise ValueError(
            "This optimizer state lists its parameters by index, as a plain optimizer saves it, not by name: "
            "load it into the plain optimizer it was saved from"
        )


def _match_groups(
    layouts: dict[int, ParamLayout], optimizer: torch.optim.Optimizer, saved_groups: list[Mapping[str, Any]]
) -> list[int]:
    """For each parameter group of ``optimizer``, the saved group holding the same parameters."""
    group_of = {name: index for index, group in enumerate(saved_groups) for name in group["params"]}
    matched = []
    for index, group in enumerate(optimizer.param_groups):
        names = [slot.name for p in group["params"] for slot in layouts[id(p)].slots]
        sources = {group_of.get(name) for name in names}
        source = sources.pop() if len(sources) == 1 else None
        if source is None or sorted(saved_groups[source]["params"]) != sorted(names):
            raise ValueError(
                f"Parameter group {index} of the optimizer holds {names}, which no saved parameter group holds "
                f"exactly (saved: {[list(g['params']) for g in saved_groups]}): build the optimizer with the "
                "parameter groups it was saved with"
            )
        matched.append(source)
    return matched


def _saved_entries(layout: ParamLayout, saved_state: Mapping[str, Any]) -> list[Mapping[str, Any] | None]:
    """The saved state of each original parameter in ``layout`` (``None`` where it has none), checked to fit;
    ``[]`` when none has any."""
    entries = [saved_state.get(slot.name) or None for slot in layout.slots]
    present = [(slot, entry) for slot, entry in zip(layout.slots, entries) if entry is not None]
    if not present:
        return []
    keys = set(present[0][1])
    for slot, entry in present:
        if set(entry) != keys:
            raise ValueError(
                f"Saved optimizer state of {slot.name} has entries {sorted(entry)}, expected {sorted(keys)}"
            )
        for key, value in entry.items():
            sharded = isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == slot.shape
            if isinstance(value, torch.Tensor) and value.dim() > 0 and not sharded and not slot.is_whole:
                raise ValueError(
                    f"Saved optimizer state {key!r} of {slot.name} has shape {tuple(value.shape)}, neither a scalar "
                    f"nor the parameter's {slot.shape}"
                )
    return entries


def check_optimizer_state(
    layouts: dict[int, ParamLayout], optimizer: torch.optim.Optimizer, full_state: Mapping[str, Any]
) -> tuple[list[torch.Tensor], list[int], list[list[Mapping[str, Any] | None]]]:
    """Check a full, name-keyed state against ``optimizer``; return its parameters, the saved group of each of
    its groups, and the saved state of each parameter's original parameters.

    Raises:
        ValueError: the state does not fit the optimizer.
    """
    _check_full_state(full_state)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in params if id(p) not in layouts]
    if missing:
        raise ValueError(f"{len(missing)} parameters of the optimizer do not belong to the module")
    sources = _match_groups(layouts, optimizer, full_state["param_groups"])
    return params, sources, [_saved_entries(layouts[id(p)], full_state["state"]) for p in params]


def local_optimizer_state(
    layouts: dict[int, ParamLayout], optimizer: torch.optim.Optimizer, full_state: Mapping[str, Any], reuse: bool
) -> dict[str, Any]:
    """This rank's index-keyed optimizer state from a full, name-keyed one; everything is checked first.

    With ``reuse``, element-wise state is copied into the optimizer's existing tensors when they fit (no second
    copy of the state while loading); otherwise, and for the rest, into new tensors. Nothing aliases
    ``full_state``, so the optimizer never writes into it (an ``mmap``'d file stays as it was).
    """
    params, sources, entries = check_optimizer_state(layouts, optimizer, full_state)
    saved_groups = full_state["param_groups"]

    state = {}
    with torch.no_grad():
        for index, (param, saved) in enumerate(zip(params, entries)):
            if saved and layouts[id(param)].keeps_state:
                current = optimizer.state.get(param, {}) if reuse else {}
                state[index] = _param_state(layouts[id(param)], saved, current)
    groups = []
    indices = iter(range(len(params)))
    for group, source in zip(optimizer.param_groups, sources):
        hyper = {k: copy.deepcopy(v) for k, v in saved_groups[source].items() if k != "params"}
        groups.append({**hyper, "params": [next(indices) for _ in group["params"]]})
    return {"state": state, "param_groups": groups}


def _param_state(
    layout: ParamLayout, saved: list[Mapping[str, Any] | None], current: Mapping[str, Any]
) -> dict[str, Any]:
    """One parameter's local optimizer state, built from the saved state of the original parameters it holds."""
    param = layout.param
    first_slot, first = next((slot, entry) for slot, entry in zip(layout.slots, saved) if entry is not None)
    state: dict[str, Any] = {}
    for key, value in first.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == first_slot.shape:
            local, result = _element_wise_target(layout, current.get(key), value.dtype)
            for slot, entry in zip(layout.slots, saved):
                part = slot.local_part(local)
                if entry is None:  # a parameter without saved state (never updated): zero, as the optimizer starts
                    part.zero_()
                elif slot.length:
                    deferred.copy_into(part, slot.full_part(entry[key]))
            state[key] = result
        elif isinstance(value, torch.Tensor):
            # 0-d (`step`) stays on the CPU as saved; the optimizer moves it where it wants it (fused, capturable).
            value = deferred.realize(value)
            device = param.device if value.dim() > 0 else value.device
            state[key] = value.to(device, copy=True)
        else:
            state[key] = copy.deepcopy(value)
    return state


def _element_wise_target(layout: ParamLayout, existing: Any, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """The local tensor to fill with element-wise state, and the value the optimizer gets (a DTensor for FSDP2).

    The existing state tensor when it has the right layout; else a new one, zero in FSDP1's padding.
    """
    param = layout.param
    if isinstance(param, DTensor):
        wanted = (param.placements, param.shape, dtype)
        if isinstance(existing, DTensor) and (existing.placements, existing.shape, existing.dtype) == wanted:
            return _compat.dtensor_local(existing), existing
        local = torch.zeros(layout.local_shape, dtype=dtype, device=_compat.dtensor_local(param).device)
        return local, _compat.dtensor_of_local(param, local)
    if isinstance(existing, torch.Tensor) and (tuple(existing.shape), existing.dtype) == (layout.local_shape, dtype):
        return existing, existing
    local = torch.zeros(layout.local_shape, dtype=dtype, device=param.device)
    return local, local
