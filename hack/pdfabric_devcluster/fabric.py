"""A placed PDCluster seen the way a serving engine sees it: rank map, token, agent addresses.

Used by the e2e tests and the demo to drive real transfers through agents that PodRunner runs.
"""

from __future__ import annotations

import base64
import urllib.request
from types import SimpleNamespace

from pdfabric_agent.client import AgentClient
from pdfabric_agent.config import SETTINGS
from pdfabric_core.rankmap import RANKMAP_KEY, RankMap
from pdfabric_core.spec import PDClusterSpec, parse_spec
from pdfabric_devcluster.cluster import LocalCluster
from pdfabric_devcluster.podrunner import PodRunner


class KubeFabric:
    def __init__(self, cluster: LocalCluster, namespace: str, name: str, runner: PodRunner) -> None:
        obj = cluster.get_json("pdcluster", name, "-n", namespace)
        self.spec: PDClusterSpec = parse_spec(obj["spec"])
        selector = f"pdfabric.dev/cluster={name}"
        maps = cluster.get_json("configmaps", "-n", namespace, "-l", selector)["items"]
        (cm,) = [m for m in maps if RANKMAP_KEY in m.get("data", {})]
        self.rankmap = RankMap.from_json(cm["data"][RANKMAP_KEY])
        (secret,) = cluster.get_json("secrets", "-n", namespace, "-l", selector)["items"]
        (token_b64,) = secret["data"].values()
        self.token = base64.b64decode(token_b64).decode().strip()
        self.runner = runner
        # localrun.transfer_room sizes page indices from the agents' pool size: the agent default.
        kv_pages = SETTINGS["PDFABRIC_KV_PAGES"][0]
        self.agents = {pod: SimpleNamespace(env={"PDFABRIC_KV_PAGES": kv_pages}) for pod in runner.pods}

    def client(self, rank_id: str) -> AgentClient:
        pod = self.runner.pods[self.rankmap.agent_for_rank(rank_id).name]
        return AgentClient(f"127.0.0.1:{pod.ports['api']}", self.token, self.rankmap.cluster_uid)


def agent_ready(metrics_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
