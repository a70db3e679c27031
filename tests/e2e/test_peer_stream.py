"""The peer door's stream on real agent processes (issue 23): a frame is the POST it stands for,
checked and answered the same, for the agent the TLS handshake named; its refusals come back in
the frame's answer and the stream stays open; only an agent of the rank map with its certificate
opens it; and the agents' own done reports travel on it (a room moved with the stream gives the
same bytes as one moved with POSTs). A stream does not outlive its caller's admission (issue 40):
its certificate expiring, or the rank map dropping its agent, closes it within a second."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
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


async def held_stream(
    lc: LocalFabric, to: str, tls_dir: str, wait_s: float, decode_rank: str = D
) -> tuple[int, float, str, int]:
    """Open a stream to agent ``to`` as the holder of ``tls_dir``, have one frame answered, then wait
    up to ``wait_s`` for the agent to close it: (the frame's status, seconds from the open to the
    close, the close's message, its code)."""
    agent = lc.agents[to]
    ctx = tls.client_context(tls_dir)
    ctx.load_verify_locations(cafile=os.path.join(agent.tls_dir, tls.CA_FILE))
    async with asyncio.timeout(wait_s + 10), aiohttp.ClientSession() as session:  # a stream never closed fails
        url = f"https://{agent.host}:{agent.peer_port}{STREAM_PATH}"
        async with session.ws_connect(url, ssl=ctx, server_hostname=agent.peer_host, autoclose=False) as ws:
            opened = time.monotonic()
            body = cancel(lc, 41) | {"decode_rank": decode_rank}
            await ws.send_str(json.dumps({"id": 1, "path": "/v1/peer/cancel", "body": body}))
            status = json.loads((await ws.receive(timeout=5)).data)["status"]
            msg = await ws.receive(timeout=wait_s)
            closed = time.monotonic() - opened
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
            return status, closed, str(msg.extra or ""), ws.close_code or int(msg.data or 0)


def test_a_stream_closes_when_its_certificate_expires(lc: LocalFabric, tmp_path: Any) -> None:
    """A certificate of the decode agent's name valid for 4 s: its stream is served, then closed
    (1008) within a second of the expiry; a new connection with it is refused in the handshake."""
    prefill = lc.agent_of(P)
    short = lc.issue_peer_tls(lc.agent_of(D), tmp_path / "short", valid_for=datetime.timedelta(seconds=4))
    status, closed_s, reason, code = asyncio.run(held_stream(lc, prefill, short, wait_s=10))
    assert status == 200
    assert code == 1008 and "expired" in reason, (code, reason)
    assert 2.0 <= closed_s <= 4 + 2.5, closed_s  # notAfter is whole seconds; a check every second
    with pytest.raises((aiohttp.ClientError, OSError)):
        asyncio.run(frames(lc, prefill, [{"id": 1, "path": "/v1/peer/cancel", "body": cancel(lc, 42)}], short))


def test_a_stream_closes_when_the_rank_map_drops_its_agent_and_its_leave_ends() -> None:
    """1P2D, a stream from the agent of decode replica 1 to the prefill agent; the rank map is
    rewritten without that agent (decode scaled 2 -> 1): the stream carries on while the agent
    leaves (its rooms may still finish), then closes within a second of the leave's end."""
    spec = {**TINY, "decode": {"tp": 1, "replicas": 2}, "transfer": {"timeoutSeconds": 2}}
    with LocalFabric(spec, env={"PDFABRIC_BOOTSTRAP_TIMEOUT_S": "1"}) as fabric:
        prefill, leaving = fabric.agent_of(P), fabric.agent_of("decode-1-tp0")
        rm = fabric.rankmap
        smaller = dataclasses.replace(
            rm,
            spec={**rm.spec, "decode": {**rm.spec["decode"], "replicas": 1}},
            agents=tuple(a for a in rm.agents if a.name != leaving),
            feeds={p: tuple(d for d in ds if d == 0) for p, ds in rm.feeds.items()},
        )

        async def run() -> tuple[int, float, str, int]:
            held = asyncio.ensure_future(
                held_stream(fabric, prefill, fabric.agents[leaving].tls_dir, 15, "decode-1-tp0")
            )
            await asyncio.sleep(1.0)  # the stream is open and answered
            path = Path(fabric.workdir) / "rankmap.json"
            tmp = path.with_name("rankmap.json.tmp")
            tmp.write_text(smaller.to_json(), encoding="utf-8")
            os.replace(tmp, path)
            return await held

        status, closed_s, reason, code = asyncio.run(run())
        grace = 1 + 2  # bootstrap timeout + transfer timeout
        assert status == 200
        assert code == 1008 and "no agent of this cluster's rank map" in reason, (code, reason)
        # Written after 1 s, adopted within the next, closed within a second of the grace's end.
        assert 1 + grace <= closed_s <= 1 + 1 + grace + 2.5, closed_s
