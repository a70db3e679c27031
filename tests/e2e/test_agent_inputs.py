"""Files the agents re-read while they serve, written badly (issue 40): real agents on loopback
(tcp, the peer door on mutual TLS) share one rank-map file, as a cluster's agents share its
ConfigMap. Each malformed map the attacks found ending every agent (a JSON array, JSON nested past
the recursion limit, feeds of the wrong type), then a seeded fuzzed set, is written over it in
turn: every agent keeps running on the map in use, says why on /readyz, and rooms stay byte-exact;
the good map written back is taken again."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.transfer import transfer_room
from tests.deadlines import wait_until
from tests.e2e.specs import TCP_SMALL_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

P, D = "prefill-0-tp0-cp0", "decode-0-tp0"
SPEC = TCP_SMALL_MODEL
FUZZED = 8


def write(path: Path, text: str) -> None:
    """As the kubelet swaps a ConfigMap volume: the new content appears at once."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _paths(doc: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into the map's JSON outside the spec (the parser types everything there)."""
    found = [at] if at else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            if at or k != "spec":
                found += _paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += _paths(v, (*at, i))
    return found


def _another_type(rng: random.Random, value: Any) -> Any:
    """A JSON value of another type than `value` (an int is not a bool here, as in the parser)."""
    choices: list[Any] = [
        [rng.randint(-5, 5)],
        {"x": [None]},
        "x" * rng.randint(0, 3),
        rng.random(),
        rng.randint(-(2**70), 2**70),
        True,
        None,
    ]
    return rng.choice([c for c in choices if type(c) is not type(value)])


def fuzzed(good: str, seed: int) -> str:
    doc = json.loads(good)
    rng = random.Random(seed)
    path = rng.choice(_paths(doc))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = _another_type(rng, node[path[-1]])
    return json.dumps(doc)


def malformed(good: str) -> dict[str, str]:
    doc = json.loads(good)
    shapes = {
        "a JSON array": json.dumps([doc]),
        "nested past the recursion limit": "[" * (sys.getrecursionlimit() * 4) + "]" * (sys.getrecursionlimit() * 4),
        "feeds of a string": json.dumps(doc | {"feeds": {"0": "0"}}),
        "feeds a list": json.dumps(doc | {"feeds": [0]}),
    }
    return shapes | {f"fuzzed {seed}": fuzzed(good, seed) for seed in range(FUZZED)}


def test_malformed_rank_maps_leave_every_agent_serving_and_saying_why() -> None:
    with LocalFabric(SPEC) as lc:
        path = Path(lc.workdir) / "rankmap.json"
        good = path.read_text(encoding="utf-8")
        room = iter(range(1, 1000))

        def exact_room() -> None:
            result = transfer_room(lc, next(room), pages=5, state_slots=1, timeout_s=15)
            assert result.decode[D].state.title == "Success" and not result.errors[D], result

        exact_room()
        shapes = malformed(good)
        for name, text in shapes.items():
            sha = hashlib.sha256(text.encode()).hexdigest()[:12]
            write(path, text)

            def refused(agent: str, sha: str = sha) -> dict[str, Any] | None:
                status, body = lc.readyz(agent)
                said = body.get("inputsRefused", {}).get("rankmap", "")
                return body if status == 200 and sha in said else None

            for agent in lc.agents:
                body = wait_until(lambda a=agent: refused(a), timeout=10, what=f"{agent} to refuse {name}")
                assert body["ready"] and body["rankmapRefused"] == body["inputsRefused"]["rankmap"], body
                assert body["rankmap"] == lc.rankmap.digest, "the map in use stays"
            assert all(a.alive() for a in lc.agents.values()), name
            if not name.startswith("fuzzed"):
                exact_room()
        exact_room()
        refusals = lc.metric_sum("pdfabric_input_refusals_total", input="rankmap")
        assert refusals == len(shapes) * len(lc.agents), refusals

        write(path, good)
        for agent in lc.agents:
            wait_until(
                lambda a=agent: "inputsRefused" not in lc.readyz(a)[1], timeout=10, what=f"{agent} to take the map"
            )
        exact_room()
        assert all(a.alive() for a in lc.agents.values())
        for agent in lc.agents:
            assert "Traceback" not in lc.log(agent), lc.log(agent)[-2000:]
