"""The unit pod the operator writes, run as local processes (a stand-in kubelet): every
container starts with its own command from `desired_pod`, the unit serves a stream, and
every port the pod declares serves Prometheus metrics; together they serve every unit
metric the chart's dashboard and alert rules query (the dashboard's panels on D's steps, P's aborts,
the KV checks and the transfer mode had nothing to scrape while only the LB's port was
declared). The LB's admin port takes the drain only with the token of the unit's Secret.
A unit with spec.codec speaks through the same commands (a voice stored with the token of
spec.voices.tokenSecret, refused without it, one WAV)."""

from __future__ import annotations

import io
import re
import sys
import wave
from typing import Any

import httpx
import pytest

from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.ports import free_port, free_port_block
from pdunit.engine.security import write_secret_file
from pdunit.engine.unit_layout import ADMIN_TOKEN_FILE, RUN_DIR, UNIT_SECRET_FILE, VOICES_TOKEN_FILE
from pdunit.operator.chart_files import metric_names, queries
from pdunit.operator.models import VOICES_MOUNT_PATH
from pdunit.operator.pod import desired_pod
from tests.engine.unit_client import random_prompt, stream, upload_demo_voice

# Started in the order `pdunit local` uses (the proxy listening before P and D register
# with it); container name -> LocalUnit child name.
ORDER = {"nvlink-proxy": "proxy", "decode": "decode", "prefill": "prefill", "quiesce-guard": "guard", "lb": "lb"}
# Scraped by the chart's other PodMonitor (operator, router): not a unit's.
CONTROL_PLANE = ("pdunit_operator_", "pdunit_router_", "pdunit_scaler_")


class PodProcesses(LocalUnit):
    """LocalUnit's start, readiness and stop around the pod's own commands; the unit's
    Secret files are written where the commands read them (mode 0600, as the engines ask)."""

    def __init__(self, pod: dict[str, Any], lb_port: int) -> None:
        self.pod = pod
        super().__init__(LocalConfig(lb_port=lb_port, guard=False, log_level="warning"))

    @property
    def pod_admin_token_file(self) -> str:
        return str(self.run_dir / "pod-admin.token")

    @property
    def pod_voices_token_file(self) -> str:
        """What the kubelet mounts from spec.voices.tokenSecret."""
        return str(self.run_dir / "pod-voices.token")

    def start(self) -> LocalUnit:
        write_secret_file(self.pod_admin_token_file)  # the unit secret is LocalUnit's own
        write_secret_file(self.pod_voices_token_file)
        return super().start()

    def secret_files(self) -> dict[str, str]:
        """The pod's secret file paths -> this unit's files."""
        return {UNIT_SECRET_FILE: self.unit_secret_file, ADMIN_TOKEN_FILE: self.pod_admin_token_file,
                VOICES_TOKEN_FILE: self.pod_voices_token_file}

    def commands(self) -> list[tuple[str, list[str]]]:
        by_name = {c["name"]: c for c in self.pod["spec"]["initContainers"] + self.pod["spec"]["containers"]}
        assert set(by_name) <= set(ORDER) and {"lb", "prefill", "decode"} <= set(by_name), sorted(by_name)
        out = []
        for container, child in ORDER.items():
            if container not in by_name:  # the proxy runs with transfer proxy and auto only
                continue
            c = by_name[container]
            env = [f"{e['name']}={e['value']}" for e in c["env"] if "value" in e]
            # /run/pdunit is the pod's shared volume; here a folder of its own (every path of
            # the unit is a flag of its commands: engine/unit_layout.py)
            env.append(f"PDUNIT_UNIT_NAME={self.unit_name}")  # how wait_ready knows the LB is this unit's
            # the voice store's volume: a folder of the run dir
            argv = [self.secret_files().get(a, a).replace(RUN_DIR, str(self.run_dir))
                    .replace(VOICES_MOUNT_PATH, str(self.run_dir / "voices")) for a in c["command"]]
            assert argv[0] == "pdunit", argv
            out.append((child, ["env", *env, sys.executable, "-m", "pdunit.engine.cli", *argv[1:]]))
        return out


def _names(text: str) -> set[str]:
    """The series a /metrics text serves, by the names queries use (metric_names)."""
    return metric_names(" ".join(re.findall(r"^(pdunit_[a-z0-9_]+)", text, re.M)))


def _unit_metrics_read_by_the_chart() -> set[str]:
    """What the dashboard's panels and the alert rules query of a unit's processes."""
    used = set().union(*(metric_names(expr) for expr in queries()))
    # counted only by transfer auto's probe (this unit names its mode: nothing to count)
    only_with_auto = {"pdunit_transfer_probe_total"}
    return {m for m in used if not m.startswith(CONTROL_PLANE)} - only_with_auto


