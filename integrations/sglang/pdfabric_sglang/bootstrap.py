"""The prefill side's bootstrap server: tells decode engines which prefill replica of the PDCluster
this is and the prefill server's own port (``peers.REPLICA_PATH``), and answers decode's heartbeat
(``/health``). Nothing else: the PDCluster's rank map tells every agent where each rank is."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from pdfabric_agent.client.api import AgentClient
from pdfabric_sglang.kvargs import FabricConfig
from pdfabric_sglang.peers import REPLICA_PATH

HEALTH_PATH = "/health"


def serving_port() -> int | None:
    """The prefill server's own HTTP port, from SGLang's published configuration in this process
    (decode posts a rebootstrap's recompute there); None where SGLang published none."""
    try:
        from sglang.srt.runtime_context import get_serving

        return int(get_serving().port)
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return None


class PdfabricKVBootstrapServer(BaseKVBootstrapServer):
    def __init__(self, host: str, port: int) -> None:
        config = FabricConfig()
        client = AgentClient(config.address, config.token, "")
        doc = {"replica": config.replica, "cluster": client.info()["cluster"]["uid"], "http_port": serving_port()}
        client.close()
        answers = {REPLICA_PATH: json.dumps(doc).encode(), HEALTH_PATH: b'{"status": "ok"}'}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                payload = answers.get(self.path.split("?", 1)[0])
                status = 200 if payload is not None else 404
                body = payload if payload is not None else b'{"error": "not found"}'
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
