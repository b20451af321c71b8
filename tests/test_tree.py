"""The walker over nested state (ignite_zero.tree): its leaves, in the order and with the paths that every module
relies on."""

from collections import OrderedDict, namedtuple

from ignite_zero import tree

Point = namedtuple("Point", "x y")


def test_leaves_are_the_leaves_map_tree_visits_in_the_same_order():
    state = {"a": [1, (2, {"b": 3})], "c": OrderedDict(d=Point(4, 5)), "e": {}, "f": {"g": None, "h": "text"}}
    visited = []
    tree.map_tree(lambda path, leaf: visited.append((path, leaf)), state)
    assert tree.leaves(state) == visited
    paths = [("a", 0), ("a", 1, 0), ("a", 1, 1, "b"), ("c", "d"), ("f", "g"), ("f", "h")]
    assert [path for path, _ in visited] == paths
    assert tree.leaves(state, is_leaf=lambda value: isinstance(value, list))[0] == (("a",), [1, (2, {"b": 3})])
    assert tree.leaves(7) == [((), 7)]
