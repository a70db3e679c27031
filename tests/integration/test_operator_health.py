"""The operator's liveness endpoint and Prometheus metrics, served by the real operator."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from pdfabric_devcluster.procs import free_port
from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import (
    apply_pdc,
    delete_all_pdclusters,
    running_operator,
    selector,
    wait_ready,
    wait_until,
)

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read().decode()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_liveness_and_metrics(cluster: Any, namespace: str, gpu_nodes: Any, operator_kubeconfig: Path) -> None:
    gpu_nodes("n", 1)
    health, metrics = free_port(), free_port()
    with running_operator(
        cluster,
        operator_kubeconfig,
        f"pdfabric-{namespace}",
        extra_env={"PDFABRIC_METRICS_PORT": str(metrics)},
        extra_args=(f"--liveness=http://127.0.0.1:{health}/healthz",),
    ):
        try:
            apply_pdc(cluster, pdcluster().placement(nodeSelector=selector(namespace)).manifest(), namespace)
            apply_pdc(
                cluster,
                pdcluster("toobig").prefill(tp=8).decode(tp=8).placement(nodeSelector=selector(namespace)).manifest(),
                namespace,
            )
            wait_ready(cluster, namespace, "pd")
            status, body = wait_until(lambda: _get(f"http://127.0.0.1:{health}/healthz"), timeout=30, what="liveness")
            assert status == 200
            assert json.loads(body)["clusters"] >= 2  # the probe counts the PDClusters being reconciled
            _, text = _get(f"http://127.0.0.1:{metrics}/metrics")
            assert _metric(text, 'pdfabric_operator_reconciles_total{result="ready"}') >= 1
            assert _metric(text, 'pdfabric_operator_placement_failures_total{reason="InsufficientGPUs"}') >= 1
            assert _metric(text, "pdfabric_operator_reconcile_duration_seconds_count") >= 2
            # Pre-created series: zero, not missing, before the first failure of that kind.
            assert _metric(text, 'pdfabric_operator_errors_total{type="api_server"}') == 0
            # The per-PDCluster gauges the operator alerts read (docs/alerts.md).
            pd = f'{{pdcluster="pd",pdcluster_namespace="{namespace}"}}'
            big = f'{{pdcluster="toobig",pdcluster_namespace="{namespace}"}}'
            assert (
                _metric(text, f"pdfabric_operator_pdcluster_ready{pd}"),
                _metric(text, f"pdfabric_operator_pdcluster_placed{pd}"),
            ) == (1, 1)
            assert (
                _metric(text, f"pdfabric_operator_pdcluster_ready{big}"),
                _metric(text, f"pdfabric_operator_pdcluster_placed{big}"),
            ) == (0, 0)
        finally:
            delete_all_pdclusters(cluster, namespace)
        # A deleted PDCluster's series go with it.
        _, text = _get(f"http://127.0.0.1:{metrics}/metrics")
        assert f'pdcluster_namespace="{namespace}"' not in text
