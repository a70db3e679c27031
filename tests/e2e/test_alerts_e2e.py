"""The chart's alerts against a real run: the real control plane, the operator, the agent pods'
real command as local processes (PodRunner), traffic over the real Mooncake engine, and a real
Prometheus scraping the agents, with one injected fault.

The fault: nodes labelled with an RDMA device (rdma/hca capacity) whose agents find none
(/sys/class/infiniband is empty here: the labels lie). The PDCluster asks for rdma with
placement.fallback TCP, so the operator places for rdma and every agent, re-checking its node,
carries KV over tcp instead. Expected: PDFabricTransportFallback fires for every agent and every
other alert of charts/pdfabric/files/alerts.yaml stays silent, although traffic, probes and the CP
state dedup feed them. The alerts are rendered by helm from the chart's values as the chart renders
them; each bare ``expr`` is an instant query (``for:`` cannot be waited out here).

Shown along the way: the per-peer series of every (local rank, peer agent) pair the rank map
implies, with the bytes each pair moved; the transport in use per agent and per pair; the
pre-flight link check's results; and the operator's word on the fallback (it reads the agents'
/readyz through PodRunner's address file)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.node.hardware import detect_rdma
from pdfabric_agent.runtime.metrics import peer_pairs, peer_ranks
from pdfabric_devcluster.fabric import Fabric
from pdfabric_devcluster.podrunner import PodRunner
from pdfabric_devcluster.prometheus import Prometheus
from pdfabric_devcluster.transfer import transfer_room
from tests.builders import SMALL_MODEL, pdcluster
from tests.e2e import node_pods
from tests.integration import pdcluster_harness as h

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes
runner, operator = node_pods.runner, node_pods.operator

EXPECTED = {"PDFabricTransportFallback"}
# Series only agents running serving engines (spec.engine) export: this PDCluster is fabric-only,
# so the serving-engine alerts stay silent for want of them (tests/alerts/ has their cases).
ENGINE_ONLY = re.compile(r"pdfabric_serving_engine_")
# The operator's own series (the operator alerts'): this Prometheus scrapes the agents only, so
# those alerts stay silent for want of them (tests/alerts/ has their cases; the operator's
# export of them is tests/integration/test_operator_health.py's).
OPERATOR_ONLY = re.compile(r"pdfabric_operator_")
# The pre-flight probe's baseline for this "link" (loopback tcp on a shared CI machine, a few
# MiB per probe): the chart's default (1 GB/s) is a datacenter NIC's, set as the values say to do.
PROBE_BASELINE_GBPS = "0.01"
ROOMS = (5, 6)
PAGES = 9
ARTIFACTS = h.ROOT / ".artifacts" / "pytest"  # tests/conftest.py's, where the cluster logs go


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path / "prometheus").start()
    yield prom
    prom.stop()


def alert_rules(cluster: Any) -> dict[str, str]:
    """alert name -> expr, rendered by helm from the chart's values (PrometheusRule enabled)."""
    docs = h.render_chart(
        cluster,
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--set-json",  # --set would make 0.01 a string
        f"metrics.prometheusRule.alerts.probeBandwidthLow.thresholdGBps={PROBE_BASELINE_GBPS}",
    )
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}


def series(prom: Prometheus, expr: str, *keys: str) -> dict[tuple[str, ...], float]:
    return {tuple(s["metric"].get(k, "") for k in keys): float(s["value"][1]) for s in prom.query(expr)}


