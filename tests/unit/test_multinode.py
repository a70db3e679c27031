"""A replica over several nodes (prefill/decode ``nodesPerReplica``, issue 45): its node blocks equal
SGLang's own split (``_calculate_rank_ranges``), the planner places a group on distinct nodes all or
none (in every transport that can carry one), keeps it where it is and moves it whole, and the
builders give each node rank its engine launch, the leader its rendezvous port and the router
only the leader."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any

import pytest

from pdfabric_core.engines.launch import EngineEnv, EngineLaunch, decode_launches
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import node_rank, replica_parts, replica_ranks
from pdfabric_core.spec import SpecError
from pdfabric_operator.builders.agent_pod import build_agent_pods
from pdfabric_operator.builders.names import ClusterRef, agent_name
from pdfabric_operator.builders.services import engine_endpoints
from pdfabric_operator.group_restarts import GroupActions
from pdfabric_operator.placement import Placement, PlacementFailure, PlacementReason
from pdfabric_operator.planner import plan_placement
from tests.builders import gpu_node, pdcluster

REF = ClusterRef("ns", "big", "uid-1")
GROUP_ARGS = [
    "--nnodes", "$(PDFABRIC_NNODES)", "--node-rank", "$(PDFABRIC_NODE_RANK)",
    "--dist-init-addr", "$(PDFABRIC_DIST_INIT_ADDR)",
]  # fmt: skip
SPLITS = [
    (tp, pp, n)
    for tp in (1, 2, 4, 8)
    for pp in (1, 2, 4)
    for n in (2, 4, 8)
    if pp % n == 0 or (n % pp == 0 and tp % (n // pp) == 0)
]


def sglang_blocks(tp: int, pp: int, nnodes: int) -> list[set[tuple[int, int]]]:
    """(pp rank, tp rank) of each node rank, by SGLang's own function (its parallel state stood in)."""
    engine = pytest.importorskip("sglang.srt.entrypoints.engine")
    parallel = types.SimpleNamespace(nnodes=nnodes, pp_size=pp, tp_size=tp)
    original = engine.get_parallel
    engine.get_parallel = lambda: parallel
    try:
        blocks = []
        for k in range(nnodes):
            pps, tps, _, _ = engine._calculate_rank_ranges(k)
            blocks.append({(p, t) for p in pps for t in tps})
        return blocks
    finally:
        engine.get_parallel = original


@pytest.mark.parametrize(("tp", "pp", "nodes"), SPLITS, ids=[f"tp{t}-pp{p}-n{n}" for t, p, n in SPLITS])
def test_node_blocks_are_sglangs(tp: int, pp: int, nodes: int) -> None:
    spec = pdcluster().model(kvHeads=8).prefill(tp=tp, pp=pp, nodesPerReplica=nodes).decode(tp=tp, pp=pp).spec()
    parts = replica_parts(spec, Role.PREFILL, 0)
    assert [{(r.pp_rank, r.tp_rank) for r in part} for part in parts] == sglang_blocks(tp, pp, nodes)
    assert all(node_rank(spec, r) == k for k, part in enumerate(parts) for r in part)


SPEC_REFUSALS = [
    ("past-tp", {"prefill": {"tp": 2, "nodesPerReplica": 4}}, "cannot split a replica of tp 2 x pp 1"),
    ("pp-not-divided", {"prefill": {"tp": 1, "pp": 4, "nodesPerReplica": 3}}, "cannot split"),
    ("with-cp", {"prefill": {"tp": 2, "cp": 2, "nodesPerReplica": 2}}, "needs prefill.dp 1 and cp 1"),
    ("decode-with-dp", {"decode": {"tp": 2, "dp": 2, "nodesPerReplica": 2}}, "needs decode.dp 1 and cp 1"),
    (
        "intra-node-nvlink",
        {"transfer": {"memPool": "INTRA_NODE_NVLINK"}, "prefill": {"tp": 2, "nodesPerReplica": 2}},
        "intra-node NVLink keeps every replica on one node",
    ),
]


@pytest.mark.parametrize(("patch", "fragment"), [c[1:] for c in SPEC_REFUSALS], ids=[c[0] for c in SPEC_REFUSALS])
def test_a_split_sglang_cannot_run_is_refused_naming_the_field(patch: dict[str, Any], fragment: str) -> None:
    builder = pdcluster()
    for section, fields in patch.items():
        builder = getattr(builder, section)(**fields)
    with pytest.raises(SpecError, match=fragment):
        builder.spec()


