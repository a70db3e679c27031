"""`helm install` of the chart on the real API server: everything applies, CRDs survive uninstall."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.integration import pdcluster_harness as h

ROOT = Path(__file__).resolve().parents[2]
operator_kubeconfig = h.operator_kubeconfig


def _helm(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(cluster.bin_dir) / "helm"), "--kubeconfig", str(cluster.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_helm_install_and_uninstall_keeps_crds(cluster: Any, namespace: str, operator_kubeconfig: Path) -> None:
    release = f"h{namespace[-6:]}"
    # Its own peering object and names, so it cannot collide with the operator the other tests run.
    install = _helm(
        cluster,
        "install",
        release,
        str(ROOT / "charts" / "pdfabric"),
        "-n",
        namespace,
        "--set",
        f"operator.peeringName={release}",
        "--wait",
        "--timeout",
        "120s",
    )
    assert install.returncode == 0, install.stderr
    assert "kubectl get pdclusters -A -o wide" in install.stdout, "NOTES.txt is shown"
    dep = cluster.get_json("deployment", f"{release}-pdfabric", "-n", namespace)
    assert dep["status"].get("availableReplicas") == 2
    # The disruption controller counts both replicas healthy; a drain may take one of them.
    h.wait_until(
        lambda: (
            (cluster.get_json("pdb", f"{release}-pdfabric", "-n", namespace).get("status") or {}).get(
                "disruptionsAllowed"
            )
            == 1
        ),
        timeout=30,
        what="the PodDisruptionBudget to allow one disruption",
    )
    assert cluster.get_json("clusterkopfpeering", release)["metadata"]["name"] == release
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    who = f"system:serviceaccount:{namespace}:{sa}"
    can = cluster.kubectl("auth", "can-i", "create", "pods", "--as", who, "-n", "default", check=False)
    assert can.stdout.strip() == "yes"
    cannot = cluster.kubectl("auth", "can-i", "list", "secrets", "--as", who, "-n", "default", check=False)
    assert cannot.stdout.strip() == "no", "the operator never lists Secrets"

    uninstall = _helm(cluster, "uninstall", release, "-n", namespace, "--wait")
    assert uninstall.returncode == 0, uninstall.stderr
    assert cluster.kubectl("get", "crd", "pdclusters.pdfabric.dev", check=False).returncode == 0
    assert cluster.kubectl("get", "clusterrole", f"{release}-pdfabric", check=False).returncode != 0


def _agent_fields(cluster: Any) -> set[str]:
    crd = cluster.get_json("crd", "pdclusters.pdfabric.dev")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return set(schema["properties"]["spec"]["properties"]["agent"]["properties"])


def test_crds_are_upgraded_the_way_docs_upgrade_md_says(
    cluster: Any, namespace: str, operator_kubeconfig: Path
) -> None:
    chart = str(ROOT / "charts" / "pdfabric")
    release = f"u{namespace[-6:]}"
    # An older release's CRD: this one without spec.agent.pod (added since).
    crd = yaml.safe_load((ROOT / "crds" / "pdcluster.yaml").read_text())
    del crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["agent"][
        "properties"
    ]["pod"]
    apply = ["apply", "--server-side", "--force-conflicts", "-f", "-"]
    try:
        cluster.kubectl(*apply, input=json.dumps(crd))
        assert "pod" not in _agent_fields(cluster)
        sets = ["--set", f"operator.peeringName={release}", "--set", "replicaCount=1"]
        install = _helm(cluster, "install", release, chart, "-n", namespace, *sets)
        assert install.returncode == 0, install.stderr
        assert "helm show crds" in install.stdout, "NOTES.txt says how to upgrade the CRDs"
        upgrade = _helm(cluster, "upgrade", release, chart, "-n", namespace, *sets)
        assert upgrade.returncode == 0, upgrade.stderr
        assert "pod" not in _agent_fields(cluster), "helm upgrade leaves CRDs as they were"
        # docs/upgrade.md, step 1:
        crds = _helm(cluster, "show", "crds", chart)
        assert crds.returncode == 0, crds.stderr
        cluster.kubectl(*apply, input=crds.stdout)
        assert "pod" in _agent_fields(cluster)
        pdb = cluster.get_json("pdb", f"{release}-pdfabric", "-n", namespace)
        assert pdb["spec"]["maxUnavailable"] == 1
    finally:
        cluster.kubectl(*apply[:-1], str(ROOT / "crds"))
        _helm(cluster, "uninstall", release, "-n", namespace, "--wait")
