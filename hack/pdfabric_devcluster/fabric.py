"""Real agent processes of one PDCluster on this machine (loopback tcp), seen the way a serving
engine sees them: the rank map, the engine token, one client per agent (on its engine door), each
agent's /readyz and /metrics; and the way a peer agent sees them (``peer_post``: its peer door,
mutual TLS). ``Fabric`` is that view, built one way from what it is given.

Two ways to get the agents:

- ``LocalFabric(raw_spec, ...)``, a Fabric that places the ranks itself (one agent per role
  replica, or per ``ranks_per_agent`` ranks), writes the rank map, the engine token, a cluster CA
  and one peer certificate per agent as the operator would (the operator's own ``pki``), and runs
  the agent's real command for each entry (e2e agent tests, benchmarks, GPU tests);
- ``Fabric.from_cluster(cluster, namespace, name, runner)`` reads a placed PDCluster's rank map
  and engine token from the control plane and drives the agent processes PodRunner started from
  the operator's pods, with the certificates the operator issued (the demo, the whole-fabric e2e
  test).

The processes themselves (ports, environment, /readyz, peer calls) are ``agents.py``'s: every
process gets free loopback ports in place of its container ports (engine door, peer door,
metrics) and learns its peers' peer-door addresses through PDFABRIC_PEERS, standing in for the
headless Service's DNS names (the certificates still carry those names, and peers verify them).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import os
import secrets
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from pdfabric_agent.client.api import AgentClient
from pdfabric_agent.runtime.config import SETTINGS
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import RANKMAP_KEY, AgentEntry, Rank, RankMap, replica_ranks
from pdfabric_core.spec import PDClusterSpec, parse_spec
from pdfabric_devcluster.agents import (
    DEFAULT_PEER_HOST_TEMPLATE,
    AgentProcess,
    LocalEngine,
    Samples,
    engines_env,
    loopback_env,
    peer_request,
    stop_all,
    write_tls_dir,
)
from pdfabric_devcluster.procs import FAILURE_LOG_CHARS, console_argv, free_port
from pdfabric_devcluster.timings import timed
from pdfabric_operator import pki

if TYPE_CHECKING:
    from pdfabric_devcluster.cluster import LocalCluster
    from pdfabric_devcluster.podrunner import PodRunner


def place(spec: PDClusterSpec, *, ranks_per_agent: int = 0, decode_gpu: int = 0) -> list[AgentEntry]:
    """One agent per (role, replica), or per ``ranks_per_agent`` ranks of it when > 0; decode ranks
    on GPU ``decode_gpu``, prefill ranks on GPU 0."""
    agents: list[AgentEntry] = []
    groups: list[tuple[str, int, list[Rank]]] = []
    for r in range(spec.prefill.replicas):
        groups.append(("prefill", r, replica_ranks(spec, Role.PREFILL, r)))
    for r in range(spec.decode.replicas):
        groups.append(("decode", r, replica_ranks(spec, Role.DECODE, r, gpu=decode_gpu)))
    for role, replica, ranks in groups:
        size = ranks_per_agent or len(ranks)
        for i in range(0, len(ranks), size):
            name = f"agent-{role[0]}{replica}-{i // size}"
            agents.append(AgentEntry(name, f"node-{role[0]}{replica}-{i // size}", tuple(ranks[i : i + size])))
    return agents


class Fabric:
    """Real agent processes of one PDCluster, driven as an engine and as a peer would: clients on
    their engine doors, their /readyz and /metrics, posts on their peer doors. A context manager
    that starts them all and, on exit, stops them and removes what they left."""

    def __init__(
        self,
        spec: PDClusterSpec,
        rankmap: RankMap,
        token: str,  # the engine token
        agents: dict[str, AgentProcess],  # by agent (pod) name
        *,
        engines: dict[tuple[str, str], LocalEngine] | None = None,  # (agent, engine name), with spec.engine
        workdir: str = "",
        ca: pki.KeyPair | None = None,  # the cluster CA, when this fabric issued the certificates itself
        tmp: tempfile.TemporaryDirectory[str] | None = None,  # removed by close()
    ) -> None:
        self.spec, self.rankmap, self.token, self.agents, self.workdir = spec, rankmap, token, agents, workdir
        self.engines = dict(engines or {})
        self.ca = ca
        self._tmp = tmp
        self._clients: dict[tuple[str, str, str], AgentClient] = {}

    @classmethod
    def from_cluster(cls, cluster: LocalCluster, namespace: str, name: str, runner: PodRunner) -> Fabric:
        """The agents PodRunner runs for PDCluster ``namespace/name``, with the rank map and token
        the operator published for it. The runner owns the processes; close() here only stops them."""
        obj = cluster.get_json("pdcluster", name, "-n", namespace)
        selector = f"pdfabric.dev/cluster={name}"
        maps = cluster.get_json("configmaps", "-n", namespace, "-l", selector)["items"]
        (cm,) = [m for m in maps if RANKMAP_KEY in m.get("data", {})]
        rankmap = RankMap.from_json(cm["data"][RANKMAP_KEY])
        secrets_ = cluster.get_json("secrets", "-n", namespace, "-l", selector)["items"]
        (secret,) = [s for s in secrets_ if s["metadata"]["name"] == f"{name}-engine-token"]
        (token_b64,) = secret["data"].values()
        agents = {e.name: runner.pods[e.name] for e in rankmap.agents}
        token = base64.b64decode(token_b64).decode().strip()
        engines = {k: v for k, v in runner.engines.items() if k[0] in agents}
        # The CA is the operator's, in its Secret.
        return Fabric(parse_spec(obj["spec"]), rankmap, token, agents, engines=engines)

    @property
    def uid(self) -> str:
        return self.rankmap.cluster_uid

    @property
    def kv_pages(self) -> int:
        """KV pages per pool, as the agents were configured (the agent default when not set)."""
        env = next(iter(self.agents.values())).env
        return int(env.get("PDFABRIC_KV_PAGES") or SETTINGS["PDFABRIC_KV_PAGES"][0] or 0)

    @property
    def shm_dir(self) -> str:
        """Where the agents' CPU pool files live."""
        env = next(iter(self.agents.values())).env if self.agents else {}
        return env.get("PDFABRIC_SHM_DIR") or "/dev/shm"

    # ------------------------------------------------------------------ processes
    def start(self, name: str | None = None, *, wait_s: float = 60.0, ready: bool = True) -> None:
        """Start every agent (or ``name``); with ``ready``, wait until each answers /readyz 200."""
        agents = [self.agents[name]] if name else list(self.agents.values())
        for agent in agents:
            agent.start()
        if ready:
            for agent in agents:
                agent.wait_ready(wait_s)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig``; for SIGKILL and SIGTERM, wait until the process is gone."""
        agent = self.agents[name]
        if agent.alive():
            agent.signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM) and agent.proc is not None:
                agent.proc.wait(timeout=15)

    def readyz(self, name: str) -> tuple[int, dict[str, Any]]:
        return self.agents[name].readyz()

    def bytes_by_path(self, role: str = "decode") -> dict[str, float]:
        """Bytes the agents counted into ``role``'s ranks, by "path/kind" (nvlink-kernel/kv, ...)."""
        out: dict[str, float] = {}
        for name in self.agents:
            for (metric, labels), value in self.scrape(name).items():
                d = dict(labels)
                if metric == "pdfabric_transfer_bytes_total" and d.get("role") == role and value:
                    key = f"{d['path']}/{d['kind']}"
                    out[key] = out.get(key, 0) + value
        return out

    def log(self, name: str) -> str:
        return self.agents[name].log_tail()

    def failure_logs(self) -> dict[str, str]:
        """Each agent's log tail, for a failed test's report (tests/conftest.py)."""
        return {f"agent {name}": agent.log_tail(FAILURE_LOG_CHARS) for name, agent in self.agents.items()}

    def keep_logs(self, folder: Path) -> None:
        """Copy each agent's log into ``folder`` (``agent-<name>.log``), for a look after the fabric's
        own folder is gone."""
        folder.mkdir(parents=True, exist_ok=True)
        for name, agent in self.agents.items():
            with contextlib.suppress(OSError):
                shutil.copyfile(agent.log_path, folder / f"agent-{name}.log")

    def stop(self) -> None:
        stop_all(self.agents.values())

    def close(self) -> None:
        with timed("agent fabric stop"):
            self.stop()  # first: nothing below may leave agents running
        try:
            from pdfabric_agent.process.main import remove_stale_pools

            # Agents killed with SIGKILL could not unlink their pool files; nobody restarts them now.
            remove_stale_pools(self.shm_dir, self.uid)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> Self:
        # Agents with spec.engine are ready once their engines load and answer: slower.
        try:
            with timed("agent fabric start"):
                self.start(wait_s=240 if self.spec.engine is not None else 60)
        except BaseException:
            # __exit__ does not run when __enter__ raises: one agent that never got ready left
            # the others (and their engines) running for the machine's life.
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ access
    def agent_of(self, rank_id: str) -> str:
        return self.rankmap.agent_for_rank(rank_id).name

    def entry(self, name: str) -> AgentEntry:
        """The rank map's entry of agent ``name``: its node and ranks."""
        return next(e for e in self.rankmap.agents if e.name == name)

    def client(self, rank_id_or_agent: str, *, token: str | None = None, uid: str | None = None) -> AgentClient:
        name = rank_id_or_agent if rank_id_or_agent in self.agents else self.agent_of(rank_id_or_agent)
        key = (self.agents[name].address, token or self.token, uid or self.uid)
        client = self._clients.get(key)
        if client is None:  # one per agent and identity, so its keep-alive connections are reused
            client = self._clients[key] = AgentClient(*key)
        return client

    def issue_peer_tls(
        self, agent: str, path: Path, *, ca: pki.KeyPair | None = None, valid_for: datetime.timedelta | None = None
    ) -> str:
        """A peer TLS directory for agent name ``agent`` (in the rank map or not), from this
        fabric's CA or from ``ca`` (another cluster's), named and addressed as the operator names
        agents, valid for ``valid_for`` (the operator's default without); for tests that call peer
        doors as someone else."""
        ca = ca or self.ca
        if ca is None:
            raise RuntimeError("this fabric's CA is the operator's; pass ca=")
        rm = self.rankmap
        host = DEFAULT_PEER_HOST_TEMPLATE.format(name=agent, cluster=rm.cluster, namespace=rm.namespace)
        leaf = pki.issue_agent(
            ca,
            namespace=rm.namespace,
            cluster=rm.cluster,
            agent=agent,
            dns_name=host,
            valid_for=valid_for or pki.AGENT_VALID_FOR,
        )
        return str(write_tls_dir(path, leaf, ca))

    def peer_post(
        self, target: str, path: str, data: bytes, *, as_agent: str | None, tls_dir: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """POST ``data`` to agent ``target``'s peer door as agent ``as_agent`` (its certificate),
        or with the certificate in ``tls_dir``, or with none (both None)."""
        if tls_dir is None and as_agent is not None:
            tls_dir = self.agents[as_agent].tls_dir
        return peer_request(self.agents[target], "POST", path, data, tls_dir=tls_dir)

    def scrape(self, name: str) -> Samples:
        """Parse the agent's /metrics into {(sample name, labels): value}."""
        return self.agents[name].scrape()

    def metric_sum(self, sample: str, names: list[str] | None = None, **labels: str) -> float:
        total = 0.0
        for name in names or list(self.agents):
            for (n, lbl), value in self.scrape(name).items():
                if n == sample and all(dict(lbl).get(k) == v for k, v in labels.items()):
                    total += value
        return total


class LocalFabric(Fabric):
    """A fabric placed here: the ranks of ``raw_spec`` on agents of their own (``place``), the rank
    map, engine token, cluster CA and one certificate per agent written as the operator would,
    and the agent's real command run for each."""

    def __init__(
        self,
        raw_spec: Mapping[str, Any],
        *,
        ranks_per_agent: int = 0,
        env: Mapping[str, str] | None = None,
        # The rank map's transport: default the spec's; the operator writes "tcp" after a declared
        # placement fallback, which is how pools that need GPUs are exercised on a CPU box.
        transport: str = "",
        # The GPU decode ranks use (prefill ranks use GPU 0): 1 on a two-GPU machine puts the roles
        # on two GPUs, as INTRA_NODE_NVLINK between prefill and decode needs.
        decode_gpu: int = 0,
        # With spec.engine: the installed distribution's folder the engines import (entry points).
        engine_pythonpath: Iterable[str] = (),
    ) -> None:
        spec = parse_spec(raw_spec)
        # Under /var/tmp, not /tmp: the engines' sandbox hides each agent's TLS directory here, and a
        # sandboxed engine cannot read what is created later directly in a directory on the way
        # there (sandbox.py), which /tmp would be for every temporary file an engine writes.
        base = "/var/tmp" if os.access("/var/tmp", os.W_OK) else None
        tmp = tempfile.TemporaryDirectory(prefix="pdfabric-local-", dir=base)
        workdir = Path(tmp.name)
        entries = place(spec, ranks_per_agent=ranks_per_agent, decode_gpu=decode_gpu)
        # A fresh uid per fabric, shaped like a PDCluster's metadata.uid: two fabrics in one process
        # are two clusters; the uid's first 8 characters scope the agents' pool file names and
        # their stale-pool cleanup.
        uid = str(uuid.uuid4())
        transport = transport or spec.transfer.effective_transport.value
        rankmap = RankMap("default", "demo", uid, transport, dict(raw_spec), tuple(entries))
        token = secrets.token_hex(16)
        (workdir / "rankmap.json").write_text(rankmap.to_json(), encoding="utf-8")
        (workdir / "engine-token").write_text(token, encoding="utf-8")
        # What the operator issues: the cluster's CA, one certificate per agent named as its pod.
        ca = pki.new_ca(rankmap.namespace, rankmap.cluster, uid)
        ports = {e.name: (free_port(), free_port(), free_port()) for e in entries}
        peers = {name: peer for name, (_, peer, _) in ports.items()}
        agents = {}
        engines: dict[tuple[str, str], tuple[int, int]] = {}
        for e in entries:
            api, peer, met = ports[e.name]
            host = DEFAULT_PEER_HOST_TEMPLATE.format(name=e.name, cluster=rankmap.cluster, namespace=rankmap.namespace)
            tls_dir = write_tls_dir(
                workdir / f"{e.name}-tls",
                pki.issue_agent(ca, namespace=rankmap.namespace, cluster=rankmap.cluster, agent=e.name, dns_name=host),
                ca,
            )
            agent_env = {
                **os.environ,
                "NODE_NAME": e.node,
                "POD_NAME": e.name,
                "PDFABRIC_RANKMAP": str(workdir / "rankmap.json"),
                "PDFABRIC_ENGINE_TOKEN_FILE": str(workdir / "engine-token"),
                "PDFABRIC_PEER_TLS_DIR": str(tls_dir),
                "PDFABRIC_KV_PAGES": "64",
                "PDFABRIC_STATE_SLOTS": "8",
                "PDFABRIC_AUX_SLOTS": "8",
                **loopback_env(peers, api, peer, met, os.environ),
                **(env or {}),
            }
            if spec.engine is not None:  # the agent runs its node's engines (docs/engines.md)
                extra, where = engines_env(spec, e.ranks, workdir / "bin", agent_env, engine_pythonpath)
                agent_env.update(extra)
                engines.update({(e.name, name): (port, boot) for name, port, boot in where})
            argv = console_argv(["pdfabric-agent"])
            agents[e.name] = AgentProcess(
                e.name, e.node, argv, agent_env, api, met, workdir / f"{e.name}.log", peer_port=peer
            )
        local = {key: LocalEngine(key[0], key[1], port, boot, agents[key[0]]) for key, (port, boot) in engines.items()}
        super().__init__(spec, rankmap, token, agents, engines=local, workdir=str(workdir), ca=ca, tmp=tmp)
