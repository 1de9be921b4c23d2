"""--sample-stacks: each thread's Python stacks, folded, from inside the process."""

from __future__ import annotations

import threading
import time

from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.stack_sampler import StackSampler, parse_dump
from tests.engine.unit_client import random_prompt, stream


def spin_marker(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(200))


def test_the_sampler_sees_each_thread_where_it_runs_and_not_itself(tmp_path):
    stop = threading.Event()
    spinner = threading.Thread(target=spin_marker, args=(stop,), name="spinner")
    idle = threading.Thread(target=stop.wait, name="idler")
    spinner.start()
    idle.start()
    sampler = StackSampler(tmp_path / "stacks.folded", hz=500).start()
    # until 20 samples, not a fixed time: on a loaded machine the spinner holds the GIL and
    # the sampler gets far fewer than 500 a second (18 in 0.3 s seen under a busy suite)
    deadline = time.monotonic() + 60
    while sampler.samples < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    per_thread = sampler.stop()
    stop.set()
    spinner.join()
    idle.join()
    lines = (tmp_path / "stacks.folded").read_text().splitlines()
    stacks = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in lines}
    assert sampler.samples >= 20
    assert per_thread["spinner"] == per_thread["idler"] == sampler.samples  # every sample saw both
    assert all("test_stack_sampler.py:spin_marker" in k for k in stacks if k.startswith("spinner;"))
    assert any(k.startswith("idler;") and "threading.py:wait" in k for k in stacks)
    assert "stack-sampler" not in per_thread
    assert sum(stacks.values()) == sum(per_thread.values())


def test_a_faulthandler_dump_parses_into_each_threads_stack_outermost_first():
    dump = """Thread 0x00007f095db296c0 (most recent call first):
  File "/srv/app/worker.py", line 3 in work
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00000000000000ab (most recent call first):
  <no Python frame>

Current thread 0x00007f095e88db80 (most recent call first):
  File "<stdin>", line ??? in <module>
  ...
"""
    assert parse_dump(dump) == {
        0x7F095DB296C0: ["threading.py:_bootstrap", "threading.py:run", "worker.py:work"],
        0xAB: [],
        0x7F095E88DB80: ["<stdin>:<module>"],
    }


def test_p_writes_its_threads_stacks_when_it_stops(tmp_path):
    path = tmp_path / "p.folded"
    cfg = LocalConfig(mode="pd", pool_tokens=8192, cache_tokens=8192, lb_port=0, guard=False, log_level="warning",
                      extra_prefill_args=["--sample-stacks", str(path), "--sample-hz", "400"])
    with LocalUnit(cfg) as unit:
        frames, last = stream(unit.url, random_prompt(200, seed=9), max_frames=8, min_frames=8)
        assert last.get("done") and len(frames) == 8
        assert not path.exists()  # written at the stop, not before
    text = path.read_text()
    assert "pipeline.py:_forward_once" in text  # P's forward loop
    assert "pipeline.py:_reserve_once" in text  # its reserve stage

