"""The unit's layout and commands (engine/unit_layout.py): one builder for the operator's
pod and `pdunit local`, so the two run the same commands but for paths, ports and local's
own engine options."""

from __future__ import annotations

import pytest

from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.unit_layout import (
    ADMIN_TOKEN_FILE,
    RUN_DIR,
    UNIT_SECRET_FILE,
    UnitSpec,
    container_name,
    metrics_port_of,
    process_metrics_port,
    unit_commands,
)
from pdunit.operator.pod import desired_pod

# Flags `pdunit local` gives its processes beyond the pod's: loopback listeners, its LB's
# name, its log level and its CPU-sized pools.
LOCAL_ONLY = {"--host", "--unit-name", "--log-level", "--cache-tokens", "--pool-tokens",
              "--shutdown-timeout-s"}  # local cuts the streams in flight at stop (LocalConfig.drain_s)


def flags(argv: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a command (every flag these commands give takes a value)."""
    assert len(argv) % 2 == 0, argv
    return dict(zip(argv[::2], argv[1::2], strict=True))


def test_pdunit_local_runs_the_pods_commands_but_for_paths_ports_and_its_own_options(tmp_path) -> None:
    pod = desired_pod({"metadata": {"name": "u", "namespace": "t", "uid": "x"},
                       "spec": {"image": "i", "model": "random:tiny:0", "device": "cpu", "transfer": "proxy",
                                "decoders": 2, "metricsPort": 9400}})
    in_pod = {c["name"]: c["command"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]}
    unit = LocalUnit(LocalConfig(model="random:tiny:0", transfer="proxy", decoders=2, metrics_port=9400,
                                 admin_host="0.0.0.0", run_dir=str(tmp_path)))
    local = dict(unit.commands())
    assert {container_name(p) for p in local} == set(in_pod)
    program = list(unit.layout().program)
    for process, argv in local.items():
        assert argv[:len(program)] == program
        here = ["pdunit", *argv[len(program):]]
        for mine, pods in ((unit.unit_secret_file, UNIT_SECRET_FILE), (str(unit.admin_token_file), ADMIN_TOKEN_FILE),
                           (str(tmp_path), RUN_DIR)):  # the files first: they are in the run dir
            here = [a.replace(mine, pods) for a in here]
        theirs = in_pod[container_name(process)]
        assert here[:2] == theirs[:2], process
        ours, pods_flags = flags(here[2:]), flags(theirs[2:])
        assert set(ours) - set(pods_flags) <= LOCAL_ONLY, process
        if process == "lb":  # local's LB listens on ports of this machine
            assert ours.pop("--port") == str(unit.lb_port) and ours.pop("--admin-port") == str(unit.admin_port)
            pods_flags.pop("--port"), pods_flags.pop("--admin-port")
        assert {k: v for k, v in ours.items() if k not in LOCAL_ONLY} == pods_flags, process


@pytest.mark.parametrize("transfer", ["auto", "proxy", "fabric", "ipc", "posix-fd", "tcp", "host"])
def test_every_process_names_the_proxy_socket_exactly_when_the_unit_runs_the_proxy(transfer: str) -> None:
    cmds = unit_commands(UnitSpec(model="random:tiny:0", transfer=transfer))
    runs_proxy = transfer in ("auto", "proxy")
    assert ("proxy" in cmds) is runs_proxy
    for process in ("lb", "prefill", "decode"):
        argv = cmds[process]
        assert ("--proxy-socket" in argv) is runs_proxy, process
        if runs_proxy:
            assert argv[argv.index("--proxy-socket") + 1] == f"{RUN_DIR}/proxy.sock"


def test_a_monolith_unit_is_the_monolith_and_an_lb_on_its_one_socket() -> None:
    cmds = unit_commands(UnitSpec(model="random:tiny:0", mode="monolith", transfer="proxy", metrics_port=9400,
                                  monolith_policy="chunked", chunk_tokens=96))
    assert list(cmds) == ["monolith", "lb"]
    lb, mono = flags(cmds["lb"][2:]), flags(cmds["monolith"][2:])
    assert lb["--prefill-socket"] == lb["--decode-socket"] == mono["--socket"] == f"{RUN_DIR}/monolith.sock"
    assert mono["--metrics-port"] == str(metrics_port_of(9400, "prefill"))
    assert mono["--policy"] == "chunked" and mono["--chunk-tokens"] == "96"
    assert "--proxy-socket" not in cmds["lb"]


def test_each_d_gets_its_socket_its_device_its_metrics_port_and_the_decode_extras_last() -> None:
    spec = UnitSpec(model="random:tiny:0", transfer="tcp", decoders=2, decode_devices=("cuda:1", "cuda:2"),
                    metrics_port=9400, extra_args={"decode": ["--max-batch", "64"]})
    cmds = unit_commands(spec)
    assert [p for p in cmds if p.startswith("decode")] == ["decode-0", "decode-1"]
    for i in range(2):
        argv = cmds[f"decode-{i}"]
        assert argv[-2:] == ["--max-batch", "64"]
        d = flags(argv[2:])
        assert d["--socket"] == f"{RUN_DIR}/decode-{i}.sock" and d["--device"] == f"cuda:{i + 1}"
        assert d["--metrics-port"] == str(9403 + i)
    assert flags(cmds["prefill"][2:])["--decode-socket"] == f"{RUN_DIR}/decode-0.sock,{RUN_DIR}/decode-1.sock"
    assert flags(cmds["guard"][2:])["--decode-socket"] == f"{RUN_DIR}/decode-0.sock,{RUN_DIR}/decode-1.sock"


def test_an_unknown_mode_is_refused_naming_the_modes() -> None:
    with pytest.raises(ValueError, match="mode '1p2d': expected pd or monolith"):
        unit_commands(UnitSpec(model="random:tiny:0", mode="1p2d"))


def test_each_process_serves_metrics_on_the_port_its_command_names() -> None:
    for spec in (UnitSpec(model="random:tiny:0", transfer="proxy", decoders=3, metrics_port=9400),
                 UnitSpec(model="random:tiny:0", mode="monolith", metrics_port=9400)):
        for process, argv in unit_commands(spec).items():
            named = flags(argv[2:]).get("--port" if process == "guard" else "--metrics-port")
            assert process_metrics_port(9400, process) == (int(named) if named else None), process
