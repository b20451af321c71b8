"""The supported torch range is stated in three places, and they agree with each other and with the running torch;
_compat re-exports every name of its modules, where callers look them up."""

import configparser
import importlib
import pkgutil
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

from ignite_zero import _compat

ROOT = Path(__file__).parent.parent


def test_setup_cfg_the_compatibility_page_and_compat_declare_the_same_minimum_torch():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].split("\n")
    requirements = [Requirement(line) for line in lines if line.strip() and not line.strip().startswith("#")]
    (torch_requirement,) = [r for r in requirements if r.name == "torch"]
    (floor,) = [spec.version for spec in torch_requirement.specifier if spec.operator == ">="]
    assert _compat.MIN_TORCH_VERSION == Version(floor)
    assert f"``torch >= {floor}``" in (ROOT / "docs" / "compatibility.rst").read_text()
    assert _compat.TORCH_VERSION >= _compat.MIN_TORCH_VERSION, torch.__version__


def test_the_package_re_exports_every_name_of_its_modules():
    for info in pkgutil.iter_modules(_compat.__path__):
        module = importlib.import_module(f"{_compat.__name__}.{info.name}")
        assert set(module.__all__) <= set(_compat.__all__), info.name
        for name in module.__all__:
            assert getattr(_compat, name) is getattr(module, name), name
