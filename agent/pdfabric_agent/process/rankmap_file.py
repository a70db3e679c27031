"""The mounted rank map, read again while the agent runs (live membership, service/membership.py).

The kubelet rewrites a ConfigMap volume in place when the ConfigMap changes (an atomic swap of the
directory the file name points through), on its next sync of the pod; the operator touches the
pods' annotations after each rank-map change so that sync comes within seconds. Reading a file of
a few kilobytes once a second costs nothing next to that. A map that does not read or parse is
refused under the rule of runtime/inputs.py: the map in use stays, and /readyz says why.
"""

from __future__ import annotations

from pdfabric_agent.runtime.inputs import RereadFile
from pdfabric_core.rankmap import RankMap

CHECK_EVERY_S = 1.0
INPUT_NAME = "rankmap"


class RankMapFile(RereadFile[RankMap]):
    def __init__(self, path: str) -> None:
        super().__init__(INPUT_NAME, path, RankMap.from_json)
        self.rankmap = self.read_first()
        self.refusals.cluster = self.rankmap.cluster

    def newer(self) -> RankMap | None:
        """The map in the file when its content changed since the last read and parses; None
        otherwise (the map in use stays)."""
        rankmap = self.check()
        if rankmap is not None:
            self.rankmap = rankmap
        return rankmap
