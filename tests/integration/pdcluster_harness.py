"""Fixtures and helpers for the PDCluster operator's integration tests.

The operator runs in-process under kopf.testing.KopfRunner with a token of the chart's own
ServiceAccount, so every request it makes is checked against the chart's ClusterRole: an RBAC rule
missing from the chart fails these tests. Each test gets its own fake GPU nodes (labelled with the
test's namespace and selected by the PDCluster's nodeSelector), so tests never compete for GPUs
with each other or with other suites sharing the session's control plane.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from kopf.testing import KopfRunner

from pdfabric_core.rankmap import RankMap
from pdfabric_devcluster.nodes import GpuNodeShape
from pdfabric_operator.builders.names import agent_name
from tests.deadlines import wait_until

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "pdfabric-system"
RELEASE = "pdfabric"  # the chart names the ServiceAccount and ClusterRole after it
TEST_LABEL = "pdfabric.dev/test"


def render_chart(cluster: Any, *args: str) -> list[dict[str, Any]]:
    out = cluster_helm(cluster, "template", RELEASE, str(ROOT / "charts" / "pdfabric"), "-n", OPERATOR_NAMESPACE, *args)
    return [d for d in yaml.safe_load_all(out) if d]


def cluster_helm(cluster: Any, *args: str) -> str:
    import subprocess

    proc = subprocess.run(
        [str(Path(cluster.bin_dir) / "helm"), *args], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed: {proc.stderr}")
    return proc.stdout


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: Any) -> Path:
    """CRDs from crds/, the chart's ServiceAccount + RBAC, and a kubeconfig holding that SA's token."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.wait_crds_established(["pdclusters.pdfabric.dev", "pdroles.pdfabric.dev", "clusterkopfpeerings.kopf.dev"])
    if cluster.kubectl("get", "namespace", OPERATOR_NAMESPACE, check=False).returncode != 0:
        cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    wanted = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}
    docs = [d for d in render_chart(cluster) if d["kind"] in wanted]
    assert {d["kind"] for d in docs} == wanted, "the chart must ship the operator's identity and RBAC"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return cluster.service_account_kubeconfig(OPERATOR_NAMESPACE, RELEASE)


@pytest.fixture
def gpu_nodes(cluster: Any, namespace: str) -> Iterator[Callable[..., list[str]]]:
    """Factory: add fake GPU nodes that only this test's PDClusters select; removed afterwards."""
    made: list[str] = []

    def add(prefix: str, count: int, **kw: Any) -> list[str]:
        labels = {TEST_LABEL: namespace, **kw.pop("labels", {})}
        names = cluster.add_gpu_nodes([GpuNodeShape(f"{namespace[-6:]}-{prefix}", count, labels=labels, **kw)])
        made.extend(names)
        return names

    yield add
    # A test may have deleted some itself (node loss).
    left = {n["metadata"]["name"] for n in cluster.get_json("nodes", "-l", f"{TEST_LABEL}={namespace}")["items"]}
    if left:
        cluster.delete_nodes(sorted(left))


def selector(namespace: str) -> dict[str, str]:
    return {TEST_LABEL: namespace}


@contextlib.contextmanager
def running_operator(
    cluster: Any,
    kubeconfig: Path,
    peering: str,
    *,
    interval: float = 1.0,
    priority: int | None = None,
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> Iterator[KopfRunner]:
    """The real operator (pdfabric_operator.main) in a thread, as the chart's ServiceAccount."""
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}}),
    )
    env = {
        "PDFABRIC_KUBECONFIG": str(kubeconfig),
        "PDFABRIC_PEERING": peering,
        "PDFABRIC_RECONCILE_INTERVAL": str(interval),
        "PDFABRIC_RESYNC_INTERVAL": str(interval),  # the tests' cadence for settled clusters too
        "PDFABRIC_METRICS_PORT": "0",
        "PDFABRIC_WATCH_TIMEOUT": "30",
    }
    if priority is not None:
        env["PDFABRIC_PRIORITY"] = str(priority)
    env.update(extra_env or {})
    try:
        with (
            mock.patch.dict(os.environ, env),
            KopfRunner(["run", "-A", "--verbose", *extra_args, "-m", "pdfabric_operator.main"], timeout=60) as runner,
        ):
            yield runner
    finally:
        cluster.kubectl("delete", "clusterkopfpeering", peering, "--ignore-not-found", check=False)
    assert runner.exception is None, runner.output[-5000:]
    assert runner.exit_code == 0, runner.output[-5000:]


