"""The prefill side's bootstrap server: tells decode engines which prefill replica of the PDCluster
this is, its DP groups and the prefill server's own port (``peers.REPLICA_PATH``), answers decode's
heartbeat (``/health``), and keeps SGLang's table of requests' prefill DP groups where they do not
follow the bootstrap room (``/register_dp_rank``, ``/query_dp_ranks``). Nothing else: the
PDCluster's rank map tells every agent where each rank is."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from pdfabric_agent.client.api import AgentClient
from pdfabric_agent.client.engine_env import FabricConfig
from pdfabric_sglang.kvargs import FOLLOW_BOOTSTRAP_ROOM
from pdfabric_sglang.peers import QUERY_DP_RANKS_PATH, REGISTER_DP_RANK_PATH, REPLICA_PATH

HEALTH_PATH = "/health"
MAX_BODY = 1 << 20  # a query of many rooms; anything longer is not SGLang's
REMEMBERED_DP_RANKS = 1 << 16  # rooms whose DP group is kept (decode asks within seconds)


def serving_port() -> int | None:
    """The prefill server's own HTTP port, from SGLang's published configuration in this process
    (decode posts a rebootstrap's recompute there); None where SGLang published none."""
    try:
        from sglang.srt.runtime_context import get_serving

        return int(get_serving().port)
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return None


def server_dp_groups() -> tuple[int, bool]:
    """The server's DP groups (SGLang's ``num_dp_ranks``) and whether a request's group follows its
    bootstrap room, from SGLang's published configuration; one group where it published none."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        method = getattr(parallel.load_balance_method, "value", parallel.load_balance_method)
        return int(parallel.num_dp_ranks), method == FOLLOW_BOOTSTRAP_ROOM
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return 1, True


class DpRanks:
    """Bootstrap room -> the prefill DP group that took it (SGLang's ``room_to_dp_rank``), the
    newest ``REMEMBERED_DP_RANKS``."""

    def __init__(self) -> None:
        self._rooms: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def register(self, doc: Any) -> None:
        room, dp = int(doc["bootstrap_room"]), int(doc["dp_rank"])
        with self._lock:
            self._rooms.pop(room, None)
            self._rooms[room] = dp
            while len(self._rooms) > REMEMBERED_DP_RANKS:
                self._rooms.popitem(last=False)

    def query(self, doc: Any) -> dict[str, int]:
        rooms = [int(r) for r in doc["bootstrap_rooms"]]
        with self._lock:
            return {str(r): self._rooms[r] for r in rooms if r in self._rooms}


class PdfabricKVBootstrapServer(BaseKVBootstrapServer):
    def __init__(self, host: str, port: int) -> None:
        config = FabricConfig()
        client = AgentClient(config.address, config.token, "")
        dp_size, follow = server_dp_groups()
        doc = {
            "replica": config.replica,
            "cluster": client.info().cluster_uid,
            "http_port": serving_port(),
            "dp_size": dp_size,
            "follow_bootstrap_room": follow,
        }
        client.close()
        answers = {REPLICA_PATH: json.dumps(doc).encode(), HEALTH_PATH: b'{"status": "ok"}'}
        self.dp_ranks = dp_ranks = DpRanks()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                payload = answers.get(self.path.split("?", 1)[0])
                if payload is None:
                    self._answer(404, b'{"error": "not found"}')
                else:
                    self._answer(200, payload)

            def do_POST(self) -> None:
                path = self.path.split("?", 1)[0]
                length = int(self.headers.get("Content-Length") or 0)
                if path not in (REGISTER_DP_RANK_PATH, QUERY_DP_RANKS_PATH):
                    self._answer(404, b'{"error": "not found"}')
                    return
                if not 0 < length <= MAX_BODY:
                    self._answer(413, b'{"error": "a JSON body of at most 1 MiB"}')
                    return
                try:
                    body = json.loads(self.rfile.read(length))
                    if path == REGISTER_DP_RANK_PATH:
                        dp_ranks.register(body)
                        self._answer(200, b"OK")
                    else:
                        self._answer(200, json.dumps(dp_ranks.query(body)).encode())
                except (ValueError, KeyError, TypeError) as exc:
                    self._answer(400, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="pdfabric-bootstrap", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
