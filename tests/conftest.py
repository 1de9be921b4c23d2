"""Shared test setup: one torch thread per process (2-core CI box; more threads only
contend), and the groups pytest-xdist keeps together (`make test` runs two workers):
each file's tests stay on one worker (its module fixtures start once), and every test
of the one envtest control plane (a session fixture) on the same worker."""

import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

torch.set_num_threads(1)

# Session fixtures too costly to start once per worker: their users form one group.
SHARED_SESSION_FIXTURES = ("control_plane",)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    loadgroup = bool(getattr(config.option, "loadgroup", False))  # set on xdist's workers
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        shared = [name for name in SHARED_SESSION_FIXTURES if name in fixtures]
        group = shared[0] if shared else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        if loadgroup and "@" not in item.nodeid:
            # xdist's loadgroup scheduler groups by an "@group" suffix of the node id,
            # which pytest-xdist 3.8 writes to `_nodeid` while pytest 9.2 reads `_id`
            # (pytest-xdist issue 1386): without this, nothing was grouped.
            attr = "_id" if hasattr(item, "_id") else "_nodeid"
            setattr(item, attr, f"{item.nodeid}@{group}")


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A folder for unix sockets, removed after the test: their paths hold at most 107
    bytes, and pytest's tmp_path under an xdist worker (.../popen-gwN/<test name>) can
    leave too little of that for a unit's run dir."""
    d = tempfile.mkdtemp(prefix="pdt", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)
