"""Issue 32.4 through a whole unit (`pdunit local`, --transfer proxy): after the proxy
is SIGKILLed and started again, D and P register with it by themselves and requests
complete again, with neither P nor D restarted (before, every transfer failed with
`NOT_FOUND: destination region ... is not registered` for good)."""

from __future__ import annotations

from pdunit.engine.local import LocalConfig, LocalUnit
from tests.engine.unit_client import load, random_prompt, stream, wait_for

SMALL = dict(pool_tokens=16384, cache_tokens=16384, lb_port=0, guard=False, log_level="warning")
PROMPT = random_prompt(120, seed=1)


def test_a_restarted_proxy_serves_the_unit_again_without_restarting_p_or_d():
    with LocalUnit(LocalConfig(mode="pd", transfer="proxy", **SMALL)) as unit:
        frames, last = stream(unit.url, PROMPT, max_frames=12, min_frames=12)
        assert last.get("done"), last
        pids = {name: unit.child(name).proc.pid for name in ("prefill", "decode")}
        unit.restart("proxy")

        def served() -> bool:
            # A request only once the unit says ready from a probe made for the question
            # (/v1/load probes P, D and the proxy anew): each request that met the dead
            # proxy would be a held abort in P, and P exits on purpose at 3 of them (polled
            # blindly every 0.2 s, three did before the LB's next 1-s probe saw the proxy gone).
            if not load(unit.url).ready:
                return False
            got, end = stream(unit.url, PROMPT, max_frames=12, min_frames=12)
            return bool(end.get("done")) and got == frames

        wait_for(served, timeout=60, interval=0.1, what="a request completes over the restarted proxy")
        assert {name: unit.child(name).proc.pid for name in pids} == pids
        assert unit.child("prefill").proc.poll() is None and unit.child("decode").proc.poll() is None