@pytest.mark.timeout(300)
def test_every_declared_port_of_a_unit_pod_serves_what_the_dashboard_and_alerts_read():
    lb_port = free_port()
    unit = {
        "metadata": {"name": "metrics-unit", "namespace": "t", "uid": "u"},
        "spec": {
            "image": "pdunit:cpu", "model": "random:tiny:0", "device": "cpu", "transfer": "proxy",
            "lbPort": lb_port, "adminPort": free_port(), "metricsPort": free_port_block(4),
            # small pools: the CPU defaults are sized for a real model
            "extraArgs": {"prefill": ["--cache-tokens", "16384"], "decode": ["--pool-tokens", "16384"]},
        },
    }
    pod = desired_pod(unit)
    declared = {
        (c["name"], p["name"]): p["containerPort"]
        for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]
        for p in c.get("ports", [])
    }
    admin = declared.pop(("lb", "admin"))  # serves the drain behind the token, no /metrics
    assert len(declared) == 5, declared  # the LB's http port and four metrics ports
    with PodProcesses(pod, lb_port) as unit_procs:  # in a short temp folder of its own
        frames, _ = stream(unit_procs.url, random_prompt(40, seed=3), max_frames=6, min_frames=6)
        assert len(frames) == 6
        # the pod's LB really guards its admin port (and the stream port has no admin route)
        drain = f"http://127.0.0.1:{admin}/v1/admin/drain"
        assert httpx.post(drain, json={"draining": False}, timeout=5).status_code == 401
        assert httpx.post(f"{unit_procs.url}/v1/admin/drain", json={"draining": False}, timeout=5).status_code == 404
        token = open(unit_procs.pod_admin_token_file).read().strip()
        ok = httpx.post(drain, json={"draining": False}, headers={"Authorization": f"Bearer {token}"}, timeout=5)
        assert ok.status_code == 200, ok.text
        served: dict[str, set[str]] = {}
        texts: dict[str, str] = {}
        for (container, port_name), port in declared.items():
            resp = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            assert resp.status_code == 200, (container, port_name, resp.status_code)
            texts[port_name] = resp.text
            served[port_name] = _names(resp.text)
            assert served[port_name], f"{container}'s {port_name} serves no pdunit_ metric"
    assert "pdunit_decode_streams" in served["metrics-decode0"]
    assert "pdunit_prefill_held_aborts" in served["metrics-prefill"]
    assert "pdunit_lb_streams_in_flight" in served["http"]
    # named by the spec, not probed by auto: P still says which mode carries the KV
    assert 'pdunit_transfer_mode{decode="decode",pdunit_transfer_mode="proxy"} 1.0' in texts["metrics-prefill"]
    assert 'pdunit_transfer_mode{decode="decode",pdunit_transfer_mode="tcp"} 0.0' in texts["metrics-prefill"]
    everything = set().union(*served.values())
    missing = _unit_metrics_read_by_the_chart() - everything
    assert not missing, f"the dashboard or the alerts query unit metrics no port of the pod serves: {sorted(missing)}"


@pytest.mark.timeout(300)
def test_a_speaking_unit_pod_serves_speech_through_its_own_commands():
    """spec.codec and spec.voices as the operator passes them (--codec to D, --model,
    --codec, --voices and --voices-token-file to the LB, spec.audio's chunking to D): a
    voice refused without the token, then uploaded with it into the pod's voice store, one
    POST /v1/audio/speech answered with a WAV of frames x the codec's samples per frame."""
    lb_port = free_port()
    unit = {
        "metadata": {"name": "speaking-unit", "namespace": "t", "uid": "u"},
        "spec": {
            "image": "pdunit:cpu", "model": "random:csm-tiny:0", "codec": "random:mimi-tiny:0",
            "audio": {"firstChunkFrames": 2, "chunkFrames": 3}, "device": "cpu", "transfer": "host",
            "lbPort": lb_port, "adminPort": free_port(), "metricsPort": 0,
            "volumes": [{"name": "voice-store", "emptyDir": {}}],
            "voices": {"volume": "voice-store", "tokenSecret": "speaking-voices"},
            "extraArgs": {"prefill": ["--cache-tokens", "4096"], "decode": ["--pool-tokens", "4096"]},
        },
    }
    pod = desired_pod(unit)
    with PodProcesses(pod, lb_port) as procs:
        anonymous = httpx.delete(f"{procs.url}/v1/voices/demo", timeout=10)
        assert anonymous.status_code == 401 and anonymous.json()["error"]["param"] == "Authorization"
        audio = upload_demo_voice(procs.url, procs.pod_voices_token_file)
        rate, spf = audio["sample_rate"], audio["samples_per_frame"]
        assert (procs.run_dir / "voices").is_dir()  # the store is the pod's voice volume
        speech = httpx.post(f"{procs.url}/v1/audio/speech", timeout=120, json={
            "model": "random:csm-tiny:0", "voice": "demo", "input": "Hello there.", "response_format": "wav",
            "max_frames": 7, "min_frames": 7})
        assert speech.status_code == 200, speech.text
        with wave.open(io.BytesIO(speech.content)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (rate, 1, 2)
            pcm = w.readframes(w.getnframes())
        assert len(pcm) == 2 * 7 * spf  # 7 frames, every one decoded once (first chunk 2, then 3 and 2)
