"""The agent's side of talking to peer agents: one HTTPS session, typed messages, probes and the
peers' health (blacklist on failure, re-probe with backoff, heartbeat misses).

Peers are reached on their peer door (spec.agent.peerPort) over mutual TLS: this agent presents
its own certificate, and a peer's must chain to the cluster CA and carry the host name the rank
map's agent is dialled by (``peer_host``), even when ``PDFABRIC_PEERS`` gives another address.

A peer that answers with an error status raises ``PeerRefused`` (status, reason, message); a peer
that cannot be reached raises what aiohttp raises (``PEER_UNREACHABLE``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from pdfabric_agent.peers.health import PeerHealth
from pdfabric_agent.peers.stream import PeerStream
from pdfabric_agent.protocol import tls
from pdfabric_agent.protocol.peer_wire import PING_PATH, STREAM_PATH, Answer, PeerMessage
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.config import AgentConfig
from pdfabric_agent.runtime.inputs import RereadFile
from pdfabric_agent.runtime.tasks import Liveness
from pdfabric_core.rankmap import RankMap

log = logging.getLogger("pdfabric.agent")

HEARTBEAT_MISSES = 2  # upstream: two missed heartbeats fail the rooms
RECHECK_S = 1.0  # a peer blacklisted for silence is pinged again for a new room at most this often
STREAM_RETRY_S = 60.0  # an agent that answered without a stream gets POSTs this long before another try
STREAM_HEARTBEAT_S = 10.0  # a stream whose peer stops answering pings closes, failing its waiting calls
# A stream unused this long is closed by its opener (never with a call waiting): an agent holds
# streams to the peers it talks to now, not to every peer it ever talked to, and its peers' doors
# hold as many (guard.peer_door_bound). The next message to that peer opens one again.
STREAM_IDLE_S = 60.0
# How long a decode agent's room info push may take. A busy node can stall the agent's own loop
# for seconds (5.1 s seen on two cores under the test suite), during which the peer's answer
# waits: a 5 s timeout failed rooms the peer had taken. A hung peer still fails the room within
# it, or at the room's own deadline when that comes first.
ROOM_INFO_PUSH_S = 15.0


class PeerRefused(RuntimeError):
    """A peer agent answered a request with an error status."""

    def __init__(self, agent: str, path: str, status: int, reason: str, message: str) -> None:
        super().__init__(f"{agent} refused {path}: HTTP {status} {message}")
        self.agent = agent
        self.path = path
        self.status = status
        self.reason = reason


# What a failed peer call raises: refused, unreachable, or too slow.
PEER_ERRORS = (PeerRefused, aiohttp.ClientError, TimeoutError, OSError)


PEERS_FILE_INPUT = "peers-file"


def parse_peers_file(text: str) -> dict[str, str]:
    """{agent name: "host:port"} from a PDFABRIC_PEERS_FILE's text; ValueError for anything else."""
    data = json.loads(text)
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ValueError('the peers file must be a JSON object of agent name to "host:port"')
    return data


