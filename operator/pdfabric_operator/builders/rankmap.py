"""The rank map the agents read (pdfabric_core.rankmap), its ConfigMap, and the compact form of a
pod's ranks its annotation carries (stickiness reads it back)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdfabric_core.rankmap import RANKMAP_KEY, AgentEntry, Rank, RankMap
from pdfabric_operator import constants as c
from pdfabric_operator.builders.names import ClusterRef, agent_name, object_meta, rankmap_name
from pdfabric_operator.placement import Placement


def encode_ranks(ranks: tuple[Rank, ...]) -> str:
    """Compact, order-stable form of a node's ranks for the pod annotation (stickiness reads it back)."""
    return ",".join(f"{r.rank_id}@{r.gpu}" for r in ranks)


def decode_ranks(text: str) -> tuple[Rank, ...]:
    ranks = []
    for item in filter(None, text.split(",")):
        rank_id, _, gpu = item.partition("@")
        ranks.append(Rank.from_id(rank_id, int(gpu or 0)))
    return tuple(ranks)


def build_rankmap(ref: ClusterRef, raw_spec: Mapping[str, Any], placement: Placement) -> RankMap:
    agents = tuple(
        AgentEntry(agent_name(ref.name, a.unit, a.node), a.node, a.ranks, a.domain) for a in placement.agents
    )
    return RankMap(
        namespace=ref.namespace,
        cluster=ref.name,
        cluster_uid=ref.uid,
        transport=placement.transport.value,
        spec=dict(raw_spec),
        agents=agents,
        feeds=dict(placement.feeds),
    )


def build_rankmap_configmap(ref: ClusterRef, rankmap: RankMap) -> dict[str, Any]:
    meta = object_meta(ref, rankmap_name(ref.name))
    meta["annotations"] = {c.ANN_RANKMAP_HASH: rankmap.digest}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {RANKMAP_KEY: rankmap.to_json()}}
