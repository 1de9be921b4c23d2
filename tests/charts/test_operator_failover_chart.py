"""The chart's failover pieces (issue 27.6): two operator replicas under one Lease, the
Lease's RBAC and nothing more, PodDisruptionBudgets that select the pods they guard, and
a refusal of two replicas without leader election."""

from __future__ import annotations

from typing import Any

from pdunit.engine.settings import parse_config
from pdunit.operator.config import OperatorConfig
from tests.charts.test_helm_chart import CHART, NAMESPACE, by_kind, one, render, run_helm


def _operator(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", "rel-pdunit-operator")


def test_two_operator_replicas_elect_a_leader_on_a_lease_in_the_release_namespace() -> None:
    docs = render([])
    deploy = _operator(docs)
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    cfg = parse_config(OperatorConfig, args[1:], "pdunit operator", env={})
    assert cfg.leader_election
    assert (cfg.lease_namespace, cfg.lease_name) == (NAMESPACE, "rel-pdunit-operator")
    assert cfg.lease_retry_seconds < cfg.renew_deadline_seconds < cfg.lease_seconds
    anti = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]


def test_the_lease_role_grants_only_the_operators_own_lease() -> None:
    docs = render([])
    role = one(docs, "Role", "rel-pdunit-operator-leader-election")
    assert role["metadata"]["namespace"] == NAMESPACE
    rules = {
        (tuple(r.get("resourceNames") or ()), verb)
        for r in role["rules"]
        for verb in r["verbs"]
        if r["apiGroups"] == ["coordination.k8s.io"] and r["resources"] == ["leases"]
    }
    assert rules == {((), "create"), (("rel-pdunit-operator",), "get"), (("rel-pdunit-operator",), "update")}
    assert len(role["rules"]) == 2
    binding = one(docs, "RoleBinding", "rel-pdunit-operator-leader-election")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == "rel-pdunit-operator"


def test_pod_disruption_budgets_select_the_operator_and_router_pods() -> None:
    docs = render([])
    pdbs = {p["metadata"]["name"]: p for p in by_kind(docs, "PodDisruptionBudget")}
    assert set(pdbs) == {"rel-pdunit-operator", "rel-pdunit-router"}
    for name, pdb in pdbs.items():
        deploy = one(docs, "Deployment", name)
        labels = deploy["spec"]["template"]["metadata"]["labels"]
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), name
        # Selects only that Deployment's pods: the other one's labels do not match.
        other = one(docs, "Deployment", ({*pdbs} - {name}).pop())
        assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items()
        assert pdb["spec"]["maxUnavailable"] == 1 < deploy["spec"]["replicas"]


def test_one_replica_has_no_budget_and_runs_without_a_lease() -> None:
    docs = render(["--set", "operator.replicas=1", "--set", "operator.leaderElection=false",
                   "--set", "router.replicas=1"])
    assert by_kind(docs, "PodDisruptionBudget") == []
    assert not [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    deploy = _operator(docs)
    assert deploy["spec"]["strategy"]["type"] == "Recreate"
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not parse_config(OperatorConfig, args[1:], "pdunit operator", env={}).leader_election


def test_two_replicas_without_leader_election_are_refused() -> None:
    out = run_helm("template", "rel", str(CHART), "--namespace", NAMESPACE,
                   "--set", "operator.leaderElection=false")
    assert out.returncode != 0
    assert "operator.replicas > 1 needs operator.leaderElection: true" in out.stderr
