"""An engine rank's table of its rooms, kept current by the agent's room feed (GET /v1/events/{rank},
``rooms/feed.py``) on a thread of its own, so the engine's poll is a dictionary lookup instead of a
request to the agent on every scheduler iteration.

The feed sends a hello (``FeedHello``), a snapshot of every room of the rank the agent holds, an
empty line once the snapshot is complete, then each view as it changes and an empty line as a
heartbeat while nothing does. The table is ``synced`` from the end of a snapshot until the
connection fails or goes silent for ``STALE_AFTER_S``; then the thread reconnects (backing off to
``RECONNECT_MAX_S``) and callers fall back to asking the agent (``AgentClient.poll``). After a
reconnect, a room the table had that the new snapshot lacks and that no later answer touched is
one the agent lost (it restarted): it reads Failed with that reason, as a poll's 404 would say.

A finished view is final: a late non-final view of the same room never replaces it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse

from pdfabric_agent.protocol.views import FeedHello, RoomState, RoomView
from pdfabric_agent.protocol.wire import EVENTS_ROUTE, FEED_HEARTBEAT_S

log = logging.getLogger("pdfabric.client")

STALE_AFTER_S = 3 * FEED_HEARTBEAT_S  # silence (no view, no heartbeat) after which the feed is down
RECONNECT_MIN_S, RECONNECT_MAX_S = 0.05, 2.0
FORGET_AFTER_S = 600.0  # a finished room's view is dropped this long after it ended, if nobody forgot it
LOST = "the agent lost the room (restarted?)"


class RoomEvents:
    """One rank's rooms as the agent last said; ``view`` is what a poll would answer."""

    def __init__(self, address: str, token: str, rank: str, instance: str = "") -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port, self.token, self.rank = host or "127.0.0.1", int(port), token, rank
        # The engine instance that registered the rank: while this feed is open, the agent keeps the
        # rank for it (service/registrants.py).
        self.instance = instance
        self.hello: FeedHello | None = None
        self.synced = threading.Event()
        self.reconnects = 0
        self._views: dict[int, RoomView] = {}
        self._touched: dict[int, float] = {}  # room -> when its view last changed here
        self._lock = threading.Lock()
        # Set whenever a view changes here: an engine with nothing else to do waits on it instead
        # of asking again at once (``wait_change``).
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"pdfabric-feed-{rank}")

    def start(self, wait_s: float = 0.0) -> RoomEvents:
        """Start following the feed; with ``wait_s`` wait that long for the first snapshot."""
        self._thread.start()
        if wait_s:
            self.synced.wait(wait_s)
        return self

    def close(self) -> None:
        self._stop.set()
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            # shutdown() wakes the thread's read in progress; close() alone does not, and the
            # thread then waited for the agent's next heartbeat (an engine rank's stop took 1.3 s).
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._thread.join(timeout=2.0)

    # ------------------------------------------------------------ the table
    def view(self, room: int) -> RoomView | None:
        """The room's latest view, or None when the agent has said nothing of it (a rank that
        sends nothing answers its early view for every room, as a poll would)."""
        # No lock: one dict read is atomic, and every writer replaces whole views (this runs for
        # every request in every queue on every scheduler iteration).
        view = self._views.get(room)
        if view is None and self.hello is not None:
            return self.hello.view_of(room)
        return view

    def put(self, view: RoomView) -> None:
        """A view from another answer (a submit's), merged like the feed's."""
        with self._lock:
            self._merge(view, time.monotonic())

    def forget(self, room: int) -> None:
        with self._lock:
            self._views.pop(room, None)
            self._touched.pop(room, None)

    def __len__(self) -> int:
        return len(self._views)

    def wait_change(self, timeout_s: float) -> bool:
        """Until a view changed since the last call, at most ``timeout_s``; whether one did."""
        changed = self._changed.wait(timeout_s)
        self._changed.clear()
        return changed

    def _merge(self, view: RoomView, now: float) -> None:
        old = self._views.get(view.room)
        if old is not None and old.finished and not view.finished:
            return  # an end is final: a late view from before it changes nothing
        self._views[view.room] = view
        self._touched[view.room] = now
        self._changed.set()

    def _lost_since(self, started: float, seen: set[int]) -> None:
        """After a resync: rooms the new snapshot lacks, untouched since before it, were lost."""
        for room, view in list(self._views.items()):
            if room not in seen and not view.finished and self._touched.get(room, 0.0) < started:
                self._views[room] = RoomView(rank=self.rank, room=room, state=RoomState.FAILED, reason=LOST)

    def _evict(self, now: float) -> None:
        old = [r for r, v in self._views.items() if v.finished and now - self._touched.get(r, now) > FORGET_AFTER_S]
        for room in old:
            del self._views[room]
            self._touched.pop(room, None)

    # ------------------------------------------------------------ the connection
    def _run(self) -> None:
        pause = RECONNECT_MIN_S
        first = True
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._follow(started, resync=not first)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                # Said once per outage (when a synced feed is lost), not at every retry against an
                # agent that stays down.
                if not self._stop.is_set() and self.synced.is_set():
                    log.info("pdfabric: room feed of %s: %s; reconnecting", self.rank, exc)
            finally:
                self.synced.clear()
                self._conn = None
            if self._stop.is_set():
                return
            first = False
            self.reconnects += 1
            if time.monotonic() - started > STALE_AFTER_S:
                pause = RECONNECT_MIN_S  # it had been up: try again at once
            self._stop.wait(pause)
            pause = min(pause * 2, RECONNECT_MAX_S)

    def _follow(self, started: float, *, resync: bool) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=STALE_AFTER_S)
        self._conn = conn
        try:
            path = EVENTS_ROUTE.format(rank=self.rank)
            if self.instance:
                path += "?" + urllib.parse.urlencode({"instance": self.instance})
            conn.request("GET", path, headers={"Authorization": f"Bearer {self.token}"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise ValueError(f"the agent answered the room feed with HTTP {resp.status}: {resp.read(512)!r}")
            self.hello = FeedHello.parse(json.loads(resp.readline()))
            seen: set[int] = set()
            while not self._stop.is_set():
                raw = resp.readline()
                if not raw:
                    raise ConnectionError("the agent closed the room feed")
                now = time.monotonic()
                if raw == b"\n":  # the snapshot is complete, or a heartbeat
                    if not self.synced.is_set():
                        with self._lock:
                            if resync:
                                self._lost_since(started, seen)
                            self._evict(now)
                        self.synced.set()
                    continue
                view = RoomView.parse(json.loads(raw))
                with self._lock:
                    self._merge(view, now)
                if not self.synced.is_set():
                    seen.add(view.room)
        finally:
            conn.close()
