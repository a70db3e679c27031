"""Decode's table of prefill servers: which prefill replica of the PDCluster answers behind each
bootstrap address the router hands out. SGLang's decode queue reads it for every request
(``prefill_info_table``) and fills it through ``try_ensure_parallel_info``; the lookup is one HTTP
GET to the prefill's bootstrap server, made on a worker thread so the scheduler's loop never waits
on the network."""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

REPLICA_PATH = "/pdfabric/v1/replica"
# SGLang's bootstrap routes for a request's prefill DP group when it does not follow its bootstrap
# room: prefill registers it, decode's queue asks (CommonKVReceiver.query_prefill_dp_ranks).
REGISTER_DP_RANK_PATH = "/register_dp_rank"
QUERY_DP_RANKS_PATH = "/query_dp_ranks"
LOOKUP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PrefillPeer:
    """A prefill server as decode sees it. ``dp_size`` and ``follow_bootstrap_room`` are the
    attributes SGLang's decode queue reads to find a request's prefill DP group: the server's DP
    groups (SGLang's ``num_dp_ranks``), and whether a request's group is ``room % dp_size``."""

    replica: int
    cluster: str
    dp_size: int = 1
    follow_bootstrap_room: bool = True
    http_port: int | None = None  # the prefill server's own port (rebootstrap posts its /generate there)


class LookupError_(Exception):
    """Why a prefill bootstrap address could not be resolved; ``retryable`` when it may come up."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def prefill_peer_at(bootstrap_addr: str, cluster_uid: str, timeout_s: float = LOOKUP_TIMEOUT_S) -> PrefillPeer:
    """Ask the prefill's bootstrap server which replica it is, and check it is this PDCluster's."""
    try:
        with urllib.request.urlopen(f"http://{bootstrap_addr}{REPLICA_PATH}", timeout=timeout_s) as resp:
            doc = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        raise LookupError_(f"{type(exc).__name__}: {exc}", retryable=True) from None
    if not isinstance(doc, dict) or doc.get("cluster") != cluster_uid:
        cluster = doc.get("cluster") if isinstance(doc, dict) else None
        raise LookupError_(f"it serves PDCluster {cluster!r}, not this decode's {cluster_uid!r}", retryable=False)
    http_port = doc.get("http_port")
    return PrefillPeer(
        replica=int(doc["replica"]),
        cluster=cluster_uid,
        dp_size=int(doc.get("dp_size", 1)),
        follow_bootstrap_room=bool(doc.get("follow_bootstrap_room", True)),
        http_port=int(http_port) if http_port else None,
    )


def post_generate(url: str, payload: dict[str, object], timeout_s: float) -> tuple[int, str]:
    """POST a JSON request to an SGLang server: its status (0: no answer) and the body's start."""
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read(4096).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(4096).decode(errors="replace")
    except (OSError, ValueError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


class PrefillPeers:
    """Bootstrap address -> ``PrefillPeer``, resolved in the background, one lookup at a time per
    address; a failed lookup is retried on the next ``ensure`` unless it can never succeed."""

    def __init__(self, cluster_uid: str) -> None:
        self.cluster_uid = cluster_uid
        self.table: dict[str, PrefillPeer] = {}
        self._pending: dict[str, Future[PrefillPeer]] = {}
        self._errors: dict[str, LookupError_] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdfabric-prefill-lookup")

    def ensure(self, bootstrap_addr: str) -> bool:
        """True once the address is resolved; otherwise starts its lookup (one at a time)."""
        self._harvest(bootstrap_addr)
        if bootstrap_addr in self.table:
            return True
        with self._lock:
            if bootstrap_addr in self._pending:
                return False
            error = self._errors.get(bootstrap_addr)
            if error is not None and not error.retryable:
                return False
            self._pending[bootstrap_addr] = self._pool.submit(prefill_peer_at, bootstrap_addr, self.cluster_uid)
        return False

    def wait(self, bootstrap_addr: str, timeout_s: float) -> bool:
        """``ensure``, waiting up to ``timeout_s`` for the lookup (off the scheduler's hot path:
        an abort before the table had the address)."""
        if self.ensure(bootstrap_addr):
            return True
        with self._lock:
            future = self._pending.get(bootstrap_addr)
        if future is not None:
            with contextlib.suppress(Exception):  # its failure is harvested below
                future.result(timeout=timeout_s)
        return self.ensure(bootstrap_addr)

    def error(self, bootstrap_addr: str) -> LookupError_ | None:
        """The last lookup's failure for the address, if it failed."""
        self._harvest(bootstrap_addr)
        return self._errors.get(bootstrap_addr)

    def _harvest(self, bootstrap_addr: str) -> None:
        """Take a finished lookup's answer into the table, or its failure into the errors."""
        with self._lock:
            future = self._pending.get(bootstrap_addr)
            if future is None or not future.done():
                return
            del self._pending[bootstrap_addr]
        try:
            self.table[bootstrap_addr] = future.result()
        except LookupError_ as exc:
            self._errors[bootstrap_addr] = exc
            return
        self._errors.pop(bootstrap_addr, None)
