"""The docs match the code: every command's `--help` works, every flag README.md and
docs/*.md name is a flag some pdunit command takes, every chart value they name is in
values.yaml, every `pdunit_*` metric they name is exported, and README's command table
lists every benchmark. Thirteen sessions renamed and removed flags; prose is where a
stale one would hide."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from pdunit.bench.main import BENCHES
from pdunit.cli import SUBCOMMANDS
from tests.charts.test_dashboard import exported_metric_names

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# Flags of other tools the docs show in their commands, and flags named as history.
NOT_PDUNITS = {
    "--set": "helm", "--create-namespace": "helm", "--name": "kind / k3d", "--rm": "docker",
    "--build-arg": "docker", "--no-deps": "pip", "--validate": "kubectl",
    "--copy-": "the proxy's --copy-* family, named as a prefix",
    "--start-steps": "performance.md's tried-and-removed row: built, measured, removed",
}
COMMANDS = [(name, module) for name, (module, _) in SUBCOMMANDS.items() if name != "bench"] + [
    (f"bench {name}", module) for name, (module, _) in BENCHES.items()
]


def _help(module: str) -> tuple[str, int | None]:
    out = io.StringIO()
    code: int | None = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            importlib.import_module(module).main(["--help"])
        except SystemExit as exc:
            code = int(exc.code or 0)
    return out.getvalue(), code


@cache
def all_flags() -> frozenset[str]:
    flags: set[str] = set()
    for _, module in COMMANDS:
        flags |= set(FLAG.findall(_help(module)[0]))
    return frozenset(flags)


@pytest.mark.parametrize(("name", "module"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_commands_help_prints_and_exits_0(name: str, module: str) -> None:
    """`pdunit decode --help` once crashed in argparse on a "%" in a flag's description."""
    text, code = _help(module)
    assert code == 0, f"pdunit {name} --help exited {code}"
    assert "usage:" in text and "--" in text, text[:300]


def _mentions(pattern: re.Pattern[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for token in pattern.findall(line):
                found.setdefault(token, []).append(f"{doc.relative_to(ROOT)}:{i}")
    return found


def test_every_flag_the_docs_name_is_a_flag_of_a_pdunit_command() -> None:
    unknown = {flag: where[:3] for flag, where in _mentions(FLAG).items()
               if flag not in all_flags() and flag not in NOT_PDUNITS}
    assert not unknown, f"docs name flags no pdunit command takes: {unknown}"


def test_the_flag_check_catches_a_stale_flag() -> None:
    assert "--decode-gemm" in all_flags() and "--decode-gemmm" not in all_flags()


VALUE = re.compile(r"`((?:examplePDUnitSet|podMonitor|prometheusRule|grafanaDashboard|keda|router|scaler|"
                   r"operator|images)\.[A-Za-z][\w.]*)")


def test_every_chart_value_the_docs_name_is_in_values_yaml() -> None:
    values = yaml.safe_load((ROOT / "charts" / "pdunit" / "values.yaml").read_text())

    def exists(path: str) -> bool:
        node = values
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    mentions = _mentions(VALUE)
    assert "podMonitor.enabled" in mentions  # the pattern sees the docs' values tables
    missing = {v: where[:3] for v, where in mentions.items()
               if not v.endswith((".md", ".py", ".yaml")) and not exists(v)}
    assert not missing, f"docs name chart values values.yaml does not have: {missing}"


def test_every_metric_the_docs_name_is_exported() -> None:
    exported = exported_metric_names()
    named = _mentions(re.compile(r"\b(pdunit_[a-z0-9_]+)"))
    missing = {m: where[:3] for m, where in named.items()
               if m not in exported and re.sub(r"_(total|bucket|count|sum)$", "", m) not in exported
               and not m.endswith("_") and m not in ("pdunit_dev_set", "pdunit_dev_unit")}  # labels (podTargetLabels)
    assert not missing, f"docs name metrics nothing exports: {missing}"


def test_readme_lists_every_command_and_benchmark() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = {line for line in readme.splitlines() if line.startswith("| `pdunit ")}
    bench_row = next(line for line in rows if line.startswith("| `pdunit bench"))
    missing = [b for b in BENCHES if f"`{b}`" not in bench_row]
    assert not missing, f"README's bench row leaves out {missing}"
    listed = " ".join(rows)
    missing_cmds = [c for c in SUBCOMMANDS if f"pdunit {c}" not in listed and f"`pdunit {c}`" not in listed]
    assert not missing_cmds, f"README's command table leaves out {missing_cmds}"


def test_docs_operator_lists_every_pdunit_spec_field() -> None:
    from pdunit.operator.models import PDUnitSpec

    text = (ROOT / "docs" / "operator.md").read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    missing = [f.alias for f in PDUnitSpec.model_fields.values() if f.alias and f"`{f.alias}" not in table]
    assert not missing, f"docs/operator.md's spec table leaves out {missing}"


def test_docs_operator_lists_every_alert_the_chart_ships() -> None:
    from pdunit.operator.alerts import ALERTS

    text = (ROOT / "docs" / "operator.md").read_text()
    missing = [a.name for a in ALERTS if f"`{a.name}`" not in text]
    assert not missing, f"docs/operator.md's Monitoring section leaves out {missing}"