def test_engines_of_a_group_must_be_told_their_node_rank() -> None:
    builder = pdcluster().prefill(tp=2, nodesPerReplica=2).engine(prefill={"args": ["--nnodes", "$(PDFABRIC_NNODES)"]})
    with pytest.raises(SpecError, match=r"engine.prefill.args must pass \$\(PDFABRIC_NODE_RANK\), \$\(PDFABRIC_DIST"):
        builder.spec()
    pdcluster().prefill(tp=2, nodesPerReplica=2).engine(prefill={"args": GROUP_ARGS}).spec()  # accepted


def _layout(result: Placement) -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    for a in result.agents:
        out.setdefault(a.unit, {})[a.node] = [r.rank_id for r in a.ranks]
    return out


@pytest.mark.parametrize("transport", ["tcp", "rdma", "nvlink"])
def test_a_group_takes_one_block_per_distinct_node_in_every_transport(transport: str) -> None:
    spec = pdcluster().transport(transport).prefill(tp=4, nodesPerReplica=2).decode(tp=2).spec()
    # Each node could hold the whole replica, yet a group never doubles up on a node.
    nodes = [gpu_node(n, 8, rdma=2, clique="c1") for n in ("a", "b", "c")]
    result = plan_placement(spec, nodes, [], cluster_uid="u")
    assert isinstance(result, Placement), result
    prefill = _layout(result)["prefill-0"]
    assert sorted(len(ranks) for ranks in prefill.values()) == [2, 2] and len(prefill) == 2
    blocks = sorted(prefill.values())
    assert blocks == [["prefill-0-tp0-cp0", "prefill-0-tp1-cp0"], ["prefill-0-tp2-cp0", "prefill-0-tp3-cp0"]]
    # GPUs numbered from 0 within each pod, as the device plugin gives them.
    for a in result.agents:
        assert [r.gpu for r in a.ranks] == list(range(len(a.ranks)))


def test_a_group_that_does_not_fit_is_not_placed_at_all_with_the_reason() -> None:
    spec = pdcluster().prefill(tp=4, nodesPerReplica=4).decode(tp=1).engine(prefill={"args": GROUP_ARGS}).spec()
    # 16 free GPUs in all, but only three nodes: no part of the group is placed, nor the cluster.
    result = plan_placement(spec, [gpu_node("a", 8), gpu_node("b", 4), gpu_node("c", 4)], [], cluster_uid="u")
    assert isinstance(result, PlacementFailure)
    assert result.reason is PlacementReason.INSUFFICIENT_GPUS
    assert "prefill-0 spans 4 nodes with 1 free GPUs each" in result.message
    assert "offer 3 such node(s)" in result.message


def test_a_running_group_stays_put_and_moves_whole_when_a_node_goes() -> None:
    spec = pdcluster().prefill(tp=2, nodesPerReplica=2).decode(tp=2, nodesPerReplica=2).spec()
    nodes = [gpu_node(n, 2) for n in ("a", "b", "c", "d")]
    first = plan_placement(spec, nodes, [], cluster_uid="u")
    assert isinstance(first, Placement)
    again = plan_placement(spec, list(reversed(nodes)), [], cluster_uid="u", previous=first.ranks_by_node())
    assert isinstance(again, Placement) and _layout(again) == _layout(first)
    # The node of one prefill block is gone: the group is placed again as a whole (best-fit on
    # two distinct nodes, the lost one not among them); the decode group stays where it was.
    lost = sorted(_layout(first)["prefill-0"])[1]
    left = [n for n in nodes if n.name != lost] + [gpu_node("e", 2)]
    moved = plan_placement(spec, left, [], cluster_uid="u", previous=first.ranks_by_node())
    assert isinstance(moved, Placement)
    after = _layout(moved)
    assert sorted(r for ranks in after["prefill-0"].values() for r in ranks) == [
        "prefill-0-tp0-cp0",
        "prefill-0-tp1-cp0",
    ]
    for unit, blocks in _layout(first).items():
        if lost not in blocks:
            assert after[unit] == blocks  # a group the lost node held nothing of stays as it was
        else:
            assert len(after[unit]) == 2 and lost not in after[unit]
    # One node of 8 GPUs has room for every rank but is one node: nothing is placed.
    assert isinstance(plan_placement(spec, [gpu_node("x", 8)], [], cluster_uid="u"), PlacementFailure)


