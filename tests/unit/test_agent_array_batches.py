"""A backend that takes a batch as arrays (``block_arrays``, NIXL) gets, through a real room of the
agent, the very blocks and batches a Block backend gets, counted the same: planned on the event
loop for a small table and in a worker for a large one (``LOOP_ARRAY_BLOCKS``)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.memory import block_arrays
from pdfabric_agent.memory.block_arrays import BlockArrays
from pdfabric_agent.memory.plan import Block
from pdfabric_agent.rooms import writer
from tests.unit.agents import Backend, run_room

PAGES = list(range(64))[::-1][:40]  # reversed: one block per page, 320 with layers and K/V


class RecordingBackend(Backend):
    """The test engine, recording every batch's blocks."""

    def __init__(self) -> None:
        super().__init__(kernel=False, takes=False)
        self.batches: list[tuple[str, list[Block]]] = []

    def write_batch(self, peer: str, blocks: Any) -> str | None:
        self.batches.append(("blocks", list(blocks)))
        return None


class ArrayBackend(RecordingBackend):
    @property
    def block_arrays(self) -> bool:
        return True

    def write_arrays(self, peer: str, batch: BlockArrays) -> str | None:
        self.batches.append(("arrays", batch.blocks()))
        return None


@pytest.mark.parametrize("loop_limit", [writer.LOOP_ARRAY_BLOCKS, 8], ids=["on-the-loop", "in-a-worker"])
def test_an_array_backend_gets_the_block_backends_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loop_limit: int
) -> None:
    for side in ("blocks", "arrays"):
        (tmp_path / side).mkdir()
    blocks = RecordingBackend()
    sent_blocks, room_blocks = run_room(tmp_path / "blocks", blocks, PAGES)
    monkeypatch.setattr(writer, "LOOP_ARRAY_BLOCKS", loop_limit)
    planned_on: list[str] = []

    def kv_arrays(*args: Any) -> BlockArrays:
        planned_on.append(threading.current_thread().name)
        return block_arrays.kv_arrays(*args)

    monkeypatch.setattr(writer, "kv_arrays", kv_arrays)
    arrays = ArrayBackend()
    sent_arrays, room_arrays = run_room(tmp_path / "arrays", arrays, PAGES)
    assert {kind for kind, _ in blocks.batches} == {"blocks"}
    assert {kind for kind, _ in arrays.batches} == {"arrays"}
    assert [b for _, b in arrays.batches] == [b for _, b in blocks.batches]
    assert [len(b) for _, b in arrays.batches] == [16] * 20 + [4]  # maxBatchEntries 16; state and aux ride last
    assert sent_arrays["bytes_by_path"] == sent_blocks["bytes_by_path"]
    assert room_arrays.moved == room_blocks.moved
    on_loop = planned_on == [threading.main_thread().name]
    assert on_loop == (loop_limit >= 320), planned_on
