"""The checks a decode rank's room info must pass on the prefill side before it is taken: its
destinations are what this rank writes, so nothing in it is taken on trust. It must come from a
decode rank this prefill rank feeds, through the agent that holds that rank, in the layout the
spec gives that rank, with aux rows of this rank's sizes."""

from __future__ import annotations

import dataclasses

from pdfabric_agent.memory.plan import decode_targets
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.errors import malformed
from pdfabric_agent.protocol.peer_wire import RoomInfo
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank


def aux_rows_mismatch(local: LocalRank, info: RoomInfo) -> str:
    """Why a decode rank's aux rows cannot take this rank's (different sizes), or ""."""
    mine, theirs = local.layout.aux_items, info.layout.aux_items
    if mine == theirs:
        return ""
    return (
        f"aux rows of {info.decode_rank} are {list(theirs)} bytes, {local.rank.rank_id}'s {list(mine)}: prefill "
        "and decode engines must hand the same metadata rows (the same SGLang version, model hidden size and settings)"
    )


def check_peer(ctx: AgentContext, prefill_rank: str, decode_rank: str, sender_agent: str | None) -> None:
    """A decode rank this local prefill rank feeds, spoken for by the agent that holds it."""
    local = ctx.ranks.local(prefill_rank, Role.PREFILL)
    valid = {
        Rank(Role.DECODE, r, route.decode_tp_rank, 0, ctx.ranks.decode_stage(local), dp_rank=dp).rank_id
        for r in range(ctx.ranks.peer_replicas(Role.DECODE))
        for dp in range(ctx.spec.decode.dp)
        for route in decode_targets(ctx.spec, local.rank.tp_rank)
    }
    if decode_rank not in valid:
        raise malformed(f"{decode_rank} is not fed by {prefill_rank}")
    ctx.ranks.check_speaker(decode_rank, sender_agent)


def check_dst_layout(ctx: AgentContext, info: RoomInfo) -> None:
    """The destination layout must be the one the spec gives that decode rank (only pool sizes
    and the page order of its memory, which the decode side chooses, may differ: a page order
    unlike this side's is refused when planned): else the planned offsets would be wrong."""
    spec = ctx.spec
    rank = ctx.ranks.rank(info.decode_rank)
    got = info.layout
    want = PoolLayout.from_geometry(
        spec.model,
        spec.decode.tp,
        kv_pages=got.kv_pages,
        state_slots=got.state_slots,
        aux_slots=got.aux_slots,
        pp=spec.decode.pp,
        pp_stage=rank.pp_rank,
    )
    local = ctx.ranks.by_id[info.prefill_rank]
    # The aux rows are the engines' own; until this rank's engine registered (again, after an
    # agent restart) its rows are not known here: the room checks them when it starts.
    if local.engine is not None and (mismatch := aux_rows_mismatch(local, info)):
        raise malformed(mismatch)
    want = dataclasses.replace(want, page_order=got.page_order, aux_items=got.aux_items)
    if got.kv_buffers == 1 and want.kv_buffers == 2:
        want = want.fused()  # the decode engine keeps K and V together (vLLM): its choice, as the order is
    if got != want:
        mine = vars(got)
        diff = ", ".join(f"{k} {mine[k]} (expected {v})" for k, v in vars(want).items() if mine[k] != v)
        raise malformed(f"room info of {info.decode_rank} has a layout the spec does not give it: {diff}")
