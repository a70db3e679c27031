"""Run real agent processes on this machine (loopback tcp): used by the e2e tests, the demo and
the benchmarks. The processes run the agent's real command, as the operator's pods would."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdfabric_agent.client import AgentClient
from pdfabric_core.rankmap import AgentEntry, Rank, RankMap
from pdfabric_core.spec import PDClusterSpec, parse_spec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def place(spec: PDClusterSpec, *, ranks_per_agent: int = 0, decode_gpu: int = 0) -> list[AgentEntry]:
    """One agent per (role, replica), or per ``ranks_per_agent`` ranks of it when > 0; decode ranks
    on GPU ``decode_gpu``, prefill ranks on GPU 0."""
    agents: list[AgentEntry] = []
    groups: list[tuple[str, int, list[Rank]]] = []
    for r in range(spec.prefill.replicas):
        ranks = [
            Rank("prefill", r, tp, cp, pp)
            for pp in range(spec.prefill.pp)
            for cp in range(spec.prefill.cp)
            for tp in range(spec.prefill.tp)
        ]
        groups.append(("prefill", r, ranks))
    for r in range(spec.decode.replicas):
        ranks = [
            Rank("decode", r, tp, 0, pp, decode_gpu) for pp in range(spec.decode.pp) for tp in range(spec.decode.tp)
        ]
        groups.append(("decode", r, ranks))
    for role, replica, ranks in groups:
        size = ranks_per_agent or len(ranks)
        for i in range(0, len(ranks), size):
            name = f"agent-{role[0]}{replica}-{i // size}"
            agents.append(AgentEntry(name, f"node-{role[0]}{replica}-{i // size}", tuple(ranks[i : i + size])))
    return agents


@dataclass
class AgentProc:
    entry: AgentEntry
    api_port: int
    metrics_port: int
    env: dict[str, str]
    log_path: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.api_port}"


@dataclass
class LocalFabric:
    raw_spec: Mapping[str, Any]
    ranks_per_agent: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    # The rank map's transport: default the spec's; the operator writes "tcp" after a declared
    # placement fallback, which is how pools that need GPUs are exercised on a CPU box.
    transport: str = ""
    # The GPU decode ranks use (prefill ranks use GPU 0): 1 on a two-GPU machine puts the roles
    # on two GPUs, as INTRA_NODE_NVLINK between prefill and decode needs.
    decode_gpu: int = 0
    workdir: str = ""
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    uid: str = "uid-" + secrets.token_hex(4)
    agents: dict[str, AgentProc] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.spec = parse_spec(self.raw_spec)
        self._clients: dict[tuple[str, str, str], AgentClient] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="pdfabric-local-")
        self.workdir = self._tmp.name
        entries = place(self.spec, ranks_per_agent=self.ranks_per_agent, decode_gpu=self.decode_gpu)
        self.rankmap = RankMap(
            "default",
            "demo",
            self.uid,
            self.transport or self.spec.transfer.effective_transport.value,
            dict(self.raw_spec),
            tuple(entries),
        )
        rankmap_path = os.path.join(self.workdir, "rankmap.json")
        with open(rankmap_path, "w", encoding="utf-8") as fh:
            fh.write(self.rankmap.to_json())
        token_path = os.path.join(self.workdir, "token")
        with open(token_path, "w", encoding="utf-8") as fh:
            fh.write(self.token)
        ports = {e.name: (free_port(), free_port()) for e in entries}
        peers = json.dumps({name: f"127.0.0.1:{api}" for name, (api, _) in ports.items()})
        for e in entries:
            api, met = ports[e.name]
            env = {
                **os.environ,
                "NODE_NAME": e.node,
                "POD_NAME": e.name,
                "PDFABRIC_RANKMAP": rankmap_path,
                "PDFABRIC_TOKEN_FILE": token_path,
                "PDFABRIC_BIND_ADDRESS": "127.0.0.1",
                "PDFABRIC_ENGINE_HOST": "127.0.0.1",
                "PDFABRIC_API_PORT": str(api),
                "PDFABRIC_METRICS_PORT": str(met),
                "PDFABRIC_PEERS": peers,
                "PDFABRIC_KV_PAGES": "64",
                "PDFABRIC_STATE_SLOTS": "8",
                "PDFABRIC_AUX_SLOTS": "8",
                # The repo's packages first, then whatever this process was given (a carried engine).
                "PYTHONPATH": os.pathsep.join(
                    [*(os.path.join(REPO, p) for p in ("core", "agent")), *filter(None, [os.environ.get("PYTHONPATH")])]
                ),
                **self.env,
            }
            self.agents[e.name] = AgentProc(e, api, met, env, os.path.join(self.workdir, f"{e.name}.log"))

    # ------------------------------------------------------------------ processes
    def start(self, name: str | None = None, *, wait_s: float = 60.0, ready: bool = True) -> None:
        for agent in [self.agents[name]] if name else self.agents.values():
            with open(agent.log_path, "ab") as log:
                agent.proc = subprocess.Popen(
                    [sys.executable, "-m", "pdfabric_agent.main"], env=agent.env, stdout=log, stderr=subprocess.STDOUT
                )
        if not ready:
            return
        for agent in [self.agents[name]] if name else self.agents.values():
            self.wait_ready(agent, wait_s)

    def wait_ready(self, agent: AgentProc, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if agent.proc is not None and agent.proc.poll() is not None:
                raise RuntimeError(
                    f"agent {agent.entry.name} exited {agent.proc.returncode}:\n{self.log(agent.entry.name)}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"agent {agent.entry.name} not ready in {wait_s} s:\n{self.log(agent.entry.name)}")

    def readyz(self, name: str) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of the agent's /readyz; (0, {}) while nothing answers."""
        url = f"http://127.0.0.1:{self.agents[name].metrics_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
        except (urllib.error.URLError, OSError):
            return 0, {}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.agents[name].proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                proc.wait(timeout=15)

    def stop(self) -> None:
        for agent in self.agents.values():
            if agent.proc is not None and agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGCONT)
                agent.proc.terminate()
        for agent in self.agents.values():
            if agent.proc is not None:
                try:
                    agent.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    agent.proc.kill()
                    agent.proc.wait(timeout=10)

    def close(self) -> None:
        from pdfabric_agent.main import remove_stale_pools

        self.stop()
        # Agents killed with SIGKILL could not unlink their pool files; nobody restarts them now.
        remove_stale_pools(self.agents_env("PDFABRIC_SHM_DIR") or "/dev/shm", self.uid)
        self._tmp.cleanup()

    def agents_env(self, name: str) -> str:
        return next(iter(self.agents.values())).env.get(name, "") if self.agents else ""

    def __enter__(self) -> LocalFabric:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self, name: str) -> str:
        try:
            with open(self.agents[name].log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()[-4000:]
        except OSError:
            return ""

    # ------------------------------------------------------------------ access
    def agent_of(self, rank_id: str) -> str:
        return self.rankmap.agent_for_rank(rank_id).name

    def client(self, rank_id_or_agent: str, *, token: str | None = None, uid: str | None = None) -> AgentClient:
        name = rank_id_or_agent if rank_id_or_agent in self.agents else self.agent_of(rank_id_or_agent)
        address = self.agents[name].address
        key = (address, token or self.token, uid or self.uid)
        client = self._clients.get(key)
        if client is None:  # one per agent and identity, so its keep-alive connections are reused
            client = self._clients[key] = AgentClient(*key)
        return client

    def scrape(self, name: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Parse the agent's /metrics into {(sample name, labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.agents[name].metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    def metric_sum(self, sample: str, names: list[str] | None = None, **labels: str) -> float:
        total = 0.0
        for name in names or list(self.agents):
            for (n, lbl), value in self.scrape(name).items():
                if n == sample and all(dict(lbl).get(k) == v for k, v in labels.items()):
                    total += value
        return total


@dataclass
class RoomResult:
    prefill: dict[str, dict[str, Any]]  # rank id -> final view
    decode: dict[str, dict[str, Any]]
    errors: dict[str, list[str]]  # decode rank id -> byte mismatches
    elapsed_s: float


def scattered_pages(n: int, limit: int, *, offset: int = 0) -> list[int]:
    """n distinct pages with runs of three consecutive pages, then a gap: coalescing has work."""
    pages = [offset + i + (i // 3) * 2 for i in range(n)]
    if pages and pages[-1] >= limit:
        raise ValueError(f"{n} scattered pages need a pool of {pages[-1] + 1} pages, have {limit}")
    return pages


def transfer_room(
    lc: LocalFabric,
    room: int,
    *,
    pages: int,
    state_slots: int = 0,
    aux: bool = True,
    prefill_replica: int = 0,
    decode_replica: int = 0,
    fill: bool = True,
    verify: bool = True,
    timeout_s: float = 30.0,
) -> RoomResult:
    """Drive one room through real agents like a serving engine pair would: decode announces its
    destination, every prefill rank fills its pages (synthetic contents) and sends, both sides
    wait for a final state, decode verifies every byte."""
    from pdfabric_agent.plan import receives_request_rows
    from pdfabric_agent.synthetic import fill_prefill, verify_decode
    from pdfabric_core.policy.rank_mapping import cp_page_shard, pp_layer_range

    spec = lc.spec
    kv_pages = int(next(iter(lc.agents.values())).env["PDFABRIC_KV_PAGES"])
    dst_pages = scattered_pages(pages, kv_pages, offset=1)
    src_pages = scattered_pages(pages, kv_pages, offset=0)
    dst_state = list(range(state_slots))[::-1]
    src_state = list(range(state_slots))
    aux_dst, aux_src = (3, 1) if aux else (None, None)
    decode_rank_objs = [
        Rank("decode", decode_replica, d, 0, s) for s in range(spec.decode.pp) for d in range(spec.decode.tp)
    ]
    decode_ranks = [r.rank_id for r in decode_rank_objs]
    prefill_ranks = [
        Rank("prefill", prefill_replica, p, c, s)
        for s in range(spec.prefill.pp)
        for c in range(spec.prefill.cp)
        for p in range(spec.prefill.tp)
    ]
    layers = spec.model.layers
    started = time.monotonic()
    for d in decode_ranks:
        lc.client(d).receive(
            d, room, dst_pages, prefill_replica=prefill_replica, state_indices=dst_state, aux_index=aux_dst
        )
    all_send = spec.prefill.all_cp_ranks_transfer or spec.prefill.dsa_cache_layer_split
    for r in prefill_ranks:
        shard = cp_page_shard(pages, spec.prefill.cp, r.cp_rank, all_ranks_send=all_send)
        mine = [src_pages[i] for i in shard]
        client = lc.client(r.rank_id)
        if fill:
            pools = client.map_pools(r.rank_id)
            try:
                fill_prefill(
                    pools, spec, tp_rank=r.tp_rank, room=room, positions=shard, pages=mine,
                    state_slots=src_state, aux_index=aux_src,
                    first_layer=pp_layer_range(layers, spec.prefill.pp, r.pp_rank).start,
                )  # fmt: skip
            finally:
                pools.close()
        client.send(r.rank_id, room, mine, decode_replica=decode_replica, state_indices=src_state, aux_index=aux_src)
    decode_views = {d: lc.client(d).wait(d, room, timeout_s) for d in decode_ranks}
    prefill_views = {r.rank_id: lc.client(r.rank_id).wait(r.rank_id, room, timeout_s) for r in prefill_ranks}
    elapsed = time.monotonic() - started
    errors: dict[str, list[str]] = {}
    if verify:
        for r in decode_rank_objs:
            d = r.rank_id
            rows = receives_request_rows(spec, r.pp_rank)  # aux and state land on one stage only
            pools = lc.client(d).map_pools(d)
            try:
                errors[d] = verify_decode(
                    pools, spec, tp_rank=r.tp_rank, room=room, pages=dst_pages,
                    state_slots=dst_state if rows else (), aux_index=aux_dst if rows else None,
                    first_layer=pp_layer_range(layers, spec.decode.pp, r.pp_rank).start,
                )  # fmt: skip
            finally:
                pools.close()
    return RoomResult(prefill_views, decode_views, errors, elapsed)


DEMO_MODEL = {
    "layers": 4,
    "kvHeads": 8,
    "headDim": 64,
    "pageSizeTokens": 16,
    "stateBytesPerRequest": 4096,
    "stateLayers": 4,
    "auxRowBytes": [16, 8, 8, 8, 128],
}
DEMO_CASES: dict[str, dict[str, Any]] = {
    "equal-tp2": {"prefill": {"tp": 2}, "decode": {"tp": 2}},
    "prefill-tp2-decode-tp4": {"prefill": {"tp": 2}, "decode": {"tp": 4}},
    "prefill-tp4-decode-tp2": {"prefill": {"tp": 4}, "decode": {"tp": 2}},
    "prefill-cp4-all-ranks": {"prefill": {"cp": 4, "allCpRanksTransfer": True}, "decode": {}},
    "prefill-cp4-layer-split": {"prefill": {"cp": 4, "dsaCacheLayerSplit": True}, "decode": {}},
    "prefill-pp2-decode-pp1": {"prefill": {"pp": 2}, "decode": {}},
}


def demo(cases: list[str], pages: int) -> int:
    """Each case: real agents, one room, every byte verified, counters against the synthetic count."""
    from pdfabric_agent.synthetic import expected_bytes

    failed = 0
    print(f"{'case':26} {'verified':9} {'kv bytes':>10} {'state':>7} {'aux':>5} {'dedup saved':>12} {'ms':>7}")
    for name in cases:
        raw = {**DEMO_CASES[name], "transfer": {"transport": "tcp"}, "model": DEMO_MODEL}
        with LocalFabric(raw) as lc:
            result = transfer_room(lc, 1, pages=pages, state_slots=1)
            want = expected_bytes(lc.spec, pages=pages, state_slots=1, aux=True)
            got = {
                k: lc.metric_sum("pdfabric_transfer_bytes_total", role="prefill", kind=k)
                for k in ("kv", "state", "aux")
            }
            saved = lc.metric_sum("pdfabric_state_dedup_skipped_bytes_total")
            ok = not any(result.errors.values()) and got == {"kv": want.kv, "state": want.state, "aux": want.aux}
            ok = ok and saved == want.state_skipped
            failed += not ok
            print(
                f"{name:26} {'yes' if ok else 'NO':9} {int(got['kv']):>10} {int(got['state']):>7} {int(got['aux']):>5} "
                f"{int(saved):>12} {result.elapsed_s * 1e3:>7.1f}"
            )
    return 1 if failed else 0


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Run real agents locally (loopback tcp) and move verified rooms.")
    ap.add_argument("cases", nargs="*", help=f"any of {', '.join(DEMO_CASES)} (default: all)")
    ap.add_argument("--pages", type=int, default=12)
    args = ap.parse_args()
    unknown = sorted(set(args.cases) - set(DEMO_CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {', '.join(DEMO_CASES)}")
    args.cases = args.cases or list(DEMO_CASES)
    sys.exit(demo(args.cases, args.pages))


if __name__ == "__main__":
    main()
