"""The distribution's shape: every package folder is listed in pyproject (so a wheel
build ships it), the wheel holds one top-level package (pdunit, typed), the repo root's
operator/ folder never shadows the standard library's, generated protobuf code is current."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
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


def test_the_wheel_holds_one_top_level_package_pdunit_marked_typed(tmp_path):
    # Built from a copy of the sources: an in-tree build reuses build/lib, which keeps
    # the files of modules deleted since.
    src = tmp_path / "src"
    src.mkdir()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in sorted(set(cfg["package-dir"].values())):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], cwd=tmp_path, check=True)
    (wheel,) = (tmp_path / "dist").glob("pdunit-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        declared = zf.read(top_level).decode().split()
    shipped = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert shipped == {"pdunit"}, f"the wheel installs {sorted(shipped)} at the top of site-packages"
    assert declared == ["pdunit"], f"top_level.txt declares {declared}"
    assert "pdunit/py.typed" in names, "mypy reads pdunit's types only with pkg/py.typed shipped"


def _from_the_repo_root(*argv: str) -> subprocess.CompletedProcess[str]:
    # `python -c` and `python -m` put the working directory first on sys.path, where the
    # repo's operator/ folder wins unless the stdlib's was imported before (make install's
    # .pth does that at interpreter start).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True)


def test_python_run_from_the_repo_root_imports_the_standard_librarys_operator():
    out = _from_the_repo_root("-c", "import operator; print(operator.__file__)")
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).parent == Path(sysconfig.get_path("stdlib")), (
        f"`import operator` in the repo root gives {out.stdout.strip()}: run `make install`")


def test_python_m_runs_the_engine_cli_from_the_repo_root():
    out = _from_the_repo_root("-m", "pdunit.engine.cli", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: pdunit <command>")


@pytest.mark.parametrize("proto_dir", ["engine/proto"])
def test_generated_protobuf_code_is_current(proto_dir, tmp_path):
    src = ROOT / proto_dir
    for proto in src.glob("*.proto"):
        (tmp_path / proto.name).write_text(proto.read_text())
    for path in generate(tmp_path, tmp_path):
        committed = src / path.name
        assert committed.exists(), f"{committed} missing: run `make proto`"
        assert filecmp.cmp(path, committed, shallow=False), f"{committed} is stale: run `make proto`"
