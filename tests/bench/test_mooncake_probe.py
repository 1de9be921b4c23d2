"""The Mooncake probe's parts that need no GPU and no Mooncake: the request layouts and
their copy plans, the bit-exact verdict D gives (through the same functions, on small
CPU pools), the transport read from the engine's log, and the probe run end to end on
a machine without Mooncake, which must write a result that says so instead of crashing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.bench import mooncake_probe as mp

SCRIPT = Path(mp.__file__).resolve()
SMALL = mp.Geometry(layers=3, kv_heads=2, head_dim=4, n_slots=64)


def _apply(geo: mp.Geometry, src: torch.Tensor, dst: torch.Tensor, segs: mp.Segments) -> None:
    """What the engine does with a plan: byte copies between the two pools."""
    sb, db = src.view(torch.uint8).view(-1), dst.view(torch.uint8).view(-1)
    for a, b, n in zip(segs.src.tolist(), segs.dst.tolist(), segs.length.tolist(), strict=True):
        db[b:b + n] = sb[a:a + n]


def _pools(geo: mp.Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.empty(geo.shape(), dtype=torch.bfloat16)
    dst = torch.empty(geo.shape(), dtype=torch.bfloat16)
    mp.fill_pattern(src, mp.SEED_SRC)
    mp.fill_pattern(dst, mp.SEED_DST)
    return src, dst


def test_layouts_give_distinct_slots_on_each_side_within_the_pool() -> None:
    for name, (s, t) in mp.request_layouts(2048, 8192).items():
        assert s.size == t.size == 2048, name
        assert np.unique(s).size == 2048 and np.unique(t).size == 2048, name
        assert 0 <= min(s.min(), t.min()) and max(s.max(), t.max()) < 8192, name


def test_contiguous_request_is_one_4_MiB_segment_per_layer_and_kv() -> None:
    geo = mp.Geometry()
    s, t = mp.request_layouts(2048, geo.n_slots)["contiguous"]
    segs = mp.plan_segments(geo, s, t)
    assert len(segs) == 72
    assert set(segs.length.tolist()) == {2048 * 2048}
    assert segs.total_bytes == 2048 * 144 * 1024
    plane_bytes = geo.n_slots * geo.row_bytes
    assert segs.src.tolist() == [p * plane_bytes + int(s[0]) * geo.row_bytes for p in range(72)]
    assert segs.dst.tolist() == [p * plane_bytes + int(t[0]) * geo.row_bytes for p in range(72)]


def test_fragmented_request_is_one_2_KiB_copy_per_row() -> None:
    geo = mp.Geometry()
    s, t = mp.request_layouts(2048, geo.n_slots)["fragmented"]
    segs = mp.plan_segments(geo, s, t)
    # Merges need both sides consecutive; this seed's permutations have none.
    assert len(segs) == 147_456
    assert set(segs.length.tolist()) == {2048}
    assert np.unique(segs.dst).size == 147_456


def test_only_runs_consecutive_on_both_sides_coalesce() -> None:
    geo = mp.Geometry(layers=1, kv_heads=1, head_dim=1, n_slots=32)
    # 3,4,5 -> 10,11,12 is one run; 6 -> 20 breaks on the destination side; 9 -> 21
    # breaks on the source side.
    segs = mp.plan_segments(geo, np.array([3, 4, 5, 6, 9]), np.array([10, 11, 12, 20, 21]))
    row = geo.row_bytes
    assert segs.length.tolist() == [3 * row, row, row] * 2
    assert segs.src.tolist()[:3] == [3 * row, 6 * row, 9 * row]
    assert segs.dst.tolist()[3:] == [(32 + 10) * row, (32 + 20) * row, (32 + 21) * row]


def test_repeated_or_out_of_range_slots_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="dst_slots has repeated slots"):
        mp.plan_segments(SMALL, np.array([1, 2]), np.array([5, 5]))
    with pytest.raises(ValueError, match=r"src_slots out of range \[0, 64\)"):
        mp.plan_segments(SMALL, np.array([64]), np.array([0]))
    with pytest.raises(ValueError, match="n_slots >= 2\\*tokens"):
        mp.request_layouts(40, 64)


@pytest.mark.parametrize("layout", ["contiguous", "fragmented"])
def test_a_correctly_applied_plan_passes_verification(layout: str) -> None:
    s, t = mp.request_layouts(16, SMALL.n_slots)[layout]
    src, dst = _pools(SMALL)
    _apply(SMALL, src, dst, mp.plan_segments(SMALL, s, t))
    verdict = mp.check_rows(dst, SMALL, s, t)
    assert verdict == {"ok": True, "rows_checked": 16 * SMALL.planes, "bad_rows": 0,
                       "clobbered_rows": 0, "first_mismatch": None}


def test_page_fields_describe_the_same_copies_as_the_row_plan() -> None:
    s, t = mp.request_layouts(16, SMALL.n_slots)["fragmented"]
    fields = mp.page_fields(SMALL, 1000, 5000)
    # page i of field f: src_base + src_pages[i]*stride -> dst_base + dst_pages[i]*stride
    pages = {(int(f[0] + si * f[1]) - 1000, int(f[2] + ti * f[3]) - 5000, int(f[4]))
             for f in fields for si, ti in zip(s, t, strict=True)}
    segs = mp.plan_segments(SMALL, s, t, coalesce=False)
    assert pages == set(zip(segs.src.tolist(), segs.dst.tolist(), segs.length.tolist(), strict=True))


def test_verification_rejects_one_corrupted_destination_row() -> None:
    s, t = mp.request_layouts(16, SMALL.n_slots)["fragmented"]
    src, dst = _pools(SMALL)
    _apply(SMALL, src, dst, mp.plan_segments(SMALL, s, t))
    dst.view(torch.int16)[2, 1, int(t[5]), 1, 3] ^= 1  # one bit of one element
    verdict = mp.check_rows(dst, SMALL, s, t)
    assert not verdict["ok"]
    assert (verdict["bad_rows"], verdict["clobbered_rows"]) == (1, 0)
    assert verdict["first_mismatch"] == {"layer": 2, "kv": 1, "slot": int(t[5])}


def test_verification_rejects_a_clobbered_row_outside_the_destination() -> None:
    s, t = mp.request_layouts(16, SMALL.n_slots)["contiguous"]
    src, dst = _pools(SMALL)
    _apply(SMALL, src, dst, mp.plan_segments(SMALL, s, t))
    outside = next(x for x in range(SMALL.n_slots) if x not in set(t.tolist()))
    dst[0, 0, outside] = src[0, 0, outside]
    verdict = mp.check_rows(dst, SMALL, s, t)
    assert not verdict["ok"]
    assert (verdict["bad_rows"], verdict["clobbered_rows"]) == (0, 1)


def test_verification_rejects_a_transfer_that_wrote_nothing() -> None:
    s, t = mp.request_layouts(16, SMALL.n_slots)["contiguous"]
    _, dst = _pools(SMALL)
    verdict = mp.check_rows(dst, SMALL, s, t)
    assert verdict["bad_rows"] == 16 * SMALL.planes and not verdict["ok"]


def test_flat_write_verification_bounds_the_written_prefix() -> None:
    src, dst = _pools(SMALL)
    n = 10 * SMALL.row_bytes
    dst.view(torch.uint8).view(-1)[:n] = src.view(torch.uint8).view(-1)[:n]
    assert mp.check_flat(dst, SMALL, n)["ok"]
    short = mp.check_flat(dst, SMALL, n + SMALL.row_bytes)
    assert (short["ok"], short["bad_rows"], short["clobbered_rows"]) == (False, 1, 0)
    over = mp.check_flat(dst, SMALL, n - SMALL.row_bytes)
    assert (over["ok"], over["bad_rows"], over["clobbered_rows"]) == (False, 0, 1)


def test_installed_transport_is_read_from_the_engines_log_not_assumed() -> None:
    log = ("I1129 transfer_engine_impl.cpp:120] Topology discovery complete. Found 0 HCAs.\n"
           "W1129 transfer_engine_impl.cpp:140] NVLink transport was requested but is not compiled in, "
           "falling back to RDMA/TCP\n"
           "I1129 transfer_engine_impl.cpp:180] Using TCP transport (no HCA detected)\n")
    assert mp.installed_transport(log) == "tcp"
    assert mp.installed_transport("I1129 x] Using Intra-Node NVLink transport (MC_INTRANODE_NVLINK set)") \
        == "nvlink_intra"
    assert mp.installed_transport("I1129 x] Using TCP transport for RPC communication") is None


def test_probe_without_mooncake_writes_the_import_error_for_every_protocol(tmp_path: Path) -> None:
    out = tmp_path / "mooncake.json"
    # A mooncake package whose engine cannot load, as on a host without libibverbs.
    fake = tmp_path / "site" / "mooncake"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "engine.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file: No such file or directory')\n")
    env = {"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True,
                         text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    want = "ImportError: libibverbs.so.1: cannot open shared object file: No such file or directory"
    assert res["mooncake"]["ok"] is False and res["mooncake"]["error"] == want
    assert set(res["protocols"]) == set(mp.PROTOCOLS)
    for rec in res["protocols"].values():
        assert (rec["ok"], rec["stage"], rec["error"]) == (False, "import", want)
    assert "import FAILED" in run.stdout


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is not None, reason="mooncake is installed here")
def test_probe_with_no_mooncake_package_says_module_not_found(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--protocols", "tcp"],
                         capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    rec = json.loads(out.read_text())["protocols"]["tcp"]
    assert rec["stage"] == "import" and rec["error"] == "ModuleNotFoundError: No module named 'mooncake'"


class _FakeEngineModule:
    """Stands in for mooncake.engine: initialize writes what the real engine logs."""

    def __init__(self, log: Path, lines: str, rc: int) -> None:
        outer = self
        self.log, self.lines, self.rc = log, lines, rc

        class TransferEngine:
            def initialize(self, *args: str) -> int:
                with open(outer.log, "a") as f:
                    f.write(outer.lines)
                return outer.rc

        self.TransferEngine = TransferEngine


def test_a_transport_other_than_the_one_asked_for_is_a_failed_initialize(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    fake = _FakeEngineModule(log, "W1129 x] NVLink transport was requested but is not compiled in\n"
                                  "I1129 x] Using TCP transport (no HCA detected)\n", 0)
    with pytest.raises(mp._StageError, match="asked for transport 'nvlink' but the engine installed 'tcp'") as e:
        mp._new_engine(fake, "nvlink", log)
    assert e.value.stage == "initialize"


def test_a_refused_initialize_carries_the_engines_own_error_line(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    log.write_text("I1129 earlier] unrelated\nE1129 earlier] an older error\n")
    fake = _FakeEngineModule(log, "E1129 transfer_engine_py.cpp:246] Protocol 'nvlink' requires -DUSE_MNNVL=ON\n", -1)
    with pytest.raises(mp._StageError) as e:
        mp._new_engine(fake, "nvlink", log)
    assert e.value.error.endswith("returned -1; the engine logged: "
                                  "E1129 transfer_engine_py.cpp:246] Protocol 'nvlink' requires -DUSE_MNNVL=ON")


def test_each_attempt_starts_from_only_its_own_selector_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine tests presence, so an inherited MC_INTRANODE_NVLINK=0 would still select.
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "0")
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "7")
    args = mp._parser().parse_args(["--out", "x.json"])
    env = mp._child_env("tcp", args)
    assert "MC_INTRANODE_NVLINK" not in env and "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER" not in env
    assert env["MC_FORCE_TCP"] == "1"
    tuned = mp._child_env("tcp_tuned", args)
    assert tuned["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "65535"
    assert mp._child_env("nvlink_intra", args)["MC_INTRANODE_NVLINK"] == "1"


class _CopyEngine:
    """A TransferEngine that really copies, between two CPU pools at pretend addresses."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, log: Path, *, rc: int = 0, flip: bool = False) -> None:
        self.sb, self.db = src.view(torch.uint8).view(-1), dst.view(torch.uint8).view(-1)
        self.log, self.rc, self.flip = log, rc, flip

    def _copy(self, s: int, d: int, n: int) -> None:
        self.db[d - DST_BASE:d - DST_BASE + n] = self.sb[s - SRC_BASE:s - SRC_BASE + n]

    def _done(self) -> int:
        if self.flip:  # a wrong byte in the first destination row
            self.db[int(self.last_dst) - DST_BASE] ^= 0xFF
        if self.rc:
            with open(self.log, "a") as f:
                f.write("W1129 lane.h:1] TCP lane queue-full rejection count: 8192\n")
        return self.rc

    def transfer_sync_write(self, target: str, s: int, d: int, n: int) -> int:
        self.last_dst = d
        self._copy(s, d, n)
        return self._done()

    def batch_transfer_sync_write_arrays(self, target: str, s: np.ndarray, d: np.ndarray, n: np.ndarray) -> int:
        self.last_dst = int(d[0])
        for a, b, k in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
            self._copy(a, b, k)
        return self._done()

    def batch_transfer_sync_write_pages(self, target: str, sp: np.ndarray, dp: np.ndarray, f: np.ndarray) -> int:
        self.last_dst = int(f[0, 2] + dp[0] * f[0, 3])
        for row in f.tolist():
            for i, j in zip(sp.tolist(), dp.tolist(), strict=True):
                self._copy(row[0] + i * row[1], row[2] + j * row[3], row[4])
        return self._done()


