"""One rank's engine for the e2e tests that drive SGLang's own sender and receiver by hand against
real agents (chunks, room board): the reference engine's pool in SGLang's buffer shapes, filled
with the synthetic request's bytes, a pdfabric manager over it, and SGLang's decode announcing a
room to prefill."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdfabric_agent.client.api import AgentRefused
from pdfabric_core.rankmap import Rank
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.synthetic import aux_chunk, kv_chunk, state_chunk
from tests.e2e.sglang_rooms import poll_until

MODEL = {
    "layers": 4,
    "kvHeads": 2,
    "headDim": 16,
    "dtype": "float32",
    "pageSizeTokens": 16,
    "stateBytesPerRequest": 2048,
    "stateLayers": 4,
    "auxRowBytes": [64, 64, 64],
}
SPEC = {"prefill": {"tp": 1}, "decode": {"tp": 1}, "transfer": {"transport": "tcp", "timeoutSeconds": 20}}
CHUNKS, PER_CHUNK = 4, 3  # 12 pages of 16 tokens, in 4 chunks
PAGES = CHUNKS * PER_CHUNK
ROOM = 2323
TOKENS = 16
SLOT, AUX = 1, 0  # prefill's state slot and aux row
DST_SLOT, DST_AUX = 2, 3


def as_bytes(t: Any) -> np.ndarray[Any, Any]:
    return t.numpy().view(np.uint8)


class Engine:
    """One rank's pool (the reference engine's, SGLang's buffer shapes) and its pdfabric manager."""

    def __init__(self, lc: LocalFabric, rank: Rank, monkeypatch: pytest.MonkeyPatch, token_file: Path) -> None:
        from pdfabric_refengine import KVPool, kv_args
        from pdfabric_sglang.conn import PdfabricKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode

        geo = lc.spec.model
        self.pool = KVPool(layers=geo.layers, local_heads=geo.kv_heads, head_dim=geo.head_width, num_pages=32,
                           shm_dir=lc.shm_dir, state_layers=geo.state_layers,
                           state_slot_bytes=geo.state_bytes_per_request // geo.state_layers, state_slots=4)  # fmt: skip
        monkeypatch.setenv("PDFABRIC_ENGINE_TOKEN_FILE", str(token_file))
        monkeypatch.setenv("PDFABRIC_AGENT_ADDRESS", lc.agents[lc.agent_of(rank.rank_id)].address)
        monkeypatch.setenv("PDFABRIC_CP_RANK", "0")
        args = kv_args(self.pool, engine_rank=0, page_size=TOKENS, kv_head_num=geo.kv_heads,
                       total_kv_head_num=geo.kv_heads)  # fmt: skip
        mode = DisaggregationMode.PREFILL if rank.role == "prefill" else DisaggregationMode.DECODE
        self.mgr = PdfabricKVManager(args, mode, None, False)
        self.row = geo.head_width * geo.dtype_bytes

    def rows(self) -> list[Any]:
        return [as_bytes(b) for bufs in (self.pool.k_buffers, self.pool.v_buffers) for b in bufs]

    def cells(self, pages: list[int], first_pos: int) -> Iterator[tuple[Any, int, int, bytes]]:
        """Every (buffer view, token row, head, the request's bytes there) of these pages, whose
        request positions start at ``first_pos``."""
        for buf, view in enumerate(self.rows()):
            layer, kv = divmod(buf, 2)
            for i, page in enumerate(pages):
                for t in range(TOKENS):
                    for head in range(self.pool.local_heads):
                        tok = (first_pos + i) * TOKENS + t
                        yield view, page * TOKENS + t, head, kv_chunk(ROOM, layer, kv, tok, head, self.row)

    def fill_pages(self, pages: list[int], first_pos: int) -> None:
        """What a forward writes: the KV of these request pages (positions from ``first_pos``)."""
        for view, row, head, data in self.cells(pages, first_pos):
            view[row, head] = np.frombuffer(data, np.uint8)

    def fill_state_aux(self) -> None:
        for layer, buf in enumerate(self.pool.state_buffers[0]):
            as_bytes(buf)[SLOT] = np.frombuffer(state_chunk(ROOM, layer, 0, self.pool.state_slot_bytes), np.uint8)
        for item, buf in enumerate(self.pool.aux.values()):
            as_bytes(buf)[AUX] = np.frombuffer(aux_chunk(ROOM, item, 64), np.uint8)

    def landed(self, pages: list[int], first_pos: int) -> bool:
        """Whether these decode pages hold the request's KV of positions ``first_pos`` onwards."""
        return all(view[row, head].tobytes() == data for view, row, head, data in self.cells(pages, first_pos))

    def state_aux_landed(self) -> bool:
        state = all(
            as_bytes(buf)[DST_SLOT].tobytes() == state_chunk(ROOM, layer, 0, self.pool.state_slot_bytes)
            for layer, buf in enumerate(self.pool.state_buffers[0])
        )
        aux = all(
            as_bytes(buf)[DST_AUX].tobytes() == aux_chunk(ROOM, i, 64) for i, buf in enumerate(self.pool.aux.values())
        )
        return state and aux

    def snapshot(self) -> list[bytes]:
        views = [
            *self.rows(),
            *(as_bytes(b) for b in self.pool.state_buffers[0]),
            *(as_bytes(b) for b in self.pool.aux.values()),
        ]
        return [v.tobytes() for v in views]

    def close(self) -> None:
        self.mgr.close()
        self.pool.close()


def until(check: Callable[[], bool], timeout_s: float = 20.0) -> float | None:
    """The monotonic time ``check`` first held, or None at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.002)
    return None


def announce(
    pre: Engine, dec: Engine, server: Any, room: int, dst: list[int], slot: int = DST_SLOT, aux: int = DST_AUX
) -> tuple[Any, Any]:
    """SGLang's decode announces the room (receiver, ``send_metadata``); prefill's sender sees it."""
    from pdfabric_sglang.conn import PdfabricKVReceiver, PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    rx = PdfabricKVReceiver(dec.mgr, f"127.0.0.1:{server.port}", room)
    rx.init(0)
    assert poll_until([rx], {KVPoll.WaitingForInput}, failed_ends=False) == [KVPoll.WaitingForInput], (
        "receiver",
        room,
        rx.reason,
    )
    rx.send_metadata(np.asarray(dst, np.int32), aux, [np.asarray([slot], np.int32)])
    tx = PdfabricKVSender(pre.mgr, f"127.0.0.1:{server.port}", room)
    states = poll_until([tx], {KVPoll.WaitingForInput}, failed_ends=False)
    if states != [KVPoll.WaitingForInput]:
        try:
            at_prefill: object = pre.mgr.client.poll(pre.mgr.rank_id, tx.room)
        except AgentRefused as exc:  # decode's room info never reached the prefill agent
            at_prefill = exc
        try:
            at_decode: object = dec.mgr.client.poll(dec.mgr.rank_id, rx.room)
        except AgentRefused as exc:  # the receive was refused (the receiver's reason says why)
            at_decode = exc
        pytest.fail(
            f"room {room}: the sender stayed {states} ({tx.reason!r}); the receiver polls {int(rx.poll())} "
            f"({rx.reason!r}); prefill's agent: {at_prefill}; decode's agent: {at_decode}"
        )
    return tx, rx
