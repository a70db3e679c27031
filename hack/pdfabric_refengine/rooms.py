"""How the reference engines drive SGLang's senders and receivers through a request, shared by
the Llama (``pd.py``) and the MLA model (``mla_pd.py``): polling rooms to a state as SGLang's
queues do, giving a request up at its agents, sending its pages in two chunks as a chunked prefill
does, holding a decode request's pages and aux row on every rank of a row of pools, and the answer
a request reports.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

import numpy as np

from pdfabric_agent.protocol.views import RoomState
from pdfabric_refengine.kvpool import KVPool

POLL_S = 0.005


class RoomDriver(Protocol):
    """What driving rooms needs of an engine process: its deadline and the lock its ranks share."""

    timeout_s: float
    lock: Any


def wait(obj: Any, until: set[RoomState], timeout_s: float, lock: Any = None) -> RoomState:
    """Poll ``obj`` until a state in ``until`` or Failed (under ``lock``, released between polls)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with lock if lock is not None else contextlib.nullcontext():
            state = RoomState(int(obj.poll()))  # SGLang's KVPoll code
        if state in until or state is RoomState.FAILED:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"still {state.title} after {timeout_s} s")
        time.sleep(POLL_S)


def metric(obj: Any) -> dict[str, Any]:
    m = obj.get_transfer_metric()
    return {"latency_s": m.transfer_latency_s, "bytes": m.transfer_total_bytes}


def failure(obj: Any) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def abort_all(rooms: dict[Any, Any]) -> None:
    """Give up the rooms at their agents (SGLang aborts a request's sender or receiver so)."""
    for obj in rooms.values():
        abort = getattr(obj, "abort", None)
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()


def failed(room: int, rooms: dict[Any, Any], why: str = "") -> dict[str, Any]:
    errors = {str(k): failure(s) for k, s in rooms.items()}
    if why:
        errors = {k: v or why for k, v in errors.items()} or {"engine": why}
    return {"room": room, "state": "Failed", "errors": errors}


class GaveUp(Exception):
    """A request's rooms were given up; ``result`` is its Failed answer."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(result.get("errors"))
        self.result = result


def wait_all(
    engine: RoomDriver, rooms: dict[Any, Any], until: set[RoomState], room: int, what: str, *, failed_ends: bool = False
) -> dict[Any, RoomState]:
    """Every room's state once each reached ``until`` (or Failed). A timeout, or with
    ``failed_ends`` a Failed room, aborts them all at their agents and raises GaveUp."""
    try:
        states = {key: wait(obj, until, engine.timeout_s, engine.lock) for key, obj in rooms.items()}
    except TimeoutError as exc:
        with engine.lock:
            abort_all(rooms)
        raise GaveUp(failed(room, rooms, f"{what}: {exc}")) from None
    if failed_ends and RoomState.FAILED in states.values():
        with engine.lock:
            abort_all(rooms)
        raise GaveUp(failed(room, rooms))
    return states


def outcome(room: int, rooms: dict[Any, Any], final: dict[Any, RoomState]) -> dict[str, Any]:
    """A request's answer once its rooms ended: Success only if every room succeeded."""
    return {
        "room": room,
        "state": "Success" if set(final.values()) == {RoomState.SUCCESS} else "Failed",
        "errors": {str(k): failure(r) for k, r in rooms.items() if final[k] is not RoomState.SUCCESS},
        "metrics": {str(k): metric(r) for k, r in rooms.items()},
    }


def send_in_two_chunks(sender: Any, pages: np.ndarray, state: list[np.ndarray] | None) -> None:
    """A chunked prefill's sends: the first half of the pages, then the rest with the state indices."""
    half = len(pages) // 2
    if half and sender.should_send_kv_chunk(half, False):
        sender.send(pages[:half])
    if sender.should_send_kv_chunk(len(pages) - half, True):
        sender.send(pages[half:], state)


def hold_row(row: list[KVPool], n: int) -> tuple[list[int], int]:
    """A decode request's ``n`` pages and aux row, at the same place on every TP rank's pool."""
    pages = row[0].allocate_pages(n)
    for pool in row[1:]:
        pool.allocate_pages(n)
    aux = row[0].allocate_aux_slot()
    for pool in row[1:]:
        pool.allocate_aux_slot()
    return pages, aux


def release_row(row: list[KVPool], pages: list[int], aux: int | None) -> None:
    """Give back what ``hold_row`` took (either part may not have been taken)."""
    if pages:
        for pool in row:
            pool.free_pages(pages)
    if aux is not None:
        for pool in row:
            pool.free_aux_slot(aux)