def _engines(pod: dict[str, Any]) -> list[EngineLaunch]:
    (value,) = [e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == "PDFABRIC_ENGINES"]
    return decode_launches(value.replace("$$", "$"))


def test_each_node_rank_gets_its_launch_and_only_the_leader_serves() -> None:
    builder = (
        pdcluster()
        .prefill(tp=2, nodesPerReplica=2)
        .decode(tp=2, nodesPerReplica=2)
        .engine(prefill={"args": GROUP_ARGS}, decode={"args": GROUP_ARGS})
    )
    spec = builder.spec()
    placement = plan_placement(spec, [gpu_node(n, 2) for n in ("a", "b")], [], cluster_uid=REF.uid)
    assert isinstance(placement, Placement)
    pods = build_agent_pods(REF, spec, placement)
    assert len(pods) == 4
    leaders = {}
    for a in placement.agents:
        if any(r.tp_rank == 0 for r in a.ranks):
            leaders[a.ranks[0].role] = agent_name(REF.name, a.unit, a.node)
    for pod, agent in zip(pods, placement.agents, strict=True):
        (launch,) = _engines(pod)
        role = Role(launch.role)
        rank = 0 if agent.ranks[0].tp_rank == 0 else 1
        port = 20000 if role is Role.PREFILL else 21000
        assert (launch.nnodes, launch.node_rank) == (2, rank)
        assert launch.dist_init_addr == f"{leaders[role]}.big-agents.ns.svc:{port}"
        assert launch.rank_ids == (agent.ranks[0].rank_id,) and launch.tp == 2
        env = launch.contract_env("127.0.0.1:1", "/t", "/s")
        assert env[EngineEnv.NODE_RANK] == str(rank) and env[EngineEnv.NNODES] == "2"
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        labels = pod["metadata"]["labels"]
        serves = f"pdfabric.dev/serves-{role.value}"
        if rank == 0:
            assert ports[f"{role.value[0]}-dist-0"] == port and labels[serves] == "true"
        else:  # a follower runs its ranks; requests go to its leader only
            assert f"{role.value[0]}-dist-0" not in ports and serves not in labels
    endpoints = engine_endpoints(REF.name, REF.namespace, spec, placement)
    assert [e["pod"] for e in endpoints["prefill"]] == [leaders[Role.PREFILL]]
    assert [e["pod"] for e in endpoints["decode"]] == [leaders[Role.DECODE]]


def test_a_group_launch_round_trips_and_refuses_a_bad_rendezvous() -> None:
    spec = pdcluster().prefill(tp=2, nodesPerReplica=2).engine(prefill={"args": GROUP_ARGS}).spec()
    ranks = replica_parts(spec, Role.PREFILL, 0)[1]
    from pdfabric_core.engines.groups import engine_launches

    (launch,) = engine_launches(spec, ranks, {(Role.PREFILL, 0): "lead.svc:20000"})
    body = launch.to_json()
    assert (body["nnodes"], body["nodeRank"], body["distInitAddr"]) == (2, 1, "lead.svc:20000")
    assert EngineLaunch.from_json(json.loads(json.dumps(body))) == launch
    for bad, field in (({"nodeRank": 2}, "nodeRank"), ({"distInitAddr": "lead.svc"}, "distInitAddr")):
        with pytest.raises(ValueError, match=field):
            EngineLaunch.from_json({**body, **bad})
    with pytest.raises(ValueError, match="no leader address"):
        engine_launches(spec, ranks)
    # A single-node replica's launch carries none of it (its message is as before).
    plain = pdcluster().engine().spec()
    (one,) = engine_launches(plain, replica_ranks(plain, Role.PREFILL, 0))
    assert "nnodes" not in one.to_json() and EngineEnv.NODE_RANK not in one.contract_env("a:1", "/t", "/s")