def operator_subprocess_env(kubeconfig: Path, peering: str, **extra: str) -> dict[str, str]:
    """Environment for an operator replica run as its own process (`python -m kopf run ...`)."""
    paths = [str(ROOT / p) for p in ("core", "operator")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "PDFABRIC_KUBECONFIG": str(kubeconfig),
        "PDFABRIC_PEERING": peering,
        "PDFABRIC_RECONCILE_INTERVAL": "1",
        "PDFABRIC_RESYNC_INTERVAL": "1",
        "PDFABRIC_METRICS_PORT": "0",
        "PDFABRIC_WATCH_TIMEOUT": "30",
        **extra,
    }


@pytest.fixture
def operator(cluster: Any, operator_kubeconfig: Path, namespace: str) -> Iterator[KopfRunner]:
    """The operator for one test; on teardown deletes the test's PDClusters while it still runs."""
    with running_operator(cluster, operator_kubeconfig, f"pdfabric-{namespace}") as runner:
        yield runner
        delete_all_pdclusters(cluster, namespace)


@contextlib.contextmanager
def operator_reading_agents(
    cluster: Any, operator_kubeconfig: Path, namespace: str, addresses: Path
) -> Iterator[KopfRunner]:
    """The test's operator reading the agents' /readyz (transport, engines) at the addresses a
    local runner writes (PDFABRIC_AGENT_ADDRESSES); on teardown deletes the test's PDClusters."""
    env = {"PDFABRIC_AGENT_ADDRESSES": str(addresses)}
    with running_operator(cluster, operator_kubeconfig, f"pdfabric-{namespace}", extra_env=env) as runner:
        yield runner
        delete_all_pdclusters(cluster, namespace)


def delete_all_pdclusters(cluster: Any, namespace: str, timeout: float = 60) -> None:
    # The finalizer needs the operator: delete while it runs, or the namespace would hang.
    cluster.kubectl("delete", "pdclusters", "--all", "-n", namespace, "--wait=false", check=False)
    wait_until(
        lambda: not cluster.get_json("pdclusters", "-n", namespace)["items"],
        timeout=timeout,
        what=f"PDClusters in {namespace} to be finalized",
    )


# --- reading state -----------------------------------------------------------------------------


