"""set_on_signals (engine/observability.py): SIGTERM and SIGINT set a threading.Event
through a pipe and a reader thread, never from the handler itself (Event.set() in a
handler can deadlock on the event's own lock held by the interrupted main thread)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import logging, os, signal, threading, time
    from pdunit.engine.observability import set_on_signals
    logging.basicConfig(level=logging.INFO, format="%(message)s %(signal)s")
    stop = threading.Event()
    set_on_signals(stop, logging.getLogger("t"))
    sig = getattr(signal, os.environ["SIG"])
    # the main thread waits on the event, as the proxy does, while a thread signals it:
    # many signals, each landing wherever the main thread is inside wait()
    def fire():
        for _ in range(200):
            os.kill(os.getpid(), sig)
            time.sleep(0.0005)
    threading.Thread(target=fire).start()
    assert stop.wait(20), "the event was never set"
    print("stopped", flush=True)
    """
)


def test_sigterm_and_sigint_set_the_event_and_log_once_without_the_handler_touching_it() -> None:
    for sig in ("SIGTERM", "SIGINT"):
        out = subprocess.run([sys.executable, "-c", SCRIPT], env={"SIG": sig, "PATH": ""}, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "stopped"
        assert out.stderr.count("shutdown requested") == 1, out.stderr
        assert sig in out.stderr
