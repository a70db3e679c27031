"""The agent's dma-buf door: a Unix domain socket in the shared-memory directory where engines hand
over the dma-buf fds of their GPU allocations (``protocol.handover``) for NIC registration
(``ranks.nic_memory``).

Like the engine door it takes the engine token and the cluster uid; unlike it, the socket is not
reachable over any network (a path in the pod's shared ``PDFABRIC_SHM_DIR``, mode 0600). Each
connection is one exchange on a thread of its own with a deadline on every read and write
(``timeout_s``), at most ``max_connections`` at once (more are refused with 429 at once): a
client that stalls holds one thread until its deadline, never the door. Every fd received is closed
before the answer is sent, whatever the answer.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.handover import DmabufHandover, close_fds, recv_frame, refusal_json, send_frame
from pdfabric_agent.protocol.labels import Refusal
from pdfabric_agent.ranks.nic_memory import NicMemory

log = logging.getLogger("pdfabric.handover")


class HandoverDoor:
    def __init__(
        self,
        path: str,
        *,
        token: str,
        cluster_uid: str,
        nic: NicMemory,
        timeout_s: float = 5.0,
        max_connections: int = 8,
    ) -> None:
        self.path, self.nic = path, nic
        self._token, self._cluster = token, cluster_uid
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a previous agent's: nothing listens there any more
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound and listening under a name of its own, then renamed: the socket appears listening.
        staging = f"{self.path}.{os.getpid()}"
        old = os.umask(0o177)
        try:
            sock.bind(staging)
        finally:
            os.umask(old)
        sock.listen(16)
        os.rename(staging, self.path)
        sock.settimeout(0.2)  # the accept loop notices close() within this
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="dmabuf-door", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(self.timeout_s)
            if not self._slots.acquire(blocking=False):
                busy = ApiError(429, Refusal.TOO_MANY_CONNECTIONS, "too many hand-overs at once; retry")
                with contextlib.suppress(OSError), conn:
                    send_frame(conn, refusal_json(busy))
                continue
            threading.Thread(target=self._serve, args=(conn,), name="dmabuf-handover", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                answer = self.exchange(conn)
                with contextlib.suppress(OSError):
                    send_frame(conn, answer)
        finally:
            self._slots.release()

    def exchange(self, conn: socket.socket) -> Mapping[str, Any]:
        """One hand-over on a connected socket: the answer to send (a refusal included)."""
        fds: list[int] = []
        try:
            doc, fds = recv_frame(conn)
            token = doc.get("token")  # first, as on the engine door: nothing else is read for a stranger
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token.encode()):
                raise ApiError(401, Refusal.UNAUTHORIZED, "missing or wrong engine token")
            msg = DmabufHandover.parse(doc)
            if msg.cluster != self._cluster:
                raise ApiError(
                    403,
                    Refusal.WRONG_CLUSTER,
                    f"hand-over for cluster {msg.cluster!r}; this agent serves {self._cluster}",
                )
            return self.nic.hand_over(msg, fds).to_json()
        except ApiError as exc:
            log.info("dma-buf hand-over refused (%d %s): %s", exc.status, exc.reason.value, exc.message)
            return refusal_json(exc)
        except (OSError, TimeoutError) as exc:
            err = ApiError(
                408, Refusal.TIMEOUT, f"the hand-over did not arrive whole within {self.timeout_s:g} s: {exc}"
            )
            return refusal_json(err)
        except Exception as exc:  # no check anticipated it: logged, answered, the door stays up
            log.exception("unexpected error in a dma-buf hand-over")
            return refusal_json(
                ApiError(500, Refusal.INTERNAL, f"internal error ({type(exc).__name__}), logged by the agent")
            )
        finally:
            close_fds(fds)

    def close(self) -> None:
        self._closing.set()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._thread is not None:
            self._thread.join(timeout=2)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.nic.close()
