"""The peer door's stream on real agent processes (issue 23): a frame is the POST it stands for,
checked and answered the same, for the agent the TLS handshake named; its refusals come back in
the frame's answer and the stream stays open; only an agent of the rank map with its certificate
opens it; and the agents' own done reports travel on it (a room moved with the stream gives the
same bytes as one moved with POSTs)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from pdfabric_agent.protocol import tls
from pdfabric_agent.protocol.peer_wire import STREAM_PATH
from pdfabric_devcluster.agents import peer_request
from pdfabric_devcluster.fabric import LocalFabric
from tests.e2e.specs import TINY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SPEC = TINY
P, D = "prefill-0-tp0-cp0", "decode-0-tp0"


@pytest.fixture(scope="module")
def lc() -> Iterator[LocalFabric]:
    with LocalFabric(SPEC) as fabric:
        yield fabric


async def frames(lc: LocalFabric, to: str, sent: list[dict[str, Any]], tls_dir: str | None) -> list[dict[str, Any]]:
    """Send these frames on a stream to agent ``to`` as the holder of ``tls_dir``; their answers by id."""
    agent = lc.agents[to]
    ctx = tls.client_context(tls_dir) if tls_dir else None
    if ctx is None:
        import ssl

        ctx = ssl.create_default_context()
    ctx.load_verify_locations(cafile=os.path.join(agent.tls_dir, tls.CA_FILE))
    async with aiohttp.ClientSession() as session:
        url = f"https://{agent.host}:{agent.peer_port}{STREAM_PATH}"
        async with session.ws_connect(url, ssl=ctx, server_hostname=agent.peer_host) as ws:
            for frame in sent:
                await ws.send_str(json.dumps(frame))
            answers = [json.loads((await ws.receive(timeout=5)).data) for _ in sent]
    return sorted(answers, key=lambda a: a["id"])


def cancel(lc: LocalFabric, room: int, cluster: str | None = None) -> dict[str, Any]:
    return {"cluster": cluster or lc.uid, "room": room, "decode_rank": D, "prefill_rank": P, "reason": "test"}


def test_a_frame_is_answered_as_its_post(lc: LocalFabric) -> None:
    decode_tls = lc.agents[lc.agent_of(D)].tls_dir
    prefill = lc.agent_of(P)
    body = cancel(lc, 11)
    status, posted = peer_request(
        lc.agents[prefill], "POST", "/v1/peer/cancel", json.dumps(body).encode(), tls_dir=decode_tls
    )
    answers = asyncio.run(
        frames(lc, prefill, [
            {"id": 1, "path": "/v1/peer/cancel", "body": cancel(lc, 12)},
            {"id": 2, "path": "/v1/peer/cancel", "body": cancel(lc, 13, cluster="another-uid")},
            {"id": 3, "path": "/v1/peer/cancel", "body": {"cluster": lc.uid, "room": "x"}},
            {"id": 4, "path": "/v1/peer/nothing", "body": cancel(lc, 14)},
            {"id": 5, "path": "/v1/peer/cancel", "body": cancel(lc, 15)},
        ], decode_tls)
    )  # fmt: skip
    assert status == 200 and answers[0]["status"] == 200 and answers[0]["body"].keys() == posted.keys()
    # Refusals come back in the frame's answer, and the stream goes on (frame 5 after them).
    assert answers[1]["body"]["reason"] == "wrong_cluster"
    assert answers[2]["status"] == 400 and answers[2]["body"]["reason"] == "malformed"
    assert answers[3]["status"] == 404 and "no such peer message" in answers[3]["body"]["error"]
    assert answers[4]["status"] == 200


def test_only_a_rank_map_agent_with_its_certificate_opens_the_stream(lc: LocalFabric, tmp_path: Any) -> None:
    prefill = lc.agent_of(P)
    with pytest.raises((aiohttp.ClientError, OSError)):
        asyncio.run(frames(lc, prefill, [{"id": 1, "path": "/v1/peer/cancel", "body": cancel(lc, 21)}], None))
    stranger = lc.issue_peer_tls("agent-not-in-the-rank-map", tmp_path / "stranger")
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        asyncio.run(frames(lc, prefill, [{"id": 1, "path": "/v1/peer/cancel", "body": cancel(lc, 22)}], str(stranger)))
    assert refused.value.status == 403


def test_the_agents_done_reports_travel_on_the_stream(lc: LocalFabric) -> None:
    """A room between the two agents: the prefill agent's done report is a frame (the decode
    agent's feed of peer-stream frames counts it), and the bytes land as with POSTs."""
    before = lc.metric_sum("pdfabric_peer_stream_frames_total", [lc.agent_of(D)])
    client_p, client_d = lc.client(P), lc.client(D)
    client_d.receive(D, 31, [0], state_indices=[], aux_index=None)
    client_p.send(P, 31, [1], state_indices=[], aux_index=None)
    assert client_d.wait(D, 31, 20).succeeded and client_p.wait(P, 31, 20).succeeded
    # Its room info went to the prefill agent on a stream too; the decode agent took the done report.
    assert lc.metric_sum("pdfabric_peer_stream_frames_total", [lc.agent_of(D)]) >= before + 1
