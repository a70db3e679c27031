"""Per-role scaling through the scale API on the real control plane: `kubectl scale` of a PDRole and
an autoscaling/v2 HPA (the real kube-controller-manager's) move the PDCluster's replicas and its
pods; a direct edit of the PDCluster shows in the PDRole; a scale the PDCluster's CEL rules refuse
is reported on the PDRole; a user's own PDRole of the name is left alone (docs/scaling.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import agent_pods, apply_pdc, condition, pdc, selector, wait_ready


def wait_until(predicate: Callable[[], Any], *, timeout: float, what: str) -> Any:
    # Each look runs kubectl: twice a second is plenty and leaves the CPUs to the control plane.
    return h.wait_until(predicate, timeout=timeout, what=what, interval=0.5)


operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator

ROOT = Path(__file__).resolve().parents[2]


def _role(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    return cluster.get_json("pdrole", name, "-n", namespace)


def _role_exists(cluster: Any, namespace: str, name: str) -> bool:
    return cluster.kubectl("get", "pdrole", name, "-n", namespace, check=False).returncode == 0


def _synced(cluster: Any, namespace: str, name: str, replicas: int) -> bool:
    if not _role_exists(cluster, namespace, name):
        return False
    obj = _role(cluster, namespace, name)
    cond = condition(obj, "Synced")
    return bool(
        obj["spec"]["replicas"] == replicas
        and obj.get("status", {}).get("replicas") == replicas
        and cond
        and cond["status"] == "True"
    )


def _gpus(cluster: Any, namespace: str) -> int:
    return sum(
        int(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for p in agent_pods(cluster, namespace, "pd")
    )


def _wait_role_replicas(cluster: Any, namespace: str, role: str, replicas: int, timeout: float = 60) -> None:
    """The PDCluster asks for `replicas` of `role`, has placed them Ready, and the PDRole agrees."""
    wait_until(
        lambda: pdc(cluster, namespace, "pd")["spec"][role]["replicas"] == replicas,
        timeout=timeout,
        what=f"the PDCluster's spec.{role}.replicas to become {replicas}",
    )
    obj = wait_ready(cluster, namespace, "pd")
    assert obj["status"][f"{role}Ready"] == f"{replicas}/{replicas}"
    wait_until(
        lambda: (
            _synced(cluster, namespace, f"pd-{role}", replicas)
            and _role(cluster, namespace, f"pd-{role}")["status"].get("readyReplicas") == replicas
        ),
        timeout=30,
        what=f"pdrole pd-{role} to show {replicas} replicas, Ready and Synced",
    )


def test_kubectl_scale_moves_each_role_and_edits_of_the_pdcluster_come_back(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    gpu_nodes("n", 2)
    builder = pdcluster().prefill(replicas=1, tp=2).decode(replicas=1, tp=2).placement(nodeSelector=selector(namespace))
    apply_pdc(cluster, builder.manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    for role in ("prefill", "decode"):
        wait_until(lambda r=role: _synced(cluster, namespace, f"pd-{r}", 1), timeout=30, what=f"pdrole pd-{role}")
    uid = pdc(cluster, namespace, "pd")["metadata"]["uid"]
    obj = _role(cluster, namespace, "pd-decode")
    assert [(o["uid"], o["controller"]) for o in obj["metadata"]["ownerReferences"]] == [(uid, True)]
    assert obj["spec"] == {"cluster": "pd", "role": "decode", "replicas": 1}
    # Fabric-only: the agents serve both roles' ranks and carry no role label.
    assert obj["status"]["selector"] == f"pdfabric.dev/cluster-uid={uid},app.kubernetes.io/component=agent"
    assert _gpus(cluster, namespace) == 4

    # The scale subresource as kubectl (and an HPA) sees it.
    path = f"/apis/pdfabric.dev/v1alpha1/namespaces/{namespace}/pdroles/pd-decode/scale"
    scale = json.loads(cluster.kubectl("get", "--raw", path).stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == 1
    assert scale["status"]["selector"] == obj["status"]["selector"]

    cluster.kubectl("scale", "pdrole/pd-decode", "--replicas", "3", "-n", namespace)
    _wait_role_replicas(cluster, namespace, "decode", 3)
    wait_until(lambda: _gpus(cluster, namespace) == 8, timeout=30, what="agents holding 2 + 6 GPUs")
    assert pdc(cluster, namespace, "pd")["spec"]["prefill"]["replicas"] == 1, "the other role stays"

    cluster.kubectl("scale", "pdrole/pd-prefill", "--replicas", "2", "-n", namespace)
    _wait_role_replicas(cluster, namespace, "prefill", 2)
    wait_until(lambda: _gpus(cluster, namespace) == 10, timeout=30, what="agents holding 4 + 6 GPUs")

    # The PDCluster edited directly: the PDRole follows (the last writer wins), nothing flaps back.
    cluster.kubectl(
        "patch", "pdcluster", "pd", "-n", namespace, "--type=merge", "-p", '{"spec":{"decode":{"replicas":1}}}'
    )
    _wait_role_replicas(cluster, namespace, "decode", 1)
    wait_until(lambda: _gpus(cluster, namespace) == 6, timeout=30, what="agents holding 4 + 2 GPUs")
    assert _role(cluster, namespace, "pd-decode")["metadata"]["annotations"]["pdfabric.dev/synced-replicas"] == "1"
    assert pdc(cluster, namespace, "pd")["spec"]["decode"]["replicas"] == 1

    # A PDRole deleted by hand comes back with the PDCluster's count.
    cluster.kubectl("delete", "pdrole", "pd-prefill", "-n", namespace)
    wait_until(lambda: _synced(cluster, namespace, "pd-prefill", 2), timeout=30, what="pdrole pd-prefill made again")

    # Deleting the PDCluster deletes its PDRoles.
    h.delete_all_pdclusters(cluster, namespace)
    assert cluster.get_json("pdroles", "-n", namespace)["items"] == []


def _example_hpas(namespace: str, min_replicas: int) -> list[dict[str, Any]]:
    """examples/hpa-pdroles.yaml, aimed at this test's PDCluster `pd`."""
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "hpa-pdroles.yaml").read_text()) if d]
    assert [d["spec"]["scaleTargetRef"]["name"] for d in docs] == ["demo-prefill", "demo-decode"]
    for doc in docs:
        role = doc["spec"]["scaleTargetRef"]["name"].removeprefix("demo-")
        doc["metadata"] = {"name": f"pd-{role}", "namespace": namespace}
        doc["spec"]["scaleTargetRef"]["name"] = f"pd-{role}"
        doc["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]["pdcluster"] = "pd"
        doc["spec"]["minReplicas"] = min_replicas
    return docs


def test_an_hpa_per_role_moves_the_replicas(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    gpu_nodes("n", 1)
    builder = pdcluster().prefill(replicas=1, tp=2).decode(replicas=1, tp=2).placement(nodeSelector=selector(namespace))
    apply_pdc(cluster, builder.manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    for role in ("prefill", "decode"):
        wait_until(lambda r=role: _synced(cluster, namespace, f"pd-{r}", 1), timeout=30, what=f"pdrole pd-{role}")

    # The example HPAs as the API server takes them; below minReplicas the real HPA controller
    # scales up without reading any metric (there is no metrics API here).
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": _example_hpas(namespace, 2)})
    )
    for role in ("prefill", "decode"):
        # The HPA controller works each HPA every 15 s and resolves new kinds within 30 s.
        _wait_role_replicas(cluster, namespace, role, 2, timeout=120)
    wait_until(lambda: _gpus(cluster, namespace) == 8, timeout=30, what="agents holding 4 + 4 GPUs")
    for role in ("prefill", "decode"):
        hpa = cluster.get_json("hpa", f"pd-{role}", "-n", namespace)
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "PDRole"
        able = condition(hpa, "AbleToScale")
        assert able and able["status"] == "True", hpa["status"]
        rescaled = cluster.get_json(
            "events", "-n", namespace, "--field-selector", f"involvedObject.name=pd-{role},reason=SuccessfulRescale"
        )["items"]
        assert any("below Spec.MinReplicas" in e["message"] for e in rescaled), rescaled
    cluster.kubectl("delete", "hpa", "pd-prefill", "pd-decode", "-n", namespace)


def test_a_scale_the_pdcluster_refuses_is_reported_on_the_pdrole(cluster: Any, namespace: str, operator: Any) -> None:
    # Intra-node NVLink: decode replicas must be a multiple of prefill replicas (a CEL rule across
    # the roles that the PDRole cannot check itself). No GPU nodes: placement is not the point.
    builder = pdcluster().transport("nvlink-intra").prefill(replicas=2).decode(replicas=2)
    apply_pdc(cluster, builder.manifest(), namespace)
    for role in ("prefill", "decode"):
        wait_until(lambda r=role: _synced(cluster, namespace, f"pd-{r}", 2), timeout=30, what=f"pdrole pd-{role}")

    # The PDRole's own bounds are the PDCluster's: the API server refuses these to the caller.
    for bad in ("0", "1025"):
        proc = cluster.kubectl("scale", "pdrole/pd-decode", "--replicas", bad, "-n", namespace, check=False)
        assert proc.returncode != 0 and "spec.replicas" in proc.stderr, proc.stderr

    generation = pdc(cluster, namespace, "pd")["metadata"]["generation"]
    cluster.kubectl("scale", "pdrole/pd-decode", "--replicas", "3", "-n", namespace)

    def refused() -> dict[str, Any] | None:
        obj = _role(cluster, namespace, "pd-decode")
        cond = condition(obj, "Synced")
        return obj if cond and cond["reason"] == "ScaleRefused" else None

    obj = wait_until(refused, timeout=30, what="pdrole pd-decode to say ScaleRefused")
    cond = condition(obj, "Synced")
    assert cond and cond["status"] == "False"
    assert "decode.replicas must be a multiple of prefill.replicas" in cond["message"], cond
    assert cond["message"].startswith(
        'PDCluster pd refused decode replicas 3: PDCluster.pdfabric.dev "pd" is invalid'
    ), cond
    assert obj["spec"]["replicas"] == 3, "the asked-for count stays visible"
    assert obj["status"]["replicas"] == 2, "status.replicas is what is in effect"
    assert obj["status"]["refused"]["replicas"] == 3
    spec = pdc(cluster, namespace, "pd")
    assert spec["spec"]["decode"]["replicas"] == 2 and spec["metadata"]["generation"] == generation
    events = cluster.get_json(
        "events",
        "-n",
        namespace,
        "--field-selector",
        "involvedObject.kind=PDRole,involvedObject.name=pd-decode,reason=ScaleRefused",
    )["items"]
    assert (
        len(events) == 1 and events[0]["type"] == "Warning" and "multiple of prefill.replicas" in events[0]["message"]
    )

    # Once the PDCluster changes so that 3 fits (prefill 2 -> 1), the refused scale goes through.
    cluster.kubectl("scale", "pdrole/pd-prefill", "--replicas", "1", "-n", namespace)
    wait_until(
        lambda: pdc(cluster, namespace, "pd")["spec"]["decode"]["replicas"] == 3,
        timeout=30,
        what="the refused decode scale to be tried again and taken",
    )
    wait_until(lambda: _synced(cluster, namespace, "pd-decode", 3), timeout=30, what="pdrole pd-decode in sync")
    wait_until(lambda: _synced(cluster, namespace, "pd-prefill", 1), timeout=30, what="pdrole pd-prefill in sync")
    assert "refused" not in _role(cluster, namespace, "pd-decode")["status"]


def test_a_users_own_pdrole_of_the_name_is_left_alone(cluster: Any, namespace: str, operator: Any) -> None:
    mine = {
        "apiVersion": "pdfabric.dev/v1alpha1",
        "kind": "PDRole",
        "metadata": {"name": "pd-decode", "namespace": namespace, "labels": {"owner": "me"}},
        "spec": {"cluster": "elsewhere", "role": "decode", "replicas": 7},
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(mine))
    apply_pdc(cluster, pdcluster().prefill(replicas=1).decode(replicas=2).manifest(), namespace)
    wait_until(lambda: _synced(cluster, namespace, "pd-prefill", 1), timeout=30, what="pdrole pd-prefill")
    wait_until(
        lambda: cluster.get_json(
            "events", "-n", namespace, "--field-selector", "involvedObject.kind=PDCluster,reason=PDRoleNotOwned"
        )["items"],
        timeout=30,
        what="a PDRoleNotOwned Warning on the PDCluster",
    )
    theirs = _role(cluster, namespace, "pd-decode")
    assert "ownerReferences" not in theirs["metadata"] and "status" not in theirs
    assert theirs["spec"]["replicas"] == 7 and "annotations" not in theirs["metadata"]
    assert pdc(cluster, namespace, "pd")["spec"]["decode"]["replicas"] == 2, "not scaled by a stranger's PDRole"
    h.delete_all_pdclusters(cluster, namespace)
    assert not _role_exists(cluster, namespace, "pd-prefill")
    assert _role(cluster, namespace, "pd-decode")["spec"]["replicas"] == 7, "the user's own stays"


def _pod_uids(cluster: Any, namespace: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in agent_pods(cluster, namespace, "pd")}


def _rankmap(cluster: Any, namespace: str) -> tuple[str, str]:
    cm = cluster.get_json("configmap", "pd-rankmap", "-n", namespace)
    return cm["metadata"]["resourceVersion"], cm["data"]["rankmap.json"]


def test_a_scale_past_the_nodes_keeps_what_runs_and_reports_the_rest(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    """Issue 40: decode scaled one past four one-GPU nodes (what an HPA overshoot does), then to
    1,024: no pod deleted, none made that cannot be placed, the rank map untouched; the PDCluster
    and the PDRole say what is placed and why not the rest; scaling back clears it."""
    gpu_nodes("n", 4, gpus=1)
    builder = pdcluster().prefill(replicas=1).decode(replicas=3).placement(nodeSelector=selector(namespace))
    apply_pdc(cluster, builder.manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    wait_until(lambda: _synced(cluster, namespace, "pd-decode", 3), timeout=30, what="pdrole pd-decode")
    pods, rankmap = _pod_uids(cluster, namespace), _rankmap(cluster, namespace)
    assert len(pods) == 4

    for asked in (4, 1024):
        cluster.kubectl("scale", "pdrole/pd-decode", "--replicas", str(asked), "-n", namespace)

        def reported(asked: int = asked) -> dict[str, Any] | None:
            obj = pdc(cluster, namespace, "pd")
            status = obj.get("status") or {}
            role = _role(cluster, namespace, "pd-decode").get("status") or {}
            placed = condition({"status": role}, "Placed") or {}
            if (
                status.get("observedGeneration") == obj["metadata"]["generation"]
                and (status.get("unplaced") or {}).get("decode") == asked - 3
                and role.get("replicas") == asked
                and placed.get("reason") == "InsufficientGPUs"
            ):
                return obj
            return None

        obj = wait_until(reported, timeout=30, what=f"the shortfall of decode {asked} reported")
        status = obj["status"]
        assert status["decode"] == {"desired": asked, "placed": 3, "ready": 3}, status["decode"]
        assert status["decodeReady"] == f"3/{asked}"
        assert status["unplaced"]["reason"] == "InsufficientGPUs" and "0 free" in status["unplaced"]["message"]
        placed = condition(obj, "Placed")
        assert placed and placed["status"] == "True" and placed["reason"] == "PartiallyPlaced", placed
        assert placed["message"].startswith(f"3 of {asked} decode replicas placed: ")
        degraded = condition(obj, "Degraded")
        assert degraded and (degraded["status"], degraded["reason"]) == ("True", "InsufficientGPUs")
        ready = condition(obj, "Ready")
        assert ready and (ready["status"], ready["reason"]) == ("True", "PartiallyPlaced"), ready
        role = _role(cluster, namespace, "pd-decode")
        assert (role["status"]["replicas"], role["status"]["placedReplicas"]) == (asked, 3)
        role_placed = condition(role, "Placed")
        assert role_placed and role_placed["status"] == "False"
        assert role_placed["message"].startswith(f"3 of {asked} decode replicas placed: ")
        # What ran runs on: same pods (uids), no pending one, the rank map not rewritten.
        assert _pod_uids(cluster, namespace) == pods
        assert _rankmap(cluster, namespace) == rankmap
        events = cluster.get_json(
            "events", "-n", namespace, "--field-selector", "involvedObject.kind=PDCluster,reason=InsufficientGPUs"
        )["items"]
        assert events and all(e["type"] == "Warning" for e in events)

    cluster.kubectl("scale", "pdrole/pd-decode", "--replicas", "3", "-n", namespace)
    wait_until(
        lambda: (
            "unplaced" not in (pdc(cluster, namespace, "pd").get("status") or {})
            and (condition(_role(cluster, namespace, "pd-decode"), "Placed") or {}).get("status") == "True"
        ),
        timeout=30,
        what="the shortfall cleared",
    )
    obj = wait_ready(cluster, namespace, "pd")
    assert condition(obj, "Placed")["reason"] == "Placed"  # type: ignore[index]
    assert _role(cluster, namespace, "pd-decode")["status"]["placedReplicas"] == 3
    assert _pod_uids(cluster, namespace) == pods
    assert _rankmap(cluster, namespace) == rankmap
