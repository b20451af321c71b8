"""``ignite_zero._compat`` re-exports every name of its modules, where callers look them up."""

import importlib
import pkgutil

from ignite_zero import _compat


def test_the_package_re_exports_every_name_of_its_modules():
    for info in pkgutil.iter_modules(_compat.__path__):
        module = importlib.import_module(f"{_compat.__name__}.{info.name}")
        assert set(module.__all__) <= set(_compat.__all__), info.name
        for name in module.__all__:
            assert getattr(_compat, name) is getattr(module, name), name
