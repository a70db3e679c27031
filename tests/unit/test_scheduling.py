"""What the scheduler is told about node pods, and the planner's mirror of its taint filter."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_operator.scheduling import (
    Taint,
    affinity_allows,
    node_affinity,
    node_pod_tolerations,
    placement_labels,
    taints_from,
    tolerates,
    unschedulable_message,
    untolerated,
)
from tests.builders import pdcluster

DEDICATED = Taint("dedicated", "inference", "NoSchedule")

# (id, toleration, taint, tolerated) — Kubernetes' ToleratesTaint, case by case.
TOLERATION_CASES: list[tuple[str, dict[str, Any], Taint, bool]] = [
    ("equal-same-value", {"key": "dedicated", "value": "inference"}, DEDICATED, True),
    ("equal-other-value", {"key": "dedicated", "value": "training"}, DEDICATED, False),
    ("equal-explicit", {"key": "dedicated", "operator": "Equal", "value": "inference"}, DEDICATED, True),
    ("exists-any-value", {"key": "dedicated", "operator": "Exists"}, DEDICATED, True),
    ("exists-other-key", {"key": "gpu", "operator": "Exists"}, DEDICATED, False),
    ("empty-key-exists-tolerates-all", {"operator": "Exists"}, DEDICATED, True),
    ("empty-key-equal-tolerates-nothing", {"value": "inference"}, DEDICATED, False),
    ("effect-must-match", {"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}, DEDICATED, False),
    ("effect-matches", {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}, DEDICATED, True),
    ("empty-effect-any", {"key": "dedicated", "operator": "Exists"}, Taint("dedicated", "", "NoExecute"), True),
    ("equal-empty-value", {"key": "k", "operator": "Equal"}, Taint("k", "", "NoSchedule"), True),
]


@pytest.mark.parametrize(
    ("toleration", "taint", "expected"), [c[1:] for c in TOLERATION_CASES], ids=[c[0] for c in TOLERATION_CASES]
)
def test_tolerates_follows_kubernetes(toleration: dict[str, Any], taint: Taint, expected: bool) -> None:
    assert tolerates(toleration, taint) is expected


def test_only_filtering_effects_keep_a_pod_off() -> None:
    taints = [DEDICATED, Taint("soft", "", "PreferNoSchedule"), Taint("evict", "x", "NoExecute")]
    assert untolerated(taints, []) == [DEDICATED, Taint("evict", "x", "NoExecute")]
    assert untolerated(taints, [{"key": "dedicated", "operator": "Exists"}]) == [Taint("evict", "x", "NoExecute")]


def test_node_pods_tolerate_the_gpu_taint_and_the_users_once() -> None:
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert node_pod_tolerations(pdcluster().spec()) == [gpu]
    mine = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
    spec = pdcluster().agent(pod={"tolerations": [gpu, mine]}).spec()
    assert node_pod_tolerations(spec) == [gpu, mine]
    assert untolerated([Taint("nvidia.com/gpu", "present", "NoSchedule")], node_pod_tolerations(spec)) == []
    assert untolerated([DEDICATED], node_pod_tolerations(spec)) == []


def test_taints_from_the_api_and_their_spelling() -> None:
    raw = [{"key": "a", "value": "b", "effect": "NoSchedule"}, {"key": "c", "effect": "NoExecute"}]
    assert taints_from(raw) == (Taint("a", "b", "NoSchedule"), Taint("c", "", "NoExecute"))
    assert taints_from(None) == ()
    assert [str(t) for t in taints_from(raw)] == ["a=b:NoSchedule", "c:NoExecute"]


def test_affinity_pins_the_node_by_name_and_the_labels_it_was_chosen_for() -> None:
    assert node_affinity("n1", {}) == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
            }
        }
    }
    (term,) = node_affinity("n1", {"z": "1", "a": "2"})["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "a", "operator": "In", "values": ["2"]},
        {"key": "z", "operator": "In", "values": ["1"]},
    ]


def test_placement_labels_are_the_selector_and_the_domain() -> None:
    spec = pdcluster().transport("nvlink").placement(nodeSelector={"pool": "pd"}).spec()
    assert placement_labels(spec, None) == {"pool": "pd"}
    assert placement_labels(spec, "c1") == {"pool": "pd", "nvidia.com/gpu.clique": "c1"}


# (id, pod conditions, the scheduler's word)
UNSCHEDULABLE_CASES: list[tuple[str, list[dict[str, Any]] | None, str]] = [
    ("none-yet", None, ""),
    ("scheduled", [{"type": "PodScheduled", "status": "True"}], ""),
    (
        "unschedulable",
        [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available"}],
        "0/3 nodes are available",
    ),
    (
        "gated",
        [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated", "message": "gated"}],
        "SchedulingGated: gated",
    ),
    ("no-message", [{"type": "PodScheduled", "status": "False"}], "not scheduled"),
]


@pytest.mark.parametrize(
    ("conditions", "expected"), [c[1:] for c in UNSCHEDULABLE_CASES], ids=[c[0] for c in UNSCHEDULABLE_CASES]
)
def test_unschedulable_message(conditions: list[dict[str, Any]] | None, expected: str) -> None:
    assert unschedulable_message(conditions) == expected


PIN = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
ZONE_A = {"key": "zone", "operator": "In", "values": ["a"]}
POD_ANTI = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]}}
PREFERRED = {
    "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 5, "preference": {"matchExpressions": [ZONE_A]}}]
}

# (id, user affinity, expected merged affinity)
MERGE_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("none", {}, {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [PIN]}}}),
    (
        "pod-anti-affinity-kept",
        POD_ANTI,
        {**POD_ANTI, "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [PIN]}}},
    ),
    (
        "preferred-kept",
        {"nodeAffinity": PREFERRED},
        {"nodeAffinity": {**PREFERRED, "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [PIN]}}},
    ),
    (
        "each-required-term-anded-with-the-pin",
        {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [ZONE_A]},
                        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}]},
                    ]
                }
            }
        },
        {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [ZONE_A], "matchFields": PIN["matchFields"]},
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "NotIn", "values": ["n9"]},
                                *PIN["matchFields"],
                            ]
                        },
                    ]
                }
            }
        },
    ),
]


@pytest.mark.parametrize(("user", "expected"), [c[1:] for c in MERGE_CASES], ids=[c[0] for c in MERGE_CASES])
def test_user_affinity_is_merged_with_the_pin(user: dict[str, Any], expected: dict[str, Any]) -> None:
    assert node_affinity("n1", {}, user) == expected


def _required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


def _expr(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": op, "values": list(values)}]}


# (id, affinity, node name, node labels, admitted) — the scheduler's NodeAffinity filter.
ALLOWS_CASES: list[tuple[str, dict[str, Any], str, dict[str, str], bool]] = [
    ("no-affinity", {}, "n", {}, True),
    ("only-preferred", {"nodeAffinity": PREFERRED}, "n", {}, True),
    ("in", _required(_expr("zone", "In", "a", "b")), "n", {"zone": "b"}, True),
    ("in-absent-label", _required(_expr("zone", "In", "a")), "n", {}, False),
    ("not-in", _required(_expr("zone", "NotIn", "a")), "n", {"zone": "a"}, False),
    ("not-in-absent-label", _required(_expr("zone", "NotIn", "a")), "n", {}, True),
    ("exists", _required(_expr("gpu", "Exists")), "n", {"gpu": ""}, True),
    ("does-not-exist", _required(_expr("gpu", "DoesNotExist")), "n", {"gpu": "x"}, False),
    ("gt", _required(_expr("mem", "Gt", "100")), "n", {"mem": "141"}, True),
    ("lt-not-a-number", _required(_expr("mem", "Lt", "100")), "n", {"mem": "lots"}, False),
    ("terms-ored", _required(_expr("zone", "In", "a"), _expr("zone", "In", "b")), "n", {"zone": "b"}, True),
    (
        "requirements-anded",
        _required({"matchExpressions": [ZONE_A, {"key": "rack", "operator": "In", "values": ["1"]}]}),
        "n",
        {"zone": "a", "rack": "2"},
        False,
    ),
    (
        "match-fields-name",
        _required({"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n"]}]}),
        "n",
        {},
        False,
    ),
    ("empty-term-admits-none", _required({}), "n", {}, False),
]


@pytest.mark.parametrize(
    ("affinity", "node", "labels", "expected"), [c[1:] for c in ALLOWS_CASES], ids=[c[0] for c in ALLOWS_CASES]
)
def test_affinity_allows_as_the_scheduler_filters(
    affinity: dict[str, Any], node: str, labels: dict[str, str], expected: bool
) -> None:
    assert affinity_allows(node, labels, affinity) is expected
    # The merged affinity admits the pinned node exactly when the user's does.
    assert affinity_allows(node, labels, node_affinity(node, {}, affinity)) is expected
