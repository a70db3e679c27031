"""spec.engine on the real control plane: the node pod the operator builds (one container, the
agent from the engine image, holding every GPU of the node's ranks; its engines in
PDFABRIC_ENGINES; the valueFrom env hoisted; /dev/shm; probes), the per-role Services, the status a
PD router reads (from the agents' /readyz, served here by fake agents over real HTTP), the
EngineRestarted Event, rolling replacement on an engine change, and back to fabric-only. The
operator runs under the chart's ServiceAccount, so a missing RBAC rule fails here."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from pdfabric_core.engines.launch import decode_launches
from pdfabric_core.engines.router import sglang_router_args
from pdfabric_operator.builders.names import agent_name
from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import agent_pods, apply_pdc, selector, wait_ready, wait_until

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes


class FakeAgents:
    """A /readyz per agent pod on 127.0.0.1 (PDFABRIC_AGENT_ADDRESSES names it to the operator):
    the agent ready, and each engine of the pod's PDFABRIC_ENGINES Running with `restarts`."""

    def __init__(self, cluster: Any, namespace: str, addresses: Path) -> None:
        self.cluster, self.namespace, self.addresses = cluster, namespace, addresses
        self.restarts: dict[str, int] = {}  # engine name -> restarts it reports
        self.servers: dict[str, ThreadingHTTPServer] = {}
        self.engines: dict[str, list[str]] = {}  # pod -> its engines, as its spec says
        addresses.write_text("{}")

    def body(self, pod: str) -> dict[str, Any]:
        engines = [
            {
                "name": n,
                "role": n.split("-")[0],
                "replica": int(n.split("-")[1]),
                "phase": "Running",
                "ready": True,
                "restarts": self.restarts.get(n, 0),
                "pid": 100,
                "lastExit": "exit code 137" if self.restarts.get(n) else "",
            }
            for n in self.engines.get(pod, [])
        ]
        return {"ready": True, "enginesReady": True, "engines": engines, "transport": "tcp", "requested": "tcp"}

    def serve(self, pod: str) -> None:
        if pod in self.servers:
            return
        agents = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                raw = json.dumps(agents.body(pod)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *_: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers[pod] = server
        self.addresses.write_text(json.dumps({p: f"127.0.0.1:{s.server_address[1]}" for p, s in self.servers.items()}))

    def sync(self) -> None:
        """Serve every agent pod there is, listing the engines its current spec names."""
        for pod in agent_pods(self.cluster, self.namespace, "pd"):
            name = pod["metadata"]["name"]
            self.engines[name] = [x.name for x in decode_launches(_engines_env(pod))] if _has_engines(pod) else []
            self.serve(name)

    def close(self) -> None:
        for s in self.servers.values():
            s.shutdown()
            s.server_close()


@pytest.fixture
def agents(cluster: Any, namespace: str, tmp_path: Path) -> Iterator[FakeAgents]:
    fake = FakeAgents(cluster, namespace, tmp_path / "agents.json")
    stop = threading.Event()

    def keep_syncing() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a pod between states; the next pass sees it
                fake.sync()
            stop.wait(0.5)

    thread = threading.Thread(target=keep_syncing, daemon=True)
    thread.start()
    yield fake
    stop.set()
    thread.join(5)
    fake.close()


@pytest.fixture
def operator(cluster: Any, operator_kubeconfig: Path, namespace: str, agents: FakeAgents) -> Iterator[KopfRunner]:
    """The operator reading the agents' /readyz (PDFABRIC_AGENT_ADDRESSES)."""
    with h.operator_reading_agents(cluster, operator_kubeconfig, namespace, agents.addresses) as op:
        yield op


def _builder(namespace: str) -> Any:
    return (
        pdcluster()
        .prefill(replicas=2, tp=1)
        .decode(replicas=1, tp=2)
        .placement(nodeSelector=selector(namespace))
        .engine(
            prefill={
                "args": ["--port", "$(PDFABRIC_PORT)"],
                "env": [
                    {"name": "HF_HOME", "value": "/cache"},
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                ],
            },
            decode={"resources": {"limits": {"memory": "2Gi"}}},
        )
    )


def _has_engines(pod: dict[str, Any]) -> bool:
    return any(e["name"] == "PDFABRIC_ENGINES" for e in pod["spec"]["containers"][0].get("env", []))


def _engines_env(pod: dict[str, Any]) -> str:
    """PDFABRIC_ENGINES as the agent process sees it: the kubelet undoes the $$ escaping."""
    (value,) = [e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == "PDFABRIC_ENGINES"]
    return str(value).replace("$$", "$")


def test_engine_pod_services_status_and_events(
    cluster: Any, namespace: str, gpu_nodes: Any, agents: FakeAgents, operator: Any
) -> None:
    (node,) = gpu_nodes("e", 1, gpus=8)
    apply_pdc(cluster, _builder(namespace).manifest(), namespace)
    obj = wait_ready(cluster, namespace, "pd")
    # A node pod per replica, each named for its replica and node.
    pods = h.pods_by_unit(cluster, namespace, "pd")
    assert sorted(pods) == ["decode-0", "prefill-0", "prefill-1"]
    for unit, pod in pods.items():
        assert pod["metadata"]["name"] == agent_name("pd", unit, node)
        assert pod["spec"]["nodeName"] == node

    # One container per pod: the agent, from the engine image, with every GPU of the pod's ranks.
    gpus = {"prefill-0": "1", "prefill-1": "1", "decode-0": "2"}
    for unit, pod in pods.items():
        (c,) = pod["spec"]["containers"]
        assert (c["name"], c["image"], c["command"]) == ("agent", "pdfabric/refengine:test", ["pdfabric-agent"])
        res = c["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == gpus[unit], unit
        if unit == "decode-0":
            assert res["limits"]["memory"] == "2Gi"  # decode's, once (one decode engine in the pod)
        else:
            assert "memory" not in res["limits"], unit  # a prefill pod runs no decode engine
        spec = pod["spec"]
        assert not any(spec.get(k) for k in ("hostIPC", "hostPID", "hostNetwork"))
        assert not (c.get("securityContext") or {}).get("privileged")
        env = {e["name"]: e for e in c["env"]}
        assert not {"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} & set(env)
        assert "HF_TOKEN" not in env and "HF_HOME" not in env
        assert spec["terminationGracePeriodSeconds"] == 60
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
        assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["dshm"] == "/dev/shm"
        probe = c["readinessProbe"]["httpGet"]
        assert (probe["path"], probe["port"]) == ("/readyz", "metrics")  # 200 once the agent and its engines are
        assert c["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert h.gpus_by_node(cluster, namespace, "pd") == {node: 4}  # every GPU of the node's ranks, once
    for unit in ("prefill-0", "prefill-1"):
        env = {e["name"]: e for e in pods[unit]["spec"]["containers"][0]["env"]}
        assert env["PDFABRIC_ENV_PREFILL_HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    decode_env = {e["name"] for e in pods["decode-0"]["spec"]["containers"][0]["env"]}
    assert "PDFABRIC_ENV_PREFILL_HF_TOKEN" not in decode_env  # prefill's Secret only in prefill's pods

    # Each pod has a network of its own: its engines' ports start at the role's first port.
    def ports(unit: str) -> dict[str, int]:
        (c,) = pods[unit]["spec"]["containers"]
        return {p["name"]: p["containerPort"] for p in c["ports"] if p["name"] not in ("peer", "metrics")}

    assert ports("prefill-0") == ports("prefill-1") == {"p-http-0": 30000, "p-boot-0": 8998}
    assert ports("decode-0") == {"d-http-0": 31000}

    # The engines each agent runs, as it will read them (the kubelet unescapes $$).
    launches = {unit: decode_launches(_engines_env(pod)) for unit, pod in pods.items()}
    assert {u: [(x.name, x.rank_ids, x.port, x.bootstrap_port) for x in ls] for u, ls in launches.items()} == {
        "prefill-0": [("prefill-0", ("prefill-0-tp0-cp0",), 30000, 8998)],
        "prefill-1": [("prefill-1", ("prefill-1-tp0-cp0",), 30000, 8998)],
        "decode-0": [("decode-0", ("decode-0-tp0", "decode-0-tp1"), 31000, None)],
    }
    for unit, ls in launches.items():  # each GPU of each pod, once, numbered from 0 in the pod
        assert sorted(g for x in ls for g in x.gpus) == list(range(int(gpus[unit]))), unit
    assert launches["prefill-1"][0].argv == ("python3", "-m", "sglang.launch_server", "--port", "$(PDFABRIC_PORT)")
    assert [(e.name, e.value, e.from_container) for e in launches["prefill-0"][0].env] == [
        ("HF_HOME", "/cache", ""),
        ("HF_TOKEN", "", "PDFABRIC_ENV_PREFILL_HF_TOKEN"),
    ]

    # Status: from the agents' word on their engines.
    st = obj["status"]
    assert st["engines"] == {
        "prefill": {"desired": 2, "ready": 2, "restarts": 0},
        "decode": {"desired": 1, "ready": 1, "restarts": 0},
    }
    assert (st["prefillEnginesReady"], st["decodeEnginesReady"]) == ("2/2", "1/1")
    assert h.condition(obj, "EnginesReady")["status"] == "True"
    host = {unit: f"{pod['metadata']['name']}.pd-agents.{namespace}.svc" for unit, pod in pods.items()}
    assert [(e["engine"], e["url"], e["bootstrap"], e["phase"]) for e in st["endpoints"]["prefill"]] == [
        ("prefill-0", f"http://{host['prefill-0']}:30000", f"{host['prefill-0']}:8998", "Running"),
        ("prefill-1", f"http://{host['prefill-1']}:30000", f"{host['prefill-1']}:8998", "Running"),
    ]
    assert [e["url"] for e in st["endpoints"]["decode"]] == [f"http://{host['decode-0']}:31000"]
    assert st["services"] == {"prefill": "pd-prefill", "decode": "pd-decode"}
    table = cluster.kubectl("get", "pdc", "pd", "-n", namespace).stdout
    assert "PREFILL-ENGINES" in table and "2/2" in table

    # The per-role Services select the pods of the role, ports named after the k-th engine of a pod
    # (a pod per replica: one engine of its role, k = 0).
    svc = cluster.get_json("service", "pd-prefill", "-n", namespace)
    assert svc["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("http-0", 30000, "p-http-0"),
        ("boot-0", 8998, "p-boot-0"),
    ]
    for unit, pod in pods.items():
        labels = pod["metadata"]["labels"]
        role = unit.split("-")[0]
        assert labels.get("pdfabric.dev/serves-prefill") == ("true" if role == "prefill" else None), unit
        assert labels.get("pdfabric.dev/serves-decode") == ("true" if role == "decode" else None), unit
    dsvc = cluster.get_json("service", "pd-decode", "-n", namespace)
    assert [p["targetPort"] for p in dsvc["spec"]["ports"]] == ["d-http-0"]

    # An engine restarts: its restarts and last exit in status, and one Warning Event naming it.
    agents.restarts["decode-0"] = 1

    def restarted() -> dict[str, Any] | None:
        ep = h.pdc(cluster, namespace, "pd")["status"]["endpoints"]["decode"][0]
        return ep if ep["restarts"] == 1 else None

    ep = wait_until(restarted, timeout=30, what="the decode engine's restart in status")
    assert ep["lastExit"] == "exit code 137"
    assert h.pdc(cluster, namespace, "pd")["status"]["engines"]["decode"]["restarts"] == 1

    def event() -> list[dict[str, Any]]:
        items = cluster.get_json("events", "-n", namespace, "--field-selector", "reason=EngineRestarted")["items"]
        return [e for e in items if e["type"] == "Warning"]

    (ev,) = wait_until(event, timeout=30, what="the EngineRestarted Event")
    assert "decode-0" in ev["message"] and pods["decode-0"]["metadata"]["name"] in ev["message"]
    assert "exit code 137" in ev["message"]

    # Back to fabric-only: the agent image, every GPU, the engines' Services and status gone.
    manifest = _builder(namespace).manifest()
    del manifest["spec"]["engine"]
    cluster.kubectl("replace", "-n", namespace, "-f", "-", input=json.dumps(manifest))

    def fabric_only() -> bool:
        pods = agent_pods(cluster, namespace, "pd")
        return len(pods) == 3 and not any(_has_engines(p) for p in pods)

    wait_until(fabric_only, timeout=60, what="the pods without engines")
    obj = wait_ready(cluster, namespace, "pd")
    assert "engines" not in obj["status"] and "endpoints" not in obj["status"]
    assert h.condition(obj, "EnginesReady") is None
    wait_until(
        lambda: cluster.kubectl("get", "service", "pd-prefill", "-n", namespace, check=False).returncode != 0,
        timeout=30,
        what="the prefill engines' Service to go",
    )
    pods = h.pods_by_unit(cluster, namespace, "pd")
    assert sorted(pods) == ["decode-0", "prefill-0", "prefill-1"]
    for unit, pod in pods.items():
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus[unit]
        assert pod["spec"]["containers"][0]["image"] != "pdfabric/refengine:test"
        assert pod["spec"]["nodeName"] == node
    assert h.gpus_by_node(cluster, namespace, "pd") == {node: 4}


def test_engines_not_reported_keep_the_cluster_not_ready(
    cluster: Any, namespace: str, gpu_nodes: Any, agents: FakeAgents, operator: Any
) -> None:
    gpu_nodes("n", 1, gpus=8)
    builder = pdcluster().placement(nodeSelector=selector(namespace)).engine()
    original = agents.body
    agents.body = lambda pod: {**original(pod), "engines": [], "enginesReady": False}  # type: ignore[method-assign]
    apply_pdc(cluster, builder.manifest(), namespace)

    def not_ready() -> dict[str, Any] | None:
        obj = h.pdc(cluster, namespace, "pd")
        cond = h.condition(obj, "Ready")
        return obj if cond and cond["reason"] == "EnginesNotReady" else None

    obj = wait_until(not_ready, timeout=60, what="Ready False for the engines")
    # A pod per replica; the agents themselves say they are ready.
    assert obj["status"]["agents"] == {"desired": 2, "ready": 2}
    (p0,) = obj["status"]["endpoints"]["prefill"]
    assert (p0["ready"], p0["phase"]) == (False, "Unknown")
    assert h.condition(obj, "EnginesReady")["status"] == "False"
    agents.body = original  # type: ignore[method-assign]
    wait_ready(cluster, namespace, "pd")


def test_engine_change_rolls_pods_one_at_a_time(
    cluster: Any, namespace: str, gpu_nodes: Any, agents: FakeAgents, operator: Any
) -> None:
    gpu_nodes("r", 3, gpus=8)
    builder = pdcluster().prefill(replicas=2, tp=8).decode(tp=8).placement(nodeSelector=selector(namespace)).engine()
    apply_pdc(cluster, builder.manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    before = {p["spec"]["nodeName"]: p["metadata"]["uid"] for p in agent_pods(cluster, namespace, "pd")}
    assert len(before) == 3
    apply_pdc(cluster, builder.engine(image="pdfabric/refengine:v2").manifest(), namespace)

    most_gone = 0
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        items = cluster.get_json("pods", "-n", namespace, "-l", "pdfabric.dev/cluster=pd")["items"]
        live = [p for p in items if not p["metadata"].get("deletionTimestamp")]
        new = [p for p in live if p["spec"]["containers"][0]["image"] == "pdfabric/refengine:v2"]
        old_ready = [p for p in live if p not in new and p["metadata"]["uid"] in before.values()]
        most_gone = max(most_gone, 3 - len(old_ready) - len(new))
        if len(new) == 3 and all(p["status"].get("phase") == "Running" for p in new):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the engine image change did not reach every pod")
    assert most_gone <= 1, "more than one node pod was down at once"
    after = {p["spec"]["nodeName"]: p["metadata"]["uid"] for p in agent_pods(cluster, namespace, "pd")}
    assert set(after) == set(before), "an engine change moves no ranks"
    assert not set(after.values()) & set(before.values()), "every pod was replaced"
    obj = wait_ready(cluster, namespace, "pd")
    assert obj["status"]["engines"]["prefill"] == {"desired": 2, "ready": 2, "restarts": 0}

    # A change to one role's engines replaces only the pods that run that role.
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in agent_pods(cluster, namespace, "pd")}
    flagged = builder.engine(
        image="pdfabric/refengine:v2", decode={"args": ["--disaggregation-mode", "decode", "--v2"]}
    )
    apply_pdc(cluster, flagged.manifest(), namespace)

    def decode_rolled() -> bool:
        pods = agent_pods(cluster, namespace, "pd")
        return any(any("--v2" in x.argv for x in decode_launches(_engines_env(p))) for p in pods)

    wait_until(decode_rolled, timeout=60, what="the decode pod with the new args")
    wait_ready(cluster, namespace, "pd")
    now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in agent_pods(cluster, namespace, "pd")}
    assert sum(1 for n in uids if now.get(n) != uids[n]) == 1


def test_spec_router_runs_sglangs_router_in_front_of_the_engines(
    cluster: Any, namespace: str, gpu_nodes: Any, agents: FakeAgents, operator: Any
) -> None:
    """spec.router: a Deployment of SGLang's router whose workers are exactly the engines the
    status lists, behind a Service; the cluster is Ready once the router is too (its pod scheduled
    by the real scheduler, run by KWOK); removing spec.router removes both."""
    gpu_nodes("r", 1, gpus=8)
    builder = _builder(namespace).router(args=["--policy", "cache_aware"], nodeSelector=selector(namespace))
    apply_pdc(cluster, builder.manifest(), namespace)
    obj = wait_ready(cluster, namespace, "pd", timeout=90)
    dep = cluster.get_json("deployment", "pd-router", "-n", namespace)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    workers = sglang_router_args(obj["status"]["endpoints"])
    assert c["args"] == [
        *workers, "--host", "0.0.0.0", "--port", "8000", "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000",
        "--policy", "cache_aware",
    ]  # fmt: skip
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "metrics": 29000}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert workers.count("--prefill") == 2 and workers.count("--decode") == 1
    assert obj["status"]["router"] == {
        "service": "pd-router",
        "url": f"http://pd-router.{namespace}.svc:8000",
        "replicas": 1,
        "readyReplicas": 1,
        "ready": "1/1",
    }
    svc = cluster.get_json("service", "pd-router", "-n", namespace)
    routers = cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=router")["items"]
    assert len(routers) == 1 and svc["spec"]["selector"].items() <= routers[0]["metadata"]["labels"].items()
    # The router's pod is its Deployment's, not an agent: the agents are a pod per replica.
    assert sorted(h.pods_by_unit(cluster, namespace, "pd")) == ["decode-0", "prefill-0", "prefill-1"]

    apply_pdc(cluster, _builder(namespace).manifest(), namespace)

    def gone() -> bool:
        left = cluster.kubectl(
            "get", "deployment/pd-router", "service/pd-router", "-n", namespace, "--ignore-not-found", "-o", "name"
        ).stdout.strip()
        return not left

    wait_until(gone, timeout=60, what="the router's Deployment and Service deleted")
    wait_until(lambda: "router" not in h.pdc(cluster, namespace, "pd")["status"], timeout=30, what="status.router gone")