def test_a_groups_endpoint_is_ready_only_while_every_node_rank_serves() -> None:
    from pdfabric_core.engines.state import EngineState
    from pdfabric_operator.observed import AgentView, Observed
    from pdfabric_operator.status import compute_status

    spec = pdcluster().prefill(tp=2, nodesPerReplica=2).engine(prefill={"args": GROUP_ARGS}).spec()
    placement = plan_placement(spec, [gpu_node(n, 2) for n in ("a", "b")], [], cluster_uid="u")
    assert isinstance(placement, Placement)

    def status(follower: EngineState) -> dict[str, Any]:
        views = []
        for a in placement.agents:
            name = "prefill-0" if a.ranks[0].role is Role.PREFILL else "decode-0"
            lead = a.ranks[0].role is Role.DECODE or a.ranks[0].tp_rank == 0
            state = EngineState(name, a.ranks[0].role, 0, "Running", True, restarts=1) if lead else follower
            views.append(AgentView(agent_name("pd", a.unit, a.node), a.node, True, True, engines={name: state}))
        return compute_status(Observed(1, spec, placement, views, namespace="ns"), "pd")

    sick = EngineState("prefill-0", Role.PREFILL, 0, "BackOff", False, restarts=3, last_exit="exit code 1")
    (entry,) = status(sick)["endpoints"]["prefill"]
    assert (entry["ready"], entry["phase"], entry["restarts"], entry["lastExit"]) == (
        False,
        "BackOff",
        4,
        "exit code 1",
    )
    assert status(sick)["prefillEnginesReady"] == "0/1"
    well = EngineState("prefill-0", Role.PREFILL, 0, "Running", True)
    (entry,) = status(well)["endpoints"]["prefill"]
    assert (entry["ready"], entry["phase"], entry["restarts"]) == (True, "Running", 1)


def test_a_group_restarts_whole_when_a_member_goes_or_is_replaced() -> None:
    from pdfabric_operator.group_restarts import MemberPod, group_members, group_restarts

    spec = pdcluster().prefill(tp=2, nodesPerReplica=2).engine(prefill={"args": GROUP_ARGS}).spec()
    placement = plan_placement(spec, [gpu_node(n, 2) for n in ("a", "b")], [], cluster_uid="u")
    assert isinstance(placement, Placement)
    members = group_members("pd", spec, placement)
    assert list(members) == ["prefill-0"] and len(members["prefill-0"]) == 2  # decode-0 is one node
    lead, follower = sorted(members["prefill-0"])
    pods = {lead: MemberPod("u1", engine_restarts=0)}
    assert not group_restarts(members, pods).record  # still forming: nothing recorded
    pods[follower] = MemberPod("u2")  # its agent has not answered yet: no engine restart so far
    decided = group_restarts(members, pods)
    assert not decided.delete and decided.record == {lead: "u1=0/0,u2=0/0", follower: "u1=0/0,u2=0/0"}
    pods = {n: dataclasses.replace(p, incarnation=decided.record[n]) for n, p in pods.items()}
    assert group_restarts(members, pods) == GroupActions()  # recorded: nothing more to do
    # The follower was killed: the leader goes too, while the follower is gone and once it is back.
    assert list(group_restarts(members, {lead: pods[lead]}).delete) == [lead]
    back = {lead: pods[lead], follower: MemberPod("u3", engine_restarts=0)}
    assert list(group_restarts(members, back).delete) == [lead]
    # Both anew: the new incarnation is recorded on both, nothing is deleted.
    fresh = {lead: MemberPod("u4", engine_restarts=0), follower: back[follower]}
    assert group_restarts(members, fresh).record == {lead: "u3=0/0,u4=0/0", follower: "u3=0/0,u4=0/0"}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"engine_restarts": 4}, "the engine in pod"),  # its agent restarted a crashed engine
        ({"container_restarts": 1}, "a container of pod"),  # the kubelet restarted the agent's container
    ],
)
def test_a_group_restarts_whole_when_an_engine_or_container_of_a_member_restarts(
    change: dict[str, int], why: str
) -> None:
    from pdfabric_operator.group_restarts import MemberPod, group_restarts

    members = {"prefill-0": ["pd-prefill-0-a", "pd-prefill-0-b"]}
    word = "u1=0/0,u2=3/0"
    pods = {"pd-prefill-0-a": MemberPod("u1", word, 0), "pd-prefill-0-b": MemberPod("u2", word, 3)}
    assert group_restarts(members, pods) == GroupActions()
    # An agent that did not answer this time says nothing about its engines: no restart read into it.
    quiet = {**pods, "pd-prefill-0-b": MemberPod("u2", word, None)}
    assert group_restarts(members, quiet) == GroupActions()
    crashed = {**pods, "pd-prefill-0-b": dataclasses.replace(pods["pd-prefill-0-b"], **change)}
    decided = group_restarts(members, crashed)
    assert sorted(decided.delete) == sorted(members["prefill-0"]) and not decided.record  # every node rank
    assert all(why in w and "prefill-0" in w for w in decided.delete.values()), decided.delete


