"""The image names agree everywhere without building anything: what `make images` produces
(hack/images.sh refs), the chart's default operator image, the PDCluster's default agent image
(CRD and spec model), and the OCI version label the build is given."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import yaml

from pdfabric_core import images
from pdfabric_core.spec import AgentSpec, PDClusterSpec

ROOT = Path(__file__).resolve().parents[2]


def refs(*targets: str) -> list[str]:
    out = subprocess.run(
        ["bash", str(ROOT / "hack" / "images.sh"), "refs", *targets],
        capture_output=True, text=True, timeout=30, check=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT)},
    )  # fmt: skip
    return out.stdout.split()


def test_defaults_are_the_names_make_images_produces() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((ROOT / "charts" / "pdfabric" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "pdfabric" / "values.yaml").read_text())
    crd = yaml.safe_load((ROOT / "crds" / "pdcluster.yaml").read_text())
    agent_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["agent"]
    operator, agent, cuda = refs("operator", "agent", "agent-cuda13")
    assert chart["appVersion"] == version
    assert f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}" == operator
    # The agent image has no CRD default: the operator picks the CPU or the CUDA one by transport.
    assert "default" not in agent_schema["properties"]["image"] and AgentSpec().image == ""
    assert (agent, cuda) == (images.AGENT_IMAGE, images.AGENT_IMAGE_CUDA)
    assert PDClusterSpec().agent_image == agent
    assert cuda == f"{agent}-cuda13"
    assert refs() == [operator, agent], "make images builds the operator and the CPU agent by default"


def test_no_registry_host_in_the_build_files() -> None:
    # Image names stay short (the engine's or the user's registry configuration resolves them), and
    # package registries' addresses come from the host at build time, never from these files.
    for path in [*sorted((ROOT / "images").iterdir()), ROOT / "hack" / "images.sh"]:
        text = path.read_text()
        assert not re.search(r"https?://[A-Za-z]", text), path
        for base in re.findall(r"\bBASE=(\S+)", text):
            assert "." not in base.split("/")[0], (path, base)
