"""examples/sglang's PDCluster (the one `make demo` applies) runs the servers the SGLang tests run:
the same flags and environment, and a spec.model that matches SGLang's buffers for that model."""

from __future__ import annotations

from pathlib import Path

from pdfabric_core.spec import parse_spec
from pdfabric_sglangserver.model import spec_model_for_servers
from pdfabric_sglangserver.pd import example_pdcluster
from pdfabric_sglangserver.servers import CPU_ENV, PAGE_SIZE, STANDIN, server_args


def test_the_example_runs_the_servers_the_tests_run(tmp_path: Path) -> None:
    doc = example_pdcluster(tmp_path)
    spec = doc["spec"]
    parse_spec(spec)  # the operator's and agents' reading of it
    assert spec["model"] == spec_model_for_servers(PAGE_SIZE)
    for role in ("prefill", "decode"):
        engine = spec["engine"][role]
        want = server_args(
            tmp_path, "$(PDFABRIC_PORT)", mode=role, backend="pdfabric", bootstrap_port="$(PDFABRIC_BOOTSTRAP_PORT)"
        )
        assert engine["args"] == want
        env = {e["name"]: e["value"] for e in engine["env"]}
        assert env == {**CPU_ENV, "SGLANG_PLUGINS": "pdfabric", "PYTHONPATH": f"{STANDIN}:$(PYTHONPATH)"}
    assert "${" not in str(doc)  # every placeholder filled
