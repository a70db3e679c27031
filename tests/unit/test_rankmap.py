"""Rank enumeration and the rank's role vocabulary."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank, replica_ranks
from tests.builders import pdcluster


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
    with pytest.raises(ValueError, match="rank role must be prefill or decode"):
        Rank.from_dict({"role": "encode", "replica": 0, "tpRank": 0})


@given(
    st.sampled_from(["prefill", "decode"]),
    st.integers(0, 99),
    st.integers(0, 63),
    st.integers(0, 15),
    st.integers(0, 7),
)
def test_a_rank_id_names_its_rank_back(role: str, replica: int, tp: int, cp: int, pp: int) -> None:
    rank = Rank(role, replica, tp, cp if role == "prefill" else 0, pp)
    assert Rank.from_id(rank.rank_id) == rank
    assert Rank.from_id(rank.rank_id, gpu=3).gpu == 3


@pytest.mark.parametrize(
    "bad", ["", "prefill", "prefill-x-tp0-cp0", "router-0-tp0", "decode-0-tp0-cp0", "decode-0-tp0-zz1", "decode-0-tp01"]
)
def test_what_names_no_rank_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a pdfabric rank id"):
        Rank.from_id(bad)
