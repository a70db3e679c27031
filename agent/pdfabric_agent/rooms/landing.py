"""What lands on a decode rank from one source: the plan of its transfer as the source made it (for
the verify checksum), the side-channel aux rows it may write, and the count of what arrived."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pdfabric_agent.memory.plan import TransferPlan, TransferSide, pair_duties, plan_transfer
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.errors import out_of_range
from pdfabric_agent.protocol.labels import Completion, Kind, Outcome
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.registry import DecodeRoom
from pdfabric_agent.runtime import metrics
from pdfabric_core.policy.types import Role


def landing_plan(ctx: AgentContext, room: DecodeRoom, local: LocalRank, prefill_rank: str) -> TransferPlan:
    """The plan of this source's transfer, as its agent made it, seen from this side: the same
    duties and layouts, so its destination blocks are exactly where the source wrote."""
    spec = ctx.spec
    source = ctx.ranks.rank(prefill_rank)
    duties = pair_duties(spec, source.tp_rank, source.cp_rank, source.pp_rank, local.rank.tp_rank, len(room.dst_pages))
    assert duties is not None  # expected_sources names only sources that send
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
        TransferSide(local.layout, local.bases, room.dst_pages, room.dst_state if with_state else [], room.dst_aux),
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
    if nbytes:
        metrics.peer_bytes.labels(cluster, rank_id, peer, Role.DECODE.value).inc(nbytes)
    metrics.count_peer_part(cluster, rank_id, peer, Role.DECODE, Outcome.SUCCESS, duration_s)
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
