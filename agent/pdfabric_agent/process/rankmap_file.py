"""The mounted rank map, read again while the agent runs (live membership, rooms/membership.py).

The kubelet rewrites a ConfigMap volume in place when the ConfigMap changes (an atomic swap of the
directory the file name points through), on its next sync of the pod; the operator touches the
pods' annotations after each rank-map change so that sync comes within seconds. Reading a file of
a few kilobytes once a second costs nothing next to that.
"""

from __future__ import annotations

import hashlib
import logging

from pdfabric_core.rankmap import RankMap

log = logging.getLogger("pdfabric.main")

CHECK_EVERY_S = 1.0


class RankMapFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._seen = ""  # hash of the text last read, parsed or not
        self.rankmap = self._read()

    def _read(self) -> RankMap:
        with open(self.path, encoding="utf-8") as fh:
            text = fh.read()
        self._seen = hashlib.sha256(text.encode()).hexdigest()
        return RankMap.from_json(text)

    def newer(self) -> RankMap | None:
        """The map in the file when its text changed since the last read; None when it did not or
        cannot be read (said once per change in the log: the map in use stays)."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            log.warning("rank map %s unreadable (the map in use stays): %s", self.path, exc)
            return None
        seen = hashlib.sha256(text.encode()).hexdigest()
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            self.rankmap = RankMap.from_json(text)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("rank map %s does not parse (the map in use stays): %s", self.path, exc)
            return None
        return self.rankmap
