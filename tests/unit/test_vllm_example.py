"""examples/vllm's PDCluster (the one `make demo` applies and tests/e2e/test_vllm_pdcluster.py runs
under the operator) runs the servers the vLLM tests run: the same flags and CPU environment,
pdfabric's connector for each role, a spec.model equal to the fabric's in those tests, and vLLM's
router."""

from __future__ import annotations

from pathlib import Path

from pdfabric_core.spec import RouterKind, parse_spec
from pdfabric_sglangserver.model import spec_model
from pdfabric_vllmserver.pd import ONE_RANK, example_pdcluster
from pdfabric_vllmserver.servers import BLOCK_SIZE, CPU_ENV, MODEL, pdfabric_kv_config, server_argv


def test_the_example_runs_the_servers_the_tests_run(tmp_path: Path) -> None:
    doc = example_pdcluster(tmp_path)
    spec = doc["spec"]
    parsed = parse_spec(spec)  # the operator's and agents' reading of it
    assert spec["model"] == spec_model(BLOCK_SIZE, MODEL) == ONE_RANK.fabric_spec()["model"]
    for role in ("prefill", "decode"):
        engine = spec["engine"][role]
        argv = server_argv("python", tmp_path, "$(PDFABRIC_PORT)", pdfabric_kv_config(role))
        assert [*engine["command"], *engine["args"]] == argv
        assert {e["name"]: e["value"] for e in engine["env"]} == CPU_ENV
    assert parsed.router is not None and parsed.router.kind == RouterKind.VLLM
    assert parsed.router.launch_command == ("vllm-router",)
    assert "${" not in str(doc)  # every placeholder filled
