"""spec.transfer.verify through real agents: every room is checksummed on both sides (TP mismatch
head slices, CP all-ranks shards, aux over the TCP side channel), arrives byte-exact, and each
source's comparison is counted as a match."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.transfer import transfer_room
from tests.builders import SMALL_MODEL

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.parametrize(
    ("prefill", "decode", "aux_over_tcp"),
    [({"tp": 2}, {"tp": 4}, False), ({"tp": 1, "cp": 2, "allCpRanksTransfer": True}, {"tp": 1}, True)],
    ids=["head-slices", "cp2-all-ranks-aux-tcp"],
)
def test_verified_rooms_arrive_exact_and_every_source_matches(
    prefill: dict[str, Any], decode: dict[str, Any], aux_over_tcp: bool, backend: str
) -> None:
    raw = {
        "backend": backend,
        "prefill": prefill,
        "decode": decode,
        "transfer": {"transport": "tcp", "verify": True, "auxOverTcp": aux_over_tcp},
        "model": SMALL_MODEL,
    }
    with LocalFabric(raw) as lc:
        for room in (1, 2):
            result = transfer_room(lc, room, pages=6, state_slots=1)
            assert all(not errors for errors in result.errors.values()), result.errors
        sources = sum(len(view.senders) for view in result.decode.values())
        assert lc.metric_sum("pdfabric_integrity_checks_total", result="match") == 2 * sources
        assert lc.metric_sum("pdfabric_integrity_checks_total", result="mismatch") == 0
        assert lc.metric_sum("pdfabric_integrity_seconds_count", role="prefill") == 2 * sources
