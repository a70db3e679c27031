"""The Helm chart: lint and template pass, RBAC is least-privilege, values are schema-checked."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.unit.charts import CHART, ROOT, operator_grants, render, run_helm


def test_helm_lint() -> None:
    proc = run_helm("lint", "--strict", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_template_renders_the_operator() -> None:
    kinds = {d["kind"] for d in render()}
    assert {
        "ClusterKopfPeering",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
        "ServiceAccount",
    } <= kinds
    assert not kinds & {"Role", "RoleBinding"}, "one cluster-wide role; PDClusters live in any namespace"


def test_deployment_shape() -> None:
    (dep,) = [d for d in render() if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert dep["spec"]["replicas"] == 2
    assert container["command"] == ["pdfabric-operator"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["PDFABRIC_PEERING"] == "pdfabric"
    assert pod["serviceAccountName"] == "pdfabric"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_rbac_is_least_privilege() -> None:
    grants = operator_grants()
    for (group, resource), verbs in grants.items():
        assert "*" not in verbs and group != "*" and resource != "*", (group, resource)
    # Secrets: the operator makes, replaces (a new pod's certificate) and removes its own; it never
    # reads the cluster's others in bulk.
    assert grants[("", "secrets")] == {"get", "create", "update", "delete"}
    assert grants[("networking.k8s.io", "networkpolicies")] == {"get", "create", "update", "delete"}
    assert grants[("policy", "poddisruptionbudgets")] == {"get", "create", "update", "delete"}
    assert grants[("", "pods")] == {
        "get",
        "list",
        "watch",
        "create",
        "delete",
        "patch",
    }  # patch: the rank-map and group annotations, the disruption-budget label
    assert grants[("", "nodes")] == {"get", "list", "watch"}
    assert grants[("apps", "deployments")] == {"get", "create", "update", "delete"}  # spec.router's
    assert grants[("pdfabric.dev", "pdclusters/status")] == {"get", "patch"}
    assert not any(verb in grants.get(("", "nodes"), set()) for verb in ("create", "update", "patch", "delete"))


def test_chart_crds_keep_on_uninstall() -> None:
    for path in (CHART / "crds").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


@pytest.mark.parametrize(
    "bad",
    [
        "replicaCount=-1",
        "image.pullPolicy=Sometimes",
        "operator.reconcileInterval=0",
        "metrics.port=70000",
        "bogus=1",
        "operator.peerCertificateValiditySeconds=30",
    ],
    ids=["negative-replicas", "bad-pull-policy", "zero-interval", "port-out-of-range", "unknown-key", "cert-too-short"],
)
def test_values_schema_rejects(bad: str) -> None:
    proc = run_helm("template", "pdfabric", str(CHART), "--set", bad)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr


def test_chart_env_is_valid_operator_config() -> None:
    from pdfabric_operator.config import OperatorConfig

    (dep,) = [d for d in render("--set", "operator.reconcileInterval=7") if d["kind"] == "Deployment"]
    env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
    cfg = OperatorConfig.from_env(env)
    assert (cfg.reconcile_interval, cfg.peering, cfg.metrics_port, cfg.watch_timeout) == (7.0, "pdfabric", 8080, 300)
    assert cfg.resync_interval == 300.0, "a settled cluster without engines reconciles every 5 minutes"
    assert 1 <= cfg.priority <= 2**30, "replicas draw a random peering priority"
    assert (cfg.network_policy, cfg.monitoring_namespace) == (True, "")
    assert cfg.peer_cert_validity.total_seconds() == 365 * 86400
    (short,) = [d for d in render("--set", "operator.peerCertificateValiditySeconds=3600") if d["kind"] == "Deployment"]
    short_env = {
        e["name"]: e["value"] for e in short["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e
    }
    assert OperatorConfig.from_env(short_env).peer_cert_validity.total_seconds() == 3600
    # The operator's own namespace from the downward API: the agents' NetworkPolicy admits it to /readyz.
    (ns,) = [e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == "PDFABRIC_NAMESPACE"]
    assert ns["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_agent_network_policy_values_reach_the_operator() -> None:
    from pdfabric_operator.config import OperatorConfig

    args = ("--set", "agentNetworkPolicy.enabled=false", "--set", "agentNetworkPolicy.monitoringNamespace=monitoring")
    (dep,) = [d for d in render(*args) if d["kind"] == "Deployment"]
    env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
    cfg = OperatorConfig.from_env(env)
    assert (cfg.network_policy, cfg.monitoring_namespace) == (False, "monitoring")
    proc = run_helm("template", "pdfabric", str(CHART), "--set", "agentNetworkPolicy.monitoringNamespace=Not_A_Name")
    assert proc.returncode != 0


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"PDFABRIC_RECONCILE_INTERVAL": "soon"}, "must be a number"),
        ({"PDFABRIC_RECONCILE_INTERVAL": "0"}, "at least 0.1"),
        ({"PDFABRIC_PRIORITY": "high"}, "must be an integer"),
        ({"PDFABRIC_METRICS_PORT": "-1"}, "at least 0"),
        ({"PDFABRIC_NETWORK_POLICY": "maybe"}, "true or false"),
        ({"PDFABRIC_MONITORING_NAMESPACE": "Monitoring"}, "a namespace name"),
        ({"PDFABRIC_PEER_CERT_VALIDITY_S": "59"}, "at least 60"),
    ],
    ids=[
        "interval-not-a-number",
        "interval-zero",
        "priority-not-an-integer",
        "negative-port",
        "network-policy-not-a-bool",
        "monitoring-namespace-not-a-name",
        "cert-validity-too-short",
    ],
)
def test_operator_config_rejects(env: dict[str, str], fragment: str) -> None:
    from pdfabric_operator.config import ConfigError, OperatorConfig

    with pytest.raises(ConfigError, match=fragment):
        OperatorConfig.from_env(env)


MONITORING = ("PrometheusRule", "PodMonitor")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), set()),
        (("--set", "metrics.prometheusRule.enabled=true"), {"PrometheusRule"}),
        (("--set", "metrics.podMonitor.enabled=true"), {"PodMonitor"}),
        (("--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.podMonitor.enabled=true"), set(MONITORING)),
    ],
    ids=["default-off", "rule-only", "podmonitor-only", "both"],
)
def test_monitoring_objects_are_switched(args: tuple[str, ...], expected: set[str]) -> None:
    docs = render(*args)
    assert {d["kind"] for d in docs} & set(MONITORING) == expected
    for d in docs:
        if d["kind"] in MONITORING:
            assert d["apiVersion"] == "monitoring.coreos.com/v1"
            assert d["metadata"]["namespace"] == "pdfabric-system"


def test_helm_lint_with_monitoring_on() -> None:
    sets = [
        "metrics.prometheusRule.enabled=true",
        "metrics.podMonitor.enabled=true",
        "metrics.serviceMonitor.enabled=true",
    ]
    proc = run_helm("lint", "--strict", str(CHART), *(a for s in sets for a in ("--set", s)))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_podmonitor_selects_the_agent_pods_the_operator_builds() -> None:
    from pdfabric_operator.builders.agent_pod import build_agent_pods
    from pdfabric_operator.builders.names import ClusterRef
    from pdfabric_operator.builders.router import build_router_deployment
    from pdfabric_operator.placement import Placement
    from pdfabric_operator.planner import plan_placement
    from tests.builders import gpu_node, pdcluster

    ref = ClusterRef("team-a", "pd", "uid-1")
    spec = pdcluster().engine().router().spec()
    placement = plan_placement(spec, [gpu_node("n1", 8, rdma=2)], [], cluster_uid=ref.uid)
    assert isinstance(placement, Placement)
    pod = build_agent_pods(ref, spec, placement)[0]
    router = build_router_deployment(ref, spec, placement)
    assert router is not None
    router_pod = router["spec"]["template"]
    (pm,) = [
        d
        for d in render("--set", "metrics.podMonitor.enabled=true", "--set", "metrics.podMonitor.labels.release=kps")
        if d["kind"] == "PodMonitor"
    ]

    def selects(labels: dict[str, str]) -> bool:
        sel = pm["spec"]["selector"]
        if not sel["matchLabels"].items() <= labels.items():
            return False
        assert all(e["operator"] == "In" for e in sel.get("matchExpressions", []))
        return all(labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", []))

    assert selects(pod["metadata"]["labels"]) and selects(router_pod["metadata"]["labels"])
    # Agents and routers only, not every pdfabric object.
    assert not selects({**pod["metadata"]["labels"], "app.kubernetes.io/component": "operator"})
    assert pm["spec"]["namespaceSelector"] == {"any": True}, "PDClusters live in any namespace"
    assert pm["metadata"]["labels"]["release"] == "kps"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    for scraped in (pod["spec"], router_pod["spec"]):
        port_names = {p["name"] for p in scraped["containers"][0]["ports"]}
        assert endpoint["port"] in port_names and endpoint["port"] == "metrics"
    assert endpoint["path"] == "/metrics"

    (scoped,) = [
        d
        for d in render("--set", "metrics.podMonitor.enabled=true", "--set", "metrics.podMonitor.namespaces={team-a}")
        if d["kind"] == "PodMonitor"
    ]
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


@pytest.mark.parametrize(
    "bad",
    [
        "metrics.prometheusRule.alerts.transferFailureRatio.threshold=2",
        "metrics.prometheusRule.alerts.agentNotReady.for=soon",
        "metrics.prometheusRule.alerts.apiRefusals.severity=page",
        "metrics.prometheusRule.alerts.bogus.for=5m",
    ],
    ids=["ratio-over-one", "bad-duration", "unknown-severity", "unknown-alert"],
)
def test_values_schema_rejects_bad_alert_thresholds(bad: str) -> None:
    proc = run_helm("template", "pdfabric", str(CHART), "--set", "metrics.prometheusRule.enabled=true", "--set", bad)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr


# (id, --set values, expected PodDisruptionBudget spec or None)
PDB_CASES: list[tuple[str, tuple[str, ...], dict[str, Any] | None]] = [
    ("default-max-unavailable-1", (), {"maxUnavailable": 1}),
    ("min-available-instead", ("podDisruptionBudget.minAvailable=1",), {"minAvailable": 1}),
    ("percentage", ("podDisruptionBudget.maxUnavailable=50%",), {"maxUnavailable": "50%"}),
    ("off", ("podDisruptionBudget.enabled=false",), None),
]


@pytest.mark.parametrize(("sets", "expected"), [c[1:] for c in PDB_CASES], ids=[c[0] for c in PDB_CASES])
def test_pod_disruption_budget_selects_the_operator_pods(
    sets: tuple[str, ...], expected: dict[str, Any] | None
) -> None:
    args = [a for s in sets for a in ("--set", s)]
    docs = render(*args)
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    if expected is None:
        assert pdbs == []
        return
    (pdb,) = pdbs
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert pdb["apiVersion"] == "policy/v1"
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == expected
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("bad", ["podDisruptionBudget.maxUnavailable=-1", "podDisruptionBudget.minAvailable=half"])
def test_values_schema_rejects_bad_budgets(bad: str) -> None:
    proc = run_helm("template", "pdfabric", str(CHART), "--set", bad)
    assert proc.returncode != 0 and "values don't meet the specifications of the schema" in proc.stderr


def test_notes_say_how_to_check_start_and_upgrade() -> None:
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert (
        "kubectl apply -f examples/pdcluster-tcp.yaml" in notes and (ROOT / "examples" / "pdcluster-tcp.yaml").exists()
    )
    assert "helm show crds" in notes and "docs/upgrade.md" in notes and (ROOT / "docs" / "upgrade.md").exists()
