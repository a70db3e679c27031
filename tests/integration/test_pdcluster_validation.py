"""The API server itself enforces the PDCluster schema: defaults, enums, minimums and CEL rules."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdfabric_core.spec import PDClusterSpec, parse_spec
from tests.builders import ENGINE, ENGINE_INVALID_SPECS, INVALID_SPECS, merge, pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import wait_until

operator_kubeconfig = h.operator_kubeconfig


@pytest.fixture(scope="module")
def crds(cluster: Any, operator_kubeconfig: Any) -> None:
    """The CRDs are installed (the harness fixture does it once per session)."""


def test_at_least_twenty_invalid_specs() -> None:
    assert len(INVALID_SPECS) >= 20


def test_invalid_specs_rejected_with_their_messages(cluster: Any, namespace: str, crds: None) -> None:
    failures = []
    for case_id, patch, fragment in INVALID_SPECS:
        manifest = pdcluster(case_id).manifest()
        manifest["spec"] = merge(manifest["spec"], patch)
        proc = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)
        if proc.returncode == 0:
            failures.append(f"{case_id}: accepted")
        elif fragment not in proc.stderr:
            failures.append(f"{case_id}: message lacks {fragment!r}: {proc.stderr.strip()}")
    assert not failures, "\n".join(failures)
    # Nothing was created: no PDCluster and therefore no children.
    assert cluster.get_json("pdclusters", "-n", namespace)["items"] == []
    for kind in ("pods", "configmaps", "services", "secrets"):
        assert cluster.get_json(kind, "-n", namespace, "-l", "pdfabric.dev/cluster")["items"] == []


def test_state_bytes_that_state_layers_do_not_divide_rejected(cluster: Any, namespace: str, crds: None) -> None:
    manifest = pdcluster("state-split").manifest()
    manifest["spec"] = merge(manifest["spec"], {"model": {"stateBytesPerRequest": 1000, "stateLayers": 3}})
    proc = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)
    assert proc.returncode != 0
    assert "model.stateBytesPerRequest must be divisible by model.stateLayers" in proc.stderr
    # The same geometry with an even split is accepted.
    manifest["spec"]["model"]["stateBytesPerRequest"] = 999
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    cluster.kubectl("delete", "pdcluster", "state-split", "-n", namespace)


def test_nixl_on_nvlink_intra_with_the_default_pool_accepted(cluster: Any, namespace: str, crds: None) -> None:
    """Backend nixl carries nvlink-intra on memPool NONE (UCX's CUDA IPC); the CEL rules that keep
    the pair to nixl (mori-default-pool-on-nvlink-intra, default-pool-on-nvlink-intra) and the node
    rules of nvlink-intra (nixl-nvlink-intra-*) are in INVALID_SPECS."""
    manifest = pdcluster("nixl-intra").manifest()
    manifest["spec"] = merge(manifest["spec"], {"backend": "nixl", "transfer": {"transport": "nvlink-intra"}})
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    stored = cluster.get_json("pdcluster", "nixl-intra", "-n", namespace)["spec"]
    assert (stored["backend"], stored["transfer"]["memPool"], stored["transfer"]["transport"]) == (
        "nixl",
        "NONE",
        "nvlink-intra",
    )
    cluster.kubectl("delete", "pdcluster", "nixl-intra", "-n", namespace)


def test_server_defaults_equal_spec_defaults(cluster: Any, namespace: str, crds: None) -> None:
    manifest = {"apiVersion": "pdfabric.dev/v1alpha1", "kind": "PDCluster", "metadata": {"name": "bare"}, "spec": {}}
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    stored = cluster.get_json("pdcluster", "bare", "-n", namespace)["spec"]
    assert parse_spec(stored) == PDClusterSpec()
    assert stored["transfer"]["transport"] == "auto"
    assert stored["placement"]["nvlinkDomainKey"] == "nvidia.com/gpu.clique"
    cluster.kubectl("delete", "pdcluster", "bare", "-n", namespace)


def test_missing_spec_rejected(cluster: Any, namespace: str, crds: None) -> None:
    manifest = {"apiVersion": "pdfabric.dev/v1alpha1", "kind": "PDCluster", "metadata": {"name": "nospec"}}
    proc = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)
    assert proc.returncode != 0
    assert "spec: Required value" in proc.stderr


def test_unknown_field_rejected(cluster: Any, namespace: str, crds: None) -> None:
    manifest = pdcluster("typo").manifest()
    manifest["spec"]["prefill"]["tensorParallel"] = 2
    proc = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)
    assert proc.returncode != 0
    assert "tensorParallel" in proc.stderr


def test_update_to_invalid_rejected(cluster: Any, namespace: str, crds: None) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(pdcluster("upd").manifest()))
    proc = cluster.kubectl(
        "patch",
        "pdcluster",
        "upd",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"decode": {"cp": 4}}}),
        check=False,
    )
    assert proc.returncode != 0
    assert "decode.cp must be 1" in proc.stderr
    assert cluster.get_json("pdcluster", "upd", "-n", namespace)["spec"]["decode"]["cp"] == 1
    cluster.kubectl("delete", "pdcluster", "upd", "-n", namespace)


def test_engine_defaults_applied_by_the_server(cluster: Any, namespace: str, crds: None) -> None:
    manifest = pdcluster("eng").engine().manifest()
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    stored = cluster.get_json("pdcluster", "eng", "-n", namespace)["spec"]
    assert stored["engine"]["prefill"]["port"] == 30000
    assert stored["engine"]["prefill"]["bootstrapPort"] == 8998
    assert stored["engine"]["decode"]["port"] == 31000
    assert stored["engine"]["decode"]["healthPath"] == "/health"
    assert "bootstrapPort" not in stored["engine"]["decode"]
    assert parse_spec(stored).engine == parse_spec(manifest["spec"]).engine
    cluster.kubectl("delete", "pdcluster", "eng", "-n", namespace)


def test_engine_refusals_name_the_field(cluster: Any, namespace: str, crds: None) -> None:
    """Each bad engine spec is refused with the path of the field at fault (spec.engine...)."""
    assert len(ENGINE_INVALID_SPECS) >= 10
    failures = []
    for case_id, patch, _fragment in ENGINE_INVALID_SPECS:
        manifest = pdcluster(case_id).manifest()
        manifest["spec"] = merge(manifest["spec"], patch)
        proc = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)
        if proc.returncode == 0 or "spec.engine" not in proc.stderr:
            failures.append(f"{case_id}: {proc.stderr.strip() or 'accepted'}")
    assert not failures, "\n".join(failures)


def test_adding_and_removing_engine_on_a_live_cluster(cluster: Any, namespace: str, crds: None) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(pdcluster("live").manifest()))
    patch = {"spec": {"engine": ENGINE}}
    cluster.kubectl("patch", "pdcluster", "live", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    assert cluster.get_json("pdcluster", "live", "-n", namespace)["spec"]["engine"]["decode"]["port"] == 31000
    bad = {"spec": {"engine": {"decode": {"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]}}}}
    proc = cluster.kubectl(
        "patch", "pdcluster", "live", "-n", namespace, "--type=merge", "-p", json.dumps(bad), check=False
    )
    assert proc.returncode != 0 and "only GPU grant" in proc.stderr
    off = {"spec": {"engine": None}}
    cluster.kubectl("patch", "pdcluster", "live", "-n", namespace, "--type=merge", "-p", json.dumps(off))
    assert "engine" not in cluster.get_json("pdcluster", "live", "-n", namespace)["spec"]
    cluster.kubectl("delete", "pdcluster", "live", "-n", namespace)


def test_kubectl_explain_describes_spec_and_status_fields(cluster: Any, crds: None) -> None:
    def explain(path: str) -> str:
        # The API server publishes the CRD's schema to OpenAPI a moment after it is established.
        out = wait_until(
            lambda: (p := cluster.kubectl("explain", path, check=False)).returncode == 0 and p.stdout,
            timeout=30,
            what=f"kubectl explain {path}",
        )
        return str(out)

    assert "The node the scheduler binds the agent pod to" in explain("pdclusters.status.placement.node")
    assert "KV heads of the model before TP sharding" in explain("pdclusters.spec.model.kvHeads")
    assert "Tolerations added to the operator's" in explain("pdclusters.spec.agent.pod.tolerations")
