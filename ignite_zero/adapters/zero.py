"""Optimizers that shard their state over ranks and consolidate it on request (ZeRO, fairscale OSS, ...)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ignite_zero import _compat, staging, transport
from ignite_zero.adapters import deferred
from ignite_zero.adapters.base import ShardedState, copy_structure, group_ranks
from ignite_zero.transport.groups import cpu_group

__all__ = ["OptimizerStatePart", "ZeROState", "consolidate", "recipient_keyword", "as_saved_optimizer_state"]


def recipient_keyword(optimizer: Any) -> str | None:
    """How ``optimizer.consolidate_state_dict`` takes the recipient rank.

    ``"to"`` for ``torch.distributed.optim.ZeroRedundancyOptimizer``, ``"recipient_rank"`` for fairscale's
    ``OSS``, known by their type (proxies such as ``MagicMock(ZeroRedundancyOptimizer, wraps=optimizer)``
    included); for others, read from the signature: ``None`` for a method with a single other parameter, taken
    positionally.

    Raises:
        TypeError: the signature does not say where the recipient goes.
    """
    known = {"zero": "to", "oss": "recipient_rank"}.get(_compat.sharded_optimizer_kind(optimizer) or "")
    if known is not None:
        return known
    method = optimizer.consolidate_state_dict
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        signature = None
    parameters = [
        p
        for p in (signature.parameters.values() if signature else ())
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    names = {p.name for p in parameters}
    for name in ("to", "recipient_rank"):
        if name in names:
            return name
    if len(parameters) == 1 and parameters[0].kind != inspect.Parameter.KEYWORD_ONLY:
        return None
    shown = f"{getattr(method, '__qualname__', None) or type(optimizer).__name__ + '.consolidate_state_dict'}"
    raise TypeError(
        f"Cannot tell how {shown}{signature if signature is not None else '(...)'} takes the recipient rank: expected "
        "a parameter named `to` or `recipient_rank`, or a single parameter. Wrap the optimizer in a `ShardedState` "
        "adapter of your own."
    )


def process_group_of(optimizer: Any) -> Any:
    """The process group a sharded optimizer consolidates over (``process_group`` in torch, ``group`` in fairscale);
    the default group where it names none (a proxy of the optimizer, say)."""
    for attribute in ("process_group", "group"):
        group = getattr(optimizer, attribute, None)
        if isinstance(group, dist.ProcessGroup):
            return group
    return dist.group.WORLD


def consolidate(optimizer: Any, recipient_rank: int) -> None:
    """Consolidate a sharded optimizer's state on the global rank ``recipient_rank``; a collective.

    Afterwards ``optimizer.state_dict()`` on the recipient returns the current global state, exactly as after
    the optimizer's own ``consolidate_state_dict``. For ``ZeroRedundancyOptimizer`` and fairscale's ``OSS``
    the local states travel through :func:`ignite_zero.transport.gather_to` (raw tensors, to the recipient
    only, over gloo) into the list the optimizer merges from, so its own ``state_dict()`` does the merge;
    any other optimizer runs its own ``consolidate_state_dict``, the recipient translated to its group.
    """
    group = process_group_of(optimizer)
    attribute = _compat.consolidated_state_attribute(optimizer)
    if attribute is None:
        group_recipient = dist.get_group_rank(group, recipient_rank)
        keyword = recipient_keyword(optimizer)
        if keyword is None:
            optimizer.consolidate_state_dict(group_recipient)
        else:
            optimizer.consolidate_state_dict(**{keyword: group_recipient})
        return
    # What consolidate_state_dict does besides moving data: hyperparameters changed on the exposed groups
    # (a learning-rate scheduler) reach the local optimizer whose state is gathered.
    for exposed, local in zip(optimizer.param_groups, optimizer.optim.param_groups):
        local.update((key, value) for key, value in exposed.items() if key != "params")
    states = transport.gather_to(optimizer.optim.state_dict(), recipient_rank, cpu_group(group))
    setattr(optimizer, attribute, states or [])


@dataclass(frozen=True)
class OptimizerStatePart:
    """The state of some parameters (by index) of an optimizer state dict, with all its param_groups."""

    indices: tuple[int, ...]

    def select(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        state = entry["state"]
        return {**entry, "state": {index: state[index] for index in self.indices if index in state}}


class ZeROState(ShardedState):
    """Full state of an optimizer that shards its state over ranks and can consolidate it.

    Works with :class:`torch.distributed.optim.ZeroRedundancyOptimizer`, fairscale's ``OSS`` and any optimizer
    with a ``consolidate_state_dict`` method. ``state_dict()`` consolidates afresh on every call (a
    consolidation left by an earlier call is never reused) and returns the global state, the same as
    ``consolidate_state_dict`` + ``state_dict`` of the optimizer itself, with every tensor on CPU. The
    optimizer's copy of the consolidated state is then released, so the recipient does not keep a second
    full copy between saves.

    ``load_state_dict()`` takes a global optimizer state saved on any number of ranks (or by a plain
    optimizer); each rank keeps the part it owns. It is local: no communication.

    Args:
        optimizer: the sharded optimizer.
        recipient_rank: global rank that receives the full state; it must belong to the optimizer's process
            group.

    Examples:
        With stock ignite:

        .. code-block:: python

            from ignite.handlers import Checkpoint
            from ignite_zero.adapters import ZeROState

            to_save = {"model": model, "optimizer": ZeROState(optimizer, recipient_rank=0)}
            trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, "ckpt"))

    .. versionadded:: 0.1.0
    """

    #: Loading reads this rank's partition only, straight into the optimizer's state tensors where they fit.
    loads_deferred = True

    def __init__(self, optimizer: Any, recipient_rank: int = 0) -> None:
        super().__init__(optimizer, recipient_rank)
        for method in ("consolidate_state_dict", "state_dict", "load_state_dict"):
            if not callable(getattr(optimizer, method, None)):
                raise TypeError(f"{type(optimizer).__name__} has no `{method}` method: it is not a sharded optimizer")
        recipient_keyword(optimizer)  # fail now on an unusable signature

    def ranks(self) -> list[int]:
        try:
            return group_ranks(process_group_of(self.obj))
        except ValueError:  # a stale group: check() explains it, on every rank
            return super().ranks()

    def check(self) -> None:
        super().check()
        name = type(self.obj).__name__
        group = process_group_of(self.obj)
        try:
            ranks = group_ranks(group)
        except ValueError as error:
            raise ValueError(
                f"The process group of this {name} is not part of the process group in use ({error}). Was the "
                "process group destroyed and initialised again? Create the optimizer after `init_process_group`."
            ) from error
        if _compat.zero_awaits_ddp(self.obj):
            raise ValueError(
                f"This {name} was created with `overlap_with_ddp=True` and is not initialised yet: DDP initialises "
                "it once its buckets are rebuilt, during the first iterations (and only with the NCCL backend). Save "
                "after a few iterations."
            )
        if self.recipient_rank not in ranks:
            raise ValueError(
                f"Recipient rank {self.recipient_rank} is not in the process group of this {name} (global ranks "
                f"{ranks}): its state can only be consolidated on one of them. Set `consolidate_recipient_rank` to "
                "one of these ranks."
            )

    def snapshot(self) -> dict[str, Any]:
        """This rank's part of the state, keyed by global parameter index: views of the live tensors.

        ``{"state": {index: {...}}, "param_groups": [...]}`` as in the optimizer's own global state dict;
        ``param_groups`` hold the hyperparameters of the exposed groups (those a scheduler changes). An optimizer
        of unknown layout consolidates itself instead, now: its snapshot is the full state on the recipient.
        """
        if not _knows_its_partition(self.obj):
            consolidate(self.obj, self.recipient_rank)
            return {"full": staging.to_cpu(self.obj.state_dict()) if self.is_recipient else {}}
        everything = [p for group in self.obj.param_groups for p in group["params"]]
        index_of = {id(p): index for index, p in enumerate(everything)}
        local = self.obj.optim.state_dict()  # keyed by the local optimizer's own parameter order
        local_params = [p for group in self.obj.optim.param_groups for p in group["params"]]
        state = {index_of[id(local_params[position])]: value for position, value in local["state"].items()}
        groups, start = [], 0
        for group in self.obj.param_groups:
            count = len(group["params"])
            hyperparameters = {key: value for key, value in group.items() if key != "params"}
            groups.append({**hyperparameters, "params": list(range(start, start + count))})
            start += count
        return {"state": state, "param_groups": groups}

    def assemble(
        self, snapshot: dict[str, Any], group: Any, overlap: transport.Overlap | None = None
    ) -> dict[str, Any]:
        """Collective over ``group``: every rank's snapshot to the recipient, merged there; ``{}`` elsewhere.

        The merge is the one ``ZeroRedundancyOptimizer.state_dict()`` and fairscale's ``OSS.state_dict()`` make
        after their consolidation: the state of every parameter by global index, sorted, and the exposed param
        groups. The shards travel through :func:`ignite_zero.transport.gather_to`, once, to the recipient only.
        """
        if "full" in snapshot:  # consolidated by the optimizer itself
            return snapshot["full"]
        snapshots = transport.gather_to(snapshot, self.recipient_rank, group, overlap=overlap)
        if snapshots is None:
            return {}
        state = {index: value for part in snapshots for index, value in part["state"].items()}
        return {"state": dict(sorted(state.items())), "param_groups": snapshot["param_groups"]}

    def gather_group(self, dedicated: str | None = None) -> Any:
        """The gloo group over the ranks of the optimizer's own process group (none for one that consolidates
        itself)."""
        if not _knows_its_partition(self.obj):
            return None
        return cpu_group(process_group_of(self.obj), dedicated=dedicated)

    def sharded_state_dict(self) -> dict[str, Any]:
        """The state of the parameters this rank owns, by global index (as strings: names in a sharded checkpoint),
        and the param groups; an optimizer of unknown layout writes its consolidated state from the recipient."""
        snapshot = self.snapshot()
        if "full" in snapshot:
            return snapshot["full"]
        return {"state": {str(index): value for index, value in snapshot["state"].items()}, **_without_state(snapshot)}

    def wants(self, path: tuple[Any, ...]) -> bool:
        """The param groups, and the state of the parameters this rank owns (all of it when saved by name, which
        only the model can translate)."""
        if self._owned_names is None or path[:1] != ("state",) or len(path) < 2 or not str(path[1]).isdigit():
            return True
        return str(path[1]) in self._owned_names

    @functools.cached_property
    def _owned_names(self) -> set[str] | None:
        part = self.part_needed()
        return None if part is None else {str(index) for index in part.indices}

    def load_sharded(self, state: Any) -> None:
        self.load_state_dict(as_saved_optimizer_state(state))

    def part_needed(self) -> OptimizerStatePart | None:
        """The state of the parameters this rank owns: each rank loads only its partition."""
        if not _knows_its_partition(self.obj):  # an optimizer whose partition is unknown: it gets the whole state
            return None
        local = self.obj.optim
        owned = {id(p) for group in local.param_groups for p in group["params"]}
        everything = [p for group in self.obj.param_groups for p in group["params"]]
        return OptimizerStatePart(tuple(index for index, p in enumerate(everything) if id(p) in owned))

    def check_entry(self, state_dict: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state_dict`` is a global optimizer state of this optimizer's shape."""
        name = type(self.obj).__name__
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
            keys = sorted(state_dict)[:10] if isinstance(state_dict, Mapping) else "-"
            raise ValueError(
                f"Expected an optimizer state dict with keys 'state' and 'param_groups' for this {name}, got "
                f"{type(state_dict).__name__} with keys {keys}"
            )
        if any(not isinstance(index, int) for index in state_dict["state"]):
            raise ValueError(
                f"The saved state of this {name} is keyed by parameter names: load it together with the model whose "
                "parameters the optimizer updates, e.g. {'model': model, 'optimizer': optimizer}"
            )
        saved = [len(group["params"]) for group in state_dict["param_groups"]]
        own = [len(group["params"]) for group in self.obj.param_groups]
        if saved != own:
            raise ValueError(
                f"The saved optimizer state has parameter groups of {saved} parameters, this {name} of {own}: build "
                "the optimizer over the same parameters, in the same groups, as the one that was saved"
            )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore this rank's partition from a global optimizer state; tensors of a checkpoint that are still to
        be read (``ignite_zero.adapters.deferred``) are read straight into the optimizer's state tensors where they fit,
        which the optimizer then keeps, sparing the page faults of new memory."""
        self.check_entry(state_dict)
        part = self.part_needed()
        entry = copy_structure(state_dict if part is None else part.select(state_dict))
        current = self._current_state() if part is not None else {}
        with torch.no_grad():
            for index, values in entry["state"].items():
                existing = current.get(index, {})
                for key, value in values.items():
                    if deferred.is_deferred(value):
                        values[key] = _read_into(existing.get(key), value)
        self.obj.load_state_dict(entry)

    def _current_state(self) -> dict[int, dict[str, Any]]:
        """The local optimizer's state tensors, by global parameter index."""
        everything = [p for group in self.obj.param_groups for p in group["params"]]
        return {index: self.obj.optim.state[p] for index, p in enumerate(everything) if p in self.obj.optim.state}


