"""Peer health: the first failed transfer blacklists the peer agent; a probe loop re-admits it.

Upstream behaviour (sglang mooncake): blacklist on the first failure, re-probe with backoff from
30 s up to 300 s. While blacklisted, new rooms to the peer fail at once instead of hanging on a
dead session. The clock is injected so tests drive the backoff without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Entry:
    since: float
    next_probe: float
    delay: float
    reason: str
    silent: bool  # blacklisted for not answering (not for a failed transfer): hearing from it refutes that


class PeerHealth:
    def __init__(
        self, initial_s: float = 30.0, max_s: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError("backoff needs 0 < initial <= max")
        self._initial = initial_s
        self._max = max_s
        self._clock = clock
        self._bad: dict[str, _Entry] = {}

    def fail(self, peer: str, reason: str, *, silent: bool = False) -> None:
        """Blacklist peer (idempotent: a second failure does not reset its backoff). `silent`: it
        did not answer; a failure of another kind makes the entry not silent."""
        entry = self._bad.get(peer)
        if entry is None:
            now = self._clock()
            self._bad[peer] = _Entry(now, now + self._initial, self._initial, reason, silent)
        elif not silent:
            entry.silent = False

    def is_silent(self, peer: str) -> bool:
        """Blacklisted only for not answering."""
        entry = self._bad.get(peer)
        return entry is not None and entry.silent

    def heard_from(self, peer: str) -> bool:
        """The peer called this agent (with its certificate): one blacklisted only for silence is
        re-admitted now. True when it was."""
        entry = self._bad.get(peer)
        if entry is None or not entry.silent:
            return False
        del self._bad[peer]
        return True

    def is_blacklisted(self, peer: str) -> bool:
        return peer in self._bad

    def forget(self, peer: str) -> None:
        """The peer left the cluster (or a new agent took its name): no record of it is kept."""
        self._bad.pop(peer, None)

    def reason(self, peer: str) -> str:
        entry = self._bad.get(peer)
        return entry.reason if entry else ""

    def due(self) -> list[str]:
        """Blacklisted peers whose next probe time has come."""
        now = self._clock()
        return [p for p, e in self._bad.items() if e.next_probe <= now]

    def probe_result(self, peer: str, ok: bool) -> bool:
        """Record a probe; returns True when the peer was re-admitted."""
        entry = self._bad.get(peer)
        if entry is None:
            return False
        if ok:
            del self._bad[peer]
            return True
        entry.delay = min(entry.delay * 2, self._max)
        entry.next_probe = self._clock() + entry.delay
        return False

    def next_delay(self, peer: str) -> float | None:
        entry = self._bad.get(peer)
        return entry.delay if entry else None

    @property
    def blacklisted(self) -> list[str]:
        return sorted(self._bad)
