"""One voice directory shared by several stores and processes (the LBs of a unit set on one
ReadWriteMany volume): what one writes the others read at once, a create of one name is
won by exactly one of two racing processes (with hard links and without), and a reader
racing a replacing writer only ever sees a whole voice."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pdunit.engine.audio.errors import UnknownVoice, VoiceExists
from pdunit.engine.audio.voices import VoiceStore


@dataclass
class FakeCodec:
    """The store's Codec for voices given as codes (nothing is encoded)."""

    sample_rate: int = 800
    frame_rate: float = 25.0
    num_codebooks: int = 4
    codebook_size: int = 32

    def encode(self, samples: np.ndarray) -> np.ndarray:
        raise AssertionError("codes only")


def codes(value: int, frames: int = 30) -> np.ndarray:
    return np.full((4, frames), value, np.int64)


# A process of its own with a store on `root`: `create` puts each name (replace false) and
# prints which it won; `replace` rewrites one voice `n` times between two contents; `read`
# gets it `n` times and prints the digests it saw and any error. `nolink` first makes the
# volume refuse hard links (the placeholder path).
WORKER = """
import json, os, sys, time
import numpy as np
from pdunit.engine.audio.errors import VoiceExists
from pdunit.engine.audio.voices import VoiceStore
from tests.audio.test_voices_shared import FakeCodec
root, job, arg, start, nolink = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5] == "1"
if nolink:
    def no_link(*a, **k):
        raise PermissionError(1, "Operation not permitted")
    os.link = no_link
store = VoiceStore(__import__("pathlib").Path(root), FakeCodec())
while time.time() < start:
    pass
out = {"won": [], "lost": [], "seen": [], "errors": []}
if job == "create":
    for name in arg.split(","):
        try:
            store.put(name, "Words.", codes=np.full((4, 30), os.getpid() % 32, np.int64))
            out["won"].append(name)
        except VoiceExists:
            out["lost"].append(name)
elif job == "replace":
    for i in range(int(arg)):
        store.put("v", "Words.", codes=np.full((4, 30 + i % 2), 1, np.int64), replace=True)
else:
    for _ in range(int(arg)):
        try:
            out["seen"].append(store.get("v").digest)
        except Exception as exc:
            out["errors"].append(repr(exc))
print(json.dumps(out))
"""


def run_together(root: Path, jobs: list[tuple[str, str]], nolink: bool = False) -> list[dict[str, list[str]]]:
    """Start one process per job; they begin their work at the same instant (after imports)."""
    start = str(time.time() + 3.0)
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(root), job, arg, start, "1" if nolink else "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for job, arg in jobs
    ]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout))
    return outs


def test_a_voice_one_store_writes_the_other_reads_at_once_and_a_delete_is_seen_at_once(tmp_path: Path) -> None:
    a, b = VoiceStore(tmp_path, FakeCodec()), VoiceStore(tmp_path, FakeCodec())
    first = a.put("anna", "Hello.", codes=codes(1))
    assert b.get("anna").digest == first.digest and [v.name for v in b.list()] == ["anna"]
    with pytest.raises(VoiceExists):
        b.put("anna", "Other.", codes=codes(2))
    second = b.put("anna", "Other.", codes=codes(2), replace=True)
    assert a.get("anna").digest == second.digest != first.digest
    a.delete("anna")
    with pytest.raises(UnknownVoice):
        b.get("anna")
    assert b.list() == []
    with pytest.raises(UnknownVoice):
        b.delete("anna")


@pytest.mark.parametrize("nolink", [False, True], ids=["hard-links", "no-hard-links"])
def test_two_processes_creating_the_same_names_each_name_is_won_exactly_once(tmp_path: Path, nolink: bool) -> None:
    names = [f"v{i}" for i in range(40)]
    one, two = run_together(tmp_path, [("create", ",".join(names)), ("create", ",".join(names))], nolink)
    assert sorted(one["won"] + two["won"]) == sorted(names)
    assert sorted(one["lost"] + two["lost"]) == sorted(names)
    assert set(one["won"]).isdisjoint(two["won"])
    store = VoiceStore(tmp_path, FakeCodec())
    assert [v.name for v in store.list()] == sorted(names)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n + ".voice" for n in names)  # no temp left


def test_a_reader_racing_a_replacing_writer_sees_only_whole_voices(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path, FakeCodec())
    whole = {store.put("v", "Words.", codes=np.full((4, 30 + k), 1, np.int64), replace=True).digest for k in (1, 0)}
    _, reader = run_together(tmp_path, [("replace", "300"), ("read", "600")])
    assert reader["errors"] == []
    assert len(reader["seen"]) == 600 and set(reader["seen"]) <= whole
