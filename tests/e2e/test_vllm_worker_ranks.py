"""vLLM's connector worker side in three processes of its own (prefill TP 1 -> decode TP 2) against
real agents, its KV cache in shared memory as the connector makes vLLM allocate it on CPU: one
room lands byte-exact, each decode rank its head's K and V (tests/e2e/vllm_worker_ranks.py; the
same on a GPU: tests/gpu/test_vllm_connector_gpu.py)."""

from __future__ import annotations

import pytest

from pdfabric_devcluster.fabric import LocalFabric
from tests.e2e.vllm_worker_ranks import move_a_room, spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_worker_ranks_move_a_room_of_vllms_cpu_cache_byte_exact() -> None:
    with LocalFabric(spec()) as fabric:
        report = move_a_room(fabric, "cpu")
    assert report["byte_exact"]
