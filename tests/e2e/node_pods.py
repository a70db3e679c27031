"""What the e2e tests of the operator's node pods share: PodRunner running the pods' real command
(``runner``), the test's operator reading those agents' /readyz (``operator``), the reference
engine as spec.engine (``ENGINE``) and the colocated answers its prompts must equal. Modules take
the fixtures by name (``runner, operator = node_pods.runner, node_pods.operator``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from pdfabric_devcluster.podrunner import PodRunner
from tests.integration import pdcluster_harness as h

NEW_TOKENS = 16
SERVER = ["python", "-m", "pdfabric_refengine.server"]
# What the agents run as engines: the reference engine's serving front with SGLang's classes for
# --disaggregation-transfer-backend pdfabric; its port, TP and shm dir from the container's env.
ENGINE = {
    "image": "pdfabric/refengine:local",
    "prefill": {"command": SERVER, "args": ["--role", "prefill", "--tp", "$(PDFABRIC_TP)", "--timeout-s", "10"]},
    "decode": {"command": SERVER, "args": ["--role", "decode", "--tp", "$(PDFABRIC_TP)", "--timeout-s", "10"]},
}


@pytest.fixture
def runner(cluster: Any, namespace: str, tmp_path: Path, installed_site: Path) -> Iterator[PodRunner]:
    """The agent pods' command as local processes (engines with pdfabric installed as a user does)."""
    pods = PodRunner(
        cluster, namespace, "app.kubernetes.io/component=agent", tmp_path / "pods", pythonpath=[str(installed_site)]
    )
    yield pods
    pods.stop()


@pytest.fixture
def operator(cluster: Any, operator_kubeconfig: Path, namespace: str, runner: PodRunner) -> Iterator[KopfRunner]:
    """The operator reading the agents' /readyz (PDFABRIC_AGENT_ADDRESSES)."""
    with h.operator_reading_agents(cluster, operator_kubeconfig, namespace, runner.addresses_file) as op:
        yield op


def colocated(prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """The reference model's greedy tokens for each prompt, generated in one process."""
    from pdfabric_refengine import build_model, colocated_generate

    model = build_model(0)
    return [colocated_generate(model, p, new_tokens) for p in prompts]


def router_pods_scheduled(cluster: Any, namespace: str) -> list[dict[str, Any]]:
    """spec.router's pods the kube-scheduler has placed (start_routers runs those)."""
    out = cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=router")["items"]
    return [p for p in out if p["spec"].get("nodeName")]
