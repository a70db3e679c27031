"""What lands on a decode rank from one source: the plan of its transfer as the source made it (for
the verify checksum), the side-channel aux rows it may write, and the count of what arrived."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from pdfabric_agent.memory.plan import TransferPlan, TransferSide, pair_duties, plan_transfer
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.errors import malformed, out_of_range
from pdfabric_agent.protocol.labels import Completion, Kind, Outcome
from pdfabric_agent.protocol.wire import BytesByPath, zero_bytes
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.room import DecodeRoom
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.peer_series import PEERS
from pdfabric_core.policy.types import Role


def landing_plan(
    ctx: AgentContext, room: DecodeRoom, local: LocalRank, prefill_rank: str, positions: Sequence[int] | None = None
) -> TransferPlan:
    """The plan of this source's transfer, as its agent made it, seen from this side: the same
    duties and layouts, so its destination blocks are exactly where the source wrote (a sharded
    room's source: at the ``positions`` its report names, in order)."""
    spec = ctx.spec
    source = ctx.ranks.rank(prefill_rank)
    duties = pair_duties(spec, source.tp_rank, source.cp_rank, source.pp_rank, local.rank.tp_rank, len(room.dst_pages))
    assert duties is not None  # expected_sources names only sources that send
    dst_pages: Sequence[int] = room.dst_pages
    if duties.sharded:
        dst_pages = [room.dst_pages[i] for i in positions or ()]
        duties = dataclasses.replace(duties, pages=range(len(dst_pages)), kv_shard_size=1, kv_shard_rank=0)
    n_state = len(room.dst_state)
    src_layout = PoolLayout.from_geometry(
        spec.model,
        spec.prefill.tp,
        kv_pages=max(len(duties.pages), 1),
        state_slots=max(n_state, 1),
        aux_slots=1,
        pp=spec.prefill.pp,
        pp_stage=source.pp_rank,
    )
    # The source planned in its own memory, whose pages are ordered like ours (or it refused).
    src_layout = dataclasses.replace(src_layout, page_order=local.layout.page_order)
    with_state = bool(duties.state_layers or duties.state_skipped)
    return plan_transfer(
        duties,
        TransferSide(
            src_layout,
            local.bases,
            list(range(len(duties.pages))),
            list(range(n_state)) if with_state else [],
            0 if room.dst_aux is not None else None,
        ),
        TransferSide(local.layout, local.bases, dst_pages, room.dst_state if with_state else [], room.dst_aux),
        coalesce=ctx.cfg.coalesce,
        kv_blocks=False,
    )


def count_arrival(
    ctx: AgentContext,
    by_path: Mapping[str, Mapping[str, int]],
    how: Completion,
    rank_id: str,
    peer: str,
    nbytes: int,
    duration_s: float,
) -> None:
    cluster = ctx.labels.cluster
    # The per-peer view: `peer` is the agent the rank map gives the source (``room.expected``).
    PEERS.count(cluster, rank_id, peer, Role.DECODE, Outcome.SUCCESS, duration_s, nbytes)
    metrics.decode_completions.labels(cluster, how.value).inc()
    for path, per_kind in sorted(by_path.items()):
        for kind in Kind:
            n = per_kind.get(kind.value, 0)
            if n:
                metrics.transfer_bytes.labels(*ctx.traffic_labels(Role.DECODE, path), kind.value).inc(n)


def checked_aux_rows(rows: Sequence[tuple[int, bytes]], local: LocalRank, room: DecodeRoom) -> list[tuple[int, bytes]]:
    """Side-channel aux rows, checked before any is written: each must be exactly one item of
    this room's own aux row, so a report cannot write elsewhere in the pool."""
    aux = local.bases.aux
    allowed = (
        {aux[i] + room.dst_aux * size: size for i, size in enumerate(local.layout.aux_items)}
        if room.dst_aux is not None
        else {}
    )
    for dst_addr, raw in rows:
        if allowed.get(dst_addr) != len(raw):
            raise out_of_range(f"aux row at {dst_addr:#x} is not an item of this room's aux row")
    return list(rows)


def check_owed(room: DecodeRoom, prefill_rank: str, by_path: BytesByPath, positions: Sequence[int] | None) -> None:
    """A source's report must say it delivered exactly what this room planned from it: a report
    of other bytes (a faulty or forged peer) is refused, and the room waits for the right one. In a
    sharded room it names the positions it wrote: in the room, in order, none another source wrote;
    its KV bytes are those positions' pages."""
    owed = room.owed.get(prefill_rank)
    if room.sharded:
        if positions is None:
            raise malformed(f"room {room.room} is KV-sharded: {prefill_rank}'s report must name its kv_positions")
        n = len(room.dst_pages)
        if any(not 0 <= p < n for p in positions) or any(a >= b for a, b in itertools.pairwise(positions)):
            raise out_of_range(f"kv_positions of {prefill_rank} must rise within 0..{n - 1} (room {room.room})")
        taken = {p for src, got in room.positions.items() if src != prefill_rank for p in got}
        if clash := sorted(taken.intersection(positions)):
            raise out_of_range(f"{prefill_rank} reports positions {clash[:5]} of room {room.room}, another source's")
        if owed is not None:
            owed = {**owed, Kind.KV.value: owed[Kind.KV.value] * len(positions)}
    elif positions is not None:
        raise malformed(f"room {room.room} is not KV-sharded: a report names no kv_positions")
    said = zero_bytes()
    for per_kind in by_path.values():
        for kind, n_bytes in per_kind.items():
            said[kind] += n_bytes
    if owed is not None and said != owed:
        raise out_of_range(f"{prefill_rank} reports {said} for room {room.room}, which expects {owed} from it")


def unwritten_positions(room: DecodeRoom) -> str:
    """Why a sharded room whose every source arrived must not be Success: positions no source
    wrote, or one written twice (reports checked one at a time may race); "" when each came once."""
    counts = collections.Counter(p for got in room.positions.values() for p in got)
    missing = [i for i in range(len(room.dst_pages)) if i not in counts]
    if missing:
        return f"no source of the KV-sharded room wrote its pages at positions {missing[:8]}"
    twice = sorted(p for p, n in counts.items() if n > 1)
    return f"more than one source wrote positions {twice[:8]} of the KV-sharded room" if twice else ""
