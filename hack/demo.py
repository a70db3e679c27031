"""The demo on the embedded default: the whole fabric on this machine.

1. a real control plane with fake GPU nodes (already up: `python -m pdfabric_devcluster up`);
2. `helm install` of charts/pdfabric (CRDs, RBAC, dashboards; the operator Deployment is scaled to
   0 because fake nodes run nothing) and the operator itself as a local process, authenticated as
   the chart's ServiceAccount;
3. `kubectl apply` of examples/: a TCP PDCluster, an intra-node NVLink one, and one that cannot be
   placed, to show the reason the operator reports; an invalid one, to show the API server's message;
4. the agent pods' real command as local processes, real bytes over the Mooncake engine, verified
   on arrival, scraped by a real Prometheus, and a summary read back from it;
5. the transfer dashboard's traffic panels rendered to docs/img/ from that Prometheus' data;
6. spec.engine and spec.router on PDCluster demo (the reference engine, the reference model,
   SGLang's router): the pods roll one at a time, each node pod's agent runs its engines as
   processes and the router's pod runs SGLang's router (PodRunner runs the pods' commands
   locally), prompts go through the router and the PD path (prefill computes the KV, the agents
   move it, decode generates from it), answers printed beside colocated generation, then the
   traffic Prometheus saw for them;
7. spec.engine running SGLang's own server (PDCluster sglang: SGLang's CPU engine on a small
   random-weight Llama, pdfabric as its transfer backend, SGLang's router in front): answers equal
   a single SGLang server's token for token, and the bytes Prometheus saw;
8. spec.engine running vLLM's own server (PDCluster vllm: vLLM's CPU build on a small seeded Llama,
   pdfabric's KV connector, vLLM's router in front): answers equal a single vLLM server's token for
   token, and the bytes Prometheus saw.
Local processes stop at the end; the cluster stays up for `kubectl` (stop it: make cluster-down).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pdfabric_refengine.geometry import SPEC_MODEL

from pdfabric_devcluster.binaries import ClusterError, wait_for
from pdfabric_devcluster.cluster import LocalCluster
from pdfabric_devcluster.fabric import Fabric
from pdfabric_devcluster.podrunner import PodRunner
from pdfabric_devcluster.procs import REPO_ROOT, console_argv, free_port
from pdfabric_devcluster.prometheus import Prometheus
from pdfabric_devcluster.sglang_router import SGLangRouter
from pdfabric_devcluster.synthetic import expected_bytes
from pdfabric_devcluster.transfer import transfer_room
from render_panels import http_range_query, render

NAMESPACE = "demo"
SYSTEM_NAMESPACE = "pdfabric-system"
WORKDIR = REPO_ROOT / ".artifacts" / "demo"
ROOMS = 40
ROOM_PAUSE_S = 0.5  # traffic over some seconds, for the pictures' rates
PAGES = 24
EXAMPLES = ("demo", "llama-70b", "dsv4-cp8")
# Prefill TP8 and the two decode TP8 replicas it feeds must share one NVLink domain: 24 GPUs,
# and the demo fleet's only domain has 16.
REF_MODEL = SPEC_MODEL  # the reference engine's model as spec.model
SERVER = ["python", "-m", "pdfabric_refengine.server"]
PROMPTS = ["Hello, PD!", "prefill and decode", "KV cache over the fabric", "pdfabric"]
NEW_TOKENS = 16
TOO_BIG = {
    "apiVersion": "pdfabric.dev/v1alpha1",
    "kind": "PDCluster",
    "metadata": {"name": "too-big"},
    "spec": {"transfer": {"memPool": "NVLINK"}, "prefill": {"tp": 8}, "decode": {"replicas": 2, "tp": 8}},
}


def step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def show(cluster: LocalCluster, *args: str, input: str | None = None) -> None:
    print(cluster.kubectl(*args, input=input).stdout.rstrip(), flush=True)


def print_queries(prometheus: Prometheus, queries: dict[str, str]) -> None:
    """One line per query: its label and the value Prometheus answers (nan: no series)."""
    for label, expr in queries.items():
        result = prometheus.query(expr)
        value = float(result[0]["value"][1]) if result else float("nan")
        print(f"  {label:32} {value:,.0f}" if value >= 100 else f"  {label:32} {value:.4g}")


def pdc_condition(cluster: LocalCluster, name: str, type_: str, namespace: str = NAMESPACE) -> dict | None:
    obj = cluster.get_json("pdcluster", name, "-n", namespace)
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), None)


def main() -> int:
    cluster = LocalCluster.attach(REPO_ROOT / ".artifacts" / "cluster")
    WORKDIR.mkdir(parents=True, exist_ok=True)
    helm = str(cluster.bin_dir / "helm")

    step("helm install charts/pdfabric (CRDs, RBAC, dashboards)")
    subprocess.run(
        [helm, "upgrade", "--install", "pdfabric", str(REPO_ROOT / "charts" / "pdfabric"), "-n", SYSTEM_NAMESPACE,
         "--create-namespace", "--set", "replicaCount=0", f"--kubeconfig={cluster.kubeconfig}"],
        check=True,
    )  # fmt: skip
    show(cluster, "get", "crd", "pdclusters.pdfabric.dev")
    show(cluster, "get", "configmaps", "-n", SYSTEM_NAMESPACE, "-l", "grafana_dashboard=1")

    site, backend = installed_site()
    runner = PodRunner(
        cluster, NAMESPACE, "app.kubernetes.io/component=agent", WORKDIR / "pods", pythonpath=[site] if site else []
    )

    step("operator running as the chart's ServiceAccount (least-privilege RBAC)")
    metrics_port = free_port()
    env = {
        **os.environ,
        "PDFABRIC_KUBECONFIG": str(cluster.service_account_kubeconfig(SYSTEM_NAMESPACE, "pdfabric")),
        "PDFABRIC_METRICS_PORT": str(metrics_port),
        "PDFABRIC_LIVENESS": f"http://127.0.0.1:{free_port()}/healthz",
        "PDFABRIC_RECONCILE_INTERVAL": "2",
        # It reads each agent's /readyz (transport, engines); here the agents are local processes.
        "PDFABRIC_AGENT_ADDRESSES": str(runner.addresses_file),
        "PYTHONPATH": os.pathsep.join(str(REPO_ROOT / p) for p in ("core", "operator", "agent")),
    }
    operator_log = WORKDIR / "operator.log"
    with open(operator_log, "wb") as log:
        operator = subprocess.Popen(console_argv(["pdfabric-operator"]), env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"operator pid {operator.pid}, log {operator_log}")
    prometheus = Prometheus(WORKDIR / "prometheus")
    try:
        code = run_demo(cluster, runner, prometheus, metrics_port)
        code = code or serve_demo(cluster, runner, prometheus, backend)
        code = code or sglang_demo(cluster, runner, prometheus, site)
        code = code or vllm_demo(cluster, runner, prometheus)
        return code or finish(cluster)
    finally:
        runner.stop()
        prometheus.stop()
        operator.terminate()
        operator.wait(timeout=30)


def installed_site() -> tuple[str, str]:
    """pdfabric installed as an engine image has it (its sglang.srt.plugins entry point, which
    SGLang's load_plugins() finds), into the demo's folder; without the build tools the engines
    use the agent's engine API directly (--backend direct)."""
    site = WORKDIR / "site"
    shutil.rmtree(site, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(REPO_ROOT)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        print(f"(pdfabric not installable here, the engines run --backend direct: {proc.stderr.strip()[-300:]})")
        return "", "direct"
    return str(site), "sglang"


def run_demo(cluster: LocalCluster, runner: PodRunner, prometheus: Prometheus, operator_metrics: int) -> int:
    step(f"kubectl apply -f examples/ -n {NAMESPACE}")
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    show(cluster, "apply", "-n", NAMESPACE, "-f", str(REPO_ROOT / "examples"))
    show(cluster, "apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(TOO_BIG))
    wait_for(
        lambda: all(pdc_condition(cluster, n, "Placed") is not None for n in (*EXAMPLES, "too-big")),
        timeout=60,
        interval=0.5,
        what="the operator to place or refuse every PDCluster",
    )
    wait_for(
        lambda: (c := pdc_condition(cluster, "demo", "Ready")) and c["status"] == "True",
        timeout=60,
        interval=0.5,
        what="PDCluster demo Ready",
    )
    show(cluster, "get", "pdc", "-n", NAMESPACE)
    for name in (*EXAMPLES, "too-big"):
        placed = pdc_condition(cluster, name, "Placed") or {}
        print(f"  {name}: Placed={placed.get('status')} ({placed.get('reason')}): {placed.get('message')}")
    show(cluster, "get", "pods", "-n", NAMESPACE, "-o", "wide")

    step("an invalid PDCluster is refused by the API server (schema + CEL)")
    bad = {
        "apiVersion": "pdfabric.dev/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": "bad"},
        "spec": {"prefill": {"tp": 2}, "decode": {"tp": 2, "cp": 2}},
    }
    refused = cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(bad), check=False)
    print(refused.stderr.strip())

    step("agents of PDCluster demo: their pods' real command, run locally")
    pods = {n: p for n, p in runner.sync().items() if n.startswith("demo")}
    wait_for(lambda: all(p.ready() for p in pods.values()), timeout=120, interval=0.5,
             what="every agent ready")  # fmt: skip
    for name, pod in pods.items():
        print(f"  {name:32} node {pod.node:14} api {pod.address}  metrics :{pod.metrics_port}")

    step("Prometheus scraping the agents and the operator")
    prometheus.start()
    targets = [(f"127.0.0.1:{p.metrics_port}", {"pod": n, "namespace": NAMESPACE}) for n, p in pods.items()]
    prometheus.set_targets([*targets, (f"127.0.0.1:{operator_metrics}", {"pod": "operator"})])
    prometheus.wait_targets_up()
    print(f"  {prometheus.url}")

    step(f"{ROOMS} requests: prefill TP2 x CP2 -> decode TP4 over Mooncake tcp, verified byte by byte")
    fabric = Fabric.from_cluster(cluster, NAMESPACE, "demo", runner)
    traffic_start = time.time() - 5
    for room in range(1, ROOMS + 1):
        time.sleep(ROOM_PAUSE_S)
        result = transfer_room(fabric, room, pages=PAGES, state_slots=1, aux=True)
        states = {v.state.title for v in result.decode.values()}
        bad_bytes = sum(len(e) for e in result.errors.values())
        print(
            f"  room {room}: {'/'.join(sorted(states))} in {result.elapsed_s * 1000:.1f} ms, mismatched bytes: {bad_bytes}"
        )
        if states != {"Success"} or bad_bytes:
            return 1

    step("what Prometheus saw")
    time.sleep(2.5)  # two more scrapes
    queries = {
        "KV bytes": 'sum(pdfabric_transfer_bytes_total{pdcluster="demo",role="prefill",kind="kv"})',
        "state bytes": 'sum(pdfabric_transfer_bytes_total{pdcluster="demo",role="prefill",kind="state"})',
        "aux bytes": 'sum(pdfabric_transfer_bytes_total{pdcluster="demo",role="prefill",kind="aux"})',
        "state bytes saved by CP dedup": 'sum(pdfabric_state_dedup_skipped_bytes_total{pdcluster="demo"})',
        "successful rank-requests": 'sum(pdfabric_requests_total{pdcluster="demo",outcome="success"})',
        "engine blocks / batches": 'sum(pdfabric_transfer_blocks_total{pdcluster="demo",role="prefill"}) / '
        'sum(pdfabric_transfer_batches_total{pdcluster="demo",role="prefill"})',
        "p50 submit-to-completion (s)": "histogram_quantile(0.5, sum by (le) "
        '(rate(pdfabric_request_duration_seconds_bucket{pdcluster="demo",role="prefill"}[1m])))',
        "operator reconciles": "sum(pdfabric_operator_reconciles_total)",
    }
    print_queries(prometheus, queries)
    want = expected_bytes(fabric.spec, pages=PAGES, state_slots=1, aux=True)
    print(f"  the synthetic engine's own count for {ROOMS} requests: KV {ROOMS * want.kv:,}, state "
          f"{ROOMS * want.state:,}, aux {ROOMS * want.aux:,}, state saved {ROOMS * want.state_skipped:,}")  # fmt: skip

    step("the transfer dashboard's traffic panels, from this run's Prometheus data")
    time.sleep(5)  # the rates fall back to zero
    drawn = render(http_range_query(prometheus.url), traffic_start, time.time(), pdcluster="demo", namespace=NAMESPACE)
    for name, series in drawn.items():
        print(f"  docs/img/{name}: {series} series")

    return 0


def serve_demo(cluster: LocalCluster, runner: PodRunner, prometheus: Prometheus, backend: str) -> int:
    from pdfabric_refengine import build_model, colocated_generate
    from pdfabric_refengine.server import detokenize, tokenize

    step(f"spec.engine on PDCluster demo: the reference engine ({backend} backend) beside the agents")
    args = ["--tp", "$(PDFABRIC_TP)", "--backend", backend, "--timeout-s", "20"]
    engine = {
        "image": "pdfabric/refengine:local",
        "prefill": {"command": SERVER, "args": ["--role", "prefill", "--cp", "$(PDFABRIC_CP)", *args]},
        "decode": {"command": SERVER, "args": ["--role", "decode", *args]},
    }
    router_spec = {"image": "sglang-router:0.3.2", "args": ["--policy", "round_robin"]}
    patch = [
        {"op": "replace", "path": "/spec/model", "value": REF_MODEL},
        {"op": "add", "path": "/spec/engine", "value": engine},
        {"op": "add", "path": "/spec/router", "value": router_spec},
    ]
    print(f"  kubectl patch pdc demo --type json: spec.model = the reference model, spec.engine = {json.dumps(engine)}, "
          f"spec.router = {json.dumps(router_spec)}")  # fmt: skip
    show(cluster, "patch", "pdcluster", "demo", "-n", NAMESPACE, "--type", "json", "-p", json.dumps(patch))

    def serving(pod: dict) -> bool:
        (container,) = pod["spec"]["containers"]
        return any(v["name"] == "PDFABRIC_ENGINES" for v in container.get("env", []))

    def rolled() -> bool:
        # The operator replaces one pod at a time, each once the others are Ready: run what it made
        # (the router's pod too, once the scheduler placed it).
        pods = [p for p in runner.list_pods() if p["metadata"]["name"].startswith("demo")]
        runner.sync()
        if pods and all(serving(p) for p in pods) and runner.engines:
            with contextlib.suppress(ClusterError):  # an engine URL of a pod not started yet
                runner.start_routers()
        ready = (c := pdc_condition(cluster, "demo", "Ready")) and c["status"] == "True"
        return bool(pods and all(serving(p) for p in pods) and ready and runner.routers)

    wait_for(rolled, timeout=300, interval=1, what="PDCluster demo rolled to its engine pods, its router and Ready")
    show(cluster, "get", "pdc", "demo", "-n", NAMESPACE)
    pods = {n: p for n, p in runner.sync().items() if n.startswith("demo")}
    wait_for(lambda: all(p.ready() for p in pods.values()), timeout=120, interval=0.5, what="every agent ready")
    runner.wait_engines_healthy(timeout=240)
    obj = cluster.get_json("pdcluster", "demo", "-n", NAMESPACE)
    endpoints = obj["status"]["endpoints"]
    for role in ("prefill", "decode"):
        for ep in endpoints[role]:
            local = runner.engine(ep["pod"], ep["engine"])
            boot = f", bootstrap {ep['bootstrap']}" if "bootstrap" in ep else ""
            print(f"  {role} engine {ep['engine']} of {ep['pod']}: {ep['url']}{boot} (here {local.url})")
    ((router_pod, router),) = runner.routers.items()
    router.wait_healthy(120, ready=True)  # its readiness probe: a healthy prefill and decode worker
    # Prometheus scrapes the agents and the router (its port named metrics, as the PodMonitor does).
    targets = [(f"127.0.0.1:{p.metrics_port}", {"pod": n, "namespace": NAMESPACE}) for n, p in pods.items()]
    targets.append((router.metrics_url.removeprefix("http://"), {"pod": router_pod, "namespace": NAMESPACE}))
    prometheus.set_targets(targets)
    prometheus.wait_targets_up()
    print(f"  spec.router: {json.dumps(obj['status'].get('router'))}; SGLang's router runs its pod's command "
          f"(here {router.url})")  # fmt: skip
    show(cluster, "get", "deployment", "demo-router", "-n", NAMESPACE)

    step("prompts through SGLang's router (it sends each to prefill and decode, one bootstrap room), beside colocated")
    model = build_model(0)
    equal, reported = 0, 0
    for text in PROMPTS:
        ids = tokenize(text)
        status, body = router.generate(
            {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}, timeout_s=120
        )
        want = colocated_generate(model, ids, NEW_TOKENS)
        if status != 200:
            print(f"  {text!r}: FAILED: HTTP {status} {json.dumps(body)[:400]}")
            return 1
        tokens, meta = list(body["output_ids"]), body.get("meta_info", {})
        same = tokens == want
        equal += same
        reported += sum(m["bytes"] for m in meta.get("kv_transfer", {}).values())
        print(f"  prompt {text!r} ({len(ids)} tokens, room {meta.get('bootstrap_room')})")
        print(f"    PD        text {json.dumps(body['text'], ensure_ascii=False)} tokens {tokens}")
        print(f"    colocated text {json.dumps(detokenize(want), ensure_ascii=False)} tokens {want}  "
              f"{'equal' if same else 'DIFFERENT'}")  # fmt: skip
    print(f"  {equal}/{len(PROMPTS)} answers equal the colocated reference token for token")
    if equal != len(PROMPTS):
        return 1

    step("what Prometheus saw for them")
    time.sleep(2.5)  # two more scrapes
    queries = {
        "KV bytes into decode": 'sum(pdfabric_transfer_bytes_total{pdcluster="demo",role="decode",kind="kv"})',
        "aux bytes into decode": 'sum(pdfabric_transfer_bytes_total{pdcluster="demo",role="decode",kind="aux"})',
        "successful rank-requests": 'sum(pdfabric_requests_total{pdcluster="demo",outcome="success"})',
        "failed rank-requests": 'sum(pdfabric_requests_total{pdcluster="demo",outcome!="success"}) or vector(0)',
        "router /generate requests": f'sum(smg_http_requests_total{{namespace="{NAMESPACE}",path="/generate"}})',
    }
    print_queries(prometheus, queries)
    print(f"  the engines' own count (SGLang's KVTransferMetric of the decode ranks): {reported:,} bytes")

    return 0


SGLANG_PROMPTS = ["Hello, PD!", "SGLang's own server moves its KV through pdfabric", "prefill and decode " * 8]
VLLM_PROMPTS = ["Hello, PD!", "vLLM's own server moves its KV through pdfabric", "prefill and decode " * 8]


def serve_pdcluster(
    cluster: LocalCluster, runner: PodRunner, prometheus: Prometheus, name: str, manifest: dict
) -> SGLangRouter:
    """Apply an engine PDCluster, wait until it is Ready with its router (the node pods' engines
    start as the agents run them, the router's pod once the engines have URLs), point Prometheus at
    its agents, and return its router (SGLang's or vLLM's: the same process handle)."""
    path = WORKDIR / f"pdcluster-{name}.json"
    path.write_text(json.dumps(manifest, indent=1))
    print(f"  the PDCluster: {path}")
    show(cluster, "apply", "-n", NAMESPACE, "-f", str(path))

    def routers() -> list[SGLangRouter]:
        return [r for pod, r in runner.routers.items() if pod.startswith(f"{name}-")]

    def rolled() -> bool:
        runner.sync()
        if runner.engines:
            with contextlib.suppress(ClusterError):  # an engine URL of a pod not started yet
                runner.start_routers()
        ready = (c := pdc_condition(cluster, name, "Ready")) and c["status"] == "True"
        return bool(ready and routers())

    # Ready once the agents' servers answer (a minute or two on this machine's 2 cores).
    wait_for(rolled, timeout=600, interval=1, what=f"PDCluster {name} Ready: its agents, servers and router")
    pods = {n: p for n, p in runner.sync().items() if n.startswith(f"{name}-")}
    show(cluster, "get", "pdc", name, "-n", NAMESPACE)
    (router,) = routers()
    router.wait_healthy(300, ready=True)
    targets = [(f"127.0.0.1:{p.metrics_port}", {"pod": n, "namespace": NAMESPACE}) for n, p in pods.items()]
    prometheus.set_targets(targets)
    prometheus.wait_targets_up()
    return router


Answer = tuple[int, dict]  # HTTP status, body


def compare_prompts(
    engine: str,
    model_dir: Path,
    texts: list[str],
    pd: Callable[[list[int]], Answer],
    single: Callable[[list[int]], Answer],
    tokens: Callable[[dict], list[int]],
) -> bool:
    """Each prompt through PD and through the single server, their tokens printed side by side;
    True when every answer is equal token for token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    equal = 0
    for text in texts:
        ids = tok(text)["input_ids"]
        (status, body), (want_status, want) = pd(ids), single(ids)
        if status != 200 or want_status != 200:
            print(f"  {text!r}: FAILED: HTTP {status} {json.dumps(body)[:400]} / single {want_status}")
            return False
        got, expected = tokens(body), tokens(want)
        equal += got == expected
        print(f"  prompt {text!r} ({len(ids)} tokens)")
        print(f"    PD     tokens {got}")
        print(f"    single tokens {expected}  {'equal' if got == expected else 'DIFFERENT'}")
    print(f"  {equal}/{len(texts)} answers of {engine}'s PD servers equal the single server's token for token")
    return equal == len(texts)


def print_traffic(prometheus: Prometheus, name: str, engine: str, *, aux: bool) -> None:
    """What Prometheus saw of the PDCluster's traffic (aux: the engine hands decode metadata rows;
    vLLM's connector moves KV only)."""
    time.sleep(2.5)  # two more scrapes

    def moved(kind: str) -> str:
        return f'sum(pdfabric_transfer_bytes_total{{pdcluster="{name}",role="decode",kind="{kind}"}})'

    queries = {f"KV bytes into {engine}'s decode server": moved("kv")}
    if aux:
        queries["metadata (aux) bytes"] = moved("aux")
    queries["successful rank-requests"] = f'sum(pdfabric_requests_total{{pdcluster="{name}",outcome="success"}})'
    print_queries(prometheus, queries)


def sglang_demo(cluster: LocalCluster, runner: PodRunner, prometheus: Prometheus, site: str) -> int:
    """A PDCluster whose engines are SGLang's real server (SGLang's CPU engine, a small random-weight
    Llama): the agents start prefill and decode servers with pdfabric as their transfer backend,
    SGLang's router pairs them, and each answer equals a single SGLang server's."""
    from pdfabric_sglangserver.model import write_model_dir
    from pdfabric_sglangserver.pd import example_pdcluster
    from pdfabric_sglangserver.servers import greedy, server_argv, server_env, start_server

    step("spec.engine running SGLang's own server: PDCluster sglang")
    if not site:
        print(
            "  (skipped: SGLang loads the pdfabric plugin through its entry point, and pdfabric could not be installed)"
        )
        return 0
    model_dir = write_model_dir(WORKDIR / "sglang-model")
    # The reference answers: one SGLang server serving the same model alone, started meanwhile.
    port = free_port()
    single = start_server(
        "single", server_argv(model_dir, port), server_env(dict(os.environ)), WORKDIR / "sglang-single.log", port
    )
    try:
        router = serve_pdcluster(cluster, runner, prometheus, "sglang", example_pdcluster(model_dir))
        single.wait_healthy()

        step("prompts through SGLang's router to SGLang's prefill and decode servers, beside a single SGLang server")
        if not compare_prompts(
            "SGLang", model_dir, SGLANG_PROMPTS,
            lambda ids: router.generate(greedy(ids, NEW_TOKENS), timeout_s=120),
            lambda ids: single.generate(greedy(ids, NEW_TOKENS)),
            lambda body: list(body["output_ids"]),
        ):  # fmt: skip
            return 1
        print_traffic(prometheus, "sglang", "SGLang", aux=True)
    finally:
        single.stop()
    return 0


def vllm_demo(cluster: LocalCluster, runner: PodRunner, prometheus: Prometheus) -> int:
    """A PDCluster whose engines are vLLM's real server (vLLM's CPU build, a small seeded Llama):
    the agents start prefill and decode servers with pdfabric's KV connector, vLLM's router pairs
    them, and each answer equals a single vLLM server's."""
    from pdfabric_devcluster.procs import post_json
    from pdfabric_sglangserver.model import write_model_dir
    from pdfabric_vllmserver.pd import example_images, example_pdcluster
    from pdfabric_vllmserver.servers import MODEL, completion, start_server, token_ids, vllm_python

    step("spec.engine running vLLM's own server: PDCluster vllm")
    python = vllm_python()
    model_dir = write_model_dir(WORKDIR / "vllm-model", MODEL)
    manifest = example_pdcluster(model_dir)
    runner.images.update(example_images(manifest, python))  # vLLM's environment on this machine
    # The reference answers: one vLLM server serving the same model alone, started meanwhile.
    single = start_server("single", python, model_dir, WORKDIR / "vllm-single.log")
    try:
        router = serve_pdcluster(cluster, runner, prometheus, "vllm", manifest)
        single.wait_healthy()

        step("prompts through vLLM's router to vLLM's prefill and decode servers, beside a single vLLM server")
        if not compare_prompts(
            "vLLM", model_dir, VLLM_PROMPTS,
            lambda ids: post_json(router.url + "/v1/completions", completion(ids, NEW_TOKENS), 120),
            lambda ids: single.complete(completion(ids, NEW_TOKENS)),
            token_ids,
        ):  # fmt: skip
            return 1
        print_traffic(prometheus, "vllm", "vLLM", aux=False)
    finally:
        single.stop()
    return 0


def finish(cluster: LocalCluster) -> int:
    step("done")
    print("The cluster stays up:")
    print(f"  export KUBECONFIG={cluster.kubeconfig} PATH={cluster.bin_dir}:$PATH")
    print("  kubectl get pdc -A")
    print("Stop it with: make cluster-down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
