"""The whole fabric: kubectl apply of a PDCluster -> the operator places agents on fake GPU nodes ->
the agent pods' real command runs as local processes -> real bytes over the real Mooncake engine
(tcp on loopback) -> a real Prometheus scrapes the agents -> every shipped dashboard query runs
against it and the byte counters equal the bytes the synthetic engine verified on arrival."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gen_dashboards
from pdfabric_devcluster.fabric import Fabric
from pdfabric_devcluster.podrunner import PodRunner
from pdfabric_devcluster.prometheus import Prometheus
from pdfabric_devcluster.synthetic import expected_bytes
from pdfabric_devcluster.transfer import transfer_room
from tests.builders import SMALL_MODEL, pdcluster
from tests.integration import pdcluster_harness as h

operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path / "prometheus").start()
    yield prom
    prom.stop()


@pytest.fixture
def runner(cluster: Any, namespace: str, tmp_path: Path) -> Iterator[PodRunner]:
    pods = PodRunner(cluster, namespace, "app.kubernetes.io/component=agent", tmp_path / "pods")
    yield pods
    pods.stop()


def dashboard_query(expr: str, cluster_name: str, namespace: str) -> str:
    return gen_dashboards.concrete(expr, pdcluster=cluster_name, namespace=namespace)


@pytest.mark.slow
def test_apply_place_transfer_scrape(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any, runner: PodRunner, prometheus: Prometheus
) -> None:
    gpu_nodes("fab", 2)
    builder = (
        pdcluster()
        .transport("tcp")
        .prefill(tp=2, cp=2, allCpRanksTransfer=True)
        .decode(tp=4)
        .model(**SMALL_MODEL)
        .transfer(timeoutSeconds=10)
        .placement(nodeSelector=h.selector(namespace))
    )
    h.apply_pdc(cluster, builder.manifest(), namespace)
    h.wait_ready(cluster, namespace, "pd")

    pods = runner.sync()
    assert len(pods) >= 1
    h.wait_until(
        lambda: all(p.ready() for p in pods.values()),
        timeout=90,
        what="every agent process ready (engines up, pools registered)",
    )
    # the target labels a PodMonitor gives (the dashboards' namespace variable reads them)
    prometheus.set_targets(
        [(f"127.0.0.1:{p.metrics_port}", {"pod": n, "namespace": namespace}) for n, p in pods.items()]
    )
    prometheus.wait_targets_up()

    fabric = Fabric.from_cluster(cluster, namespace, "pd", runner)
    spec = fabric.spec
    want = expected_bytes(spec, pages=9, state_slots=2, aux=True)
    for room in (5, 6):
        result = transfer_room(fabric, room, pages=9, state_slots=2, aux=True)
        assert {v.state.title for v in result.decode.values()} == {"Success"}, result.decode
        assert result.errors == {d: [] for d in result.decode}, "bytes differ on arrival"

    # Prometheus sees exactly the bytes that moved: 2 rooms of the synthetic engine's own count.
    def scraped(kind: str) -> float:
        result = prometheus.query(
            f'sum(pdfabric_transfer_bytes_total{{pdcluster="pd", role="prefill", kind="{kind}"}})'
        )
        return float(result[0]["value"][1]) if result else -1.0

    want_by_kind = {"kv": 2 * want.kv, "state": 2 * want.state, "aux": 2 * want.aux}
    h.wait_until(
        lambda: {k: scraped(k) for k in want_by_kind} == want_by_kind,
        timeout=20,
        what=f"Prometheus to scrape {want_by_kind}",
    )
    # CP2 with all-ranks transfer: CP rank 1's copy of the state was not sent, and counted as saved.
    skipped = prometheus.query('sum(pdfabric_state_dedup_skipped_bytes_total{pdcluster="pd"})')
    assert float(skipped[0]["value"][1]) == 2 * want.state_skipped > 0

    # Each rank's request counts once it is confirmed; a prefill rank's confirmation can land a
    # scrape after the bytes did (the decode side saw Success first).
    def succeeded() -> float:
        ok = prometheus.query('sum(pdfabric_requests_total{pdcluster="pd", outcome="success"})')
        return float(ok[0]["value"][1]) if ok else -1.0

    want_ok = 2 * (spec.prefill.tp * spec.prefill.cp + spec.decode.tp)
    h.wait_until(lambda: succeeded() == want_ok, timeout=20, what=f"{want_ok} successful requests scraped")
    time.sleep(1.5)  # and no more than that after another scrape
    assert succeeded() == want_ok

    # Every shipped panel query is valid PromQL; the transfer dashboard's return data now.
    time.sleep(2)  # a second scrape so rate() has two points
    empty = []
    for uid, (_, panels, _) in gen_dashboards.DASHBOARDS.items():
        for panel in panels:
            for expr, _ in panel.exprs:
                result = prometheus.query(dashboard_query(expr, "pd", namespace))
                if uid == "pdfabric-transfer" and not result and panel not in gen_dashboards.ENGINE_PANELS:
                    empty.append(panel.title)
    # Peer blacklisting and refusals are zero-valued series here (pre-created), never absent; the
    # serving engines' panels have no data for this fabric-only PDCluster (no spec.engine).
    assert empty == [], f"transfer panels without data: {empty}"

    # Deleting the PDCluster removes the agent pods; their processes stop with them.
    cluster.kubectl("delete", "pdcluster", "pd", "-n", namespace, "--wait=false")
    h.wait_until(lambda: not runner.list_pods(), timeout=60, what="agent pods to be deleted")
    assert runner.sync() == {}