def pdc(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    return cluster.get_json("pdcluster", name, "-n", namespace)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond["type"] == type_:
            return cond
    return None


def is_ready(cluster: Any, namespace: str, name: str) -> bool:
    """Ready and converged: the current generation seen, no rolling update under way (Ready is also
    True, reason RollingUpdate, while old pods serve)."""
    obj = pdc(cluster, namespace, name)
    cond = condition(obj, "Ready")
    return bool(
        cond
        and cond["status"] == "True"
        and cond["reason"] != "RollingUpdate"
        and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
    )


def wait_ready(cluster: Any, namespace: str, name: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_ready(cluster, namespace, name):
            return pdc(cluster, namespace, name)
        time.sleep(0.25)
    # Say what the operator reported, not only that the deadline passed (print is swallowed while
    # KopfRunner holds stdout, so it goes into the failure message).
    status = pdc(cluster, namespace, name).get("status", {})
    pods = [
        (p["metadata"]["name"], p["status"].get("phase"), bool(p["metadata"].get("deletionTimestamp")))
        for p in cluster.get_json("pods", "-n", namespace, "-l", f"pdfabric.dev/cluster={name}")["items"]
    ]
    pytest.fail(
        f"{namespace}/{name} not Ready after {timeout:.0f}s; conditions={status.get('conditions')} "
        f"agents={status.get('agents')} observedGeneration={status.get('observedGeneration')} pods={pods}"
    )


def agent_pods(cluster: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    items = cluster.get_json("pods", "-n", namespace, "-l", f"pdfabric.dev/cluster={name}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def children(cluster: Any, namespace: str, name: str) -> dict[str, list[str]]:
    out = {}
    for kind in ("pods", "configmaps", "services", "secrets"):
        items = cluster.get_json(kind, "-n", namespace, "-l", f"pdfabric.dev/cluster={name}")["items"]
        out[kind] = sorted(i["metadata"]["name"] for i in items)
    return out


def apply_pdc(cluster: Any, manifest: dict[str, Any], namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))


# --- the node pods: a pod per placement unit (a replica, or an NVLink group) on a node --------


def pod_gpus(pod: dict[str, Any]) -> int:
    """The GPUs one agent pod requests (its ranks')."""
    return int(pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])


def pod_ranks(pod: dict[str, Any]) -> list[tuple[str, int]]:
    """(rank id, GPU index in the pod) of every rank the pod holds, from its ranks annotation."""
    out = []
    for item in filter(None, pod["metadata"]["annotations"]["pdfabric.dev/ranks"].split(",")):
        rank_id, _, gpu = item.partition("@")
        out.append((rank_id, int(gpu or 0)))
    return out


def pod_unit(pod: dict[str, Any]) -> str:
    """The placement unit a pod holds, from its ranks: a replica (prefill-0, decode-1), or with
    nvlink-intra the group of a prefill replica and the decodes it feeds (group-<prefill replica>)."""
    replicas = sorted({"-".join(rank_id.split("-")[:2]) for rank_id, _ in pod_ranks(pod)})
    if len(replicas) == 1:
        return replicas[0]
    (prefill,) = [r for r in replicas if r.startswith("prefill-")]
    return f"group-{prefill.split('-')[1]}"


def pod_node(pod: dict[str, Any]) -> str:
    """The node the planner chose for the pod (spec.nodeName once the scheduler bound it there)."""
    return str(pod["metadata"]["annotations"]["pdfabric.dev/node"])


def pods_by_unit(cluster: Any, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    """The cluster's agent pods by placement unit, each named for its unit and node; for units
    that each sit on one node (a unit split over nodes has a pod on each)."""
    out: dict[str, dict[str, Any]] = {}
    for p in agent_pods(cluster, namespace, name):
        unit = pod_unit(p)
        assert unit not in out, f"two pods of {unit}: {out[unit]['metadata']['name']}, {p['metadata']['name']}"
        assert p["metadata"]["name"] == agent_name(name, unit, pod_node(p))
        out[unit] = p
    return out


def gpus_by_node(cluster: Any, namespace: str, name: str) -> dict[str, int]:
    """GPUs the cluster's agent pods request on each node, summed over the node's pods."""
    out: dict[str, int] = {}
    for p in agent_pods(cluster, namespace, name):
        node = p["spec"].get("nodeName") or pod_node(p)
        out[node] = out.get(node, 0) + pod_gpus(p)
    return out


def assert_no_duplicates(cluster: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    """No unit has two pods on a node, no rank is held twice (by the pods or in the rank map), the
    rank map names exactly the live pods, and each pod holds its own GPUs 0..n-1 (one per rank)."""
    pods = agent_pods(cluster, namespace, name)
    names = [p["metadata"]["name"] for p in pods]
    assert len(names) == len(set(names)), f"two agent pods of one name: {names}"
    keys = [(pod_unit(p), pod_node(p)) for p in pods]
    assert len(keys) == len(set(keys)), f"a unit with two pods on one node: {sorted(map(str, keys))}"
    held = [rank_id for p in pods for rank_id, _ in pod_ranks(p)]
    assert len(held) == len(set(held)), f"a rank held by two pods: {sorted(held)}"
    for p in pods:
        gpus = sorted(gpu for _, gpu in pod_ranks(p))
        assert gpus == list(range(pod_gpus(p))), f"{p['metadata']['name']}: GPUs {gpus} of {pod_gpus(p)}"
    cm = cluster.get_json("configmap", f"{name}-rankmap", "-n", namespace)
    rankmap = RankMap.from_json(cm["data"]["rankmap.json"])
    mapped = [r.rank_id for a in rankmap.agents for r in a.ranks]
    assert len(mapped) == len(set(mapped)), f"a rank twice in the rank map: {sorted(mapped)}"
    assert sorted(mapped) == sorted(held), "the rank map and the pods hold different ranks"
    assert sorted(a.name for a in rankmap.agents) == sorted(names), "the rank map names other pods"
    return pods
