"""Rank enumeration and the rank's role vocabulary."""

from __future__ import annotations

import pytest

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
