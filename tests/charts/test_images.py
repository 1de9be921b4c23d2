"""The Dockerfiles and pyproject's extras, checked without a Docker engine: the operator
image's extra is enough to import what it runs (and holds no torch), every module the
source imports comes from a declared distribution, every package is pinned, both images
run as non-root."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"

# Imports `pdunit operator` and `pdunit router` (what the operator image runs) while every
# installed distribution outside the operator extra's dependency closure is blocked, as if
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


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> list[str]:
    return [Requirement(r).name for r in requirements]


def _requirements(extra: str = "operator") -> list[str]:
    """The distributions `pdunit[extra]` installs directly: the core and the extra's."""
    project = _project()
    return _names(project["dependencies"]) + _names(project["optional-dependencies"][extra])


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


def test_each_image_installs_pdunit_with_its_extra_and_the_operators_has_no_torch() -> None:
    for image, extra in (("operator", "operator"), ("unit", "engine")):
        text = (IMAGES / image / "Dockerfile").read_text()
        assert f'"${{whl}}[{extra}]"' in text, f"{image}: does not install pdunit[{extra}]"
        assert "--no-deps /tmp/dist" not in text and "requirements.txt" not in text, image
    assert not {"torch", "numpy"} & {_canon(n) for n in _requirements()}


# Shipped files that only a developer runs: their imports may come from the dev extra.
DEV_TOOLS = {"engine/proto/build.py"}  # `make proto`: grpc_tools


def _third_party_imports() -> dict[str, str]:
    """Every top-level module the shipped source imports (a file naming one), pdunit's own
    and the standard library's aside."""
    folders = {"pkg", "engine", "kernels", "sidecars", "operator", "bench"}
    found: dict[str, str] = {}
    for folder in folders:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top not in sys.stdlib_module_names and top != "pdunit":
                        where = str(path.relative_to(REPO))
                        if found.get(top) in (None, *DEV_TOOLS):
                            found[top] = where
    return found


def test_every_module_the_source_imports_comes_from_a_declared_distribution() -> None:
    """A module imported by the source but declared by no extra works here (dev installs
    everything) and fails in an image (transformers was in dev only: the unit image's codec
    could not load)."""
    project = _project()
    declared = {_canon(n) for n in _names(project["dependencies"])}
    for extra in ("engine", "operator", "bench"):
        declared |= {_canon(n) for n in _names(project["optional-dependencies"][extra])}
    dev = {_canon(n) for n in _names(project["optional-dependencies"]["dev"])}
    owners = md.packages_distributions()
    undeclared = {}
    for top, where in _third_party_imports().items():
        dists = {_canon(d) for d in owners.get(top, ())}
        if not dists & (declared | (dev if where in DEV_TOOLS else set())):
            undeclared[top] = (where, sorted(dists))
    assert not undeclared, f"imported but declared by no extra: {undeclared}"


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
