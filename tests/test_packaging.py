"""The distribution's shape: every package folder is listed in pyproject (so a wheel
build ships it), generated protobuf code is current, no top-level `operator` package."""

from __future__ import annotations

import filecmp
import tomllib
from pathlib import Path

import pytest

from pdunit.engine.proto.build import generate

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for name, folder in cfg["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "listed packages without a folder"


def test_the_operator_package_does_not_shadow_the_standard_library():
    import operator

    assert hasattr(operator, "itemgetter")


@pytest.mark.parametrize("proto_dir", ["engine/proto"])
def test_generated_protobuf_code_is_current(proto_dir, tmp_path):
    src = ROOT / proto_dir
    for proto in src.glob("*.proto"):
        (tmp_path / proto.name).write_text(proto.read_text())
    for path in generate(tmp_path, tmp_path):
        committed = src / path.name
        assert committed.exists(), f"{committed} missing: run `make proto`"
        assert filecmp.cmp(path, committed, shallow=False), f"{committed} is stale: run `make proto`"
