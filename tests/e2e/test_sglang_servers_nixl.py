"""SGLang's own servers run PD over pdfabric on NIXL: the server cases of ``test_sglang_servers``
with the PDCluster's ``backend: nixl`` (the agents move the KV with NIXL over UCX's tcp transport,
``pdfabric-nixl``), and SGLang's own NIXL backend through the same cases as the control (``nixl``;
on this CPU machine its KV is registered as host memory, ``hack/controls_cpu/sitecustomize.py``).

A module of its own so that `make test` can run it beside ``test_sglang_servers`` on another
worker (a module is one unit of work, tests/parallel.py). The cases are that module's
(``sglang_server_cases``), collected here with this module's ``pd`` fixture; those that exercise the engine's side alone (a prefill
server killed, SGLang's aborts) run on the Mooncake-mover backends there, and are left out here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfabric_sglangserver.pd import PD, behind_router, pair_started_here
from tests.e2e import sglang_server_cases as cases

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

BACKENDS = ["nixl", "pdfabric-nixl"]

# The cases, in that module's order (a killed server is recovered before the next case).
test_pd_answers_equal_a_single_server_token_for_token = cases.test_pd_answers_equal_a_single_server_token_for_token
test_pd_16_concurrent_requests_equal_a_single_server = cases.test_pd_16_concurrent_requests_equal_a_single_server
test_pd_moves_kv_through_the_agents = cases.test_pd_moves_kv_through_the_agents
test_decode_radix_prefix_moves_only_the_pages_after_it = cases.test_decode_radix_prefix_moves_only_the_pages_after_it
test_decode_server_killed_mid_traffic_fails_its_requests_then_serves_after_restart = (
    cases.test_decode_server_killed_mid_traffic_fails_its_requests_then_serves_after_restart
)
test_prefill_agent_killed_fails_requests_then_restarted_agent_serves = (
    cases.test_prefill_agent_killed_fails_requests_then_restarted_agent_serves
)


@pytest.fixture(scope="module", params=BACKENDS)
def pd(
    request: pytest.FixtureRequest, model_dir: Path, installed_site: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PD]:
    """A prefill and a decode SGLang server over ``request.param``, and SGLang's router."""
    backend: str = request.param
    logs = tmp_path_factory.mktemp(f"pd-{backend}")
    with behind_router(backend, pair_started_here(backend, model_dir, installed_site, logs), logs) as pd:
        yield pd


def test_the_agents_moved_the_kv_with_nixl(pd: PD) -> None:
    """The PDCluster's backend is what moved the bytes: the decode agent counted the KV of the
    module's requests on NIXL's path over tcp, and none on any other."""
    if pd.fabric is None:
        pytest.skip("SGLang's own NIXL backend has no node agent")
    moved = pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv")
    on_nixl = pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv", path="nixl-ucx-tcp")
    assert moved > 0 and on_nixl == moved, (moved, on_nixl)
