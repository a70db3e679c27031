"""The container images `make images` builds, run as containers (podman, host network):

- the operator image, installed with `helm install` under the built references: the Deployment's pod
  spec agrees with the image (user, ports, probes), and the image run as that pod spec says (its
  command, env, user, read-only root filesystem, no capabilities) with the chart ServiceAccount's
  in-cluster credentials places a PDCluster on the real local control plane and answers its
  liveness probe;
- two CPU agent containers (the agent pods' command) move a room's KV, state and aux between them
  over the Mooncake engine, and again over NIXL (``backend: nixl``), on loopback tcp, byte-exact,
  with the byte counters scraped from their metrics port equal to what moved.

The first test builds the images (hack/images.sh: a few minutes cold, nothing when the inputs
are unchanged; cached outside the repository).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from pdfabric_core.spec import PDClusterSpec
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.procs import free_port
from pdfabric_devcluster.synthetic import expected_bytes
from pdfabric_devcluster.transfer import transfer_room
from pdfabric_operator.builders.pod_spec import pod_security_context
from pdfabric_operator.constants import HOME_DIR
from tests.builders import SMALL_MODEL, pdcluster
from tests.integration import pdcluster_harness as h

pytestmark = [pytest.mark.images, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = ROOT / "images" / "containers.conf"
BUILD_TIMEOUT = 1500  # a cold build (base root filesystem, pip downloads) with room to spare

gpu_nodes = h.gpu_nodes


def engine_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False, env=engine_env()
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """{target: reference} of the operator and CPU agent images, built when their inputs changed."""
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        pytest.skip("no podman and no apt-get to install it")
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(ROOT / "hack" / "images.sh"), "build", "operator", "agent"],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
        env={**os.environ, "PDFABRIC_CONTAINER_ENGINE": "podman"},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    refs = proc.stdout.split()
    assert len(refs) == 2, proc.stdout
    print(f"\nimages ready in {time.monotonic() - started:.0f} s: {refs}")
    return dict(zip(["operator", "agent"], refs, strict=True))


def inspect(ref: str) -> dict[str, Any]:
    (info,) = json.loads(podman("image", "inspect", ref).stdout)
    return dict(info)


def helm(cluster: Any, *args: str) -> None:
    proc = subprocess.run(
        [str(Path(cluster.bin_dir) / "helm"), "--kubeconfig", str(cluster.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def split_ref(ref: str) -> tuple[str, str]:
    repository, _, tag = ref.rpartition(":")
    return repository, tag


@contextlib.contextmanager
def container(name: str, *args: str) -> Iterator[str]:
    podman("run", "-d", "--name", name, *args)
    try:
        yield name
    finally:
        podman("rm", "-f", "-t", "5", name, check=False)


def serviceaccount_dir(cluster: Any, namespace: str, name: str, path: Path) -> Path:
    """What the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount: a token of the
    ServiceAccount, the cluster CA, the namespace."""
    token = cluster.kubectl("create", "token", name, "-n", namespace, "--duration=1h").stdout.strip()
    path.mkdir(parents=True, exist_ok=True)
    (path / "token").write_text(token)
    shutil.copyfile(cluster.ca, path / "ca.crt")
    (path / "namespace").write_text(namespace)
    for f in path.iterdir():
        f.chmod(0o444)  # readable by the image's non-root user, as the kubelet's projected volume is
    return path


def get_ok(url: str, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return bytes(resp.read())
        except OSError as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer 200 in {timeout:.0f} s: {last!r}")


@pytest.mark.timeout(BUILD_TIMEOUT + 300)
def test_helm_install_of_built_operator_image_places_a_pdcluster(
    images: dict[str, str], cluster: Any, namespace: str, gpu_nodes: Any, tmp_path: Path
) -> None:
    ref = images["operator"]
    image = inspect(ref)
    labels = image["Labels"] or {}
    assert labels["org.opencontainers.image.title"] == "pdfabric-operator"
    assert labels["org.opencontainers.image.version"] == split_ref(ref)[1]
    assert image["Size"] < 250e6, f"operator image is {image['Size'] / 1e6:.0f} MB"
    # The chart's defaults are the names `make images` gives.
    chart = next(d for d in h.render_chart(cluster) if d["kind"] == "Deployment")
    assert chart["spec"]["template"]["spec"]["containers"][0]["image"] == ref

    # --- helm install with the built references; free ports, as every process here shares the host.
    release = f"i{namespace[-6:]}"
    metrics_port, health_port = free_port(), free_port()
    repository, tag = split_ref(ref)
    helm(
        cluster, "install", release, str(ROOT / "charts" / "pdfabric"), "-n", namespace,
        "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        "--set", f"operator.peeringName={release}", "--set", "operator.reconcileInterval=1",
        "--set", f"metrics.port={metrics_port}", "--set", f"liveness.port={health_port}",
        "--wait", "--timeout", "120s",
    )  # fmt: skip
    try:
        # helm installs the chart's CRDs when they are not there yet (the other suites apply them too).
        h.wait_until(
            lambda: cluster.kubectl("get", "pdclusters", "-n", namespace, check=False).returncode == 0,
            timeout=60,
            what="the PDCluster CRD to be served",
        )
        dep = cluster.get_json("deployment", f"{release}-pdfabric", "-n", namespace)
        pods = cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=" + release)["items"]
        assert pods, "the Deployment made no pods"
        for pod_spec in [dep["spec"]["template"]["spec"], *(p["spec"] for p in pods)]:
            check_pod_spec_matches_image(pod_spec, ref, image, metrics_port, health_port)
        run_operator_as_deployment(cluster, namespace, dep, gpu_nodes, tmp_path, images["agent"])
    finally:
        helm(cluster, "uninstall", release, "-n", namespace, "--wait")


def check_pod_spec_matches_image(
    pod_spec: dict[str, Any], ref: str, image: dict[str, Any], metrics_port: int, health_port: int
) -> None:
    (c,) = pod_spec["containers"]
    assert c["image"] == ref
    # The user: the image's, numeric (runAsNonRoot can only be checked against a numeric user).
    user, _, _group = image["Config"]["User"].partition(":")
    assert user.isdigit() and int(user) != 0, image["Config"]["User"]
    sc = pod_spec["securityContext"]
    assert (sc["runAsNonRoot"], sc["runAsUser"]) == (True, int(user))
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # The command: the image's own.
    assert c["command"] == image["Config"]["Cmd"]
    # The ports the image exposes are the ones the pod names, and the probe uses.
    exposed = {int(p.split("/")[0]) for p in image["Config"]["ExposedPorts"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": metrics_port, "health": health_port}
    assert exposed == {8080, 8081}, "the image documents the chart's default ports"
    probe = c["livenessProbe"]["httpGet"]
    assert (probe["path"], ports[probe["port"]]) == ("/healthz", health_port)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PDFABRIC_METRICS_PORT"] == str(metrics_port)
    assert urlparse(env["PDFABRIC_LIVENESS"]).port == health_port


def run_operator_as_deployment(
    cluster: Any, namespace: str, dep: dict[str, Any], gpu_nodes: Any, tmp_path: Path, agent_ref: str
) -> None:
    """The image run as the Deployment's pod spec runs it, with the chart ServiceAccount's
    in-cluster credentials, against the local control plane; it places a PDCluster."""
    pod_spec = dep["spec"]["template"]["spec"]
    (c,) = pod_spec["containers"]
    server = urlparse(cluster.server)
    sa_dir = serviceaccount_dir(cluster, namespace, pod_spec["serviceAccountName"], tmp_path / "sa")
    env = {e["name"]: e.get("value", "") for e in c["env"]}  # the API drops empty values
    env |= {"KUBERNETES_SERVICE_HOST": server.hostname, "KUBERNETES_SERVICE_PORT": str(server.port)}
    args = [
        "--network", "host", "--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--user", str(pod_spec["securityContext"]["runAsUser"]),
        "-v", f"{sa_dir}:/var/run/secrets/kubernetes.io/serviceaccount:ro",
        *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
        c["image"], *c["command"],
    ]  # fmt: skip
    name = f"pdfabric-test-operator-{uuid.uuid4().hex[:8]}"
    with container(name, *args):
        try:
            health = json.loads(get_ok(env["PDFABRIC_LIVENESS"].replace("0.0.0.0", "127.0.0.1"), 60))
            assert "clusters" in health, health
            nodes = gpu_nodes("img", 2)
            builder = pdcluster("imaged").prefill(tp=2).decode(tp=2).transport("tcp")
            manifest = builder.placement(nodeSelector=h.selector(namespace)).manifest()
            assert "agent" not in manifest["spec"]  # tcp's default agent image: the CPU one `make images` built
            h.apply_pdc(cluster, manifest, namespace)
            obj = h.wait_ready(cluster, namespace, "imaged", timeout=90)
            agents = h.agent_pods(cluster, namespace, "imaged")
            assert {p["spec"]["nodeName"] for p in agents} <= set(nodes), agents
            assert {p["spec"]["containers"][0]["image"] for p in agents} == {agent_ref}
            assert obj["status"]["conditions"], obj["status"]
            metrics = get_ok(f"http://127.0.0.1:{env['PDFABRIC_METRICS_PORT']}/metrics", 10).decode()
            assert "pdfabric_" in metrics
            h.delete_all_pdclusters(cluster, namespace)
        except BaseException:
            print(podman("logs", name, check=False).stdout[-5000:])
            raise
        stopped = podman("stop", "-t", "20", name)
        assert stopped.returncode == 0
        state = json.loads(podman("inspect", name).stdout)[0]["State"]
        logs = podman("logs", name, check=False)
        assert state["ExitCode"] == 0, logs.stdout[-3000:] + logs.stderr[-3000:]


def agent_spec(backend: str) -> dict[str, Any]:
    return {
        "backend": backend,
        "prefill": {"tp": 2},
        "decode": {"tp": 2},
        "transfer": {"transport": "tcp", "timeoutSeconds": 10},
        "model": SMALL_MODEL,
        "placement": {"fallback": "TCP"},
    }


# What an agent pod's container gets from the operator's pod spec and the harness (ports, peers).
AGENT_ENV_PREFIXES = ("PDFABRIC_", "NODE_NAME", "POD_NAME", "POD_NAMESPACE", "POD_IP")


def give_to_group(root: Path, gid: int) -> None:
    """What the kubelet does for fsGroup: the files group-owned and group-readable."""
    for path in [root, *root.rglob("*")]:
        os.chown(path, -1, gid, follow_symlinks=False)
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | (0o050 if path.is_dir() else 0o040))


def containerize(fabric: LocalFabric, ref: str) -> list[str]:
    """Turn each of the fabric's agent processes into `podman run` of the agent image, with the
    same command (the image's), environment and files (mounted at the same paths), host network,
    and the node pods' user, no capabilities and no new privileges."""
    ctx = pod_security_context(PDClusterSpec().agent.run_as_user)
    user, group = ctx["runAsUser"], ctx["fsGroup"]
    give_to_group(Path(fabric.workdir), group)
    names = []
    for agent in fabric.agents.values():
        name = f"pdfabric-test-{agent.name}-{fabric.uid[:8]}"
        env = {k: v for k, v in agent.env.items() if k.startswith(AGENT_ENV_PREFIXES)}
        os.chown(env["PDFABRIC_SHM_DIR"], user, group)  # the pod's /dev/shm is its own
        mounts = [fabric.workdir, env["PDFABRIC_SHM_DIR"]]
        agent.argv = [
            "podman", "run", "--rm", "--name", name, "--network", "host", "--stop-timeout", "10",
            "--user", f"{user}:{group}", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--tmpfs", f"{HOME_DIR}:rw,mode=1777", "-e", f"HOME={HOME_DIR}",
            *[a for m in mounts for a in ("-v", f"{m}:{m}")],
            *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
            ref,
        ]  # fmt: skip
        agent.env = engine_env()
        names.append(name)
    return names


def moved(fabric: LocalFabric, role: str) -> dict[str, float]:
    return {
        kind: fabric.metric_sum("pdfabric_transfer_bytes_total", role=role, kind=kind)
        for kind in ("kv", "state", "aux")
    }


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.timeout(BUILD_TIMEOUT + 300)
def test_two_agent_containers_move_a_room_byte_exact(images: dict[str, str], backend: str) -> None:
    ref = images["agent"]
    labels = inspect(ref)["Labels"] or {}
    assert labels["org.opencontainers.image.title"] == "pdfabric-agent"
    shm = Path(tempfile.mkdtemp(prefix="pdfabric-img-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    fabric = LocalFabric(agent_spec(backend), env={"PDFABRIC_SHM_DIR": str(shm)})
    names = containerize(fabric, ref)
    assert len(names) == 2, names  # one prefill, one decode agent
    try:
        fabric.start(wait_s=90)
        pages, state_slots = 7, 2
        before = {role: moved(fabric, role) for role in ("prefill", "decode")}
        result = transfer_room(fabric, 21, pages=pages, state_slots=state_slots, aux=True)
        assert {v.state.title for v in result.decode.values()} == {"Success"}, result.decode
        assert {v.state.title for v in result.prefill.values()} == {"Success"}, result.prefill
        assert result.errors == {d: [] for d in result.decode}, "bytes differ on arrival"
        want = expected_bytes(fabric.spec, pages=pages, state_slots=state_slots, aux=True)
        for role in ("prefill", "decode"):
            after = moved(fabric, role)
            delta = {k: after[k] - before[role][k] for k in after}
            assert delta == {"kv": want.kv, "state": want.state, "aux": want.aux}, role
        assert want.kv > 0
        assert fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", backend=backend) == sum(
            (want.kv, want.state, want.aux)
        ), f"the bytes were not counted on backend {backend}"
    except BaseException:
        for agent in fabric.agents.values():
            print(f"--- {agent.name}\n{agent.log_tail()}")
        raise
    finally:
        try:
            fabric.close()
        finally:
            for name in names:
                podman("rm", "-f", "-t", "5", name, check=False)
            shutil.rmtree(shm, ignore_errors=True)
