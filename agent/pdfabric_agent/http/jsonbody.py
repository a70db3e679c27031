"""Request bodies, read and parsed within bounds: a size cap derived from the pools (the largest
legal request, with a floor), a read deadline, strict UTF-8, and JSON whose nesting depth and
integer sizes are bounded before ``json.loads`` runs (so a 200k-deep array or a 5000-digit number
is a fast 400, never a RecursionError or a slow int parse). Every refusal is an ``ApiError``."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from pdfabric_agent.http.guard import GuardedHandler
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.errors import ApiError, malformed
from pdfabric_agent.protocol.labels import Refusal

BODY_FLOOR = 256 << 10  # every legal message of a small pool fits many times over
BODY_SLACK = 16 << 10  # the fixed fields: rank, room, layout, bases, bytes_by_path, marks
MAX_DEPTH = 16  # legal messages nest 4 deep (done report: body, bytes_by_path, path, kind)
MAX_INT_DIGITS = 20  # 2**64 has 20 digits; every integer on the wire is below it
CHARSETS = frozenset({"utf-8", "utf8"})
BODY_CAP = web.AppKey("pdfabric_body_cap", int)  # the app's cap, from body_cap

# A JSON string, or an unterminated one up to the end: every match attempt succeeds at once, so
# the pass is linear whatever the quotes and backslashes (no backtracking blow-up).
_STRINGS = re.compile(rb'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def body_cap(layouts: Iterable[PoolLayout], floor: int = BODY_FLOOR) -> int:
    """The largest legal request body for ranks with these pools, or ``floor``: every index of the
    pools as a plain JSON number with room for whitespace, and the aux rows of a done report in
    base64."""
    need = 0
    for lay in layouts:
        per_index = len(str(max(lay.kv_pages, lay.state_slots, 1))) + 8
        aux_rows = 4 * sum(lay.aux_items) // 3 + 64 * (len(lay.aux_items) + 1)
        need = max(need, per_index * (lay.kv_pages + lay.state_slots) + aux_rows + BODY_SLACK)
    return max(floor, need)


def too_large(message: str) -> ApiError:
    return ApiError(413, Refusal.TOO_LARGE, message)


def check_shape(raw: bytes) -> None:
    """Nesting depth, checked in C-speed passes before the parser recurses. A body whose brackets
    alone cannot nest deeper than MAX_DEPTH skips the passes (every send and receive does)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        if not brackets:
            return
        inner = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if inner == brackets:
            return  # unbalanced: json.loads says where
        brackets = inner
    if brackets:
        raise malformed(f"the body nests deeper than {MAX_DEPTH} levels")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _bounded_int(digits: str) -> int:
    # Called by the parser for each integer literal: a length test before any conversion.
    if len(digits) > MAX_INT_DIGITS + 1:  # the sign
        raise ValueError(f"a number of {len(digits)} digits; at most {MAX_INT_DIGITS}")
    return int(digits)


# Decoders built once (json.loads with hooks builds one per call), NaN and Infinity refused. A body
# with a run of more than MAX_INT_DIGITS digits anywhere (found in two C passes, ~1 ns a byte) is
# parsed with each integer's length checked before it is converted (a 4000-digit literal costs
# ~1 ms to convert); every other body keeps the C integer parser.
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_BOUNDED_DECODER = json.JSONDecoder(parse_int=_bounded_int, parse_constant=_no_constant)
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)


def decode_json(raw: bytes, charset: str | None = None) -> dict[str, Any]:
    """A JSON object from a body's bytes, or ``ApiError`` (400)."""
    if charset is not None and charset.lower() not in CHARSETS:
        raise malformed(f"charset {charset[:40]!r} is not supported: send utf-8")
    check_shape(raw)
    try:
        text = raw.decode("utf-8")
        long_run = _LONG_RUN in raw.translate(_DIGITS_AS_ZERO)
        body = (_BOUNDED_DECODER if long_run else _DECODER).decode(text)
    except UnicodeDecodeError:
        raise malformed("body is not UTF-8") from None
    except RecursionError:
        raise malformed(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, an integer past Python's digit limit, NaN
        raise malformed(f"body is not JSON: {str(exc)[:100]}") from None
    if not isinstance(body, dict):
        raise malformed("body must be a JSON object")
    return body


async def read_body(request: web.BaseRequest, cap: int, timeout_s: float) -> bytes:
    """The whole body, at most ``cap`` bytes (a declared length past it is refused before a byte
    is read), within ``timeout_s`` (408)."""
    declared = request.content_length
    if declared is not None and declared > cap:
        raise too_large(f"body of {declared} bytes; the largest legal request here is {cap} bytes")
    if request.content.is_eof():
        try:
            return await request.read()  # all there already: no timer
        except web.HTTPRequestEntityTooLarge:
            raise too_large(f"body past {cap} bytes; the largest legal request here is {cap} bytes") from None
    proto = request.protocol if isinstance(request.protocol, GuardedHandler) else None
    if proto is not None:
        proto.reading_body()
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, Refusal.TIMEOUT, f"body not received within {timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large(f"body past {cap} bytes; the largest legal request here is {cap} bytes") from None
    except RequestPayloadError as exc:
        raise malformed(f"body framing: {exc}") from None
    except ConnectionError:
        if proto is not None and proto.evicted:
            raise ApiError(
                408, Refusal.TOO_MANY_CONNECTIONS, "body too slow while the listener is full: connection closed"
            ) from None
        raise malformed("connection closed before the body was complete") from None
    finally:
        if proto is not None:
            proto.body_read()


async def read_json(request: web.BaseRequest, cap: int, timeout_s: float) -> dict[str, Any]:
    raw = await read_body(request, cap, timeout_s)
    charset = request.charset  # None when the content type names none
    return decode_json(raw, charset)
