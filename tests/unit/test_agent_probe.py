"""The link check's pure parts: a peer's description is clamped to the probe size and must be
well formed; the verdict names the slowest pair first."""

from __future__ import annotations

import pytest

from pdfabric_agent.node.probe import PROBE_BYTES, LinkCheck, Region, Result, parse_regions


def test_a_peers_region_is_clamped_and_checked() -> None:
    got = parse_regions({"ranks": {"decode-0-tp0": {"endpoint": "h:1", "addr": 4096, "size": 1 << 40}}})
    assert got == {"decode-0-tp0": Region("h:1", 4096, PROBE_BYTES)}  # a peer cannot make us write more
    for bad in ({}, {"ranks": []}, {"ranks": {"r": {"endpoint": "h:1", "addr": "0", "size": 1}}}):
        with pytest.raises(ValueError):
            parse_regions(bad)


def test_verdict_names_the_slowest_peer_first() -> None:
    check = LinkCheck.__new__(LinkCheck)
    check.threshold = 5.0
    check.results = {
        ("p0", "d0"): Result("p0", "d0", 7.0, 0.001),
        ("p0", "d1"): Result("p0", "d1", 2.0, 0.001),
        ("p1", "d1"): Result("p1", "d1", 0.0, None, "ClientError: refused"),
    }
    assert [r.peer for r in check.slow()] == ["d1", "d1"]
    assert check.verdict() == (
        "link check below transfer.minProbeGBps 5: rank p1 -> peer d1: probe failed (ClientError: refused); "
        "rank p0 -> peer d1: 2 GB/s"
    )
    check.threshold = 0.0
    assert check.slow() == []
