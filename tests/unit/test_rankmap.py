"""Rank enumeration, the rank's role vocabulary, and the rank map's parser: any text at all gives a
RankMap or a RankMapError that says what is wrong (agents re-read the file while they serve)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank, RankMap, RankMapError, replica_ranks
from tests.builders import pdcluster
from tests.unit.rankmaps import MALFORMED, a_rankmap, with_value


@pytest.mark.parametrize(
    ("role", "expected"),
    [
        (
            Role.PREFILL,
            [
                "prefill-1-tp0-cp0",
                "prefill-1-tp1-cp0",
                "prefill-1-tp0-cp1",
                "prefill-1-tp1-cp1",
                "prefill-1-tp0-cp0-pp1",
                "prefill-1-tp1-cp0-pp1",
                "prefill-1-tp0-cp1-pp1",
                "prefill-1-tp1-cp1-pp1",
            ],
        ),
        (Role.DECODE, ["decode-1-tp0", "decode-1-tp1", "decode-1-tp0-pp1", "decode-1-tp1-pp1"]),
    ],
    ids=["prefill-pp-cp-tp-order", "decode-pp-tp-order"],
)
def test_replica_ranks_enumerates_pp_then_cp_then_tp(role: Role, expected: list[str]) -> None:
    spec = pdcluster().prefill(replicas=2, tp=2, cp=2, pp=2).decode(replicas=2, tp=2, pp=2).spec()
    ranks = replica_ranks(spec, role, 1, gpu=3)
    assert [r.rank_id for r in ranks] == expected
    assert {r.gpu for r in ranks} == {3}


def test_rank_role_is_the_enum_and_equals_its_string() -> None:
    rank = Rank("decode", 0, 1)
    assert rank.role is Role.DECODE
    assert rank == Rank(Role.DECODE, 0, 1)
    assert Rank.from_dict(rank.to_dict()) == rank
    assert rank.to_dict()["role"] == "decode"


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("rank.role must be prefill or decode")):
        Rank.from_dict({"role": "encode", "replica": 0, "tpRank": 0})


@given(
    st.sampled_from(["prefill", "decode"]),
    st.integers(0, 99),
    st.integers(0, 63),
    st.integers(0, 15),
    st.integers(0, 7),
    st.integers(0, 7),
)
def test_a_rank_id_names_its_rank_back(role: str, replica: int, tp: int, cp: int, pp: int, dp: int) -> None:
    rank = Rank(role, replica, tp, cp if role == "prefill" else 0, pp, dp_rank=dp)
    assert Rank.from_id(rank.rank_id) == rank
    assert Rank.from_id(rank.rank_id, gpu=3).gpu == 3
    assert Rank.from_dict(rank.to_dict()) == rank


def test_dp_groups_are_ranks_of_their_own_and_group_0_keeps_the_ids_without_dp() -> None:
    """SGLang's DP groups of one server (attention DP, or --dp-size): each group's attention TP
    ranks are distinct ranks (before, every group's TP 0 was one id, and the last registration
    took the others' rooms). Group 0's ids, and its rank map entries, are those of a spec without DP."""
    spec = pdcluster().prefill(tp=1, dp=2).decode(tp=2, dp=2).spec()
    assert [r.rank_id for r in replica_ranks(spec, Role.DECODE, 0)] == [
        "decode-0-tp0",
        "decode-0-tp1",
        "decode-0-dp1-tp0",
        "decode-0-dp1-tp1",
    ]
    assert [r.rank_id for r in replica_ranks(spec, Role.PREFILL, 1)] == ["prefill-1-tp0-cp0", "prefill-1-dp1-tp0-cp0"]
    assert spec.decode.ranks_per_replica == 4 and spec.prefill.ranks_per_replica == 2
    assert "dpRank" not in Rank(Role.DECODE, 0, 1).to_dict()


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "prefill",
        "prefill-x-tp0-cp0",
        "router-0-tp0",
        "decode-0-tp0-cp0",
        "decode-0-tp0-zz1",
        "decode-0-tp01",
        "decode-0-dp0-tp0",
        "decode-0-tp0-dp1",
    ],
)
def test_what_names_no_rank_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a pdfabric rank id"):
        Rank.from_id(bad)


def test_a_rankmap_reads_back_what_it_wrote() -> None:
    rm = a_rankmap()
    assert RankMap.from_json(rm.to_json()) == rm


@pytest.mark.parametrize(("text", "says"), MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_rankmap_is_a_rankmap_error_that_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(RankMapError, match=re.escape(says)):
        RankMap.from_json(text)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _paths(doc: Any, at: list[Any]) -> list[list[Any]]:
    found = [at] if at else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            found += _paths(v, [*at, k])
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += _paths(v, [*at, i])
    return found


VALID_PATHS = _paths(json.loads(a_rankmap().to_json()), [])


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID_PATHS), JSON)
def test_any_value_anywhere_in_a_rankmap_gives_a_rankmap_or_a_rankmap_error(path: list[Any], value: Any) -> None:
    try:
        rm = RankMap.from_json(with_value(path, value))
    except RankMapError:
        return
    assert RankMap.from_json(rm.to_json()) == rm  # what parses is a map that writes itself back


@settings(max_examples=300, deadline=None)
@given(JSON | st.text(max_size=64))
def test_any_json_or_text_gives_a_rankmap_error(doc: Any) -> None:
    with pytest.raises(RankMapError):
        RankMap.from_json(doc if isinstance(doc, str) else json.dumps(doc))
