"""The operator and unit images, built from the repo's Dockerfiles and run (make test-images):
`pdunit --help` works in each, the operator image has no torch, the unit image the pinned
one. buildah (overlay storage, else vfs; chroot isolation) builds them on a local Debian
bookworm base (tools/images/local-base.sh), as no registry answers here; the unit image's
CUDA base is replaced by it (torch's wheels bring CUDA). Skipped naming the command that
failed where no builder works, failed instead under PDUNIT_IMAGES_REQUIRED=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [pytest.mark.images, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("PDUNIT_CACHE", Path.home() / ".cache" / "pdunit")) / "images"
BASE = "localhost/pdunit-base:bookworm"
BASE_PYTHON = "python3.11"  # bookworm's
TAG = "test"
# Builds in the build mounts: pip.conf (the host's CA and index for pip; wheels/ as
# find-links, filled once on the host when its Python is the base's). Not committed.
PIP_MOUNT = "/pdunit-pip"


def _unavailable(reason: str) -> None:
    if os.environ.get("PDUNIT_IMAGES_REQUIRED") == "1":
        pytest.fail(f"PDUNIT_IMAGES_REQUIRED=1 and no image builder works: {reason}")
    pytest.skip(f"no image builder works here: {reason}")


def _run(cmd: list[str], timeout: float = 300, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload, no-any-return]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@dataclass
class Builder:
    """buildah on one storage root of its own under $PDUNIT_CACHE/images."""

    driver: str
    built: dict[str, dict[str, float | str]] = field(default_factory=dict)

    def cmd(self, *args: str) -> list[str]:
        return ["buildah", "--root", str(CACHE / f"storage-{self.driver}"),
                "--runroot", str(CACHE / f"run-{self.driver}"), "--storage-driver", self.driver, *args]

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return _run(self.cmd(*args), timeout=timeout)

    def build(self, name: str, build_args: dict[str, str]) -> str:
        image = f"localhost/pdunit/{name}:{TAG}"
        log = CACHE / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        mounts = ["--volume", f"{CACHE / 'pip'}:{PIP_MOUNT}:ro",
                  "--volume", f"{CACHE / 'pip' / 'pip.conf'}:/etc/pip.conf:ro"]
        args = [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
        dockerfile = REPO / "images" / name / "Dockerfile"
        start = time.monotonic()
        with log.open("w") as out:
            rc = subprocess.run(
                self.cmd("build", "--isolation", "chroot", "--layers=false", "--pull=never",
                         "--ignorefile", f"{dockerfile}.dockerignore", *mounts, *args,
                         "-f", str(dockerfile), "-t", image, str(REPO)),
                stdout=out, stderr=subprocess.STDOUT, timeout=3600, check=False,
            ).returncode
        seconds = time.monotonic() - start
        assert rc == 0, f"building images/{name} failed ({log}):\n{_tail(log.read_text())}"
        size = json.loads(self("images", "--json", image).stdout)[0]["size"]
        self.built[name] = {"build_s": round(seconds, 1), "size": size}
        return image

    def in_image(self, image: str, *cmd: str) -> subprocess.CompletedProcess[str]:
        """`cmd` in a fresh container of `image` (its user, its PATH), the container removed."""
        ctr = self("from", "--pull=never", image)
        assert ctr.returncode == 0, ctr.stderr
        name = ctr.stdout.strip().splitlines()[-1]
        try:
            return self("run", "--isolation", "chroot", name, "--", *cmd, timeout=600)
        finally:
            self("rm", name)


def _probe(driver: str) -> str | None:
    """None when buildah can make, mount and remove a container on `driver`, else why not."""
    b = Builder(driver)
    for args in (("from", "scratch"), ("mount", "working-container"), ("rm", "working-container")):
        try:
            out = b(*args, timeout=120)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(b.cmd(*args))}` timed out"
        if out.returncode != 0:
            b("rm", "working-container")
            return f"`{' '.join(b.cmd(*args))}` exited {out.returncode}: {_tail(out.stderr, 3)}"
    return None


def _pip_settings() -> None:
    """pip.conf for the builds: the host's CA (a TLS-intercepting proxy's) and index, and the
    wheel cache as find-links, filled on the host when its Python is the base's (then the
    builds use no index)."""
    pip = CACHE / "pip"
    wheels = pip / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    lines = ["[global]", f"find-links = {PIP_MOUNT}/wheels"]
    ca = next((os.environ[k] for k in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")
               if os.environ.get(k) and Path(os.environ[k]).is_file()), None)
    if ca:
        shutil.copyfile(ca, pip / "ca.crt")
        lines.append(f"cert = {PIP_MOUNT}/ca.crt")
    for key, option in (("PIP_INDEX_URL", "index-url"), ("PIP_EXTRA_INDEX_URL", "extra-index-url")):
        if os.environ.get(key):
            lines.append(f"{option} = {os.environ[key]}")
    (pip / "pip.conf").write_text("\n".join(lines) + "\n")
    if f"python{sys.version_info.major}.{sys.version_info.minor}" != BASE_PYTHON:
        return  # wheels for another Python would not fit: the builds download them
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["engine"], *extras["operator"], "setuptools>=68", "wheel"]
    # Downloaded once per constraints.txt and requirement list (pip takes ~1 min to
    # check a full folder again).
    stamp = "\n".join([(REPO / "constraints.txt").read_text(), *wanted])
    if not (pip / "wheels.stamp").is_file() or (pip / "wheels.stamp").read_text() != stamp:
        out = _run([sys.executable, "-m", "pip", "download", "-q", "-c", str(REPO / "constraints.txt"),
                    "-d", str(wheels), *wanted], timeout=1800)
        assert out.returncode == 0, f"pip download into {wheels} failed:\n{_tail(out.stderr)}"
        (pip / "wheels.stamp").write_text(stamp)
    # Every wheel both images install is there: the builds read no index (pip would
    # otherwise download what find-links holds again).
    (pip / "pip.conf").write_text("\n".join([*lines, "no-index = true"]) + "\n")


@pytest.fixture(scope="module")
def builder() -> Iterator[Builder]:
    if sys.platform != "linux":
        _unavailable(f"buildah needs Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        _unavailable("not root: debootstrap and buildah's chroot isolation need root here")
    if shutil.which("buildah") is None:
        _unavailable("`buildah` is not on PATH (Debian: apt-get install buildah; make test-images does)")
    reasons = {}
    for driver in os.environ.get("PDUNIT_IMAGES_DRIVER", "overlay vfs").split():
        reason = _probe(driver)
        if reason is None:
            break
        reasons[driver] = reason
    else:
        _unavailable("; ".join(f"{d}: {r}" for d, r in reasons.items()))
    b = Builder(driver)
    env = {**os.environ, "BUILDAH": " ".join(b.cmd()), "PDUNIT_BASE_IMAGE": BASE,
           "PDUNIT_CACHE": str(CACHE.parent)}
    if not (CACHE / f"base-bookworm-{_arch()}.tar").is_file() and shutil.which("debootstrap") is None:
        _unavailable("`debootstrap` is not on PATH for the local base (apt-get install debootstrap)")
    base = _run(["bash", str(REPO / "tools" / "images" / "local-base.sh")], timeout=1800, env=env)
    if base.returncode != 0:
        _unavailable(f"tools/images/local-base.sh exited {base.returncode}: {_tail(base.stderr, 5)}")
    smoke = b.in_image(BASE, BASE_PYTHON, "-c", "print('ok')")
    if smoke.returncode != 0 or smoke.stdout.strip() != "ok":
        _unavailable(f"`buildah run --isolation chroot` in {BASE} failed: {_tail(smoke.stderr, 5)}")
    _pip_settings()
    yield b
    # The built images go (GBs on vfs); the base and the caches stay for the next run.
    b("rm", "--all")
    for name in b.built:
        b("rmi", "--force", f"localhost/pdunit/{name}:{TAG}")
    b("rmi", "--prune")
    summary = {"driver": driver, **b.built}
    (CACHE / "last-run.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nimages ({CACHE / 'last-run.json'}): {json.dumps(summary)}")


def _arch() -> str:
    return _run(["dpkg", "--print-architecture"]).stdout.strip() if shutil.which("dpkg") else "amd64"


def _pin(name: str) -> str:
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.lower().startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{name} is not pinned in constraints.txt")


def _assert_help(builder: Builder, image: str) -> None:
    out = builder.in_image(image, "pdunit", "--help")
    assert out.returncode == 0, f"pdunit --help in {image} exited {out.returncode}:\n{out.stderr}"
    assert "usage: pdunit" in out.stdout and "operator" in out.stdout, out.stdout[:500]
    user = builder.in_image(image, "id", "-u")
    assert user.stdout.strip() == "10001", f"{image} runs as uid {user.stdout.strip()!r}, not 10001"


def test_operator_image_builds_runs_pdunit_and_has_no_torch(builder: Builder) -> None:
    image = builder.build("operator", {"PYTHON_IMAGE": BASE})
    _assert_help(builder, image)
    for command in ("operator", "router"):
        out = builder.in_image(image, "pdunit", command, "--help")
        assert out.returncode == 0, f"pdunit {command} --help in {image}:\n{out.stderr}"
    for module in ("torch", "numpy"):
        out = builder.in_image(image, "python", "-c", f"import {module}")
        assert out.returncode != 0 and f"No module named '{module}'" in out.stderr, (module, out.stderr)


def test_unit_image_builds_runs_pdunit_and_has_the_pinned_torch(builder: Builder) -> None:
    image = builder.build("unit", {"PYTHON_BUILD_IMAGE": BASE, "CUDA_BASE_IMAGE": BASE,
                                   "PYTHON": BASE_PYTHON})
    _assert_help(builder, image)
    out = builder.in_image(image, "python", "-c",
                           "import torch, numpy, transformers; print(torch.__version__)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split("+")[0] == _pin("torch"), out.stdout
