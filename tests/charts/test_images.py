"""The Dockerfiles, checked without a Docker engine: the operator image's package list is
enough to import what it runs, every package is pinned, both images run as non-root."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"

# Imports `pdunit operator` and `pdunit router` (what the operator image runs) while every
# installed distribution outside requirements.txt's dependency closure is blocked, as if
# it were not installed in the image.
_PROBE = r"""
import importlib, importlib.abc, importlib.metadata as md, re, sys
from packaging.requirements import Requirement

def canon(name): return re.sub(r"[-_.]+", "-", name).lower()

wanted = [canon(l) for l in sys.argv[1].split(",")]
closure, stack = set(), list(wanted)
while stack:
    name = stack.pop()
    if name in closure:
        continue
    closure.add(name)
    for raw in md.distribution(name).requires or []:
        req = Requirement(raw)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            stack.append(canon(req.name))

owners = md.packages_distributions()
blocked = []

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        dists = {canon(d) for d in owners.get(top, ())}
        if top != "pdunit" and dists and not dists & (closure | {"pdunit"}):
            blocked.append(top)
            raise ModuleNotFoundError(f"{top} is not in the operator image", name=top)  # as a missing module is
        return None

sys.meta_path.insert(0, Block())
for module in ("pdunit.cli", "pdunit.engine.cli", "pdunit.operator.main", "pdunit.operator.scaler",
               "pdunit.engine.router.main", "kubernetes_asyncio.client", "kubernetes_asyncio.config",
               "kubernetes_asyncio.watch"):
    importlib.import_module(module)
assert "torch" not in sys.modules and "numpy" not in sys.modules, "torch/numpy imported"
print("blocked:", sorted(set(blocked)))
"""


def _requirements() -> list[str]:
    lines = (IMAGES / "operator" / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _probe(requirements: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(requirements)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_operator_image_requirements_import_the_operator_and_router_without_torch() -> None:
    out = _probe(_requirements())
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_import_probe_fails_when_a_needed_package_is_left_out() -> None:
    # The control for the test above: without kopf, `pdunit operator` cannot import.
    out = _probe([r for r in _requirements() if _canon(r) != "kopf"])
    assert out.returncode != 0
    assert "kopf is not in the operator image" in out.stderr


def test_operator_image_requirements_are_all_pinned_in_constraints() -> None:
    pinned = {
        _canon(line.split("==")[0])
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line
    }
    missing = [name for name in _requirements() if _canon(name) not in pinned]
    assert not missing, f"not pinned in constraints.txt: {missing}"


def test_both_images_run_as_non_root_with_pdunit_as_entrypoint() -> None:
    for image in ("unit", "operator"):
        text = (IMAGES / image / "Dockerfile").read_text()
        users = re.findall(r"^USER\s+(\S+)", text, re.M)
        assert users and users[-1] == "10001:10001", f"{image}: last USER is {users}"
        assert re.search(r'^ENTRYPOINT \["pdunit"\]', text, re.M), image
        assert "--constraint /tmp/constraints.txt" in text, f"{image}: installs unpinned"


def test_operator_image_installs_pdunit_without_its_torch_dependencies() -> None:
    text = (IMAGES / "operator" / "Dockerfile").read_text()
    assert re.search(r"pip install --no-deps /tmp/dist/pdunit-\*\.whl", text)
    assert "torch" not in {_canon(n) for n in _requirements()}


def test_dockerignore_sends_every_folder_the_wheel_packages() -> None:
    # pyproject's package-dir maps these folders; a folder missing from the build context
    # would build a wheel without that subpackage.
    pyproject = (REPO / "pyproject.toml").read_text()
    folders = set(re.findall(r'"pdunit(?:\.\w+)?" = "(\w+)"', pyproject))
    assert folders, "no package-dir mapping found in pyproject.toml"
    for image in ("unit", "operator"):
        ignore = (IMAGES / image / "Dockerfile.dockerignore").read_text()
        dockerfile = (IMAGES / image / "Dockerfile").read_text()
        for folder in folders:
            assert f"!{folder}/" in ignore, f"{image}: {folder}/ not in the build context"
            assert f"COPY {folder}/ {folder}/" in dockerfile, f"{image}: {folder}/ not copied"