def as_saved_optimizer_state(state: Any) -> Any:
    """An optimizer state read back from a sharded checkpoint, as it was saved: ``state`` keyed by integer
    indices again (names there are strings), and an empty ``state`` restored (it leaves no entry there); any other
    value as it is."""
    if not isinstance(state, Mapping) or "param_groups" not in state:
        return state
    entries = state.get("state", {})
    if not isinstance(entries, Mapping):
        return state
    if all(isinstance(key, str) and key.isdigit() for key in entries):
        entries = dict(sorted((int(key), value) for key, value in entries.items()))
    return {**state, "state": entries}


def _read_into(target: Any, value: torch.Tensor) -> torch.Tensor:
    """A deferred ``value`` read into ``target`` (which the optimizer keeps) if it is a tensor laid out alike on the
    CPU, else into a new tensor."""
    fits = isinstance(target, torch.Tensor) and target.device.type == "cpu"
    if fits and (target.shape, target.dtype) == (value.shape, value.dtype) and target.is_contiguous():
        deferred.copy_into(target, value)
        return target
    return deferred.realize(value)


def _without_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if key != "state"}


def _knows_its_partition(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one whose local optimizer (``optim``) holds exactly this rank's parameters."""
    return _compat.sharded_optimizer_kind(optimizer, genuine=True) is not None and not _compat.zero_awaits_ddp(
        optimizer
    )
