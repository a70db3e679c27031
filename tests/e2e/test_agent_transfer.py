"""Real agent processes over the real Mooncake engine on loopback tcp, and over NIXL (UCX tcp) where a
case names it: KV pages, state and aux arrive byte-exact for every rank-mapping case, and the byte
counters equal what moved."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pdfabric_agent.client.api import AgentRefused
from pdfabric_agent.protocol.views import RoomView
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import replica_ranks
from pdfabric_core.traffic import pair_traffic
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.synthetic import expected_bytes
from pdfabric_devcluster.transfer import transfer_room
from tests.builders import SMALL_MODEL

# Real agent processes over the real engine; every test here starts at least one cluster.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def spec(prefill: dict[str, Any], decode: dict[str, Any], backend: str = "mooncake", **transfer: Any) -> dict[str, Any]:
    transfer = {"transport": "tcp", "timeoutSeconds": 10, **transfer}
    if transfer.get("memPool", "NONE") != "NONE":
        # Custom pools imply GPU or RDMA transports; run them on tcp the way the operator places
        # them after a declared fallback (the rank map says "tcp").
        del transfer["transport"]
    return {
        "backend": backend,
        "prefill": prefill,
        "decode": decode,
        "transfer": transfer,
        "model": SMALL_MODEL,
        "placement": {"fallback": "TCP"},
    }


def traffic(lc: LocalFabric, role: str) -> dict[str, float]:
    return {
        kind: lc.metric_sum("pdfabric_transfer_bytes_total", role=role, kind=kind) for kind in ("kv", "state", "aux")
    }


def peer_bytes(lc: LocalFabric) -> dict[tuple[str, str, str], float]:
    """pdfabric_peer_transfer_bytes_total of every agent, by (role, local rank, peer agent)."""
    out: dict[tuple[str, str, str], float] = {}
    for name in lc.agents:
        for (n, lbl), v in lc.scrape(name).items():
            if n == "pdfabric_peer_transfer_bytes_total":
                d = dict(lbl)
                out[(d["role"], d["rank"], d["peer"])] = v
    return out


def check_peer_bytes(lc: LocalFabric, before: dict[tuple[str, str, str], float], decode: dict[str, RoomView]) -> None:
    """Every (rank, peer agent) pair moved exactly what the room's per-sender counts say, on both
    sides, and a pair that moved nothing counted nothing."""
    want: dict[tuple[str, str, str], float] = {}
    agent_of = {r.rank_id: a.name for a in lc.rankmap.agents for r in a.ranks}
    for d, view in decode.items():
        for p, sent in (view.senders or {}).items():
            n = sum(sent.values())
            for key in (("prefill", p, agent_of[d]), ("decode", d, agent_of[p])):
                want[key] = want.get(key, 0) + n
    after = peer_bytes(lc)
    moved = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert moved == {k: v for k, v in want.items() if v}


def check_room(lc: LocalFabric, room: int, pages: int = 7, state_slots: int = 2) -> None:
    before = {role: traffic(lc, role) for role in ("prefill", "decode")}
    peers_before = peer_bytes(lc)
    result = transfer_room(lc, room, pages=pages, state_slots=state_slots, aux=True)
    assert {v.state.title for v in result.decode.values()} == {"Success"}, result.decode
    assert {v.state.title for v in result.prefill.values()} == {"Success"}, result.prefill
    assert result.errors == {d: [] for d in result.decode}
    want = expected_bytes(lc.spec, pages=pages, state_slots=state_slots, aux=True)
    for role in ("prefill", "decode"):
        after = traffic(lc, role)
        moved = {k: after[k] - before[role][k] for k in after}
        assert moved == {"kv": want.kv, "state": want.state, "aux": want.aux}, role
    check_prediction(lc, result.decode, pages, state_slots)
    check_peer_bytes(lc, peers_before, result.decode)


def check_prediction(lc: LocalFabric, decode: dict[str, RoomView], pages: int, state_slots: int) -> None:
    """The status prediction (pdfabric_core.traffic) per (prefill rank, decode rank) pair equals
    what each decode rank counted from each sender."""
    spec = lc.spec
    prefill_ids = {(r.tp_rank, r.cp_rank, r.pp_rank): r.rank_id for r in replica_ranks(spec, Role.PREFILL, 0)}
    decode_ids = {(r.tp_rank, r.pp_rank): r.rank_id for r in replica_ranks(spec, Role.DECODE, 0)}
    predicted: dict[str, dict[str, dict[str, int]]] = {d: {} for d in decode_ids.values()}
    for (src, dst), b in pair_traffic(spec, pages, state_slots=state_slots).items():
        predicted[decode_ids[dst]][prefill_ids[src]] = {"kv": b.kv, "state": b.state, "aux": b.aux}
    assert {d: v.senders for d, v in decode.items()} == predicted


@pytest.mark.parametrize(
    ("prefill", "decode", "ranks_per_agent", "backend"),
    [
        ({"tp": 2}, {"tp": 2}, 0, "mooncake"),
        ({"tp": 2}, {"tp": 4}, 0, "mooncake"),
        ({"tp": 4}, {"tp": 2}, 1, "mooncake"),
        ({"tp": 8}, {"tp": 2}, 0, "mooncake"),
        ({"tp": 2}, {"tp": 4}, 0, "nixl"),
        ({"tp": 4}, {"tp": 2}, 1, "nixl"),
    ],
    ids=[
        "equal-tp2",
        "prefill-tp2-decode-tp4",
        "prefill-tp4-decode-tp2-agent-per-rank",
        "replicated-heads-tp8-tp2",
        "nixl-prefill-tp2-decode-tp4",
        "nixl-prefill-tp4-decode-tp2-agent-per-rank",
    ],
)
def test_kv_state_aux_arrive_byte_exact(
    prefill: dict[str, Any], decode: dict[str, Any], ranks_per_agent: int, backend: str
) -> None:
    with LocalFabric(spec(prefill, decode, backend), ranks_per_agent=ranks_per_agent) as lc:
        assert lc.metric_sum("pdfabric_engine_up", backend=backend) > 0
        check_room(lc, room=11)
        # A room id names one request: using it again is refused (no silent reopen, no stale
        # room info taken for the new use); the next request, under a new id, is exact again.
        decode_rank = "decode-0-tp0"
        with pytest.raises(AgentRefused) as again:
            lc.client(decode_rank).receive(decode_rank, 11, [0])
        assert (again.value.status, again.value.reason) == (409, "conflict")
        assert "already ended Success" in again.value.message
        check_room(lc, room=12, pages=5)


# Typed state in the agents' own pools: a GDN-style slot state (a conv tensor of q | k | v sharded
# apart, a sharded temporal tensor, a replicated one) and SWA-style page state (a page of all 4 KV
# heads of 4 tokens of 32 bf16 per SWA K/V buffer), each tensor cut to its rank's share.
TYPED_STATE = {
    "slot": {"stateTensorBytes": [288, 512, 64], "stateTensorSharded": [True, True, False],
             "stateTensorBlocks": [[48, 48, 192]]},
    "page": {"stateKind": "page", "stateTensorBytes": [4 * 4 * 32 * 2] * 2},
}  # fmt: skip


@pytest.mark.parametrize(
    ("prefill", "decode", "state"),
    [({"tp": 2}, {"tp": 1}, "slot"), ({"tp": 1}, {"tp": 2}, "slot"), ({"tp": 1}, {"tp": 2}, "page")],
    ids=["slot-tp2-tp1", "slot-tp1-tp2", "page-tp1-tp2"],
)
def test_typed_state_arrives_byte_exact_in_the_agents_pools(
    prefill: dict[str, Any], decode: dict[str, Any], state: str
) -> None:
    """Each decode rank's share of every state tensor, by its kind's rule, counted per kind and per
    pair as the prediction says."""
    raw = spec(prefill, decode)
    raw["model"] = {**SMALL_MODEL, "stateBytesPerRequest": 0, "stateLayers": 1, **TYPED_STATE[state]}
    with LocalFabric(raw) as lc:
        check_room(lc, room=31)


@pytest.mark.parametrize(
    ("prefill", "decode", "backend"),
    [({"tp": 2}, {"tp": 1}, "mooncake"), ({"tp": 1}, {"tp": 2}, "mooncake"), ({"tp": 2}, {"tp": 1}, "nixl")],
    ids=["mla-tp2-tp1", "mla-tp1-tp2", "nixl-mla-tp2-tp1"],
)
def test_mla_latents_arrive_byte_exact_in_the_agents_pools(
    prefill: dict[str, Any], decode: dict[str, Any], backend: str
) -> None:
    """One latent buffer per layer (kvKind MLA), whole on every prefill rank: each decode rank
    takes it from one of them (the other completes having sent nothing), per-pair bytes as the
    prediction says."""
    raw = spec(prefill, decode, backend)
    raw["model"] = {**SMALL_MODEL, "kvKind": "MLA", "kvLoraRank": 24, "qkRopeHeadDim": 8}
    with LocalFabric(raw) as lc:
        check_room(lc, room=21)


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [({"tp": 1, "pp": 2}, {"tp": 1}), ({"tp": 2, "pp": 2}, {"tp": 1, "pp": 2})],
    ids=["prefill-pp2-into-decode-pp1", "prefill-tp2-pp2-into-decode-tp1-pp2"],
)
def test_pipeline_stages_land_in_their_decode_layers(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    raw = spec(prefill, decode)
    raw["model"] = {**SMALL_MODEL, "layers": 5}  # uneven: stage 0 holds 3 layers, stage 1 holds 2
    with LocalFabric(raw) as lc:
        check_room(lc, room=61)


@pytest.mark.parametrize(
    ("prefill", "decode", "kv"),
    [
        ({"tp": 1}, {"tp": 2}, {}),
        ({"tp": 2}, {"tp": 1}, {"kvKind": "MLA", "kvLoraRank": 24, "qkRopeHeadDim": 8}),
        ({"tp": 2, "pp": 2}, {"tp": 1}, {}),
        ({"tp": 1, "cp": 2, "allCpRanksTransfer": True}, {"tp": 1}, {}),
    ],
    ids=["mha-tp1-tp2", "mla-tp2-tp1", "tp2-pp2-into-pp1", "cp2-all-ranks"],
)
def test_a_draft_kv_group_lands_in_the_decode_draft_layers(
    prefill: dict[str, Any], decode: dict[str, Any], kv: dict[str, Any]
) -> None:
    """An EAGLE/MTP draft (model.draftLayers) moves by the target's route: head slices, the MLA
    one-source rule, the last PP stage only, CP page shards; each decode rank's draft layers are
    byte-exact and the kv counters and per-pair counts equal the prediction (draft included)."""
    raw = spec(prefill, decode)
    raw["model"] = {**SMALL_MODEL, "layers": 3, "draftLayers": 1, **kv}
    with LocalFabric(raw) as lc:
        assert lc.spec.model.draft_layers == 1
        check_room(lc, room=71)


@pytest.fixture(scope="module")
def cp4_all_ranks() -> Iterator[LocalFabric]:
    with LocalFabric(spec({"tp": 1, "cp": 4, "allCpRanksTransfer": True}, {"tp": 1})) as lc:
        yield lc


def test_cp4_all_ranks_sends_state_once_from_cp_rank_0(cp4_all_ranks: LocalFabric) -> None:
    lc = cp4_all_ranks
    skipped_before = lc.metric_sum("pdfabric_state_dedup_skipped_bytes_total")
    result = transfer_room(lc, 21, pages=10, state_slots=2)
    assert result.errors == {"decode-0-tp0": []}
    check_prediction(lc, result.decode, 10, 2)
    senders = result.decode["decode-0-tp0"].senders
    # Every CP rank sent its KV shard (10 pages over 4 ranks: 3, 3, 2, 2), only CP rank 0 the state.
    page = lc.spec.model.kv_page_bytes(1) * lc.spec.model.layers * 2
    assert {r: s["kv"] // page for r, s in senders.items()} == {
        "prefill-0-tp0-cp0": 3,
        "prefill-0-tp0-cp1": 3,
        "prefill-0-tp0-cp2": 2,
        "prefill-0-tp0-cp3": 2,
    }
    state = 2 * lc.spec.model.state_bytes_per_request
    assert {r: s["state"] for r, s in senders.items()} == {
        "prefill-0-tp0-cp0": state,
        "prefill-0-tp0-cp1": 0,
        "prefill-0-tp0-cp2": 0,
        "prefill-0-tp0-cp3": 0,
    }
    want = expected_bytes(lc.spec, pages=10, state_slots=2, aux=True)
    # Expected reduction: without dedup the state would go 4 times; 3 copies are saved (75 %).
    assert want.state_skipped == 3 * state
    assert lc.metric_sum("pdfabric_state_dedup_skipped_bytes_total") - skipped_before == want.state_skipped


def test_cp4_layer_split_every_cp_rank_sends_its_own_state_layers() -> None:
    with LocalFabric(spec({"tp": 1, "cp": 4, "dsaCacheLayerSplit": True}, {"tp": 1})) as lc:
        result = transfer_room(lc, 31, pages=8, state_slots=2)
        assert result.errors == {"decode-0-tp0": []}
        check_prediction(lc, result.decode, 8, 2)
        layer = lc.spec.model.state_bytes_per_request // lc.spec.model.state_layers
        senders = result.decode["decode-0-tp0"].senders
        assert {r: s["state"] for r, s in senders.items()} == {f"prefill-0-tp0-cp{c}": 2 * layer for c in range(4)}
        assert lc.metric_sum("pdfabric_state_dedup_skipped_bytes_total") == 0


def test_cp4_without_all_ranks_transfer_only_cp_rank_0_sends() -> None:
    with LocalFabric(spec({"tp": 1, "cp": 4}, {"tp": 1})) as lc:
        result = transfer_room(lc, 41, pages=6, state_slots=1)
        assert result.errors == {"decode-0-tp0": []}
        check_prediction(lc, result.decode, 6, 1)
        assert list(result.decode["decode-0-tp0"].senders) == ["prefill-0-tp0-cp0"]
        assert {r: v.moved["kv"] > 0 for r, v in result.prefill.items()} == {
            "prefill-0-tp0-cp0": True,
            "prefill-0-tp0-cp1": False,
            "prefill-0-tp0-cp2": False,
            "prefill-0-tp0-cp3": False,
        }


@pytest.mark.parametrize(
    ("transfer", "path"),
    [
        ({}, "mooncake"),
        ({"auxOverTcp": True}, "tcp-side-channel"),
        ({"memPool": "NVLINK"}, "tcp-side-channel"),
        ({"memPool": "BAREX"}, "mooncake"),
    ],
    ids=["default-engine", "aux-over-tcp-flag", "pool-exactly-nvlink", "pool-barex"],
)
def test_aux_path_follows_policy(transfer: dict[str, Any], path: str) -> None:
    # INTRA_NODE_NVLINK (the substring trap) needs GPU aux buffers, so it is covered by the pure
    # plan and policy tests; here every pool that runs on a CPU box goes end to end.
    with LocalFabric(spec({"tp": 1}, {"tp": 1}, **transfer), transport="tcp") as lc:
        result = transfer_room(lc, 51, pages=3)
        assert result.errors == {"decode-0-tp0": []}
        aux = sum(lc.spec.model.aux_row_bytes)
        for role in ("prefill", "decode"):
            assert lc.metric_sum("pdfabric_transfer_bytes_total", role=role, kind="aux", path=path) == aux
            other = "mooncake" if path != "mooncake" else "tcp-side-channel"
            assert lc.metric_sum("pdfabric_transfer_bytes_total", role=role, kind="aux", path=other) == 0
        if path == "mooncake":
            # The aux row rides in the KV's batch: one engine round trip for the room, not two.
            assert lc.metric_sum("pdfabric_transfer_batches_total", role="prefill") == 1


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_room_larger_than_one_batch_goes_in_chunks_of_1024(backend: str) -> None:
    # 1500 scattered pages x 2 layers x K/V = 6000 blocks: one tcp batch of that size would fail
    # and poison the session; chunked it is 6 batches, and the next room still works.
    geometry = {"layers": 2, "kvHeads": 2, "headDim": 8, "pageSizeTokens": 2, "auxRowBytes": [8]}
    raw = {"backend": backend, "prefill": {"tp": 1}, "decode": {"tp": 1}, "transfer": {"transport": "tcp"}}
    raw["model"] = geometry
    with LocalFabric(raw, env={"PDFABRIC_KV_PAGES": "2600", "PDFABRIC_COALESCE": "0"}) as lc:
        for room in (1, 2):
            result = transfer_room(lc, room, pages=1500, aux=False)
            assert result.errors == {"decode-0-tp0": []}
        assert lc.metric_sum("pdfabric_transfer_blocks_total", role="prefill") == 2 * 6000
        assert lc.metric_sum("pdfabric_transfer_batches_total", role="prefill") == 2 * 6


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_many_rooms_in_flight_do_not_mix(backend: str) -> None:
    from pdfabric_devcluster.synthetic import fill_prefill, verify_decode

    with LocalFabric(spec({"tp": 2}, {"tp": 4}, backend)) as lc:
        rooms = {
            room: (list(range(8 * i, 8 * i + 8)), list(range(63 - 8 * i, 55 - 8 * i, -1)))
            for i, room in enumerate(range(70, 77))
        }
        decodes = [f"decode-0-tp{d}" for d in range(4)]
        prefills = [f"prefill-0-tp{p}-cp0" for p in range(2)]
        for room, (_, dst) in rooms.items():
            for d in decodes:
                lc.client(d).receive(d, room, dst, state_indices=[room % 8], aux_index=room % 8)
        for p_tp, p in enumerate(prefills):
            pools = lc.client(p).map_pools(p)
            for room, (src, _) in rooms.items():
                fill_prefill(pools, lc.spec, tp_rank=p_tp, room=room, positions=range(8), pages=src,
                             state_slots=[room % 8], aux_index=room % 8)  # fmt: skip
            pools.close()
        for room, (src, _) in rooms.items():  # all sends back to back: rooms overlap in the agents
            for p in prefills:
                lc.client(p).send(p, room, src, state_indices=[room % 8], aux_index=room % 8)
        for room in rooms:
            assert {lc.client(d).wait(d, room, 30).state.title for d in decodes} == {"Success"}
        for d_tp, d in enumerate(decodes):
            pools = lc.client(d).map_pools(d)
            for room, (_, dst) in rooms.items():
                errors = verify_decode(pools, lc.spec, tp_rank=d_tp, room=room, pages=dst,
                                       state_slots=[room % 8], aux_index=room % 8)  # fmt: skip
                assert errors == [], (room, d, errors[:3])
            pools.close()
