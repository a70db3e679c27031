"""A prefill room that takes its pages in several sends (``SendChunk``): each chunk after the
first joins its open room here, checked in order and in range, and is fed to the room's targets
at once when decode's destinations are known (``TargetSender.feed``); before that the chunks wait
in the room and go together when it starts. A chunk refused for its order or range fails the room
too (its page list can no longer be whole), so the decode side learns at once and nothing stays
claimed; an abort between chunks ends the targets' tasks without writing more.

``until_deadline``: the room's run against its transfer deadline, which each chunk moves on (a
chunked prefill lasts as long as its forwards)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pdfabric_agent.protocol.chunks import SendChunk
from pdfabric_agent.protocol.errors import ApiError, conflict, malformed, out_of_range
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.protocol.wire import SendRequest
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.room import PrefillRoom
from pdfabric_agent.rooms.targets import TargetSender
from pdfabric_core.rankmap import Rank


class ChunkedSender(Protocol):
    """What ``add_chunk`` uses of the prefill side (``prefill.PrefillSender``): stated here because
    the prefill side calls this module, so this module must not import it."""

    @property
    def ctx(self) -> AgentContext: ...

    @property
    def targets(self) -> TargetSender: ...

    def take_aux_row(self, local: LocalRank, msg: SendRequest, slot: int | None) -> None: ...

    def abort(self, room: PrefillRoom, reason: str) -> None: ...


def add_chunk(sender: ChunkedSender, local: LocalRank, msg: SendChunk) -> RoomView:
    """The next chunk of an open room (``page_offset`` > 0)."""
    ctx = sender.ctx
    room = ctx.rooms.prefill_room(msg.rank, msg.room)
    if room is None:
        raise conflict(
            f"room {msg.room} on {msg.rank} is not open: its first chunk (page_offset 0) opens it, got page_offset "
            f"{msg.page_offset}"
        )
    if room.state.finished:
        return room.view()  # it ended (failed, or sends nothing): the view says how; the chunk changes nothing
    if room.sealed:
        raise conflict(f"room {msg.room} on {msg.rank} took its final chunk already: no pages may follow it")
    replicas = {(r.replica, r.dp_rank) for r in map(Rank.from_id, room.targets)}
    if replicas and replicas != {(msg.peer_replica, msg.peer_dp)}:
        raise malformed(f"a chunk of room {msg.room} names another decode replica or DP group than its first chunk")
    held = len(room.src_pages)
    try:
        if msg.page_offset != held:
            raise conflict(
                f"room {msg.room} on {msg.rank} holds source pages 0..{held - 1}, the chunk starts at {msg.page_offset}: "
                f"chunks go in order, without gaps or overlap (send page_offset {held})"
            )
        stop = held + len(msg.kv_pages)
        for t in room.targets_with_room_info():
            share = len(sender.targets.share(local, t))
            if stop > share or (msg.final and stop != share):
                raise out_of_range(
                    f"the chunk ends at source page {stop}, but {t.decode_rank} takes {share} pages from {msg.rank} "
                    "(decode's pages): no chunk may reach past them, and the final one must end there"
                )
        if msg.final:
            sender.take_aux_row(local, msg, room.board_slot)
    except ApiError as exc:
        sender.abort(room, f"chunk refused: {exc}")
        raise
    room.take_chunk(msg.kv_pages, msg.page_offset, ctx.clock())
    if msg.final:
        room.seal(msg.state_indices, msg.aux_index)
    if room.state is RoomState.TRANSFERRING:
        room.renew_deadline(ctx.clock(), ctx.spec.transfer.timeout_seconds)
        sender.targets.feed(room, local)
    return room.view()


async def until_deadline(room: PrefillRoom, work: Awaitable[Any], clock: Callable[[], float]) -> None:
    """Await ``work`` until the room's deadline, read anew whenever it passes (a chunk may have
    moved it on); at the deadline the work is cancelled and TimeoutError raised."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait((task,), timeout=max(0.0, room.deadline - clock()))
            if not task.done() and clock() >= room.deadline:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait((task,))
                raise TimeoutError
        task.result()
    finally:
        if not task.done():
            task.cancel()
