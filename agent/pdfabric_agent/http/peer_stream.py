"""The peer door's stream (``GET /v1/peer/stream``): one WebSocket per calling agent over which its
peer messages (room info, done reports, launch notices, cancels) arrive as frames rather than one
HTTPS request each. A frame ``{"id", "path", "body"}`` is the POST of ``path`` with that body,
checked and handled exactly as the POST (``peer_call``) for the caller the TLS handshake
authenticated when the stream opened; the answer ``{"id", "status", "body"}`` carries what the
POST would answer, refusals included. Frames are handled concurrently, as separate POSTs would be,
at most ``MAX_IN_FLIGHT`` at once per stream (more are refused 429).

The caller stays checked while the stream lives: every ``ADMISSION_CHECK_S`` and before each frame,
its certificate must not have expired since the handshake and the rank map must still list it;
else the stream closes (1008, with the reason) within one check, failing the frames it held.

Why: after the last chunk a room waits for its done report, and on two busy cores an HTTPS POST
between idle agents costs about 1.5 ms where a frame on an open stream costs about 0.7."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from pdfabric_agent.http.jsonbody import decode_json
from pdfabric_agent.protocol.errors import ApiError, internal_error, malformed
from pdfabric_agent.protocol.labels import Refusal

log = logging.getLogger("pdfabric.agent")

MAX_IN_FLIGHT = 1024  # frames of one stream being handled at once
HEARTBEAT_S = 10.0  # a stream whose peer stopped answering pings closes (its calls fail, it reconnects)

ADMISSION_CHECK_S = 1.0  # an expired certificate or a caller the rank map dropped: closed this soon

# The streams open on a peer door, closed when its app shuts down (``close_streams``): a stream's
# handler runs until its caller closes it, and the server's shutdown would wait for it.
OPEN_STREAMS = web.AppKey("pdfabric_open_streams", set[web.WebSocketResponse])

PeerCall = Callable[[str, dict[str, Any], str], Awaitable[dict[str, Any]]]  # (path, body, caller) -> answer


def _frame(frame_id: int, status: int, body: dict[str, Any]) -> str:
    return json.dumps({"id": frame_id, "status": status, "body": body})


async def _answer(
    ws: web.WebSocketResponse, frame: Any, caller: str, call: PeerCall, refused: Callable[[ApiError], None]
) -> None:
    frame_id = frame.get("id") if isinstance(frame, dict) else None
    if type(frame_id) is not int:
        return  # no id to answer to: the peer's client never sends one
    try:
        path, body = frame.get("path"), frame.get("body")
        if not isinstance(path, str) or not isinstance(body, dict):
            raise malformed("a stream frame needs a string 'path' and an object 'body'")
        status, answer = 200, await call(path, body, caller)
    except ApiError as exc:
        refused(exc)
        status, answer = exc.status, exc.body()
    except Exception as exc:  # as the POST's 500: logged, counted, the caller told
        log.exception("unexpected error on a stream frame %s from %s", frame.get("path"), caller, exc_info=exc)
        error = internal_error(exc)
        refused(error)
        status, answer = error.status, error.body()
    if not ws.closed:
        await ws.send_str(_frame(frame_id, status, answer))


async def _close_when_refused(
    ws: web.WebSocketResponse, still_admitted: Callable[[], ApiError | None], refused: Callable[[ApiError], None]
) -> None:
    while not ws.closed:
        await asyncio.sleep(ADMISSION_CHECK_S)
        if not ws.closed and await _closed_if_refused(ws, still_admitted, refused):
            return


async def _closed_if_refused(
    ws: web.WebSocketResponse, still_admitted: Callable[[], ApiError | None], refused: Callable[[ApiError], None]
) -> bool:
    exc = still_admitted()
    if exc is None:
        return False
    refused(exc)
    log.warning("closing the peer stream: %s", exc.message)
    # The reason is capped by the protocol at 123 bytes.
    await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=exc.message.encode()[:123])
    return True


async def serve_stream(
    request: web.Request,
    caller: str,
    call: PeerCall,
    max_frame: int,
    refused: Callable[[ApiError], None],
    still_admitted: Callable[[], ApiError | None],
) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(max_msg_size=max_frame, heartbeat=HEARTBEAT_S)
    await ws.prepare(request)
    streams = request.app[OPEN_STREAMS]
    streams.add(ws)
    tasks: set[asyncio.Task[None]] = set()
    watch = asyncio.ensure_future(_close_when_refused(ws, still_admitted, refused))
    async for msg in ws:
        if msg.type is not WSMsgType.TEXT:
            break
        if await _closed_if_refused(ws, still_admitted, refused):
            break
        try:
            frame = decode_json(msg.data.encode())
        except ApiError as exc:  # not bounded JSON: nothing to answer to, the stream closes
            refused(exc)
            break
        if len(tasks) >= MAX_IN_FLIGHT:
            busy = {
                "error": f"more than {MAX_IN_FLIGHT} frames in flight",
                "reason": Refusal.TOO_MANY_CONNECTIONS.value,
            }
            await ws.send_str(_frame(frame.get("id", -1), 429, busy))
            continue
        task = asyncio.ensure_future(_answer(ws, frame, caller, call, refused))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    watch.cancel()
    for task in tasks:
        task.cancel()
    streams.discard(ws)
    return ws


async def close_streams(app: web.Application) -> None:
    """The app's ``on_shutdown``: every open stream closed (1001, going away) at once, so the agent
    stops without waiting on its callers (its peers' streams reopen to its successor)."""
    open_streams = app[OPEN_STREAMS]
    streams = list(open_streams)  # a closing stream's handler leaves the set meanwhile
    await asyncio.gather(
        *(ws.close(code=WSCloseCode.GOING_AWAY, message=b"the agent is stopping") for ws in streams),
        return_exceptions=True,
    )
