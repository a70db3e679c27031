"""Builders: child objects are deterministic, owned, labelled, and carry the agent contract."""

from __future__ import annotations

import base64

import pytest
from cryptography import x509

from pdfabric_core.rankmap import Rank, RankMap
from pdfabric_operator import builders as b
from pdfabric_operator import pki
from pdfabric_operator.planner import Placement, plan_placement
from tests.builders import gpu_node, pdcluster

REF = b.ClusterRef("ns", "pd", "uid-1")


def _placed(builder, nodes) -> Placement:
    result = plan_placement(builder.spec(), nodes, [], cluster_uid=REF.uid)
    assert isinstance(result, Placement)
    return result


# (id, cluster, node, expected name)
NAME_CASES = [
    ("short", "pd", "gpu-1", "pd-gpu-1-" + b._short_hash("gpu-1")),
    ("dots-become-dashes", "pd", "node.rack.a", "pd-node-rack-a-" + b._short_hash("node.rack.a")),
    ("long-truncated", "c" * 40, "n" * 40, ("c" * 40 + "-" + "n" * 14) + "-" + b._short_hash("n" * 40)),
]


@pytest.mark.parametrize(("cluster", "node", "expected"), [c[1:] for c in NAME_CASES], ids=[c[0] for c in NAME_CASES])
def test_agent_name(cluster: str, node: str, expected: str) -> None:
    name = b.agent_name(cluster, node)
    assert name == expected
    assert len(name) <= 63


def test_agent_names_distinct_when_truncation_collides() -> None:
    assert b.agent_name("pd", "x" * 80 + "a") != b.agent_name("pd", "x" * 80 + "b")


def test_rank_annotation_round_trips() -> None:
    ranks = (Rank("prefill", 1, 2, 3, 1, 0), Rank("decode", 0, 7, 0, 0, 5))
    assert b.decode_ranks(b.encode_ranks(ranks)) == ranks


def test_agent_pod_contract() -> None:
    builder = pdcluster().transport("rdma").prefill(tp=2).decode(tp=2).agent(resources={"limits": {"memory": "1Gi"}})
    placement = _placed(builder, [gpu_node("n1", 8, rdma=2)])
    (pod,) = b.build_agent_pods(REF, builder.spec(), placement)
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert spec["nodeName"] == "n1"
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
    assert container["resources"]["limits"] == {"memory": "1Gi", "nvidia.com/gpu": "4", "rdma/hca": "1"}
    assert container["resources"]["requests"] == {"nvidia.com/gpu": "4", "rdma/hca": "1"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {
        "rankmap": "/etc/pdfabric",
        "engine-token": "/etc/pdfabric/engine-token",
        "peer-tls": "/etc/pdfabric/peer-tls",
    }
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    # Its own certificate only: the Secret is named after this pod; the CA's key is in none of them.
    assert secrets == {"engine-token": "pd-engine-token", "peer-tls": f"{pod['metadata']['name']}-peer-tls"}
    assert spec["subdomain"] == b.service_name("pd")
    assert pod["metadata"]["ownerReferences"] == [REF.owner_reference()]
    assert pod["metadata"]["labels"]["pdfabric.dev/cluster-uid"] == "uid-1"
    assert b.decode_ranks(pod["metadata"]["annotations"]["pdfabric.dev/ranks"]) == placement.agents[0].ranks


def test_tcp_pod_requests_no_rdma() -> None:
    builder = pdcluster()
    (pod,) = b.build_agent_pods(REF, builder.spec(), _placed(builder, [gpu_node("n1", 8, rdma=2)]))
    assert "rdma/hca" not in pod["spec"]["containers"][0]["resources"]["limits"]


def test_pod_hash_changes_with_ranks_only() -> None:
    nodes = [gpu_node("n1", 8)]
    one = b.build_agent_pods(REF, pdcluster().spec(), _placed(pdcluster(), nodes))[0]
    same = b.build_agent_pods(REF, pdcluster().spec(), _placed(pdcluster(), nodes))[0]
    more = pdcluster().prefill(tp=2)
    other = b.build_agent_pods(REF, more.spec(), _placed(more, nodes))[0]
    key = "pdfabric.dev/pod-hash"
    assert one["metadata"]["annotations"][key] == same["metadata"]["annotations"][key]
    assert one["metadata"]["annotations"][key] != other["metadata"]["annotations"][key]


def test_rankmap_configmap_round_trips() -> None:
    builder = pdcluster().transport("nvlink").prefill(replicas=2, tp=4).decode(tp=8)
    placement = _placed(
        builder, [gpu_node("a", 8, clique="x"), gpu_node("b", 8, clique="x"), gpu_node("c", 8, clique="x")]
    )
    rankmap = b.build_rankmap(REF, builder.raw_spec(), placement)
    cm = b.build_rankmap_configmap(REF, rankmap)
    back = RankMap.from_json(cm["data"]["rankmap.json"])
    assert back == rankmap
    assert back.transport == "nvlink"
    assert {a.domain for a in back.agents} == {"x"}
    assert [a.name for a in back.agents] == [b.agent_name("pd", a.node) for a in placement.agents]
    assert cm["metadata"]["annotations"]["pdfabric.dev/rankmap-hash"]


def test_service_is_headless_and_selects_agents() -> None:
    svc = b.build_headless_service(REF, pdcluster().spec())
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"pdfabric.dev/cluster-uid": "uid-1", "app.kubernetes.io/component": "agent"}
    assert {p["port"] for p in svc["spec"]["ports"]} == {7401, 9400}


