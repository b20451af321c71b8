"""The supported torch range (:mod:`ignite_zero._compat.torch_version`) is stated in three places, and they agree
with each other and with the running torch."""

import configparser
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

from ignite_zero import _compat

ROOT = Path(__file__).parents[2]


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
