"""Blacklist and probe backoff on a fake clock (upstream: 30 s doubling up to 300 s)."""

from __future__ import annotations

import pytest

from pdfabric_agent.peers.health import PeerHealth


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failed_probes_double_the_delay_up_to_the_cap() -> None:
    clock = Clock()
    health = PeerHealth(30, 300, clock)
    health.fail("agent-d0", "batch write returned -1")
    delays = []
    for _ in range(6):
        clock.now += health.next_delay("agent-d0") or 0
        assert health.due() == ["agent-d0"]
        assert health.probe_result("agent-d0", ok=False) is False
        delays.append(health.next_delay("agent-d0"))
    assert delays == [60, 120, 240, 300, 300, 300]


def test_probe_is_not_due_before_its_time() -> None:
    clock = Clock()
    health = PeerHealth(30, 300, clock)
    health.fail("agent-d0", "x")
    clock.now += 29.9
    assert health.due() == []
    clock.now += 0.1
    assert health.due() == ["agent-d0"]


def test_successful_probe_readmits() -> None:
    clock = Clock()
    health = PeerHealth(30, 300, clock)
    health.fail("agent-d0", "x")
    clock.now += 30
    assert health.probe_result("agent-d0", ok=True) is True
    assert not health.is_blacklisted("agent-d0")
    assert health.blacklisted == []


def test_second_failure_keeps_the_backoff() -> None:
    clock = Clock()
    health = PeerHealth(30, 300, clock)
    health.fail("agent-d0", "first")
    clock.now += 30
    health.probe_result("agent-d0", ok=False)
    health.fail("agent-d0", "second")
    assert (health.next_delay("agent-d0"), health.reason("agent-d0")) == (60, "first")


def test_probe_result_for_a_healthy_peer_is_ignored() -> None:
    assert PeerHealth(1, 2, Clock()).probe_result("agent-x", ok=True) is False


@pytest.mark.parametrize(("initial", "maximum"), [(0, 10), (10, 5)], ids=["zero-initial", "max-below-initial"])
def test_bad_backoff_is_rejected(initial: float, maximum: float) -> None:
    with pytest.raises(ValueError):
        PeerHealth(initial, maximum, Clock())


def test_a_peer_blacklisted_for_silence_is_readmitted_when_heard_from() -> None:
    health = PeerHealth(30, 300, Clock())
    health.fail("agent-d0", "missed 2 heartbeats", silent=True)
    assert health.heard_from("agent-d0") and not health.is_blacklisted("agent-d0")
    assert not health.heard_from("agent-d0")  # nothing to re-admit
    health.fail("agent-d0", "missed 2 heartbeats", silent=True)
    health.fail("agent-d0", "batch write returned -1")  # a transfer failed too: not only silence
    assert not health.heard_from("agent-d0") and health.is_blacklisted("agent-d0")