def test_secret_holds_the_engine_token() -> None:
    secret = b.build_engine_token_secret(REF, "s3cret")
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
    before = b.build_agent_pods(REF, base.spec(), _placed(base, nodes))[0]["metadata"]["annotations"]
    after = b.build_agent_pods(REF, changed.spec(), _placed(changed, nodes))[0]["metadata"]["annotations"]
    assert (before["pdfabric.dev/pod-hash"] != after["pdfabric.dev/pod-hash"]) is replaced
    assert before["pdfabric.dev/ranks"] == after["pdfabric.dev/ranks"]


# (id, transport, node, expected extended requests of the one agent)
DEVICE_CASES = [
    ("tcp-gpus-only", "tcp", gpu_node("n1", 8, rdma=2), {"nvidia.com/gpu": 2}),
    ("rdma-one-device", "rdma", gpu_node("n1", 8, rdma=2), {"nvidia.com/gpu": 2, "rdma/hca": 1}),
    ("intra-node-gpus-only", "nvlink-intra", gpu_node("n1", 8), {"nvidia.com/gpu": 2}),
]


@pytest.mark.parametrize(
    ("transport", "node", "expected"), [c[1:] for c in DEVICE_CASES], ids=[c[0] for c in DEVICE_CASES]
)
def test_agent_device_requests_follow_the_transport_traits(transport: str, node, expected: dict[str, int]) -> None:
    builder = pdcluster().transport(transport)
    placement = _placed(builder, [node])
    (agent,) = placement.agents
    assert b.agent_device_requests(builder.spec(), agent, placement.transport) == expected


def test_shared_children_are_the_objects_every_agent_mounts_or_resolves() -> None:
    assert b.shared_children("pd") == [
        ("ConfigMap", "pd-rankmap"),
        ("Service", "pd-agents"),
        ("Secret", "pd-engine-token"),
        ("Secret", "pd-peer-ca"),
        ("NetworkPolicy", "pd-agents"),
        ("Service", "pd-prefill"),
        ("Service", "pd-decode"),
    ]


def test_headless_service_carries_the_peer_door_not_the_engine_door() -> None:
    svc = b.build_headless_service(REF, pdcluster().spec())
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("peer", 7401), ("metrics", 9400)]


def test_secrets_are_owned_and_the_ca_key_is_only_in_the_ca_secret() -> None:
    ca = pki.new_ca("ns", "pd", "uid-1")
    agent = b.agent_name("pd", "n1")
    leaf = pki.issue_agent(ca, namespace="ns", cluster="pd", agent=agent, dns_name=b.peer_dns_name(REF, agent))
    ca_secret = b.build_ca_secret(REF, ca)
    tls = b.build_peer_tls_secret(REF, agent, leaf, ca)
    for secret in (ca_secret, tls, b.build_engine_token_secret(REF, "t" * 32)):
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
    assert b.ca_from_secret(as_read) == ca


