"""Builders: child objects are deterministic, owned, labelled, and carry the agent contract."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography import x509

from pdfabric_core.rankmap import Rank, RankMap
from pdfabric_core.spec.model import MAX_RANKS
from pdfabric_operator import pki
from pdfabric_operator.builders.agent_pod import agent_device_requests, build_agent_pods
from pdfabric_operator.builders.credentials import (
    build_ca_secret,
    build_engine_token_secret,
    build_peer_tls_secret,
    keypair_from_secret,
)
from pdfabric_operator.builders.names import (
    ClusterRef,
    agent_name,
    peer_dns_name,
    service_name,
    shared_children,
    short_hash,
)
from pdfabric_operator.builders.rankmap import build_rankmap, build_rankmap_configmap, decode_ranks, encode_ranks
from pdfabric_operator.builders.router import build_router_deployment, build_router_service
from pdfabric_operator.builders.services import build_engine_service, build_headless_service, build_network_policy
from pdfabric_operator.placement import Placement
from pdfabric_operator.planner import plan_placement
from tests.builders import gpu_node, pdcluster

REF = ClusterRef("ns", "pd", "uid-1")


def _placed(builder, nodes) -> Placement:
    result = plan_placement(builder.spec(), nodes, [], cluster_uid=REF.uid)
    assert isinstance(result, Placement)
    return result


# (id, cluster, unit, node, expected name)
NAME_CASES = [
    ("short", "pd", "decode-0", "gpu-1", "pd-decode-0-" + short_hash("decode-0@gpu-1")),
    ("dots-become-dashes", "pd.x", "group-1", "node.rack.a", "pd-x-group-1-" + short_hash("group-1@node.rack.a")),
    ("long-truncated", "c" * 50, "prefill-12", "n1", ("c" * 50 + "-pref") + "-" + short_hash("prefill-12@n1")),
]


@pytest.mark.parametrize(
    ("cluster", "unit", "node", "expected"), [c[1:] for c in NAME_CASES], ids=[c[0] for c in NAME_CASES]
)
def test_agent_name(cluster: str, unit: str, node: str, expected: str) -> None:
    name = agent_name(cluster, unit, node)
    assert name == expected
    assert len(name) <= 63


def test_agent_names_distinct_per_unit_and_node_when_truncation_collides() -> None:
    names = {agent_name("c" * 60, u, n) for u in ("prefill-1", "prefill-2") for n in ("a", "b")}
    assert len(names) == 4


def test_rank_annotation_round_trips() -> None:
    ranks = (Rank("prefill", 1, 2, 3, 1, 0), Rank("decode", 0, 7, 0, 0, 5))
    assert decode_ranks(encode_ranks(ranks)) == ranks


def test_agent_pod_contract() -> None:
    builder = pdcluster().transport("rdma").prefill(tp=2).decode(tp=2).agent(resources={"limits": {"memory": "1Gi"}})
    placement = _placed(builder, [gpu_node("n1", 8, rdma=2)])
    pods = build_agent_pods(REF, builder.spec(), placement)
    assert [p["metadata"]["name"] for p in pods] == [agent_name("pd", u, "n1") for u in ("decode-0", "prefill-0")]
    pod = pods[0]
    spec = pod["spec"]
    (container,) = spec["containers"]
    # The scheduler binds it, pinned to the planner's node; it never names the node itself.
    assert "nodeName" not in spec
    assert spec["affinity"] == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
            }
        }
    }
    assert pod["metadata"]["annotations"]["pdfabric.dev/node"] == "n1"
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert container["command"] == ["pdfabric-agent"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["PDFABRIC_RANKMAP"]["value"] == "/etc/pdfabric/rankmap.json"
    assert env["PDFABRIC_ENGINE_TOKEN_FILE"]["value"] == "/etc/pdfabric/engine-token/token"
    assert env["PDFABRIC_PEER_TLS_DIR"]["value"] == "/etc/pdfabric/peer-tls"
    assert (env["PDFABRIC_API_PORT"]["value"], env["PDFABRIC_PEER_PORT"]["value"]) == ("7400", "7401")
    # The engine door is loopback-only in the pod: only the peer door and metrics are ports.
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [("peer", 7401), ("metrics", 9400)]
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PDFABRIC_PEER_HOST_TEMPLATE"]["value"] == "{name}.pd-agents.{namespace}.svc"
    assert container["resources"]["limits"] == {"memory": "1Gi", "nvidia.com/gpu": "2", "rdma/hca": "1"}
    assert container["resources"]["requests"] == {"nvidia.com/gpu": "2", "rdma/hca": "1"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {
        "rankmap": "/etc/pdfabric",
        "engine-token": "/etc/pdfabric/engine-token",
        "peer-tls": "/etc/pdfabric/peer-tls",
        "home": "/var/lib/pdfabric/home",
    }
    assert env["HOME"]["value"] == "/var/lib/pdfabric/home"
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    # Its own certificate only: the Secret is named after this pod; the CA's key is in none of them.
    assert secrets == {"engine-token": "pd-engine-token", "peer-tls": f"{pod['metadata']['name']}-peer-tls"}
    assert spec["subdomain"] == service_name("pd")
    assert pod["metadata"]["ownerReferences"] == [REF.owner_reference()]
    assert pod["metadata"]["labels"]["pdfabric.dev/cluster-uid"] == "uid-1"
    assert decode_ranks(pod["metadata"]["annotations"]["pdfabric.dev/ranks"]) == placement.agents[0].ranks


@pytest.mark.parametrize("transport", ["tcp", "rdma", "nvlink-intra"])
@pytest.mark.parametrize("engine", [False, True])
def test_node_pods_run_unprivileged_as_the_restricted_standard_asks(transport: str, engine: bool) -> None:
    builder = pdcluster().transport(transport).prefill(tp=2).decode(tp=2)
    if engine:
        builder = builder.engine()
    placement = _placed(builder, [gpu_node("n1", 8, rdma=2)])
    pod, *_ = build_agent_pods(REF, builder.spec(), placement)
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    assert spec["securityContext"] == {
        "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532, "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert not any(spec.get(k) for k in ("hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"))
    assert {k for v in spec["volumes"] for k in v if k != "name"} <= {"configMap", "secret", "emptyDir"}
    # fsGroup owns the Secret files: group-readable, for the pod's user only.
    assert {v["secret"]["defaultMode"] for v in spec["volumes"] if "secret" in v} == {0o440}
    assert not any("hostPort" in p for p in container["ports"])


def test_a_root_user_is_allowed_and_then_not_claimed_non_root() -> None:
    builder = pdcluster().agent(runAsUser=0).engine()
    pod, *_ = build_agent_pods(REF, builder.spec(), _placed(builder, [gpu_node("n1", 8)]))
    ctx = pod["spec"]["securityContext"]
    assert (ctx["runAsUser"], ctx["fsGroup"]) == (0, 0) and "runAsNonRoot" not in ctx
    other = pdcluster().agent(runAsUser=1000)
    pod, *_ = build_agent_pods(REF, other.spec(), _placed(other, [gpu_node("n1", 8)]))
    assert pod["spec"]["securityContext"]["runAsUser"] == 1000
    assert (
        pod["metadata"]["annotations"]["pdfabric.dev/pod-hash"]
        != build_agent_pods(REF, pdcluster().spec(), _placed(pdcluster(), [gpu_node("n1", 8)]))[0]["metadata"][
            "annotations"
        ]["pdfabric.dev/pod-hash"]
    )  # a new user rolls the pods


def test_tcp_pod_requests_no_rdma() -> None:
    builder = pdcluster()
    for pod in build_agent_pods(REF, builder.spec(), _placed(builder, [gpu_node("n1", 8, rdma=2)])):
        assert "rdma/hca" not in pod["spec"]["containers"][0]["resources"]["limits"]


def test_pod_hash_changes_with_ranks_only() -> None:
    nodes = [gpu_node("n1", 8)]
    one = build_agent_pods(REF, pdcluster().spec(), _placed(pdcluster(), nodes))[0]
    same = build_agent_pods(REF, pdcluster().spec(), _placed(pdcluster(), nodes))[0]
    more = pdcluster().decode(tp=2)
    other = build_agent_pods(REF, more.spec(), _placed(more, nodes))[0]  # decode-0: more ranks
    key = "pdfabric.dev/pod-hash"
    assert one["metadata"]["annotations"][key] == same["metadata"]["annotations"][key]
    assert one["metadata"]["annotations"][key] != other["metadata"]["annotations"][key]


def test_rankmap_configmap_round_trips() -> None:
    builder = pdcluster().transport("nvlink").prefill(replicas=2, tp=4).decode(tp=8)
    placement = _placed(
        builder, [gpu_node("a", 8, clique="x"), gpu_node("b", 8, clique="x"), gpu_node("c", 8, clique="x")]
    )
    rankmap = build_rankmap(REF, builder.raw_spec(), placement)
    cm = build_rankmap_configmap(REF, rankmap)
    back = RankMap.from_json(cm["data"]["rankmap.json"])
    assert back == rankmap
    assert back.transport == "nvlink"
    assert {a.domain for a in back.agents} == {"x"}
    assert [a.name for a in back.agents] == [agent_name("pd", a.unit, a.node) for a in placement.agents]
    assert cm["metadata"]["annotations"]["pdfabric.dev/rankmap-hash"]


def test_service_is_headless_and_selects_agents() -> None:
    svc = build_headless_service(REF, pdcluster().spec())
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"pdfabric.dev/cluster-uid": "uid-1", "app.kubernetes.io/component": "agent"}
    assert {p["port"] for p in svc["spec"]["ports"]} == {7401, 9400}


def test_secret_holds_the_engine_token() -> None:
    secret = build_engine_token_secret(REF, "s3cret")
    assert secret["stringData"] == {"token": "s3cret"}
    assert secret["metadata"]["name"] == "pd-engine-token"
    assert secret["metadata"]["ownerReferences"][0]["controller"] is True


# (id, change applied to the default cluster, pod must be replaced)
CONFIG_CASES = [
    ("batch-entries", lambda x: x.transfer(maxBatchEntries=256), True),
    ("model-geometry", lambda x: x.model(layers=61), True),
    ("backend", lambda x: x.backend("mori"), True),
    ("image", lambda x: x.agent(image="pdfabric/agent:v2"), True),
    ("node-selector-only", lambda x: x.placement(nodeSelector={"pool": "x"}), False),
    ("fallback-policy-only", lambda x: x.placement(fallback="TCP"), False),
]


@pytest.mark.parametrize(("change", "replaced"), [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_pod_hash_tracks_agent_config(change, replaced: bool) -> None:
    nodes = [gpu_node("n1", 8, labels={"pool": "x"})]
    base = pdcluster()
    changed = change(pdcluster())
    before = build_agent_pods(REF, base.spec(), _placed(base, nodes))[0]["metadata"]["annotations"]
    after = build_agent_pods(REF, changed.spec(), _placed(changed, nodes))[0]["metadata"]["annotations"]
    assert (before["pdfabric.dev/pod-hash"] != after["pdfabric.dev/pod-hash"]) is replaced
    assert before["pdfabric.dev/ranks"] == after["pdfabric.dev/ranks"]


# (id, transport, node, expected extended requests of the one agent)
DEVICE_CASES = [
    ("tcp-gpus-only", "tcp", gpu_node("n1", 8, rdma=2), {"nvidia.com/gpu": 1}),
    ("rdma-one-device", "rdma", gpu_node("n1", 8, rdma=2), {"nvidia.com/gpu": 1, "rdma/hca": 1}),
    ("intra-node-gpus-only", "nvlink-intra", gpu_node("n1", 8), {"nvidia.com/gpu": 2}),
]


@pytest.mark.parametrize(
    ("transport", "node", "expected"), [c[1:] for c in DEVICE_CASES], ids=[c[0] for c in DEVICE_CASES]
)
def test_agent_device_requests_follow_the_transport_traits(transport: str, node, expected: dict[str, int]) -> None:
    builder = pdcluster().transport(transport)
    placement = _placed(builder, [node])
    for agent in placement.agents:  # prefill-0 and decode-0, a pod each
        assert agent_device_requests(builder.spec(), agent, placement.transport) == expected


def test_shared_children_are_the_objects_every_agent_mounts_or_resolves() -> None:
    assert shared_children("pd") == [
        ("ConfigMap", "pd-rankmap"),
        ("Service", "pd-agents"),
        ("Secret", "pd-engine-token"),
        ("Secret", "pd-peer-ca"),
        ("NetworkPolicy", "pd-agents"),
        ("Service", "pd-prefill"),
        ("Service", "pd-decode"),
        ("Deployment", "pd-router"),
        ("Service", "pd-router"),
        ("PodDisruptionBudget", "pd-prefill"),
        ("PodDisruptionBudget", "pd-decode"),
        ("PodDisruptionBudget", "pd-units"),
    ]


def test_headless_service_carries_the_peer_door_not_the_engine_door() -> None:
    svc = build_headless_service(REF, pdcluster().spec())
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("peer", 7401), ("metrics", 9400)]


def test_secrets_are_owned_and_the_ca_key_is_only_in_the_ca_secret() -> None:
    ca = pki.new_ca("ns", "pd", "uid-1")
    agent = agent_name("pd", "decode-0", "n1")
    leaf = pki.issue_agent(ca, namespace="ns", cluster="pd", agent=agent, dns_name=peer_dns_name(REF, agent))
    ca_secret = build_ca_secret(REF, ca)
    tls = build_peer_tls_secret(REF, agent, leaf, ca)
    for secret in (ca_secret, tls, build_engine_token_secret(REF, "t" * 32)):
        assert secret["metadata"]["ownerReferences"] == [REF.owner_reference()]
    assert ca_secret["metadata"]["name"] == "pd-peer-ca"
    assert set(tls["stringData"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert ca.key_pem.decode() not in tls["stringData"].values()
    assert tls["metadata"]["annotations"]["pdfabric.dev/cert-serial"] == pki.serial_hex(leaf.cert_pem)
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [f"{agent}.pd-agents.ns.svc"]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"pdfabric://ns/pd/{agent}"]
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == agent
    cert.verify_directly_issued_by(ca.cert)
    as_read = {"data": {k: base64.b64encode(v.encode()).decode() for k, v in ca_secret["stringData"].items()}}
    assert keypair_from_secret(as_read) == ca


def test_certificates_for_the_longest_names_the_api_allows() -> None:
    # A 63-character namespace and cluster, and a 63-character agent name (the DNS label bound).
    ns, cluster = "n" * 63, "c" * 63
    ref = ClusterRef(ns, cluster, "0f5b3c2e-2a47-4e39-9c1e-3d7b2f8a9c10")
    agent = agent_name(cluster, "prefill-9999", "node-" + "x" * 60)
    ca = pki.new_ca(ns, cluster, ref.uid)
    leaf = pki.issue_agent(ca, namespace=ns, cluster=cluster, agent=agent, dns_name=peer_dns_name(ref, agent))
    x509.load_pem_x509_certificate(leaf.cert_pem).verify_directly_issued_by(ca.cert)


def test_network_policy_admits_only_this_clusters_agents_and_metrics() -> None:
    policy = build_network_policy(REF, pdcluster().spec())
    agents = {"matchLabels": {"pdfabric.dev/cluster-uid": "uid-1", "app.kubernetes.io/component": "agent"}}
    assert policy["spec"]["podSelector"] == agents
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": agents}]},  # peer door and Mooncake's listeners: agents only
        {"ports": [{"protocol": "TCP", "port": 9400}]},  # probes and Prometheus
    ]
    assert policy["metadata"]["ownerReferences"] == [REF.owner_reference()]


def test_network_policy_admits_only_the_monitoring_namespace_to_metrics() -> None:
    policy = build_network_policy(REF, pdcluster().agent(metricsPort=9500).spec(), "monitoring")
    agents = {"matchLabels": {"pdfabric.dev/cluster-uid": "uid-1", "app.kubernetes.io/component": "agent"}}
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": agents}]},
        {"from": [{"namespaceSelector": monitoring}], "ports": [{"protocol": "TCP", "port": 9500}]},
    ]


def test_network_policy_admits_the_operators_namespace_to_metrics_too() -> None:
    """The operator reads each agent's /readyz (the transport it really carries)."""
    policy = build_network_policy(REF, pdcluster().spec(), "monitoring", "pdfabric-system")
    names = [
        s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for s in policy["spec"]["ingress"][1]["from"]
    ]
    assert names == ["monitoring", "pdfabric-system"]
    same = build_network_policy(REF, pdcluster().spec(), "monitoring", "monitoring")
    assert len(same["spec"]["ingress"][1]["from"]) == 1
    assert "from" not in build_network_policy(REF, pdcluster().spec(), "", "pdfabric-system")["spec"]["ingress"][1]