class _LocalTarget:
    """D's side of the control channel, answering from the same functions D uses."""

    def __init__(self, dst: torch.Tensor, geo: mp.Geometry) -> None:
        self.dst, self.geo = dst, geo

    def call(self, timeout: float, **cmd: object) -> dict[str, object]:
        if cmd["op"] == "reset":
            mp.fill_pattern(self.dst, mp.SEED_DST)
            return {"ok": True}
        if "flat_bytes" in cmd:
            return mp.check_flat(self.dst, self.geo, int(cmd["flat_bytes"]))  # type: ignore[call-overload]
        return mp.check_rows(self.dst, self.geo, cmd["src_slots"], cmd["dst_slots"])


SRC_BASE, DST_BASE = 1 << 40, 3 << 40


def _runner(tmp_path: Path, **engine: object) -> mp._CaseRunner:
    src, dst = _pools(SMALL)
    log = tmp_path / "p.log"
    log.write_text("")
    args = mp._parser().parse_args(["--out", "x", "--tokens", "16", "--iters", "2", "--min-case-s", "1",
                                    "--pool-slots", "64"])
    args.deadline, args.log = time.time() + 120, str(log)
    te = _CopyEngine(src, dst, log, **engine)  # type: ignore[arg-type]
    return mp._CaseRunner(args, SMALL, te, _LocalTarget(dst, SMALL),  # type: ignore[arg-type]
                          {"segment": "127.0.0.1:1", "base": DST_BASE}, SRC_BASE, lambda: None)