def test_certificates_for_the_longest_names_the_api_allows() -> None:
    # A 63-character namespace and cluster, and a 63-character agent name (the DNS label bound).
    ns, cluster = "n" * 63, "c" * 63
    ref = b.ClusterRef(ns, cluster, "0f5b3c2e-2a47-4e39-9c1e-3d7b2f8a9c10")
    agent = b.agent_name(cluster, "node-" + "x" * 60)
    ca = pki.new_ca(ns, cluster, ref.uid)
    leaf = pki.issue_agent(ca, namespace=ns, cluster=cluster, agent=agent, dns_name=b.peer_dns_name(ref, agent))
    x509.load_pem_x509_certificate(leaf.cert_pem).verify_directly_issued_by(ca.cert)


def test_network_policy_admits_only_this_clusters_agents_and_metrics() -> None:
    policy = b.build_network_policy(REF, pdcluster().spec())
    agents = {"matchLabels": {"pdfabric.dev/cluster-uid": "uid-1", "app.kubernetes.io/component": "agent"}}
    assert policy["spec"]["podSelector"] == agents
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": agents}]},  # peer door and Mooncake's listeners: agents only
        {"ports": [{"protocol": "TCP", "port": 9400}]},  # probes and Prometheus
    ]
    assert policy["metadata"]["ownerReferences"] == [REF.owner_reference()]


def test_network_policy_admits_only_the_monitoring_namespace_to_metrics() -> None:
    policy = b.build_network_policy(REF, pdcluster().agent(metricsPort=9500).spec(), "monitoring")
    agents = {"matchLabels": {"pdfabric.dev/cluster-uid": "uid-1", "app.kubernetes.io/component": "agent"}}
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": agents}]},
        {"from": [{"namespaceSelector": monitoring}], "ports": [{"protocol": "TCP", "port": 9500}]},
    ]


def test_network_policy_admits_the_operators_namespace_to_metrics_too() -> None:
    """The operator reads each agent's /readyz (the transport it really carries)."""
    policy = b.build_network_policy(REF, pdcluster().spec(), "monitoring", "pdfabric-system")
    names = [
        s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for s in policy["spec"]["ingress"][1]["from"]
    ]
    assert names == ["monitoring", "pdfabric-system"]
    same = b.build_network_policy(REF, pdcluster().spec(), "monitoring", "monitoring")
    assert len(same["spec"]["ingress"][1]["from"]) == 1
    assert "from" not in b.build_network_policy(REF, pdcluster().spec(), "", "pdfabric-system")["spec"]["ingress"][1]


# --- spec.engine: engines in the node pods -----------------------------------------------------


def _engine_pod(builder, nodes):
    placement = _placed(builder, nodes)
    pods = b.build_agent_pods(REF, builder.spec(), placement)
    return placement, pods


def _containers(pod) -> dict[str, dict]:
    return {c["name"]: c for c in pod["spec"]["containers"]}


