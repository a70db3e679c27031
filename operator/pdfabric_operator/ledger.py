"""The in-memory ledger of the placements this operator just made: the watch cache lags our own
creates, and without the ledger two clusters planned in the same second would both take the same
GPUs. One process-wide LEDGER, locked around each plan."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pdfabric_operator.placement import PlacedPod


class Ledger:
    """GPUs (and RDMA devices) each PDCluster was last given by this operator: node -> requests."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._by_uid: dict[str, dict[str, dict[str, int]]] = {}

    def merged(self, cached: Sequence[PlacedPod], exclude_uid: str) -> list[PlacedPod]:
        """What holds GPUs now: the watch cache, raised to the ledger where the ledger knows more.

        Per (cluster, node, resource) the larger of the two counts: the ledger covers pods we just
        created that the cache has not seen; the cache covers pods of an older placement that are
        still terminating (they hold their devices until the kubelet lets go).
        """
        usage: dict[tuple[str | None, str], dict[str, int]] = {}
        out: list[PlacedPod] = []
        for pod in cached:
            if pod.owner_uid is None or pod.owner_uid not in self._by_uid:
                out.append(pod)
                continue
            acc = usage.setdefault((pod.owner_uid, pod.node), {})
            for k, v in pod.requests.items():
                acc[k] = acc.get(k, 0) + v
        for uid, nodes in self._by_uid.items():
            for node, req in nodes.items():
                acc = usage.setdefault((uid, node), {})
                for k, v in req.items():
                    acc[k] = max(acc.get(k, 0), v)
        out += [PlacedPod(node, req, uid) for (uid, node), req in usage.items() if uid != exclude_uid]
        return out

    def record(self, uid: str, usage: dict[str, dict[str, int]]) -> None:
        self._by_uid[uid] = usage

    def forget(self, uid: str) -> None:
        self._by_uid.pop(uid, None)

    def clear(self) -> None:
        with self.lock:
            self._by_uid.clear()


LEDGER = Ledger()
