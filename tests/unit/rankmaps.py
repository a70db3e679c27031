"""Rank maps for the parser's tests and the re-read rule's: a valid one, and malformed ones each
with what the error must say."""

from __future__ import annotations

import json
import sys
from typing import Any

from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import AgentEntry, Rank, RankMap


def a_rankmap() -> RankMap:
    ranks = (Rank(Role.PREFILL, 0, 0), Rank(Role.DECODE, 1, 0, gpu=1))
    return RankMap(
        "ns", "pd", "uid-1", "tcp", {"prefill": {"tp": 1}}, (AgentEntry("pd-a", "node-a", ranks, "d0"),), {0: (1,)}
    )


def with_value(path: list[Any], value: Any) -> str:
    """The valid map's JSON with the value at `path` replaced (a key of None: deleted)."""
    doc = json.loads(a_rankmap().to_json())
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(doc)


# What an adversarial run found ending every agent, and its neighbours, each with what the error says.
MALFORMED = {
    "an array": ("[1, 2]", "must be a JSON object, not list"),
    "nested past the recursion limit": ("[" * (sys.getrecursionlimit() * 4), "nested too deeply"),
    "feeds a list": (with_value(["feeds"], [1]), "feeds must be an object"),
    "feeds of a string": (with_value(["feeds", "0"], "1"), "feeds['0']"),
    "feeds of a bool": (with_value(["feeds", "0"], [True]), "feeds['0'][0] must be an integer"),
    "a feeds key not a number": (with_value(["feeds"], {"x": [1]}), "feeds['x']"),
    "a feeds key of unicode digits": (with_value(["feeds"], {"\u00b2": [1]}), "feeds"),
    "a feeds key of 5,000 digits": (with_value(["feeds"], {"9" * 5000: [1]}), "feeds"),
    "cluster a string": (with_value(["cluster"], "pd"), "cluster must be an object"),
    "no agents": (with_value(["agents"], None), "has no 'agents'"),
    "an agent a number": (with_value(["agents", 0], 7), "agents[0] must be an object"),
    "ranks an object": (with_value(["agents", 0, "ranks"], {}), "ranks must be a list"),
    "a rank replica a float": (with_value(["agents", 0, "ranks", 0, "replica"], 1.5), "replica must be an integer"),
    "a rank replica negative": (with_value(["agents", 0, "ranks", 0, "replica"], -1), "replica must be in"),
    "a rank replica huge": (with_value(["agents", 0, "ranks", 0, "replica"], 10**30), "replica must be in"),
    "a rank role unknown": (with_value(["agents", 0, "ranks", 0, "role"], "encode"), "role must be prefill or decode"),
    "a rank role a list": (with_value(["agents", 0, "ranks", 0, "role"], ["prefill"]), "role must be a string"),
    "a domain a number": (with_value(["agents", 0, "domain"], 3), "domain must be a string or null"),
    "spec a list": (with_value(["spec"], []), "spec must be an object"),
    "version a string": (with_value(["version"], "1"), "version must be an integer"),
    "version 2": (with_value(["version"], 2), "version 2 is not supported"),
    "not JSON": ("{", "not JSON"),
    "no version": (with_value(["version"], None), "version 0 is not supported"),
}
