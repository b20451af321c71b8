"""``torch.nn.Module`` internals: which buffers a module leaves out of its state, the key of its extra state, the
name segments that torch's wrappers insert, and ``load_state_dict``'s walk over a module's children.

The FSDP adapters list a module's state buffer by buffer without calling ``state_dict()`` (which would unshard
it), and so name each entry as ``state_dict()`` would from what ``nn.Module`` and its wrappers keep privately.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

__all__ = ["EXTRA_STATE_KEY", "TORCH_WRAPPER_SEGMENTS", "load_module_state", "non_persistent_buffer_names"]

# The key of a module's get_extra_state() in its state dict (nn.Module's private _EXTRA_STATE_KEY_SUFFIX).
EXTRA_STATE_KEY = "_extra_state"

# The attributes torch's wrappers keep the wrapped module in, so segments of the names under them that the unwrapped
# module's state_dict() lacks: FSDP1's FullyShardedDataParallel, activation checkpointing's CheckpointWrapper,
# torch.compile's OptimizedModule (DSD drops the same ones).
TORCH_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers that ``state_dict()`` leaves out."""
    return set(getattr(module, "_non_persistent_buffers_set", ()))


def load_module_state(module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> _IncompatibleKeys:
    """``module.load_state_dict(state_dict, strict)``, each module's entries sorted among its children in one pass.

    ``nn.Module.load_state_dict`` hands each child the entries under its name by filtering all of its parent's
    entries, once per child: a module of many children pays the product, as a model of thousands of layers in one
    ``Sequential`` does (see the benchmarks page, "Many tensors"). Otherwise this is torch's walk (2.11 to 2.14):
    each module's ``_load_from_state_dict`` with the same entries, in the same order, then its load post hooks, and
    the same errors. A module whose class has a ``load_state_dict`` of its own, or that names a child with a dot, is
    loaded by its own method.

    Raises:
        RuntimeError: as ``load_state_dict`` raises (missing or unexpected keys where ``strict``, a shape
            that does not fit), once every module was visited.
    """
    if type(module).load_state_dict is not nn.Module.load_state_dict or any(
        "." in name for m in module.modules() for name in m._modules
    ):
        return module.load_state_dict(state_dict, strict=strict)
    found = _IncompatibleKeys([], [])
    errors: list[str] = []
    metadata = getattr(state_dict, "_metadata", None)
    entries: dict[str, Any] = OrderedDict(state_dict)  # _load_from_state_dict may change it
    if metadata is not None:
        entries._metadata = metadata  # type: ignore[attr-defined]
    _load_into(module, entries, "", metadata, found, errors)
    if strict:
        if found.unexpected_keys:
            errors.insert(0, f"Unexpected key(s) in state_dict: {_quoted(found.unexpected_keys)}. ")
        if found.missing_keys:
            errors.insert(0, f"Missing key(s) in state_dict: {_quoted(found.missing_keys)}. ")
    if errors:
        described = "\n\t".join(errors)
        raise RuntimeError(f"Error(s) in loading state_dict for {module.__class__.__name__}:\n\t{described}")
    return found


def _load_into(
    part: nn.Module,
    local: dict[str, Any],
    prefix: str,
    metadata: Mapping[str, Any] | None,
    found: _IncompatibleKeys,
    errors: list[str],
) -> None:
    """Load ``part`` and its children from ``local``, its entries (each key starts with ``prefix``)."""
    local_metadata = {} if metadata is None else metadata.get(prefix[:-1], {})
    part._load_from_state_dict(local, prefix, local_metadata, True, found.missing_keys, found.unexpected_keys, errors)
    children: dict[str, dict[str, Any]] = {name: {} for name, child in part._modules.items() if child is not None}
    if children:
        start = len(prefix)
        for key, value in local.items():  # a child's name is the segment after the prefix
            dot = key.find(".", start)
            under = children.get(key[start:dot]) if dot >= 0 else None
            if under is not None:
                under[key] = value
    for name, child in part._modules.items():
        if child is not None:
            _load_into(child, children[name], f"{prefix}{name}.", metadata, found, errors)
    for hook in part._load_state_dict_post_hooks.values():  # they may change the keys found so far, in place
        if hook(part, found) is not None:
            raise AssertionError(
                "Hooks registered with ``register_load_state_dict_post_hook`` are not expected to return new "
                "values, if incompatible_keys need to be modified, it should be done inplace."
            )


def _quoted(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)
