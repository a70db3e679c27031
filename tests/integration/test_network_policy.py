"""The agents' NetworkPolicy follows the operator's settings (chart values agentNetworkPolicy.*):
built by default, narrowed to the monitoring namespace, deleted when turned off, as the chart's
ServiceAccount (its RBAC holds the update and delete this needs)."""

from __future__ import annotations

import json
from typing import Any

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes


def _policy(cluster: Any, namespace: str) -> dict[str, Any] | None:
    found = cluster.kubectl("get", "networkpolicy", "pd-agents", "-n", namespace, "-o", "json", check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def _metrics_rule(cluster: Any, namespace: str) -> dict[str, Any] | None:
    policy = _policy(cluster, namespace)
    return policy["spec"]["ingress"][1] if policy else None


def test_network_policy_follows_the_operator_settings(
    cluster: Any, namespace: str, operator_kubeconfig: Any, gpu_nodes: Any
) -> None:
    gpu_nodes("np", 1)
    builder = pdcluster().prefill(tp=4).decode(tp=4).placement(nodeSelector=h.selector(namespace))
    peering = f"pdfabric-{namespace}"
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    try:
        with h.running_operator(cluster, operator_kubeconfig, peering):
            h.apply_pdc(cluster, builder.manifest(), namespace)
            h.wait_ready(cluster, namespace, "pd")
            # Default: only the cluster's agents reach the agents; the metrics port from anywhere.
            rule = h.wait_until(lambda: _metrics_rule(cluster, namespace), timeout=30, what="the NetworkPolicy")
            assert rule == {"ports": [{"protocol": "TCP", "port": 9400}]}
        with h.running_operator(
            cluster, operator_kubeconfig, peering, extra_env={"PDFABRIC_MONITORING_NAMESPACE": "monitoring"}
        ):
            h.wait_until(
                lambda: (_metrics_rule(cluster, namespace) or {}).get("from") == [monitoring],
                timeout=30,
                what="the metrics rule narrowed to the monitoring namespace",
            )
        with h.running_operator(cluster, operator_kubeconfig, peering, extra_env={"PDFABRIC_NETWORK_POLICY": "false"}):
            h.wait_until(lambda: _policy(cluster, namespace) is None, timeout=30, what="the NetworkPolicy deleted")
            h.delete_all_pdclusters(cluster, namespace)  # the finalizer needs the operator
    finally:
        if cluster.get_json("pdclusters", "-n", namespace)["items"]:
            with h.running_operator(cluster, operator_kubeconfig, peering):
                h.delete_all_pdclusters(cluster, namespace)
