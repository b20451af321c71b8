"""Nested state: the one walker over dicts, lists and tuples that every module uses.

A tree is a leaf or a container of trees: a mapping (rebuilt as a ``dict``, an ``OrderedDict`` kept as one), a
list, or a tuple (a named tuple is a leaf: its fields are no positions). A leaf's path is the tuple of keys and
positions that lead to it, e.g. ``("optimizer", "state", 3, "exp_avg")``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["OMIT", "Path", "check_methods", "describe", "get", "leaves", "map_tree"]

Path = tuple[Any, ...]

#: Returned by the function of :func:`map_tree` for a leaf to leave out: it is dropped from a mapping, and an empty
#: dict stands in its place in a list or tuple, whose positions are part of the other leaves' paths. A mapping whose
#: items are all left out is left out itself.
OMIT: Any = type("Omit", (), {"__repr__": lambda self: "OMIT"})()


def _is_container(value: Any) -> bool:
    return isinstance(value, (Mapping, list)) or (isinstance(value, tuple) and not hasattr(value, "_fields"))


def map_tree(
    func: Callable[[Path, Any], Any],
    tree: Any,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    path: Path = (),
) -> Any:
    """A tree of the same shape whose leaves are ``func(path, leaf)``.

    Args:
        func: called on every leaf with its path.
        tree: the nested state.
        is_leaf: takes a container for a leaf when it returns True.
        path: the path of ``tree`` itself.
    """
    if not _is_container(tree) or (is_leaf is not None and is_leaf(tree)):
        return func(path, tree)
    if isinstance(tree, Mapping):
        items = ((key, map_tree(func, value, is_leaf=is_leaf, path=(*path, key))) for key, value in tree.items())
        mapped = list(items)
        kept = [(key, value) for key, value in mapped if value is not OMIT]
        if mapped and not kept:
            return OMIT
        return OrderedDict(kept) if isinstance(tree, OrderedDict) else dict(kept)
    children = [map_tree(func, value, is_leaf=is_leaf, path=(*path, index)) for index, value in enumerate(tree)]
    positions = [{} if value is OMIT else value for value in children]
    return positions if isinstance(tree, list) else tuple(positions)


def leaves(tree: Any, *, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[Path, Any]]:
    """Every ``(path, leaf)`` of ``tree``, depth first, in order."""
    found: list[tuple[Path, Any]] = []
    _walk(tree, (), is_leaf, found)
    return found


def _walk(node: Any, path: Path, is_leaf: Callable[[Any], bool] | None, found: list[tuple[Path, Any]]) -> None:
    # not through map_tree: no tree of the same shape is built; and no closure that calls itself, which would hold
    # every leaf found until the collector's next pass
    if not _is_container(node) or (is_leaf is not None and is_leaf(node)):
        found.append((path, node))
        return
    for key, value in node.items() if isinstance(node, Mapping) else enumerate(node):
        _walk(value, (*path, key), is_leaf, found)


def get(tree: Any, path: Path) -> Any:
    """The subtree of ``tree`` at ``path``.

    Raises:
        KeyError: naming the part of ``path`` that ``tree`` does not have.
    """
    node = tree
    for depth, step in enumerate(path):
        has = (
            step in node
            if isinstance(node, Mapping)
            else isinstance(node, (list, tuple)) and isinstance(step, int) and 0 <= step < len(node)
        )
        if not has:
            raise KeyError(f"The checkpoint has no entry {describe(path[: depth + 1])}; load only the objects it holds")
        node = node[step]
    return node


def describe(path: Path) -> str:
    """A path as it reads in messages: ``['models'][0]``."""
    return "".join(f"[{step!r}]" for step in path)


def check_methods(objects: Mapping, method: str) -> None:
    """Raise ``TypeError`` naming the first leaf of ``objects`` that has no callable ``method``."""
    for path, obj in leaves(objects):
        if not callable(getattr(obj, method, None)):
            raise TypeError(  # ignite's message first: code that matches it keeps working
                f"Object {type(obj)} should have `{method}` method: object {describe(path)} of type "
                f"{type(obj).__name__} has none, and every object to checkpoint needs `state_dict` and "
                "`load_state_dict`."
            )