# --- spec.engine: engines in the node pods -----------------------------------------------------


def _engine_pod(builder, nodes):
    placement = _placed(builder, nodes)
    pods = build_agent_pods(REF, builder.spec(), placement)
    return placement, pods


def _containers(pod) -> dict[str, dict]:
    return {c["name"]: c for c in pod["spec"]["containers"]}


def _env(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_without_engine_the_pod_is_fabric_only() -> None:
    builder = pdcluster().prefill(tp=2).decode(tp=2)
    _, pods = _engine_pod(builder, [gpu_node("n1", 8)])
    assert len(pods) == 2
    for pod in pods:
        assert list(_containers(pod)) == ["agent"]
        assert _containers(pod)["agent"]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
        assert all(v["name"] != "dshm" for v in pod["spec"]["volumes"])
        assert not any(k.startswith("pdfabric.dev/serves-") for k in pod["metadata"]["labels"])


def _launches(container) -> list[dict]:
    """PDFABRIC_ENGINES as the agent will see it: the kubelet turns $$ into $ (no $(VAR) is ours)."""
    (value,) = [e["value"] for e in container["env"] if e["name"] == "PDFABRIC_ENGINES"]
    return json.loads(value.replace("$$", "$"))


def test_engine_pod_is_one_container_holding_every_gpu_of_its_ranks() -> None:
    builder = pdcluster().transport("nvlink-intra").prefill(tp=2).decode(replicas=3, tp=2).engine(image="sglang:pd")
    placement, (pod,) = _engine_pod(builder, [gpu_node("n1", 8)])  # one intra-node group: one pod
    (agent,) = pod["spec"]["containers"]
    assert agent["name"] == "agent" and agent["image"] == "sglang:pd"
    assert agent["command"] == ["pdfabric-agent"]  # the engine image's agent is the entrypoint
    res = agent["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "8"
    want = agent_device_requests(builder.spec(), placement.agents[0], placement.transport)["nvidia.com/gpu"]
    assert int(res["limits"]["nvidia.com/gpu"]) == want  # what the planner and the ledger count
    # No GPU grant but the device plugin's: no privilege, no host namespaces, no visible-devices env.
    spec = pod["spec"]
    assert not any(spec.get(k) for k in ("hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"))
    assert not (agent.get("securityContext") or {}).get("privileged")
    assert not {"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} & set(_env(agent))
    assert spec["terminationGracePeriodSeconds"] == 60
    labels = pod["metadata"]["labels"]
    assert labels["pdfabric.dev/serves-prefill"] == labels["pdfabric.dev/serves-decode"] == "true"


def test_engine_launches_are_the_pods_groups_with_their_gpus() -> None:
    from pdfabric_core.engines.groups import engine_launches
    from pdfabric_core.engines.launch import decode_launches, encode_launches

    builder = pdcluster().prefill(replicas=2, tp=2).decode(replicas=1, tp=4).engine()
    placement, pods = _engine_pod(builder, [gpu_node("n1", 8)])
    by_pod = [_launches(pod["spec"]["containers"][0]) for pod in pods]  # a pod per replica
    assert [[(x["name"], x["ranks"], x["gpus"]) for x in launches] for launches in by_pod] == [
        [("decode-0", [f"decode-0-tp{i}" for i in range(4)], [0, 1, 2, 3])],
        [("prefill-0", ["prefill-0-tp0-cp0", "prefill-0-tp1-cp0"], [0, 1])],
        [("prefill-1", ["prefill-1-tp0-cp0", "prefill-1-tp1-cp0"], [0, 1])],
    ]
    for pod, agent, launches in zip(pods, placement.agents, by_pod, strict=True):
        gpus = {r.rank_id: r.gpu for r in agent.ranks}
        assert all(x["gpus"] == [gpus[r] for r in x["ranks"]] for x in launches)
        # The same message core decodes (the agent's reading of it).
        (value,) = [e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == "PDFABRIC_ENGINES"]
        assert value == encode_launches(engine_launches(builder.spec(), agent.ranks))
        assert [x.name for x in decode_launches(value.replace("$$", "$"))] == [x["name"] for x in launches]
    (p1,) = by_pod[2]
    assert p1["argv"] == ["python3", "-m", "sglang.launch_server", "--disaggregation-mode", "prefill"]
    # Each pod has its own network: every replica serves on its role's first ports.
    assert (p1["port"], p1["bootstrapPort"], p1["tp"], p1["replica"]) == (30000, 8998, 2, 1)
    assert "bootstrapPort" not in by_pod[0][0] and by_pod[0][0]["port"] == 31000


def test_engine_pod_has_memory_backed_shm_and_the_token() -> None:
    builder = pdcluster().engine(sharedMemory="8Gi")
    _, (pod, _) = _engine_pod(builder, [gpu_node("n1", 8)])
    (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    (c,) = pod["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    assert mounts["engine-token"] == "/etc/pdfabric/engine-token"
    _, (unlimited, _) = _engine_pod(pdcluster().engine(), [gpu_node("n1", 8)])
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in unlimited["spec"]["volumes"]


def test_engine_args_keep_their_vars_and_dollars_for_the_agent() -> None:
    builder = pdcluster().engine(prefill={"args": ["--port", "$(PDFABRIC_PORT)", "--price", "$$5"]})
    _, (_, pod) = _engine_pod(builder, [gpu_node("n1", 8)])  # prefill-0
    (value,) = [e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == "PDFABRIC_ENGINES"]
    assert "$$(PDFABRIC_PORT)" in value  # escaped: the kubelet must not expand it in the agent's env
    assert _launches(pod["spec"]["containers"][0])[0]["argv"][-4:] == ["--port", "$(PDFABRIC_PORT)", "--price", "$$5"]


def test_engine_env_plain_in_the_launch_value_from_hoisted_for_the_kubelet() -> None:
    secret = {"secretKeyRef": {"name": "hf", "key": "token"}}
    builder = pdcluster().engine(
        prefill={"env": [{"name": "HF_HOME", "value": "/cache"}, {"name": "HF_TOKEN", "valueFrom": secret}]},
        decode={"env": [{"name": "HF_TOKEN", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]},
    )
    _, (decode_pod, prefill_pod) = _engine_pod(builder, [gpu_node("n1", 8)])
    # Each pod holds only its own engines' variables: the decode pod never sees prefill's Secret.
    for pod, want in (
        (prefill_pod, {"PDFABRIC_ENV_PREFILL_HF_TOKEN": secret}),
        (decode_pod, {"PDFABRIC_ENV_DECODE_HF_TOKEN": {"configMapKeyRef": {"name": "c", "key": "k"}}}),
    ):
        (c,) = pod["spec"]["containers"]
        hoisted = {e["name"]: e.get("valueFrom") for e in c["env"] if e["name"].startswith("PDFABRIC_ENV_")}
        assert hoisted == want
        assert "HF_HOME" not in _env(c) and "HF_TOKEN" not in _env(c)  # the engine's, not the agent's
    (p0,) = _launches(prefill_pod["spec"]["containers"][0])
    (d0,) = _launches(decode_pod["spec"]["containers"][0])
    assert p0["env"] == [
        {"name": "HF_HOME", "value": "/cache"},
        {"name": "HF_TOKEN", "fromContainer": "PDFABRIC_ENV_PREFILL_HF_TOKEN"},
    ]
    assert d0["env"] == [{"name": "HF_TOKEN", "fromContainer": "PDFABRIC_ENV_DECODE_HF_TOKEN"}]


def test_engine_ports_and_the_agents_probes() -> None:
    builder = (
        pdcluster()
        .transport("nvlink-intra")
        .decode(replicas=2)
        .engine(prefill={"healthPath": "/ready", "startupSeconds": 95})
    )
    _, (pod,) = _engine_pod(builder, [gpu_node("n1", 8)])  # an intra-node group: one pod, three engines
    (c,) = pod["spec"]["containers"]
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [
        ("peer", 7401),
        ("metrics", 9400),
        ("p-http-0", 30000),
        ("p-boot-0", 8998),
        ("d-http-0", 31000),
        ("d-http-1", 31001),
    ]
    names = [p["name"] for p in c["ports"]]
    assert len(names) == len(set(names)) and all(len(n) <= 15 for n in names)
    # The pod's probes are the agent's: /readyz answers 200 only when the agent and every engine
    # are ready (the agent probes each engine's health path itself, with its startup time).
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert "startupProbe" not in c
    p0 = _launches(c)[0]
    assert (p0["healthPath"], p0["startupSeconds"]) == ("/ready", 95)


def test_engine_resources_add_up_with_the_agents() -> None:
    builder = (
        pdcluster()
        .prefill(replicas=2, tp=1)
        .decode(replicas=1, tp=2)
        .agent(resources={"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}})
        .engine(
            prefill={"resources": {"requests": {"cpu": "4"}, "limits": {"memory": "64Gi"}}},
            decode={"resources": {"requests": {"cpu": 2, "memory": "512Mi"}, "limits": {"example.com/x": "1"}}},
        )
    )
    _, (decode, prefill_0, prefill_1) = _engine_pod(builder, [gpu_node("n1", 8)])
    # The agent's and its pod's engines': prefill cpu 0.5 + 4; memory requests 1Gi + 64Gi (a
    # limit stands for its request); memory limits 2Gi + 64Gi.
    for prefill in (prefill_0, prefill_1):
        res = prefill["spec"]["containers"][0]["resources"]
        assert res["requests"] == {"cpu": "4500m", "memory": "65Gi", "nvidia.com/gpu": "1"}
        assert res["limits"] == {"memory": "66Gi", "nvidia.com/gpu": "1"}
    # decode: cpu 0.5 + 2, memory 1Gi + 512Mi; limits 2Gi + 512Mi (its request stands for its missing limit).
    res = decode["spec"]["containers"][0]["resources"]
    assert res["requests"] == {"cpu": "2500m", "memory": "1536Mi", "example.com/x": "1", "nvidia.com/gpu": "2"}
    assert res["limits"] == {"memory": "2560Mi", "example.com/x": "1", "nvidia.com/gpu": "2"}


def test_sum_resources_refuses_what_is_no_quantity() -> None:
    from pdfabric_core.spec import SpecError
    from pdfabric_operator.engines import sum_resources

    with pytest.raises(SpecError, match="not a quantity"):
        sum_resources([{"requests": {"cpu": "1"}}, {"requests": {"cpu": "lots"}}])
    assert sum_resources([{}, {}]) == {"requests": {}, "limits": {}}


def test_engine_spec_change_replaces_the_pod_keeping_its_ranks() -> None:
    nodes = [gpu_node("n1", 8)]
    ann = "pdfabric.dev/pod-hash"
    variants = [
        pdcluster(),
        pdcluster().engine(),
        pdcluster().engine(image="pdfabric/refengine:v2"),
        pdcluster().engine(decode={"args": ["--other"]}),
        pdcluster().engine(prefill={"env": [{"name": "A", "value": "1"}]}),
        pdcluster().engine(decode={"port": 32000}),
        pdcluster().engine(sharedMemory="1Gi"),
    ]
    pairs = [_engine_pod(v, nodes)[1] for v in variants]  # (decode-0's pod, prefill-0's)
    assert len({tuple(p["metadata"]["annotations"][ann] for p in pods) for pods in pairs}) == len(variants)
    assert len({tuple(p["metadata"]["annotations"]["pdfabric.dev/ranks"] for p in pods) for pods in pairs}) == 1


def test_engine_groups_follow_the_nodes_ranks() -> None:
    from pdfabric_operator import engines

    builder = pdcluster().transport("nvlink-intra").prefill(replicas=1, tp=2).decode(replicas=2, tp=1).engine()
    placement = _placed(builder, [gpu_node("n1", 8)])
    groups = engines.groups(placement.agents[0])
    assert [(g.name, g.index, [r.rank_id for r in g.ranks]) for g in groups] == [
        ("prefill-0", 0, ["prefill-0-tp0-cp0", "prefill-0-tp1-cp0"]),
        ("decode-0", 0, ["decode-0-tp0"]),
        ("decode-1", 1, ["decode-1-tp0"]),
    ]


def test_engine_replicas_are_never_split_across_nodes() -> None:
    nodes = [gpu_node("n1", 3), gpu_node("n2", 3)]
    split = plan_placement(pdcluster().prefill(tp=4).spec(), nodes, [], cluster_uid="u")
    assert isinstance(split, Placement)  # fabric-only: a replica larger than a node is spread
    assert {r.rank_id.split("-tp")[0] for a in split.agents for r in a.ranks if r.role == "prefill"} == {"prefill-0"}
    assert sum(1 for a in split.agents if any(r.role == "prefill" for r in a.ranks)) == 2
    whole = plan_placement(pdcluster().prefill(tp=4).engine().spec(), nodes, [], cluster_uid="u")
    assert not isinstance(whole, Placement)
    assert whole.reason == "InsufficientGPUs" and "spec.engine" in whole.message


def test_engine_services_one_headless_per_role_with_a_port_per_kth_engine() -> None:
    from pdfabric_core.policy.types import Role

    # An intra-node group's pod runs a prefill engine and the two decode engines it feeds.
    builder = pdcluster().transport("nvlink-intra").decode(replicas=2).engine()
    placement = _placed(builder, [gpu_node("n1", 8)])
    assert build_engine_service(REF, pdcluster().spec(), placement, Role.PREFILL) is None
    pre = build_engine_service(REF, builder.spec(), placement, Role.PREFILL)
    dec = build_engine_service(REF, builder.spec(), placement, Role.DECODE)
    assert pre["metadata"]["name"] == "pd-prefill" and dec["metadata"]["name"] == "pd-decode"
    assert pre["spec"]["clusterIP"] == "None" and not pre["spec"].get("publishNotReadyAddresses")
    assert pre["spec"]["selector"] == {"pdfabric.dev/cluster-uid": "uid-1", "pdfabric.dev/serves-prefill": "true"}
    assert [(p["name"], p["port"], p["targetPort"]) for p in pre["spec"]["ports"]] == [
        ("http-0", 30000, "p-http-0"),
        ("boot-0", 8998, "p-boot-0"),
    ]
    assert [(p["name"], p["port"], p["targetPort"]) for p in dec["spec"]["ports"]] == [
        ("http-0", 31000, "d-http-0"),
        ("http-1", 31001, "d-http-1"),
    ]
    assert pre["metadata"]["ownerReferences"] == [REF.owner_reference()]


def test_network_policy_admits_engine_serving_ports_only_with_engines() -> None:
    assert len(build_network_policy(REF, pdcluster().spec())["spec"]["ingress"]) == 2
    ingress = build_network_policy(REF, pdcluster().engine().spec())["spec"]["ingress"]
    assert ingress[-1] == {
        "ports": [
            {"protocol": "TCP", "port": 30000, "endPort": 30063},
            {"protocol": "TCP", "port": 31000, "endPort": 31063},
        ]
    }


def test_router_deployment_names_every_engine_as_its_worker() -> None:
    builder = pdcluster().prefill(replicas=2, tp=2).decode(replicas=1, tp=4).engine()
    builder = builder.router(args=["--policy", "cache_aware"], replicas=2, nodeSelector={"pool": "cpu"})
    placement = _placed(builder, [gpu_node("n1", 8)])
    spec = builder.spec()
    dep = build_router_deployment(REF, spec, placement)
    assert dep is not None and dep["kind"] == "Deployment" and dep["metadata"]["name"] == "pd-router"
    assert dep["metadata"]["ownerReferences"] == [REF.owner_reference()]
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]

    def host(unit: str) -> str:
        return f"{agent_name('pd', unit, 'n1')}.pd-agents.{REF.namespace}.svc"

    assert c["command"] == ["python3", "-m", "sglang_router.launch_router"]
    assert c["args"] == [
        "--pd-disaggregation",
        "--prefill", f"http://{host('prefill-0')}:30000", "8998",
        "--prefill", f"http://{host('prefill-1')}:30000", "8998",
        "--decode", f"http://{host('decode-0')}:31000",
        "--host", "0.0.0.0", "--port", "8000",
        "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000",
        "--policy", "cache_aware",
    ]  # fmt: skip
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8000), ("metrics", 29000)]
    # Ready only with a healthy worker of each kind (its /health says 200 with none).
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert dep["spec"]["replicas"] == 2 and pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    # A rolling update never leaves the cluster without a router; no GPU, no API credentials.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert "resources" not in c and pod["spec"]["automountServiceAccountToken"] is False
    # Its pods are not agent pods (the operator's agent index selects component=agent).
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    svc = build_router_service(REF, spec)
    assert svc is not None and svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    # What it is built from is in its hash: another placement, another hash.
    other = build_router_deployment(REF, spec, _placed(builder, [gpu_node("n2", 8)]))
    assert other is not None
    assert other["metadata"]["annotations"] != dep["metadata"]["annotations"]


def test_a_vllm_router_pairs_by_url_and_waits_for_its_workers_as_long_as_the_engines_start() -> None:
    """vllm-router: no bootstrap ports (prefill's answer tells decode where the KV is), vLLM's P/D
    protocol, and since it listens only once its workers are healthy, their startup allowance to
    wait and a startup probe as long before the liveness probe counts."""
    builder = pdcluster().prefill(replicas=1, tp=1).decode(replicas=1, tp=1)
    builder = builder.engine(prefill={"command": ["vllm"], "startupSeconds": 900}).router(kind="vllm")
    dep = build_router_deployment(REF, builder.spec(), _placed(builder, [gpu_node("n1", 8)]))
    assert dep is not None
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    prefill, decode = (f"{agent_name('pd', u, 'n1')}.pd-agents.{REF.namespace}.svc" for u in ("prefill-0", "decode-0"))
    assert c["command"] == ["vllm-router"]
    assert c["args"] == [
        "--vllm-pd-disaggregation",
        "--prefill", f"http://{prefill}:30000",
        "--decode", f"http://{decode}:31000",
        "--kv-connector", "nixl",
        "--host", "0.0.0.0", "--port", "8000",
        "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000",
        "--worker-startup-timeout-secs", "1800",  # decode's default outlasts prefill's 900
    ]  # fmt: skip
    probe = c["startupProbe"]
    assert probe["httpGet"] == {"path": "/liveness", "port": "http"}
    assert probe["periodSeconds"] * probe["failureThreshold"] > 1800
    # The user's command stands over the kind's.
    custom = builder.router(kind="vllm", command=["/opt/router/bin/vllm-router"]).spec()
    dep = build_router_deployment(REF, custom, _placed(builder, [gpu_node("n1", 8)]))
    assert dep is not None and dep["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "/opt/router/bin/vllm-router"
    ]


def test_an_sglang_router_has_no_startup_probe() -> None:
    builder = pdcluster().engine().router()
    dep = build_router_deployment(REF, builder.spec(), _placed(builder, [gpu_node("n1", 8)]))
    assert dep is not None and "startupProbe" not in dep["spec"]["template"]["spec"]["containers"][0]


def test_no_router_without_spec_router() -> None:
    builder = pdcluster().engine()
    assert build_router_deployment(REF, builder.spec(), _placed(builder, [gpu_node("n1", 8)])) is None
    assert build_router_service(REF, builder.spec()) is None


def test_nvlink_pods_are_pinned_to_their_node_its_domain_and_the_selector() -> None:
    builder = pdcluster().transport("nvlink").placement(nodeSelector={"pool": "pd"}).prefill(tp=4).decode(tp=4)
    nodes = [gpu_node("x1", 4, clique="x", labels={"pool": "pd"}), gpu_node("x2", 4, clique="x", labels={"pool": "pd"})]
    pods = build_agent_pods(REF, builder.spec(), _placed(builder, nodes))
    for pod in pods:
        (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        node = pod["metadata"]["annotations"]["pdfabric.dev/node"]
        assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": [node]}]
        assert term["matchExpressions"] == [
            {"key": "nvidia.com/gpu.clique", "operator": "In", "values": ["x"]},
            {"key": "pool", "operator": "In", "values": ["pd"]},
        ]
    assert sorted(p["metadata"]["annotations"]["pdfabric.dev/node"] for p in pods) == ["x1", "x2"]


WEIGHTS = {"name": "weights", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}}
OVERRIDES = {
    "labels": {"team": "inference"},
    "annotations": {"example.com/owner": "ml"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
    "priorityClassName": "inference-high",
    "serviceAccountName": "weights-reader",
    "imagePullSecrets": [{"name": "registry"}],
    "volumes": [WEIGHTS],
    "volumeMounts": [{"name": "weights", "mountPath": "/models", "readOnly": True}],
    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
}


@pytest.mark.parametrize("engine", [False, True])
def test_node_pod_carries_the_users_overrides_after_the_operators(engine: bool) -> None:
    base = pdcluster().engine() if engine else pdcluster()
    builder = (pdcluster().engine() if engine else pdcluster()).agent(pod=OVERRIDES)
    nodes = [gpu_node("n1", 8)]
    plain, *_ = build_agent_pods(REF, base.spec(), _placed(base, nodes))
    pod, *_ = build_agent_pods(REF, builder.spec(), _placed(builder, nodes))
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    (plain_container,) = plain["spec"]["containers"]
    assert spec["volumes"] == [*plain["spec"]["volumes"], WEIGHTS]
    assert container["volumeMounts"] == [*plain_container["volumeMounts"], OVERRIDES["volumeMounts"][0]]
    assert container["env"] == [*plain_container["env"], {"name": "HF_HUB_OFFLINE", "value": "1"}]
    assert spec["tolerations"] == [*plain["spec"]["tolerations"], OVERRIDES["tolerations"][0]]
    assert (spec["priorityClassName"], spec["serviceAccountName"]) == ("inference-high", "weights-reader")
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["automountServiceAccountToken"] is False
    assert spec["affinity"]["podAntiAffinity"] == OVERRIDES["affinity"]["podAntiAffinity"]
    assert spec["affinity"]["nodeAffinity"] == plain["spec"]["affinity"]["nodeAffinity"]
    assert pod["metadata"]["labels"] == {**plain["metadata"]["labels"], "team": "inference"}
    annotations = pod["metadata"]["annotations"]
    assert annotations["example.com/owner"] == "ml"
    assert annotations["pdfabric.dev/ranks"] == plain["metadata"]["annotations"]["pdfabric.dev/ranks"]
    # The contract is untouched: ports, security contexts, the operator's volumes and Secrets.
    for key in ("ports", "securityContext", "resources", "readinessProbe", "livenessProbe", "command"):
        assert container[key] == plain_container[key]
    assert spec["securityContext"] == plain["spec"]["securityContext"]
    assert annotations["pdfabric.dev/pod-hash"] != plain["metadata"]["annotations"]["pdfabric.dev/pod-hash"]


@pytest.mark.parametrize(
    "change",
    [
        {"annotations": {"a": "b"}},
        {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}},
        {"labels": {"a": "b"}},
        {"priorityClassName": "p"},
    ],
    ids=["annotations", "affinity", "labels", "priority-class"],
)
def test_an_override_change_replaces_the_pod_keeping_its_ranks(change: dict) -> None:
    nodes = [gpu_node("n1", 8)]
    before = build_agent_pods(REF, pdcluster().spec(), _placed(pdcluster(), nodes))[0]["metadata"]["annotations"]
    changed = pdcluster().agent(pod=change)
    after = build_agent_pods(REF, changed.spec(), _placed(changed, nodes))[0]["metadata"]["annotations"]
    assert before["pdfabric.dev/pod-hash"] != after["pdfabric.dev/pod-hash"]
    assert before["pdfabric.dev/ranks"] == after["pdfabric.dev/ranks"]


def test_router_pods_carry_the_users_overrides() -> None:
    builder = pdcluster().engine().router(pod=OVERRIDES)
    plain_builder = pdcluster().engine().router()
    placement = _placed(builder, [gpu_node("n1", 8)])
    dep = build_router_deployment(REF, builder.spec(), placement)
    plain = build_router_deployment(REF, plain_builder.spec(), placement)
    assert dep is not None and plain is not None
    template, plain_template = dep["spec"]["template"], plain["spec"]["template"]
    spec, (container,) = template["spec"], template["spec"]["containers"]
    assert spec["volumes"] == [WEIGHTS] and container["volumeMounts"] == OVERRIDES["volumeMounts"]
    assert container["env"] == OVERRIDES["env"]
    assert spec["tolerations"] == OVERRIDES["tolerations"] and spec["affinity"] == OVERRIDES["affinity"]
    assert (spec["priorityClassName"], spec["serviceAccountName"]) == ("inference-high", "weights-reader")
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert template["metadata"]["labels"] == {**plain_template["metadata"]["labels"], "team": "inference"}
    assert template["metadata"]["annotations"] == {"example.com/owner": "ml"}
    assert dep["spec"]["selector"] == plain["spec"]["selector"]
    assert container["securityContext"] == plain_template["spec"]["containers"][0]["securityContext"]
    assert dep["metadata"]["annotations"] != plain["metadata"]["annotations"], "the Deployment rolls"


def test_every_label_and_annotation_the_operator_writes_is_reserved_from_the_user() -> None:
    from pdfabric_core.spec.pod_overrides import RESERVED_KEY_PREFIX, RESERVED_LABELS, RESERVED_VOLUMES
    from pdfabric_operator import constants as c

    builder = pdcluster().engine()
    pod, *_ = build_agent_pods(REF, builder.spec(), _placed(builder, [gpu_node("n1", 8)]))
    for key in pod["metadata"]["labels"]:
        assert key in RESERVED_LABELS or key.startswith(RESERVED_KEY_PREFIX), key
    assert all(key.startswith(RESERVED_KEY_PREFIX) for key in pod["metadata"]["annotations"])
    assert {v["name"] for v in pod["spec"]["volumes"]} <= set(RESERVED_VOLUMES)
    assert c.FINALIZER.startswith(RESERVED_KEY_PREFIX)


@pytest.mark.parametrize("transport", ["tcp", "rdma", "nvlink"])
def test_the_rank_map_of_the_largest_pdcluster_the_crd_admits_fits_one_configmap(transport: str) -> None:
    # Issue 47: 8,192 ranks (the CRD's bound) in 1,024 agents. Spelled out, every prefill replica's
    # feeds and an indented JSON made this 11 MB at 16,000 ranks; a ConfigMap holds 1 MiB.
    builder = pdcluster().transport(transport).prefill(replicas=512, tp=8).decode(replicas=512, tp=8)
    spec = builder.spec()
    assert spec.ranks == MAX_RANKS
    nodes = [gpu_node(f"n{i:04d}", 8, clique="d0", rdma=1) for i in range(1024)]
    placement = plan_placement(spec, nodes, [], cluster_uid="uid-big")
    assert isinstance(placement, Placement) and len(placement.agents) == 1024
    ref = ClusterRef("ns", "big", "uid-big")
    cm = build_rankmap_configmap(ref, build_rankmap(ref, builder.raw_spec(), placement))
    size = sum(len(k) + len(v.encode()) for k, v in cm["data"].items())
    assert size < 1024 * 1024 * 3 // 4, f"{size} bytes: a quarter of a ConfigMap's room must stay free"
    again = RankMap.from_json(cm["data"]["rankmap.json"])
    assert sum(len(a.ranks) for a in again.agents) == MAX_RANKS and again.feeds == {}