def _env(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_without_engine_the_pod_is_fabric_only() -> None:
    builder = pdcluster().prefill(tp=2).decode(tp=2)
    _, (pod,) = _engine_pod(builder, [gpu_node("n1", 8)])
    assert list(_containers(pod)) == ["agent"]
    assert _containers(pod)["agent"]["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert all(v["name"] != "dshm" for v in pod["spec"]["volumes"])
    assert not any(k.startswith("pdfabric.dev/serves-") for k in pod["metadata"]["labels"])


def test_engine_pod_runs_one_container_per_group_with_exactly_its_gpus() -> None:
    builder = pdcluster().prefill(replicas=2, tp=2).decode(replicas=1, tp=4).engine()
    placement, (pod,) = _engine_pod(builder, [gpu_node("n1", 8)])
    containers = _containers(pod)
    assert list(containers) == ["agent", "prefill-0", "prefill-1", "decode-0"]
    gpus = {n: c["resources"]["limits"].get("nvidia.com/gpu") for n, c in containers.items()}
    assert gpus == {"agent": None, "prefill-0": "2", "prefill-1": "2", "decode-0": "4"}
    for c in containers.values():
        assert c["resources"]["requests"].get("nvidia.com/gpu") == c["resources"]["limits"].get("nvidia.com/gpu")
    # The pod's total is what the planner and the ledger count.
    total = sum(int(g or 0) for g in gpus.values())
    assert total == b.agent_device_requests(builder.spec(), placement.agents[0], placement.transport)["nvidia.com/gpu"]
    # No GPU grant but the device plugin's: no privilege, no host namespaces, no visible-devices env.
    spec = pod["spec"]
    assert not any(spec.get(k) for k in ("hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"))
    for c in containers.values():
        assert not (c.get("securityContext") or {}).get("privileged")
        assert not {"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} & set(_env(c))
    labels = pod["metadata"]["labels"]
    assert labels["pdfabric.dev/serves-prefill"] == labels["pdfabric.dev/serves-decode"] == "true"


def test_engine_containers_share_shm_and_the_token_with_the_agent() -> None:
    builder = pdcluster().engine(sharedMemory="8Gi")
    _, (pod,) = _engine_pod(builder, [gpu_node("n1", 8)])
    (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    for c in pod["spec"]["containers"]:
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["dshm"] == "/dev/shm", c["name"]
        assert mounts["engine-token"] == "/etc/pdfabric/engine-token", c["name"]
    engine_mounts = {m["name"] for m in _containers(pod)["prefill-0"]["volumeMounts"]}
    assert engine_mounts == {"dshm", "engine-token"}  # not the agent's peer key, not the rank map


def test_engine_env_is_the_sglang_plugins_contract() -> None:
    builder = pdcluster().prefill(replicas=2, tp=1).decode(replicas=1, tp=2).agent(apiPort=7500).engine()
    _, (pod,) = _engine_pod(builder, [gpu_node("n1", 8)])
    c = _containers(pod)
    p1, d0 = _env(c["prefill-1"]), _env(c["decode-0"])
    assert p1["PDFABRIC_ENGINE_TOKEN_FILE"] == "/etc/pdfabric/engine-token/token"
    assert p1["PDFABRIC_AGENT_ADDRESS"] == d0["PDFABRIC_AGENT_ADDRESS"] == "127.0.0.1:7500"
    assert (p1["PDFABRIC_REPLICA"], d0["PDFABRIC_REPLICA"]) == ("1", "0")
    assert p1["PDFABRIC_RANK"] == "prefill-1-tp0-cp0"  # one rank: its id outright
    assert "PDFABRIC_RANK" not in d0  # two ranks: the plugin derives each from its engine rank
    assert p1["PDFABRIC_CP_RANK"] == d0["PDFABRIC_CP_RANK"] == "0"
    assert (p1["PDFABRIC_PORT"], p1["PDFABRIC_BOOTSTRAP_PORT"], d0["PDFABRIC_PORT"]) == ("30001", "8999", "31000")
    assert (d0["PDFABRIC_GPUS"], d0["PDFABRIC_TP"], d0["PDFABRIC_ROLE"]) == ("2", "2", "decode")
    assert "PDFABRIC_BOOTSTRAP_PORT" not in d0
    assert p1["PDFABRIC_SHM_DIR"] == "/dev/shm"


def test_prefill_cp_group_leaves_the_cp_rank_to_the_engine() -> None:
    builder = pdcluster().prefill(tp=1, cp=2).engine()
    _, (pod,) = _engine_pod(builder, [gpu_node("n1", 8)])
    env = _env(_containers(pod)["prefill-0"])
    assert "PDFABRIC_CP_RANK" not in env and env["PDFABRIC_CP"] == "2" and env["PDFABRIC_GPUS"] == "2"


def test_engine_ports_and_probes() -> None:
    builder = pdcluster().prefill(replicas=2).engine(prefill={"healthPath": "/ready", "startupSeconds": 95})
    _, (pod,) = _engine_pod(builder, [gpu_node("n1", 8)])
    c = _containers(pod)
    ports = {n: [(p["name"], p["containerPort"]) for p in x["ports"]] for n, x in c.items() if n != "agent"}
    assert ports == {
        "prefill-0": [("p-http-0", 30000), ("p-boot-0", 8998)],
        "prefill-1": [("p-http-1", 30001), ("p-boot-1", 8999)],
        "decode-0": [("d-http-0", 31000)],
    }
    names = [p["name"] for x in c.values() for p in x["ports"]]
    assert len(names) == len(set(names)) and all(len(n) <= 15 for n in names)
    p1 = c["prefill-1"]
    assert p1["startupProbe"]["httpGet"] == p1["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "p-http-1"}
    assert p1["startupProbe"]["periodSeconds"] * p1["startupProbe"]["failureThreshold"] >= 95
    assert p1["livenessProbe"]["tcpSocket"] == {"port": "p-http-1"}
    assert c["decode-0"]["readinessProbe"]["httpGet"] == {"path": "/health", "port": "d-http-0"}


def test_engine_command_args_env_and_resources_are_the_users() -> None:
    builder = pdcluster().engine(
        image="sglang:pd",
        prefill={
            "command": ["python3", "-m", "sglang.launch_server"],
            "args": ["--port", "$(PDFABRIC_PORT)"],
            "env": [
                {"name": "HF_HOME", "value": "/cache"},
                {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "x"}}},
            ],
            "resources": {"requests": {"cpu": "4"}, "limits": {"memory": "64Gi"}},
        },
    )
    _, (pod,) = _engine_pod(builder, [gpu_node("n1", 8)])
    p0 = _containers(pod)["prefill-0"]
    assert p0["image"] == "sglang:pd"
    assert p0["command"] == ["python3", "-m", "sglang.launch_server"]
    assert p0["args"] == ["--port", "$(PDFABRIC_PORT)"]
    assert p0["env"][:2] == [
        {"name": "HF_HOME", "value": "/cache"},
        {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "x"}}},
    ]
    assert p0["resources"] == {
        "requests": {"cpu": "4", "nvidia.com/gpu": "1"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "1"},
    }
    assert "command" not in _containers(pod)["decode-0"]  # the image's entrypoint, with its args


def test_engine_spec_change_replaces_the_pod_keeping_its_ranks() -> None:
    nodes = [gpu_node("n1", 8)]
    base = pdcluster().engine()
    _, (before,) = _engine_pod(base, nodes)
    _, (fabric,) = _engine_pod(pdcluster(), nodes)
    _, (after,) = _engine_pod(pdcluster().engine(image="pdfabric/refengine:v2"), nodes)
    ann = "pdfabric.dev/pod-hash"
    assert (
        len(
            {
                before["metadata"]["annotations"][ann],
                after["metadata"]["annotations"][ann],
                fabric["metadata"]["annotations"][ann],
            }
        )
        == 3
    )
    assert (
        before["metadata"]["annotations"]["pdfabric.dev/ranks"]
        == after["metadata"]["annotations"]["pdfabric.dev/ranks"]
    )


def test_engine_groups_follow_the_nodes_ranks() -> None:
    from pdfabric_operator import engines

    builder = pdcluster().transport("nvlink-intra").prefill(replicas=1, tp=2).decode(replicas=2, tp=1).engine()
    placement = _placed(builder, [gpu_node("n1", 8)])
    groups = engines.engine_groups(placement.agents[0])
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

    builder = pdcluster().prefill(replicas=2).decode(replicas=1).engine()
    placement = _placed(builder, [gpu_node("n1", 8)])
    assert b.build_engine_service(REF, pdcluster().spec(), placement, Role.PREFILL) is None
    pre = b.build_engine_service(REF, builder.spec(), placement, Role.PREFILL)
    dec = b.build_engine_service(REF, builder.spec(), placement, Role.DECODE)
    assert pre["metadata"]["name"] == "pd-prefill" and dec["metadata"]["name"] == "pd-decode"
    assert pre["spec"]["clusterIP"] == "None" and not pre["spec"].get("publishNotReadyAddresses")
    assert pre["spec"]["selector"] == {"pdfabric.dev/cluster-uid": "uid-1", "pdfabric.dev/serves-prefill": "true"}
    assert [(p["name"], p["port"], p["targetPort"]) for p in pre["spec"]["ports"]] == [
        ("http-0", 30000, "p-http-0"),
        ("boot-0", 8998, "p-boot-0"),
        ("http-1", 30001, "p-http-1"),
        ("boot-1", 8999, "p-boot-1"),
    ]
    assert [(p["name"], p["port"], p["targetPort"]) for p in dec["spec"]["ports"]] == [("http-0", 31000, "d-http-0")]
    assert pre["metadata"]["ownerReferences"] == [REF.owner_reference()]


def test_network_policy_admits_engine_serving_ports_only_with_engines() -> None:
    assert len(b.build_network_policy(REF, pdcluster().spec())["spec"]["ingress"]) == 2
    ingress = b.build_network_policy(REF, pdcluster().engine().spec())["spec"]["ingress"]
    assert ingress[-1] == {
        "ports": [
            {"protocol": "TCP", "port": 30000, "endPort": 30063},
            {"protocol": "TCP", "port": 31000, "endPort": 31063},
        ]
    }
