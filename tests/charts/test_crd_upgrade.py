"""CRDs that upgrade (issue 27.4): charts/pdunit-crds ships the CRDs as templates, so
`helm upgrade` changes the cluster's CRDs (a chart's crds/ folder is installed once and
never upgraded), `helm uninstall` keeps them (`helm.sh/resource-policy: keep`), and the
pdunit chart installs on top of them (its crds/ step skips CRDs that exist)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.charts.test_helm_chart import CHART, helm, kube_version
from tests.operator.envtest import REPO, Api, ControlPlane, ensure_assets, wait_for

CRD_CHART = REPO / "charts" / "pdunit-crds"
UNITS_CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pdunits.pdunit.dev"


def test_crd_chart_templates_are_exact_copies_of_the_generated_crds() -> None:
    generated = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert sorted(p.name for p in (CRD_CHART / "templates").glob("*.yaml")) == generated
    for name in generated:
        text = (CRD_CHART / "templates" / name).read_text()
        assert text == (REPO / "crds" / name).read_text(), f"run make crds ({name} is stale)"
        annotations = yaml.safe_load(text)["metadata"]["annotations"]
        assert annotations["helm.sh/resource-policy"] == "keep", name


def test_crd_chart_lints_and_renders_both_crds() -> None:
    lint = subprocess.run([helm(), "lint", str(CRD_CHART), "--strict"], capture_output=True,
                          text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    out = subprocess.run([helm(), "template", "crds", str(CRD_CHART), "--kube-version",
                          kube_version()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kinds = {d["spec"]["names"]["kind"] for d in yaml.safe_load_all(out.stdout) if d}
    assert kinds == {"PDUnit", "PDUnitSet"}


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, Api]]:
    assets, why = ensure_assets()
    if assets is None:
        pytest.skip(f"no envtest binaries and they cannot be built here: {why}")
    cp = ControlPlane(assets=assets, workdir=tmp_path_factory.mktemp("crd-upgrade"))
    api = None
    try:
        cp.start()
        api = Api(cp.server, cp.token)
        yield cp, api
    finally:
        if api is not None:
            api.close()
        cp.stop()


def _helm(cp: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([helm(), *args, "--kubeconfig", str(cp.kubeconfig)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"helm {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out


def _columns(api: Api) -> list[str]:
    crd: dict[str, Any] = api.get(UNITS_CRD) or {}
    return [c["name"] for c in crd["spec"]["versions"][0].get("additionalPrinterColumns") or []]


def test_helm_upgrade_of_the_crd_chart_changes_the_clusters_crd(
    plane: tuple[ControlPlane, Api], tmp_path: Path
) -> None:
    cp, api = plane
    # from a cluster without the CRDs: the module's other test leaves them owned by its
    # own release (seen in a random-order run), which this install could not adopt
    cp.kubectl("delete", "crd", "pdunits.pdunit.dev", "pdunitsets.pdunit.dev", "--ignore-not-found")
    wait_for(lambda: api.get(UNITS_CRD) is None, 60, "the CRDs to be deleted")
    chart = tmp_path / "pdunit-crds"
    shutil.copytree(CRD_CHART, chart)
    _helm(cp, "install", "crds", str(chart))
    assert "Node" in _columns(api) and "Zone" not in _columns(api)

    # The next release of the chart: a changed CRD (a new printer column), a new version.
    path = chart / "templates" / "pdunit.dev_pdunits.yaml"
    crd = yaml.safe_load(path.read_text())
    crd["spec"]["versions"][0]["additionalPrinterColumns"].insert(
        0, {"name": "Zone", "type": "string", "jsonPath": ".status.nodeName"}
    )
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"] = "0.1.1"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    _helm(cp, "upgrade", "crds", str(chart))
    wait_for(lambda: "Zone" in _columns(api), 30, "the upgraded CRD's new column")

    # The pdunit chart installs on top (its crds/ step skips the existing CRDs) and does
    # not take them over: the CRD release still owns them.
    _helm(cp, "install", "rel", str(CHART), "--namespace", "tts", "--create-namespace",
          "--set", "examplePDUnitSet.enabled=true", "--set", "examplePDUnitSet.device=cpu",
          "--set", "examplePDUnitSet.transfer=host")
    assert api.get("/apis/pdunit.dev/v1alpha1/namespaces/tts/pdunitsets/tts") is not None
    owner = (api.get(UNITS_CRD) or {})["metadata"]["annotations"]["meta.helm.sh/release-name"]
    assert owner == "crds"

    # Uninstalling the CRD release keeps the CRDs and so every PDUnitSet.
    _helm(cp, "uninstall", "crds")
    assert api.get(UNITS_CRD) is not None
    assert api.get("/apis/pdunit.dev/v1alpha1/namespaces/tts/pdunitsets/tts") is not None


def test_crds_no_release_owns_are_adopted_once_they_carry_the_releases_ownership(
    plane: tuple[ControlPlane, Api],
) -> None:
    """The docs' path from CRDs that came from a crds/ folder (kubectl or charts/pdunit)."""
    cp, api = plane
    cp.kubectl("delete", "crd", "pdunits.pdunit.dev", "pdunitsets.pdunit.dev", "--ignore-not-found")
    wait_for(lambda: api.get(UNITS_CRD) is None, 60, "the CRDs to be deleted")
    cp.kubectl("create", "-f", str(REPO / "crds"))
    refused = subprocess.run([helm(), "install", "pdunit-crds", str(CRD_CHART), "--kubeconfig",
                              str(cp.kubeconfig)], capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0 and "invalid ownership metadata" in refused.stderr, refused.stderr
    for crd in ("crd/pdunits.pdunit.dev", "crd/pdunitsets.pdunit.dev"):
        cp.kubectl("label", crd, "app.kubernetes.io/managed-by=Helm")
        cp.kubectl("annotate", crd, "meta.helm.sh/release-name=pdunit-crds",
                   "meta.helm.sh/release-namespace=default")
    _helm(cp, "install", "pdunit-crds", str(CRD_CHART))
    assert (api.get(UNITS_CRD) or {})["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
