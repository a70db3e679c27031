"""Drive rooms through real agents the way a serving engine pair would (used by the e2e tests,
the demo and the layout demo): decode announces its destination, every prefill rank fills its
pages with the synthetic engine's contents and sends, decode verifies every byte on arrival."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdfabric_agent.memory.plan import receives_request_rows
from pdfabric_agent.protocol.views import RoomView
from pdfabric_core.policy.rank_mapping import cp_page_shard, pp_layer_range
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import replica_ranks
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.synthetic import fill_prefill, verify_decode


@dataclass
class RoomResult:
    prefill: dict[str, RoomView]  # rank id -> final view
    decode: dict[str, RoomView]
    errors: dict[str, list[str]]  # decode rank id -> byte mismatches
    elapsed_s: float


def scattered_pages(n: int, limit: int, *, offset: int = 0) -> list[int]:
    """n distinct pages with runs of three consecutive pages, then a gap: coalescing has work."""
    pages = [offset + i + (i // 3) * 2 for i in range(n)]
    if pages and pages[-1] >= limit:
        raise ValueError(f"{n} scattered pages need a pool of {pages[-1] + 1} pages, have {limit}")
    return pages


def transfer_room(
    lc: LocalFabric,
    room: int,
    *,
    pages: int,
    state_slots: int = 0,
    aux: bool = True,
    prefill_replica: int = 0,
    decode_replica: int = 0,
    fill: bool = True,
    verify: bool = True,
    timeout_s: float = 30.0,
) -> RoomResult:
    """Drive one room through real agents like a serving engine pair would: decode announces its
    destination, every prefill rank fills its pages (synthetic contents) and sends, both sides
    wait for a final state, decode verifies every byte."""
    spec = lc.spec
    dst_pages = scattered_pages(pages, lc.kv_pages, offset=1)
    src_pages = scattered_pages(pages, lc.kv_pages, offset=0)
    dst_state = list(range(state_slots))[::-1]
    src_state = list(range(state_slots))
    aux_dst, aux_src = (3, 1) if aux else (None, None)
    decode_rank_objs = replica_ranks(spec, Role.DECODE, decode_replica)
    decode_ranks = [r.rank_id for r in decode_rank_objs]
    prefill_ranks = replica_ranks(spec, Role.PREFILL, prefill_replica)
    layers = spec.model.layers
    started = time.monotonic()
    for d in decode_ranks:
        lc.client(d).receive(
            d, room, dst_pages, prefill_replica=prefill_replica, state_indices=dst_state, aux_index=aux_dst
        )
    all_send = spec.prefill.all_cp_ranks_send
    for r in prefill_ranks:
        shard = cp_page_shard(pages, spec.prefill.cp, r.cp_rank, all_ranks_send=all_send)
        mine = [src_pages[i] for i in shard]
        client = lc.client(r.rank_id)
        if fill:
            pools = client.map_pools(r.rank_id)
            try:
                fill_prefill(
                    pools, spec, tp_rank=r.tp_rank, room=room, positions=shard, pages=mine,
                    state_slots=src_state, aux_index=aux_src,
                    first_layer=pp_layer_range(layers, spec.prefill.pp, r.pp_rank).start,
                )  # fmt: skip
            finally:
                pools.close()
        client.send(r.rank_id, room, mine, decode_replica=decode_replica, state_indices=src_state, aux_index=aux_src)
    decode_views = {d: lc.client(d).wait(d, room, timeout_s) for d in decode_ranks}
    prefill_views = {r.rank_id: lc.client(r.rank_id).wait(r.rank_id, room, timeout_s) for r in prefill_ranks}
    elapsed = time.monotonic() - started
    errors: dict[str, list[str]] = {}
    if verify:
        for r in decode_rank_objs:
            d = r.rank_id
            rows = receives_request_rows(spec, r.pp_rank)  # aux and state land on one stage only
            pools = lc.client(d).map_pools(d)
            try:
                errors[d] = verify_decode(
                    pools, spec, tp_rank=r.tp_rank, room=room, pages=dst_pages,
                    state_slots=dst_state if rows else (), aux_index=aux_dst if rows else None,
                    first_layer=pp_layer_range(layers, spec.decode.pp, r.pp_rank).start,
                )  # fmt: skip
            finally:
                pools.close()
    return RoomResult(prefill_views, decode_views, errors, elapsed)
