"""`helm install` of the chart on the real API server: everything applies, CRDs survive uninstall."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

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
    dep = cluster.get_json("deployment", f"{release}-pdfabric", "-n", namespace)
    assert dep["status"].get("availableReplicas") == 2
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
