"""What the scheduler is told about node pods, and the planner's mirror of its taint filter."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_operator.scheduling import (
    Taint,
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
    spec = pdcluster().spec()
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert node_pod_tolerations(spec) == [gpu]
    mine = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
    assert node_pod_tolerations(spec, [gpu, mine]) == [gpu, mine]
    assert untolerated([Taint("nvidia.com/gpu", "present", "NoSchedule")], node_pod_tolerations(spec)) == []


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