def test_one_fault_fires_its_alert_and_only_it(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any, runner: PodRunner, prometheus: Prometheus
) -> None:
    if detect_rdma():
        pytest.skip("this machine has an RDMA device: the agents would not fall back (the injected fault)")
    started = time.monotonic()
    rules = alert_rules(cluster)
    assert set(rules) >= EXPECTED and len(rules) >= 10, sorted(rules)

    # The fault: RDMA on the nodes' labels and capacity, no RDMA device under the agents.
    # Two GPUs a node: each agent holds two ranks, so the per-peer view spans several agents.
    gpu_nodes("rdma", 4, gpus=2, rdma_resource="rdma/hca")
    builder = (
        pdcluster()
        .transport("rdma")
        .prefill(tp=2, cp=2, allCpRanksTransfer=True)  # CP rank 1 sends: the dedup alert is armed
        .decode(tp=4)
        .model(**SMALL_MODEL)
        .transfer(timeoutSeconds=10)
        .placement(nodeSelector=h.selector(namespace), fallback="TCP")
    )
    h.apply_pdc(cluster, builder.manifest(), namespace)
    obj = h.wait_ready(cluster, namespace, "pd")
    assert (obj["status"]["transport"], obj["status"]["requestedTransport"]) == ("rdma", "rdma"), obj["status"]

    pods = runner.sync()
    h.wait_until(lambda: all(p.ready() for p in pods.values()), timeout=90, what="every agent process ready")
    prometheus.set_targets(
        [(f"127.0.0.1:{p.metrics_port}", {"pod": n, "namespace": namespace}) for n, p in pods.items()]
    )
    prometheus.wait_targets_up()

    fabric = Fabric.from_cluster(cluster, namespace, "pd", runner)
    rankmap, spec = fabric.rankmap, fabric.spec
    assert rankmap.transport == "rdma"
    agent_of = {r.rank_id: a.name for a in rankmap.agents for r in a.ranks}

    # Traffic: two rooms, every byte verified on arrival; what each pair moved, from the rooms.
    want_bytes: dict[tuple[str, str, str, str], float] = {}  # (pod, rank, peer, role) -> bytes
    for room in ROOMS:
        result = transfer_room(fabric, room, pages=PAGES, state_slots=2, aux=True)
        assert {v.state.title for v in result.decode.values()} == {"Success"}, result.decode
        assert result.errors == {d: [] for d in result.decode}, "bytes differ on arrival"
        for d, view in result.decode.items():
            for p, sent in view.senders.items():
                n = float(sum(sent.values()))
                for key in ((agent_of[p], p, agent_of[d], "prefill"), (agent_of[d], d, agent_of[p], "decode")):
                    want_bytes[key] = want_bytes.get(key, 0.0) + n

    sel = f'pdcluster="pd", namespace="{namespace}"'
    success = float(len(ROOMS) * (spec.prefill.tp * spec.prefill.cp + spec.decode.tp))
    h.wait_until(
        lambda: series(prometheus, f'sum(pdfabric_requests_total{{{sel}, outcome="success"}})') == {(): success},
        timeout=20,
        what=f"Prometheus to scrape {success:.0f} successful rooms",
    )
    time.sleep(3)  # two more scrapes: rate() windows see the counters' last step

    # The per-peer view: every pair the rank map implies, on both sides, and nothing else.
    pairs = {(name, rank, peer, role.value) for name in pods for rank, peer, role in peer_pairs(rankmap, spec, name)}
    assert {k[3] for k in pairs} == {"prefill", "decode"}
    assert len(pods) == 4 and {(k[0], k[2]) for k in pairs if k[0] != k[2]}, "pairs between agents"
    keys = ("pod", "rank", "peer", "role")
    peer_bytes = series(prometheus, f"pdfabric_peer_transfer_bytes_total{{{sel}}}", *keys)
    assert set(peer_bytes) == pairs
    assert peer_bytes == {k: want_bytes.get(k, 0.0) for k in pairs}, "per-pair bytes differ from what moved"
    assert all(peer_bytes[k] > 0 for k in want_bytes)
    # Parts per pair: one per room and peer rank the pair covers; none failed.
    parts: dict[tuple[str, str, str, str], float] = {}
    for name in pods:
        for rank, peer, _, role in peer_ranks(rankmap, spec, name):
            key = (name, rank, peer, role.value)
            parts[key] = parts.get(key, 0.0) + len(ROOMS)
    ok = series(prometheus, f'pdfabric_peer_requests_total{{{sel}, outcome="success"}}', *keys)
    assert ok == parts
    bad = series(prometheus, f'pdfabric_peer_requests_total{{{sel}, outcome!="success"}}', *keys)
    assert set(bad) == pairs and set(bad.values()) == {0.0}
    count = series(prometheus, f"pdfabric_peer_request_duration_seconds_count{{{sel}}}", *keys)
    assert count == parts

    # The transport in use: tcp where rdma was asked for, per agent and per pair.
    info = series(prometheus, f"pdfabric_transport_info{{{sel}}}", "pod", "requested", "transport")
    assert info == {(n, "rdma", "tcp"): 1.0 for n in pods}
    peer_info = series(prometheus, f"pdfabric_peer_transport_info{{{sel}}}", *keys, "requested", "transport")
    assert peer_info == {(*k, "rdma", "tcp"): 1.0 for k in pairs}

    # The pre-flight link check: every pair a prefill rank sends over, probed over tcp.
    probed = {k for k in pairs if k[3] == "prefill"}
    gbps = series(prometheus, f"pdfabric_peer_probe_bandwidth_gbps{{{sel}}}", *keys)
    latency = series(prometheus, f"pdfabric_peer_probe_latency_seconds{{{sel}}}", *keys)
    assert set(gbps) == set(latency) == probed
    assert all(v > 0 for v in gbps.values()) and all(0 < v < 1 for v in latency.values())

    # The alerts, against the real Prometheus. Every series an alert reads exists for this cluster
    # (silence is not missing data; the serving engines' excepted), the fault's alert fires for
    # every agent, the others stay silent.
    results: dict[str, list[dict[str, Any]]] = {}  # alert -> [{"labels", "value"}], fired ones only
    for alert, expr in rules.items():
        for metric in set(re.findall(r"\bpdfabric_[a-z0-9_]+", expr)):
            if ENGINE_ONLY.match(metric):
                assert not prometheus.query(f"{metric}{{{sel}}}"), f"{alert}: {metric} without spec.engine"
                continue
            if OPERATOR_ONLY.match(metric):
                continue
            assert prometheus.query(f"{metric}{{{sel}}}"), f"{alert}: no {metric} series"
        if result := prometheus.query(expr):
            results[alert] = [{"labels": s["metric"], "value": s["value"][1]} for s in result]
    assert set(results) == EXPECTED, {a: results.get(a, "silent") for a in set(results) | EXPECTED}
    fallback = [s["labels"] for s in results["PDFabricTransportFallback"]]
    assert sorted((s["pod"], s["requested"], s["transport"]) for s in fallback) == sorted(
        (n, "rdma", "tcp") for n in pods
    )
    # The dedup alert is silent because the dedup skipped state, not for want of CP traffic.
    armed, _, _ = rules["PDFabricCPDedupNotHappening"].partition("unless")
    assert prometheus.query(armed), "state and CP rank 1 traffic should arm PDFabricCPDedupNotHappening"

    # The operator read the same from the agents' /readyz: a Degraded condition and an Event.
    def degraded() -> dict[str, Any] | None:
        cond = h.condition(h.pdc(cluster, namespace, "pd"), "Degraded")
        return cond if cond and cond.get("reason") == "AgentTransportFallback" else None

    cond = h.wait_until(degraded, timeout=30, what="Degraded=AgentTransportFallback")
    assert all(f"agent {n} carries KV over tcp instead of the requested rdma" in cond["message"] for n in pods)
    h.wait_until(
        lambda: any(
            e["reason"] == "AgentTransportFallback" and e["type"] == "Warning"
            for e in cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=pd")["items"]
        ),
        timeout=30,
        what="a Warning event AgentTransportFallback",
    )

    # What the run showed, for a reader: .artifacts/pytest/alerts-e2e-<namespace>.json.
    report = {
        "fault": "nodes with rdma/hca capacity, no RDMA device: rdma asked, placement.fallback TCP",
        "agents": sorted(pods),
        "peer_bytes": [[*k, v] for k, v in sorted(peer_bytes.items())],
        "peer_transport": sorted(peer_info),
        "probe_gbps": [[*k, v] for k, v in sorted(gbps.items())],
        "probe_latency_s": [[*k, v] for k, v in sorted(latency.items())],
        "alerts": {a: results.get(a, []) for a in sorted(rules)},
        "seconds": round(time.monotonic() - started, 1),
    }
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"alerts-e2e-{namespace}.json").write_text(json.dumps(report, indent=1))
