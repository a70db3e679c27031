"""An operator killed in the middle of a reconcile, and a second replica, never duplicate anything."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdfabric_operator import reconcile
from pdfabric_operator.kube import Kube
from pdfabric_operator.operator_state import STATE
from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import (
    agent_pods,
    apply_pdc,
    children,
    delete_all_pdclusters,
    is_ready,
    running_operator,
    selector,
    wait_ready,
    wait_until,
)

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes


def test_restart_mid_reconcile_converges_without_duplicates(
    cluster: Any, namespace: str, gpu_nodes: Any, operator_kubeconfig: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_nodes("n", 4)
    # "Killing" the in-process operator: its API client fails every later request, as a dead
    # process would make none (its worker thread may still be mid-reconcile when the runner stops).
    killed: dict[str, Kube] = {}
    real_request, real_create = Kube.request, Kube.create

    def request(self: Kube, *args: Any, **kwargs: Any) -> Any:
        if killed.get("kube") is self:
            raise RuntimeError("operator process killed")
        return real_request(self, *args, **kwargs)

    def slow_create(self: Kube, obj: dict[str, Any]) -> bool:
        created = real_create(self, obj)
        if obj["kind"] == "Pod" and not killed:
            time.sleep(0.7)  # leaves time to kill the first operator between two pods
        return created

    monkeypatch.setattr(Kube, "request", request)
    monkeypatch.setattr(Kube, "create", slow_create)
    # One pod at a time, so the kill lands between two of them (8 in flight would make all four
    # before the first sleep ends).
    monkeypatch.setattr(reconcile, "CREATE_CONCURRENCY", 1)
    spec = pdcluster().prefill(replicas=2, tp=8).decode(replicas=2, tp=8).placement(nodeSelector=selector(namespace))
    peering = f"pdfabric-{namespace}"
    with running_operator(cluster, operator_kubeconfig, peering):
        apply_pdc(cluster, spec.manifest(), namespace)
        wait_until(lambda: len(agent_pods(cluster, namespace, "pd")) >= 1, timeout=30, what="a first agent pod")
        assert STATE.kube is not None
        killed["kube"] = STATE.kube
    partial = agent_pods(cluster, namespace, "pd")
    assert 1 <= len(partial) < 4, "the operator must have stopped mid-reconcile"
    assert not is_ready(cluster, namespace, "pd")
    token = cluster.get_json("secret", "pd-engine-token", "-n", namespace)["data"]["token"]
    certs = {p["metadata"]["name"]: _cert(cluster, namespace, p["metadata"]["name"]) for p in partial}

    with running_operator(cluster, operator_kubeconfig, peering):
        try:
            _check_converged(cluster, namespace, partial, token)
            # Pods that survived the restart keep their certificates: nothing is re-issued.
            assert {name: _cert(cluster, namespace, name) for name in certs} == certs
        finally:
            delete_all_pdclusters(cluster, namespace)


def _cert(cluster: Any, namespace: str, agent: str) -> str:
    return str(cluster.get_json("secret", f"{agent}-peer-tls", "-n", namespace)["data"]["tls.crt"])


def _check_converged(cluster: Any, namespace: str, partial: list[dict[str, Any]], token: str) -> None:
    wait_ready(cluster, namespace, "pd")
    pods = agent_pods(cluster, namespace, "pd")
    assert len(pods) == 4
    assert len({p["spec"]["nodeName"] for p in pods}) == 4
    assert {p["metadata"]["name"] for p in partial} <= {p["metadata"]["name"] for p in pods}
    kids = children(cluster, namespace, "pd")
    # Engine token, peer CA, one certificate per agent pod.
    assert (len(kids["configmaps"]), len(kids["services"]), len(kids["secrets"])) == (1, 1, 2 + len(pods))
    # The restarted operator kept the existing token: agents and engines stay paired.
    assert cluster.get_json("secret", "pd-engine-token", "-n", namespace)["data"]["token"] == token


def test_two_replicas_only_one_acts_and_the_other_takes_over(
    cluster: Any,
    namespace: str,
    gpu_nodes: Any,
    operator_kubeconfig: Path,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    gpu_nodes("n", 3)
    peering = f"pdfabric-{namespace}"
    sel = selector(namespace)
    lifetime = {"PDFABRIC_PEERING_LIFETIME": "4"}
    log_path = tmp_path / "leader.log"
    # The in-process replica's log is read live through caplog (the runner's output only at exit).
    with (
        running_operator(cluster, operator_kubeconfig, peering, priority=10, extra_env=lifetime),
        open(log_path, "w") as log,
    ):
        wait_until(
            lambda: "Resuming operations" in caplog.text or "Keep-alive" in caplog.text, timeout=30, what="standby up"
        )
        leader = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "-A", "-m", "pdfabric_operator.main"],
            env=h.operator_subprocess_env(operator_kubeconfig, peering, PDFABRIC_PRIORITY="1000", **lifetime),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(lambda: "Pausing operations in favour of" in caplog.text, timeout=30, what="standby pauses")
            apply_pdc(cluster, pdcluster("a").placement(nodeSelector=sel).manifest(), namespace)
            wait_ready(cluster, namespace, "a")
            # kopf tags object log records with k8s_ref; other namespaces' leftovers are not ours.
            acted = [
                r.getMessage()
                for r in caplog.records
                if "reconciled" in r.getMessage() and (getattr(r, "k8s_ref", None) or {}).get("namespace") == namespace
            ]
            assert not acted, f"the paused replica acted: {acted}"
            resumed_before = caplog.text.count("Resuming operations after the pause")
        finally:
            leader.kill()  # SIGKILL: no goodbye in the peering object, the lifetime must expire
            leader.wait(timeout=30)
        assert "create pod" in log_path.read_text()
        # The standby resumes once the dead leader's lifetime has passed, and acts on new work.
        apply_pdc(cluster, pdcluster("b").placement(nodeSelector=sel).manifest(), namespace)
        wait_ready(cluster, namespace, "b", timeout=60)
        assert caplog.text.count("Resuming operations after the pause") > resumed_before
        # Cluster a kept exactly its pods (a pod per replica) through the takeover: none doubled.
        assert sorted(h.pods_by_unit(cluster, namespace, "a")) == ["decode-0", "prefill-0"]
        h.assert_no_duplicates(cluster, namespace, "a")
        delete_all_pdclusters(cluster, namespace)
