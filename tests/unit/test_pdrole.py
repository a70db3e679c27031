"""The per-role scaling adapter: the sync decision, the PDRole's status and selector, its CRD and
the operator's RBAC for it (the real API server's side is tests/integration/test_pdrole_scaling.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pdfabric_operator import constants as c
from pdfabric_operator.builders.names import ClusterRef
from pdfabric_operator.role_status import Refusal, role_status, status_patch
from pdfabric_operator.roles import SyncDecision, build_role, decide, made_as_is, role_selector, role_view
from tests.unit.charts import operator_grants, run_helm, schema_nodes

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "pdrole.yaml"


# --- decide: which way the replicas go ---------------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "role", "synced", "want"),
    [
        # In agreement: nothing to carry; record the agreed value when the record lags.
        (3, 3, 3, SyncDecision()),
        (3, 3, 2, SyncDecision(record=3)),
        (3, 3, None, SyncDecision(record=3)),
        # Scaled through the PDRole (kubectl scale, an HPA): into the PDCluster.
        (2, 5, 2, SyncDecision(to_cluster=5, record=5)),
        (2, 1, 2, SyncDecision(to_cluster=1, record=1)),
        # The PDCluster edited directly: into the PDRole.
        (4, 2, 2, SyncDecision(to_role=4, record=4)),
        # Both moved since the last agreement: the PDCluster, the one truth, wins.
        (4, 5, 2, SyncDecision(to_role=4, record=4)),
        # Nothing recorded (a PDRole whose annotation was removed): the PDCluster wins.
        (4, 5, None, SyncDecision(to_role=4, record=4)),
    ],
)
def test_decide(cluster: int, role: int, synced: int | None, want: SyncDecision) -> None:
    assert decide(cluster, role, synced, None, cluster_generation=7) == want


def test_a_refused_scale_is_not_retried_until_the_pdcluster_changes() -> None:
    refused = Refusal(replicas=3, cluster_generation=7)
    assert decide(2, 3, 2, refused, cluster_generation=7) == SyncDecision()
    # The PDCluster changed (e.g. prefill scaled so that 3 now fits): try again.
    assert decide(2, 3, 2, refused, cluster_generation=8) == SyncDecision(to_cluster=3, record=3)
    # Scaled again to another value: try that one.
    assert decide(2, 4, 2, refused, cluster_generation=7) == SyncDecision(to_cluster=4, record=4)
    # The PDCluster edited directly meanwhile: it wins, the refused wish goes.
    assert decide(5, 3, 2, refused, cluster_generation=8) == SyncDecision(to_role=5, record=5)


@pytest.mark.parametrize("cluster", [1, 2, 5])
@pytest.mark.parametrize("role", [1, 2, 5])
@pytest.mark.parametrize("synced", [None, 1, 2, 5])
def test_one_sync_brings_agreement_and_the_next_writes_nothing(cluster: int, role: int, synced: int | None) -> None:
    """No loop: applying a decision leaves both equal and recorded, and deciding again is a no-op."""
    d = decide(cluster, role, synced, None, 1)
    cluster2 = d.to_cluster if d.to_cluster is not None else cluster
    role2 = d.to_role if d.to_role is not None else role
    synced2 = d.record if d.record is not None else synced
    assert cluster2 == role2 == synced2
    assert decide(cluster2, role2, synced2, None, 1) == SyncDecision()
    # The value that survives is the one that moved last: the PDRole's only when the PDCluster
    # did not move since the last agreement.
    if synced is not None and cluster == synced:
        assert cluster2 == role
    else:
        assert cluster2 == cluster


# --- the PDRole object -------------------------------------------------------------------------

REF = ClusterRef("ns", "pd", "uid-1")


def test_build_role_is_owned_recorded_and_labelled() -> None:
    obj = build_role(REF, "decode", 3)
    assert obj["metadata"]["name"] == "pd-decode"
    assert obj["metadata"]["ownerReferences"] == [REF.owner_reference()]
    assert obj["metadata"]["annotations"] == {c.ANN_SYNCED_REPLICAS: "3"}
    assert obj["metadata"]["labels"][c.LABEL_CLUSTER_UID] == "uid-1"
    assert obj["metadata"]["labels"][c.LABEL_ROLE] == "decode"
    assert obj["spec"] == {"cluster": "pd", "role": "decode", "replicas": 3}
    view = role_view({**obj, "metadata": {**obj["metadata"], "uid": "r1", "generation": 1}})
    assert (view.owner_uid, view.replicas, view.synced, view.refused) == ("uid-1", 3, 3, None)
    # As made: its creation wakes no reconcile of a cluster still coming up (main.pdrole_changed).
    assert made_as_is(view)
    meta = {**obj["metadata"], "uid": "r1"}
    scaled = role_view({**obj, "metadata": {**meta, "generation": 2}, "spec": {**obj["spec"], "replicas": 4}})
    assert not made_as_is(scaled), "kubectl scale: carried into the PDCluster at once"
    edited = role_view({**obj, "metadata": {**meta, "generation": 1}, "spec": {**obj["spec"], "replicas": 5}})
    assert not made_as_is(edited), "made by hand with other replicas than recorded"
    written = role_view({**obj, "metadata": {**meta, "generation": 1}, "status": {"replicas": 3}})
    assert not made_as_is(written)


def test_role_view_reads_a_refusal_and_ignores_a_garbled_record() -> None:
    obj = build_role(REF, "prefill", 2)
    obj["metadata"]["annotations"][c.ANN_SYNCED_REPLICAS] = "two"
    obj["metadata"]["ownerReferences"][0]["controller"] = False  # not our controller: not ours
    obj["status"] = {"refused": {"replicas": 3, "clusterGeneration": 4, "message": "no"}}
    view = role_view(obj)
    assert view.synced is None and view.owner_uid is None
    assert view.refused == Refusal(3, 4)


def test_selector_names_the_pods_that_serve_the_role() -> None:
    assert role_selector("u", "prefill", engines=True) == "pdfabric.dev/cluster-uid=u,pdfabric.dev/serves-prefill=true"
    assert role_selector("u", "decode", engines=True) == "pdfabric.dev/cluster-uid=u,pdfabric.dev/serves-decode=true"
    # Fabric-only: agents carry no role label and serve both roles' ranks on their node.
    assert role_selector("u", "decode", engines=False) == "pdfabric.dev/cluster-uid=u,app.kubernetes.io/component=agent"
    # The role labels are the ones the builders put on node pods.
    assert {c.LABEL_SERVES[r] for r in ("prefill", "decode")} == {
        "pdfabric.dev/serves-prefill",
        "pdfabric.dev/serves-decode",
    }


def _status(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "role": "decode",
        "cluster": "pd",
        "cluster_replicas": 2,
        "role_replicas": 2,
        "ready": 1,
        "selector": "s",
        "generation": 3,
        "refused": None,
        "refused_message": "",
    }
    return role_status(**{**args, **kw})


def test_status_says_in_sync_refused_or_pending() -> None:
    ok = _status()
    assert ok["replicas"] == 2 and ok["readyReplicas"] == 1 and ok["observedGeneration"] == 3
    assert ok["conditions"][0]["status"] == "True" and ok["conditions"][0]["reason"] == "InSync"
    assert ok["refused"] is None
    refused = _status(role_replicas=3, refused=Refusal(3, 5), refused_message="PDCluster pd refused: x")
    assert refused["replicas"] == 2, "status.replicas is what is in effect, not the wish"
    cond = refused["conditions"][0]
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "ScaleRefused", "PDCluster pd refused: x")
    assert refused["refused"] == {"replicas": 3, "clusterGeneration": 5, "message": "PDCluster pd refused: x"}
    # Scaled again after a refusal: no longer the refused value, not yet carried.
    pending = _status(role_replicas=4, refused=Refusal(3, 5))
    assert pending["conditions"][0]["reason"] == "Pending" and pending["refused"] is None


def test_status_says_how_many_replicas_are_placed_and_why_not_the_rest() -> None:
    """Issue 40: a scale step the nodes cannot take in full: the PDRole says what runs and the
    planner's word on the rest, as a Deployment's Pending pods do."""
    full = _status(placed=2, unplaced=None)
    assert full["placedReplicas"] == 2
    assert full["conditions"][1] == {
        "type": "Placed", "status": "True", "reason": "Placed", "message": "all 2 decode replicas placed",
    }  # fmt: skip
    short = _status(
        cluster_replicas=4,
        role_replicas=4,
        placed=3,
        unplaced={"prefill": 0, "decode": 1, "reason": "InsufficientGPUs", "message": "decode-3 needs 1 GPUs"},
    )
    assert short["replicas"] == 4 and short["placedReplicas"] == 3
    assert short["conditions"][0]["reason"] == "InSync"
    assert short["conditions"][1] == {
        "type": "Placed",
        "status": "False",
        "reason": "InsufficientGPUs",
        "message": "3 of 4 decode replicas placed: decode-3 needs 1 GPUs",
    }
    # The PDCluster's status not yet caught up with the scale: Pending, not Placed.
    assert _status(cluster_replicas=4, role_replicas=4, placed=3)["conditions"][1]["reason"] == "Pending"
    # An older operator's status without placed counts: all of them.
    assert _status()["placedReplicas"] == 2 and _status()["conditions"][1]["status"] == "True"


def test_status_patch_only_on_change_and_keeps_transition_times() -> None:
    first = status_patch(_status(), {}, "t1")
    assert first is not None and first["conditions"][0]["lastTransitionTime"] == "t1"
    assert status_patch(_status(), first, "t2") is None
    moved = status_patch(_status(ready=2), first, "t2")
    assert moved is not None and moved["conditions"][0]["lastTransitionTime"] == "t1"
    flipped = status_patch(_status(role_replicas=3), first, "t3")
    assert flipped is not None and flipped["conditions"][0]["lastTransitionTime"] == "t3"


# --- the CRD -----------------------------------------------------------------------------------


def _crd() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())


def test_crd_names_and_the_scale_subresource() -> None:
    crd = _crd()
    assert crd["metadata"]["name"] == f"{c.ROLE_PLURAL}.{c.GROUP}"
    assert crd["spec"]["group"] == c.GROUP and crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["kind"] == c.ROLE_KIND and crd["spec"]["names"]["singular"] == "pdrole"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == c.VERSION and version["served"] and version["storage"]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    cols = {col["name"]: col["jsonPath"] for col in version["additionalPrinterColumns"]}
    assert cols["Desired"] == ".spec.replicas" and cols["Current"] == ".status.replicas"
    assert cols["Synced"] == '.status.conditions[?(@.type=="Synced")].status'


def test_crd_replicas_bounds_equal_the_pdclusters() -> None:
    (version,) = _crd()["spec"]["versions"]
    ours = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["replicas"]
    (pdc_version,) = yaml.safe_load((ROOT / "crds" / "pdcluster.yaml").read_text())["spec"]["versions"]
    pdc_spec = pdc_version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for role in ("prefill", "decode"):
        theirs = pdc_spec[role]["properties"]["replicas"]
        assert (ours["minimum"], ours["maximum"]) == (theirs["minimum"], theirs["maximum"])


def test_crd_every_field_is_described_and_every_rule_explained() -> None:
    (version,) = _crd()["spec"]["versions"]
    nodes = schema_nodes(version["schema"]["openAPIV3Schema"])
    missing = [p for p, n in nodes if p not in ("", ".metadata") and not str(n.get("description") or "").strip()]
    assert not missing, f"fields without a description (kubectl explain shows nothing): {missing}"
    for path, node in nodes:
        assert "type" in node, f"{path} has no type"
        for rule in node.get("x-kubernetes-validations", []):
            assert rule.get("message"), f"rule at {path} has no message"


def test_operator_rbac_on_pdroles_is_exactly_what_it_uses() -> None:
    grants = operator_grants()
    assert grants[(c.GROUP, "pdroles")] == {"get", "list", "watch", "create", "patch", "delete"}
    assert grants[(c.GROUP, "pdroles/status")] == {"patch"}
    assert (c.GROUP, "pdroles/scale") not in grants, "the operator never scales through the scale API"
    assert "patch" in grants[(c.GROUP, "pdclusters")], "a scaled PDRole is carried into the PDCluster"


def test_helm_show_crds_yields_every_crd_as_its_own_document() -> None:
    # docs/upgrade.md pipes `helm show crds` into kubectl apply; helm joins the files without a
    # separator, so a file without a leading `---` would merge into the one before it.
    proc = run_helm("show", "crds", str(ROOT / "charts" / "pdfabric"))
    assert proc.returncode == 0, proc.stderr
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(proc.stdout) if d]
    assert sorted(names) == [
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
        "pdclusters.pdfabric.dev",
        "pdroles.pdfabric.dev",
    ]