def test_a_group_incarnation_written_over_is_read_as_none() -> None:
    from pdfabric_operator.group_restarts import Counts, incarnation_word, parse_incarnation

    word = incarnation_word({"b": Counts(1, 0), "a": Counts(0, 2)})
    assert word == "a=0/2,b=1/0" and parse_incarnation(word) == {"a": Counts(0, 2), "b": Counts(1, 0)}
    for bad in ("", "a", "a=1", "a=x/0", "a=0/0,", "=0/0"):
        assert parse_incarnation(bad) is None, bad


def test_fabric_only_groups_have_no_members_to_restart() -> None:
    from pdfabric_operator.group_restarts import group_members

    fabric_only = pdcluster().prefill(tp=2, nodesPerReplica=2).spec()  # engines run by someone else
    placement = plan_placement(fabric_only, [gpu_node(n, 2) for n in "ab"], [], cluster_uid="u")
    assert isinstance(placement, Placement)
    assert group_members("pd", fabric_only, placement) == {}


def test_the_two_node_deepseek_example_places_each_group_on_two_rdma_nodes() -> None:
    import yaml

    from pdfabric_core.spec import parse_spec

    doc = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "examples" / "pdcluster-deepseek-two-nodes.yaml").read_text()
    )
    spec = parse_spec(doc["spec"])  # the CRD's defaults are the dataclasses' (test_spec holds them equal)
    nodes = [gpu_node(f"n{i}", 8, rdma=1) for i in range(8)]
    placement = plan_placement(spec, nodes, [], cluster_uid="u")
    assert isinstance(placement, Placement)
    layout = _layout(placement)
    assert sorted(layout) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert all(len(blocks) == 2 and all(len(r) == 8 for r in blocks.values()) for blocks in layout.values())
    # Seven nodes cannot hold four groups of two: nothing is placed, and the reason names a group.
    failure = plan_placement(spec, nodes[:7], [], cluster_uid="u")
    assert isinstance(failure, PlacementFailure) and "spans 2 nodes with 8 free GPUs each" in failure.message


def test_a_group_the_scheduler_cannot_bind_whole_is_released_with_a_doubling_hold() -> None:
    from datetime import UTC, datetime, timedelta

    from pdfabric_operator.group_restarts import GroupHolds, Unbound, held_pods, release_stalled

    members = {"prefill-0": ["pd-prefill-0-a", "pd-prefill-0-b"], "prefill-1": ["pd-prefill-1-c", "pd-prefill-1-d"]}
    present = [n for names in members.values() for n in names]
    t0 = datetime(2026, 12, 7, tzinfo=UTC)
    refused = {"pd-prefill-0-b": Unbound(t0, "0/3 nodes are available: 1 Insufficient memory.")}
    holds = GroupHolds()

    def at(seconds: float, unbound: dict[str, Unbound] = refused) -> dict[str, str]:
        return release_stalled(holds, members, present, unbound, t0 + timedelta(seconds=seconds), 60)

    assert at(59) == {}  # the scheduler may still bind it (a pod on its node terminating, say)
    (why,) = at(60).values()
    assert "pd-prefill-0-b not scheduled for 60 s: 0/3 nodes are available: 1 Insufficient memory." in why
    assert "created again in 60 s" in why
    held = held_pods(holds, members, t0 + timedelta(seconds=90))
    assert sorted(held) == members["prefill-0"] and "created again in 30 s" in held["pd-prefill-0-a"]
    assert at(100) == {}  # held: nothing more happens to it until the hold ends
    # Created again at 120 s, refused again: the second release holds twice as long.
    again = {"pd-prefill-0-b": Unbound(t0 + timedelta(seconds=121), "0/3 nodes are available")}
    assert at(150, again) == {}
    assert "created again in 120 s" in at(181, again)["prefill-0"]
    assert held_pods(holds, members, t0 + timedelta(seconds=301)) == {}  # the hold ended
    # Bound whole at last: the count starts over, so a later release holds the timeout again.
    assert at(302, {}) == {} and holds.releases == {}
    assert (
        "created again in 60 s" in at(400, {"pd-prefill-0-a": Unbound(t0 + timedelta(seconds=330), "x")})["prefill-0"]
    )
    # The hold never grows past an hour.
    holds.releases["prefill-1"] = 20
    late = {"pd-prefill-1-c": Unbound(t0, "x")}
    assert (
        "created again in 3600 s"
        in release_stalled(holds, members, present, late, t0 + timedelta(days=1), 60)["prefill-1"]
    )
    # A group scaled away leaves no hold behind.
    release_stalled(holds, {}, [], {}, t0 + timedelta(days=1), 60)
    assert holds.until == {} and holds.releases == {}