class PeerClient:
    def __init__(
        self, cfg: AgentConfig, rankmap: RankMap, peer_port: int, clock: Callable[[], float], liveness: Liveness
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.liveness = liveness
        self.rankmap = rankmap
        self.peer_port = peer_port  # every agent's peer door listens on the spec's peerPort
        self.health = PeerHealth(cfg.probe_backoff_s, cfg.probe_backoff_max_s, clock)
        self._http: aiohttp.ClientSession | None = None
        self._probing: set[str] = set()
        self._missed: dict[str, int] = {}  # agent -> consecutive missed heartbeats
        self._rechecks: dict[str, asyncio.Task[bool]] = {}  # agent -> the ping a new room waits for
        self._recheck_after: dict[str, float] = {}
        self._file_peers: dict[str, str] = {}  # PDFABRIC_PEERS_FILE, as last taken
        # Read again when a peer is not in it yet (runtime/inputs.py: a bad write keeps what was read).
        self.peers_file = (
            RereadFile(PEERS_FILE_INPUT, cfg.peers_file, parse_peers_file, rankmap.cluster) if cfg.peers_file else None
        )
        self._streams: dict[str, PeerStream] = {}
        self._stream_used: dict[str, float] = {}  # agent -> when a call last took its stream
        self._stream_locks: dict[str, asyncio.Lock] = {}
        self._stream_retry_after: dict[str, float] = {}
        # Whether a newer rank map dropped the agent (its replica scaled away; the agent wires it).
        self.is_leaving: Callable[[str], bool] = lambda _agent: False

    def peer_host(self, agent_name: str) -> str:
        """The host name agent ``agent_name`` is dialled by, and its certificate must carry."""
        rm = self.rankmap
        return self.cfg.peer_host_template.format(name=agent_name, cluster=rm.cluster, namespace=rm.namespace)

    def address(self, agent_name: str) -> str:
        if agent_name in self.cfg.peers:
            return self.cfg.peers[agent_name]
        if self.peers_file is not None:
            if agent_name not in self._file_peers:  # a peer that came up after this agent: read again
                self._file_peers = self.peers_file.check() or self._file_peers
            if agent_name in self._file_peers:
                return self._file_peers[agent_name]
        return f"{self.peer_host(agent_name)}:{self.peer_port}"

    async def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            connector = aiohttp.TCPConnector(ssl=tls.PeerTls.of(self.cfg.peer_tls_dir).client)
            self._http = aiohttp.ClientSession(connector=connector)
        return self._http

    async def post(self, agent_name: str, msg: PeerMessage[Answer], timeout_s: float) -> Answer:
        """Send ``msg`` to the agent's peer door and read its typed answer; raises ``PEER_ERRORS``
        (an answer that is not the message's is refused like an error status). It goes on the
        stream to that agent (peers/stream.py) when one is open or opens now, else as a POST."""
        body = {**msg.to_json(), "cluster": self.rankmap.cluster_uid}
        stream = await self._stream(agent_name, timeout_s)
        data: Any
        if stream is not None:
            status, data = await stream.call(msg.PATH, body, timeout_s)
        else:
            session = await self._session()
            url = f"https://{self.address(agent_name)}{msg.PATH}"
            async with session.post(
                url,
                json=body,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                server_hostname=self.peer_host(agent_name),
            ) as resp:
                status, data = resp.status, await resp.json(content_type=None)
        if not isinstance(data, dict):
            data = {}
        if status != 200:
            raise PeerRefused(agent_name, msg.PATH, status, str(data.get("reason", "")), data.get("error", ""))
        try:
            return msg.read_answer(data)
        except ValueError as exc:
            raise PeerRefused(agent_name, msg.PATH, status, "malformed", str(exc)) from None

    async def _stream(self, agent_name: str, timeout_s: float) -> PeerStream | None:
        """The open stream to ``agent_name``, opened now if none is (one opening at a time per
        peer); None for an agent that answers without one (an older agent: the call goes as a
        POST, another try after ``STREAM_RETRY_S``). An agent that cannot be reached raises what
        a POST to it would (``PEER_ERRORS``)."""
        stream = self._streams.get(agent_name)
        if stream is not None and stream.open:
            self._stream_used[agent_name] = self.clock()
            return stream
        if self.clock() < self._stream_retry_after.get(agent_name, float("-inf")):
            return None
        lock = self._stream_locks.setdefault(agent_name, asyncio.Lock())
        async with lock:
            stream = self._streams.get(agent_name)
            if stream is not None and stream.open:
                return stream
            session = await self._session()
            url = f"https://{self.address(agent_name)}{STREAM_PATH}"
            try:
                async with asyncio.timeout(timeout_s):
                    ws = await session.ws_connect(
                        url, heartbeat=STREAM_HEARTBEAT_S, server_hostname=self.peer_host(agent_name), max_msg_size=0
                    )
            except aiohttp.WSServerHandshakeError as exc:  # it answered, without a stream
                self._stream_retry_after[agent_name] = self.clock() + STREAM_RETRY_S
                log.info("no peer stream to %s (HTTP %s); its messages go as POSTs", agent_name, exc.status)
                return None
            self._streams[agent_name] = stream = PeerStream(agent_name, ws)
            self._stream_used[agent_name] = self.clock()
            return stream

    def idle_streams(self, now: float) -> list[PeerStream]:
        """Streams unused for ``STREAM_IDLE_S`` with no call waiting, or closed: taken out now (the
        next message to the peer opens another), for the caller to close."""
        idle = [
            name
            for name, stream in self._streams.items()
            if not stream.open or (not stream.busy and now - self._stream_used.get(name, now) >= STREAM_IDLE_S)
        ]
        for name in idle:
            self._stream_used.pop(name, None)
        return [self._streams.pop(name) for name in idle]

    async def get_json(self, agent_name: str, path: str, timeout_s: float = 2.0) -> dict[str, Any]:
        """GET ``path`` on the peer's door; raises ``PEER_ERRORS`` (the link check's probe regions)."""
        session = await self._session()
        url = f"https://{self.address(agent_name)}{path}"
        async with session.get(
            url, timeout=aiohttp.ClientTimeout(total=timeout_s), server_hostname=self.peer_host(agent_name)
        ) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200 or not isinstance(data, dict):
                body = data if isinstance(data, dict) else {}
                raise PeerRefused(agent_name, path, resp.status, str(body.get("reason", "")), body.get("error", ""))
            return data

    async def ping(self, agent_name: str, timeout_s: float = 2.0) -> bool:
        session = await self._session()
        try:
            url = f"https://{self.address(agent_name)}{PING_PATH}"
            async with session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout_s), server_hostname=self.peer_host(agent_name)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    # ------------------------------------------------------------ health
    def is_blacklisted(self, agent_name: str) -> bool:
        return self.health.is_blacklisted(agent_name)

    def why_blacklisted(self, agent_name: str) -> str:
        return f"peer agent {agent_name} is blacklisted: {self.health.reason(agent_name)}"

    def stall(self, since: float) -> str:
        """Why no peer is blamed for what failed after `since`: this agent itself stalled (stopped,
        frozen) meanwhile; "" when it ran throughout."""
        stalled = self.liveness.stalled_since(since, self.clock())
        return f"this agent was stalled for {stalled:.1f} s" if stalled else ""

    def blame(self, agent_name: str, reason: str, since: float, *, silent: bool = False) -> str:
        """A call to `agent_name` that started at `since` failed: blacklist it, unless this agent
        itself stalled after `since` (``stall``), which explains the failure as well. Returns the
        reason to report, saying so when the peer was not blamed. `silent`: it did not answer
        (``heard_from`` re-admits it), rather than failing a transfer."""
        if self.is_leaving(agent_name):  # the likely why: its pod is stopping or gone
            reason += f"; {agent_name} is leaving the cluster (its replica was scaled away)"
        stall = self.stall(since)
        if stall:
            log.info("not blaming %s for %s: %s", agent_name, reason, stall)
            return f"{reason}; {stall}, so {agent_name} is not blamed"
        self.health.fail(agent_name, reason, silent=silent)
        metrics.peers_blacklisted.labels(self.rankmap.cluster).set(len(self.health.blacklisted))
        return reason

    async def usable(self, agent_name: str) -> bool:
        """Whether a new room may use `agent_name`: not blacklisted, or blacklisted only for not
        answering and answering a ping now (a stopped agent that resumed). One ping per peer at a
        time, shared by the rooms that wait for it, and at most one a second: rooms to a peer that
        is really gone still fail at once."""
        if not self.health.is_blacklisted(agent_name):
            return True
        if not self.health.is_silent(agent_name):
            return False
        task = self._rechecks.get(agent_name)
        if task is None:
            now = self.clock()
            if now < self._recheck_after.get(agent_name, float("-inf")):
                return False
            self._recheck_after[agent_name] = now + RECHECK_S
            task = self._rechecks[agent_name] = asyncio.ensure_future(self._recheck(agent_name))
        return await asyncio.shield(task)

    async def _recheck(self, agent_name: str) -> bool:
        try:
            if await self.ping(agent_name, timeout_s=RECHECK_S):
                self.heard_from(agent_name)
            return not self.health.is_blacklisted(agent_name)
        finally:
            self._rechecks.pop(agent_name, None)

    def forget(self, agent_name: str) -> None:
        """`agent_name` left the rank map, or is new in it under a name that was there before: its
        blacklisting, missed heartbeats and pending re-checks go."""
        self.health.forget(agent_name)
        self._missed.pop(agent_name, None)
        self._recheck_after.pop(agent_name, None)
        metrics.peers_blacklisted.labels(self.rankmap.cluster).set(len(self.health.blacklisted))

    def heard_from(self, agent_name: str) -> None:
        """`agent_name` called the peer door: alive, whatever its missed heartbeats said."""
        if self.health.heard_from(agent_name):
            cluster = self.rankmap.cluster
            metrics.session_recoveries.labels(cluster).inc()
            metrics.peers_blacklisted.labels(cluster).set(len(self.health.blacklisted))
            log.info("peer agent %s called in; re-admitted", agent_name)

    def heartbeat_result(self, agent_name: str, ok: bool, sent: float) -> bool:
        """Record one heartbeat sent at `sent`; True when the agent has now missed
        ``HEARTBEAT_MISSES`` in a row (it is blacklisted then and its count starts again). A miss
        while this agent itself stalled is not counted."""
        if not ok and self.stall(sent):
            return False
        self._missed[agent_name] = 0 if ok else self._missed.get(agent_name, 0) + 1
        if self._missed[agent_name] < HEARTBEAT_MISSES:
            return False
        self._missed[agent_name] = 0
        self.blame(agent_name, f"missed {HEARTBEAT_MISSES} heartbeats", sent, silent=True)
        return True

    def due_probes(self) -> list[str]:
        """Blacklisted agents whose re-probe is due and not already running (marked running now)."""
        due = [name for name in self.health.due() if name not in self._probing]
        self._probing.update(due)
        return due

    async def reprobe(self, agent_name: str) -> None:
        cluster = self.rankmap.cluster
        try:
            ok = await self.ping(agent_name)
            metrics.peer_probes.labels(cluster, "ok" if ok else "failed").inc()
            if self.health.probe_result(agent_name, ok):
                metrics.session_recoveries.labels(cluster).inc()
                log.info("peer agent %s answers again; re-admitted", agent_name)
            metrics.peers_blacklisted.labels(cluster).set(len(self.health.blacklisted))
        finally:
            self._probing.discard(agent_name)

    async def close(self) -> None:
        for stream in self._streams.values():
            await stream.close()
        self._streams.clear()
        if self._http is not None:
            await self._http.close()