@pytest.mark.parametrize("case", mp.CASES)
def test_every_case_of_a_correct_engine_is_timed_and_verified(tmp_path: Path, case: str) -> None:
    res = _runner(tmp_path).run(case)
    assert res["ok"] and res["verified"], res
    assert res["bytes"] == 16 * SMALL.token_bytes and res["iters"] == 2 and len(res["times_ms"]) == 2
    assert res["verify_after_warmup"]["ok"] and res["verify_after_timing"]["ok"]


@pytest.mark.parametrize("case", mp.CASES)
def test_an_engine_that_writes_a_wrong_byte_is_never_a_success(tmp_path: Path, case: str) -> None:
    res = _runner(tmp_path, flip=True).run(case)
    assert not res["ok"] and "median_ms" not in res
    assert res["stage"] == "verify" and "'bad_rows': 1" in res["error"]


def test_a_refused_batch_is_a_transfer_failure_with_the_engines_reason(tmp_path: Path) -> None:
    res = _runner(tmp_path, rc=-1).run("fragmented")
    assert not res["ok"] and res["stage"] == "transfer"
    assert res["error"].startswith(
        f"batch_transfer_sync_write_arrays on the warm-up call ({16 * SMALL.planes} copies, ")
    assert "returned -1" in res["error"] and "queue-full rejection count: 8192" in res["error"]
