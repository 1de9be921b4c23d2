"""engine/ports.py: ports for servers bound later come from outside the ephemeral range."""

from __future__ import annotations

import socket

from pdunit.engine import ports


def test_ports_are_below_the_ephemeral_range_bindable_and_never_repeated():
    low = ports._ephemeral_low()
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    assert all(ports._FLOOR <= p < low for p in picked), (low, sorted(picked)[:5], sorted(picked)[-5:])
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))


def test_a_port_in_use_is_never_picked(monkeypatch, tmp_path):
    # Squeeze the range to 1000 ports and hold half of them: no pick may be a held one.
    floor = ports._FLOOR
    range_file = tmp_path / "range"
    range_file.write_text(f"{floor + 1000}\t60999\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)
    monkeypatch.setattr(ports, "_handed_out", set())
    held = []
    try:
        for port in range(floor, floor + 1000, 2):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
            except OSError:
                s.close()
                continue
            held.append(s)
        held_ports = {s.getsockname()[1] for s in held}
        for _ in range(50):
            assert ports.free_port() not in held_ports
    finally:
        for s in held:
            s.close()


def test_a_host_with_a_low_ephemeral_range_falls_back_to_the_kernels_pick(monkeypatch, tmp_path):
    range_file = tmp_path / "range"
    range_file.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_block_of_ports_is_consecutive_free_and_never_handed_out_again():
    base = ports.free_port_block(5)
    for port in range(base, base + 5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert not set(range(base, base + 5)) & {ports.free_port() for _ in range(300)}
