"""What SGLang's PD router does with one request, for tests and the demo: the same ``/generate``
body with the chosen prefill's ``bootstrap_host``/``bootstrap_port`` and a fresh
``bootstrap_room`` to that prefill and to a decode server at once; the answer is decode's, an
error when either side answers one (or does not answer within the timeout)."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PrefillEndpoint:
    url: str  # http://host:port
    bootstrap_host: str
    bootstrap_port: int


@dataclass
class Answer:
    ok: bool
    room: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    error: str = ""
    status: dict[str, int] = field(default_factory=dict)  # role -> HTTP status (0: no answer)
    meta: dict[str, Any] = field(default_factory=dict)


def _post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/generate", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {"error": {"message": exc.reason}}
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a torn answer
        return 0, {"error": {"message": f"{type(exc).__name__}: {exc}"}}


def _message(answer: dict[str, Any]) -> str:
    err = answer.get("error")
    return str(err.get("message") if isinstance(err, dict) else err)


def generate(
    prefill: PrefillEndpoint,
    decode_url: str,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    room: int | None = None,
    timeout_s: float = 60.0,
) -> Answer:
    room = random.getrandbits(63) if room is None else room
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "bootstrap_host": prefill.bootstrap_host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        p = pool.submit(_post, prefill.url, body, timeout_s)
        d = pool.submit(_post, decode_url, body, timeout_s)
        (ps, pa), (ds, da) = p.result(), d.result()
    status = {"prefill": ps, "decode": ds}
    errors = [f"{role}: {_message(a)}" for role, s, a in (("prefill", ps, pa), ("decode", ds, da)) if s != 200]
    if errors:
        return Answer(False, room, error="; ".join(errors), status=status)
    return Answer(True, room, list(da["output_ids"]), da["text"], status=status, meta=da.get("meta_info", {}))