def test_a_group_stays_within_one_value_of_the_topology_key() -> None:
    spec = (
        pdcluster()
        .transport("rdma")
        .prefill(tp=4, nodesPerReplica=2)
        .decode(tp=1)
        .placement(groupTopologyKey="example.com/rail")
        .spec()
    )
    rail = {"a": "r1", "b": "r2", "c": "r2", "d": "r1"}
    # Without the key the tightest two nodes for the group's blocks of 2 GPUs are a and b, on two
    # rails; within one rail the tightest pair is b and c (6 GPUs free against a and d's 10).
    gpus = {"a": 2, "b": 2, "c": 4, "d": 8}
    nodes = [gpu_node(n, gpus[n], rdma=2, labels={"example.com/rail": rail[n]}) for n in "abcd"]
    result = plan_placement(spec, nodes, [], cluster_uid="u")
    assert isinstance(result, Placement)
    layout = _layout(result)
    assert sorted(layout["prefill-0"]) == ["b", "c"], layout
    # Without the key, the best fit crosses rails.
    plain = dataclasses.replace(spec, placement=dataclasses.replace(spec.placement, group_topology_key=""))
    free_rails = plan_placement(plain, nodes, [], cluster_uid="u")
    assert isinstance(free_rails, Placement)
    assert {rail[n] for n in _layout(free_rails)["prefill-0"]} == {"r1", "r2"}


def test_a_group_that_no_single_topology_value_can_hold_is_refused_naming_the_key() -> None:
    spec = (
        pdcluster().prefill(tp=2, nodesPerReplica=2).decode(tp=1).placement(groupTopologyKey="example.com/rack").spec()
    )
    # Two racks of one node each, and a node without the label: no rack holds two nodes.
    nodes = [
        gpu_node("a", 2, labels={"example.com/rack": "k1"}),
        gpu_node("b", 2, labels={"example.com/rack": "k2"}),
        gpu_node("c", 2),
    ]
    result = plan_placement(spec, nodes, [], cluster_uid="u")
    assert isinstance(result, PlacementFailure), result
    assert result.reason is PlacementReason.INSUFFICIENT_GPUS
    assert "one value of node label example.com/rack (placement.groupTopologyKey)" in result.message
    assert "2 value(s) in all" in result.message and "offers 1 such node(s)" in result.message


def test_a_running_group_moves_whole_when_a_node_leaves_its_topology_value() -> None:
    spec = (
        pdcluster().prefill(tp=2, nodesPerReplica=2).decode(tp=1).placement(groupTopologyKey="example.com/rack").spec()
    )
    racks = {"a": "k1", "b": "k1", "c": "k2", "d": "k2"}
    nodes = [gpu_node(n, 2, labels={"example.com/rack": racks[n]}) for n in "abcd"]
    first = plan_placement(spec, nodes, [], cluster_uid="u")
    assert isinstance(first, Placement)
    before = _layout(first)["prefill-0"]
    previous = first.ranks_by_node()
    again = plan_placement(spec, nodes, [], cluster_uid="u", previous=previous)
    assert isinstance(again, Placement) and _layout(again)["prefill-0"] == before  # sticky
    # One of its nodes is moved to the other rack: the group cannot stay split, it moves whole.
    moved_node = sorted(before)[1]
    other = "k2" if racks[moved_node] == "k1" else "k1"
    relabelled = [
        gpu_node(n.name, 2, labels={"example.com/rack": other if n.name == moved_node else racks[n.name]})
        for n in nodes
    ]
    moved = plan_placement(spec, relabelled, [], cluster_uid="u", previous=previous)
    assert isinstance(moved, Placement)
    now = _layout(moved)["prefill-0"]
    assert len({dict((n.name, n.labels["example.com/rack"]) for n in relabelled)[x] for x in now}) == 1, now
