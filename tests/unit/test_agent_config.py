"""PDFABRIC_* settings: required ones named when missing, bad values refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdfabric_agent.runtime import config
from pdfabric_agent.runtime.config import SETTINGS, ConfigError, load_config, require_peer_tls, settings_markdown
from pdfabric_devcluster.agents import write_tls_dir
from pdfabric_operator import pki


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(config, "own_address", lambda: None)
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    return {
        "NODE_NAME": "node-a",
        "PDFABRIC_RANKMAP": str(tmp_path / "rankmap.json"),
        "PDFABRIC_ENGINE_TOKEN_FILE": str(token),
    }


@pytest.fixture
def tls_dir(tmp_path: Path) -> Path:
    ca = pki.new_ca("ns", "c", "uid-1")
    leaf = pki.issue_agent(ca, namespace="ns", cluster="c", agent="a1", dns_name="a1.c-agents.ns.svc")
    return write_tls_dir(tmp_path / "tls", leaf, ca)


def test_defaults(env: dict[str, str]) -> None:
    cfg = load_config(env)
    assert (cfg.token, cfg.bind_address, cfg.api_port, cfg.metrics_port) == ("t" * 32, "0.0.0.0", None, None)
    assert (cfg.kv_pages, cfg.coalesce, cfg.bootstrap_timeout_s, cfg.probe_backoff_s, cfg.probe_backoff_max_s) == (
        256,
        True,
        300.0,
        30.0,
        300.0,
    )


def test_pod_ip_is_the_default_bind_and_engine_host(env: dict[str, str]) -> None:
    cfg = load_config({**env, "POD_IP": "10.1.2.3"})
    assert (cfg.bind_address, cfg.engine_host) == ("10.1.2.3", "10.1.2.3")


def test_without_pod_ip_the_hostname_address_is_used(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "own_address", lambda: "10.9.8.7")
    cfg = load_config(env)
    assert (cfg.bind_address, cfg.engine_host) == ("10.9.8.7", "10.9.8.7")


def test_explicit_addresses_win(env: dict[str, str]) -> None:
    cfg = load_config({**env, "POD_IP": "10.1.2.3", "PDFABRIC_BIND_ADDRESS": "127.0.0.1", "PDFABRIC_ENGINE_HOST": "h"})
    assert (cfg.bind_address, cfg.engine_host) == ("127.0.0.1", "h")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"NODE_NAME": ""}, "NODE_NAME is not set"),
        ({"PDFABRIC_RANKMAP": ""}, "PDFABRIC_RANKMAP is not set"),
        ({"PDFABRIC_ENGINE_TOKEN_FILE": ""}, "PDFABRIC_ENGINE_TOKEN_FILE is not set"),
        ({"PDFABRIC_ENGINE_TOKEN_FILE": "/nonexistent/token"}, "cannot be read"),
        ({"PDFABRIC_PEER_TLS_DIR": "/nonexistent"}, "PDFABRIC_PEER_TLS_DIR '/nonexistent': cannot load"),
        ({"PDFABRIC_PEER_PORT": "70000"}, "PDFABRIC_PEER_PORT must be a TCP port"),
        ({"PDFABRIC_API_PORT": "70000"}, "must be a TCP port"),
        ({"PDFABRIC_KV_PAGES": "0"}, "at least 1"),
        ({"PDFABRIC_KV_PAGES": "many"}, "must be an integer"),
        ({"PDFABRIC_BOOTSTRAP_TIMEOUT_S": "-1"}, "must be positive"),
        ({"PDFABRIC_PEERS": "[1]"}, "must map agent names"),
        ({"PDFABRIC_PEERS": "{"}, "not JSON"),
        ({"PDFABRIC_COALESCE": "yes"}, "0 or 1"),
        ({"PDFABRIC_PROBE_BACKOFF_S": "10", "PDFABRIC_PROBE_BACKOFF_MAX_S": "5"}, "at least PDFABRIC_PROBE_BACKOFF_S"),
        ({"PDFABRIC_SHM_DIR": "/nonexistent"}, "not a directory"),
    ],
    ids=[
        "no-node",
        "no-rankmap",
        "no-engine-token",
        "token-unreadable",
        "tls-dir-missing",
        "peer-port-too-big",
        "port-too-big",
        "zero-pages",
        "pages-not-int",
        "negative-timeout",
        "peers-not-object",
        "peers-not-json",
        "coalesce-not-bool",
        "backoff-max-below-initial",
        "shm-dir-missing",
    ],
)
def test_bad_settings_are_refused(env: dict[str, str], change: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({**env, **change})


def test_short_token_is_refused(env: dict[str, str]) -> None:
    Path(env["PDFABRIC_ENGINE_TOKEN_FILE"]).write_text("short")
    with pytest.raises(ConfigError, match="shorter than 16"):
        load_config(env)


def test_peer_tls_dir_is_loaded_and_required_to_serve(env: dict[str, str], tls_dir: Path) -> None:
    with pytest.raises(ConfigError, match="PDFABRIC_PEER_TLS_DIR is not set"):
        require_peer_tls(load_config(env))
    cfg = load_config({**env, "PDFABRIC_PEER_TLS_DIR": str(tls_dir), "PDFABRIC_PEER_PORT": "7411"})
    require_peer_tls(cfg)
    assert (cfg.peer_tls_dir, cfg.peer_port) == (str(tls_dir), 7411)


def test_a_key_that_is_not_the_certificates_is_refused(env: dict[str, str], tls_dir: Path) -> None:
    other = pki.issue_agent(pki.new_ca("ns", "c", "u"), namespace="ns", cluster="c", agent="a1", dns_name="x")
    (tls_dir / "tls.key").chmod(0o600)
    (tls_dir / "tls.key").write_bytes(other.key_pem)
    with pytest.raises(ConfigError, match="cannot load the peer certificate"):
        load_config({**env, "PDFABRIC_PEER_TLS_DIR": str(tls_dir)})


def test_every_setting_is_documented_in_agent_md() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "agent.md").read_text()
    assert settings_markdown() in doc
    assert all(f"`{name}`" in doc for name in SETTINGS)


def test_engines_and_their_settings_are_read_and_checked(env: dict[str, str]) -> None:
    from pdfabric_core.engines.launch import EngineLaunch, encode_launches, expand
    from pdfabric_core.policy.types import Role

    x = EngineLaunch("decode-0", Role.DECODE, 0, ("decode-0-tp0",), (0,), ("sglang", "--port=$(PDFABRIC_PORT)"),
                     (), 30000, None, "/health", 600, 1, 1, 1, None)  # fmt: skip
    text = expand(encode_launches([x]), {})  # as the kubelet hands it to the process
    cfg = load_config({**env, "PDFABRIC_ENGINES": text, "PDFABRIC_ENGINE_GRACE_S": "5"})
    assert cfg.engines == (x,) and cfg.engine_grace_s == 5.0 and cfg.token_file == env["PDFABRIC_ENGINE_TOKEN_FILE"]
    assert (cfg.engine_probe_s, cfg.engine_liveness_s, cfg.engine_backoff_s, cfg.engine_backoff_max_s) == (
        2.0, 60.0, 10.0, 300.0,
    )  # fmt: skip
    assert load_config(env).engines == ()
    with pytest.raises(ConfigError, match=r"PDFABRIC_ENGINES\[0\]\.port must be"):
        load_config({**env, "PDFABRIC_ENGINES": text.replace('"port":30000', '"port":0')})
    with pytest.raises(ConfigError, match="PDFABRIC_ENGINES is not JSON"):
        load_config({**env, "PDFABRIC_ENGINES": "[{"})
    with pytest.raises(ConfigError, match="PDFABRIC_ENGINE_PROBE_S must be a number"):
        load_config({**env, "PDFABRIC_ENGINE_PROBE_S": "soon"})
    with pytest.raises(ConfigError, match="PDFABRIC_ENGINE_BACKOFF_MAX_S must be at least"):
        load_config({**env, "PDFABRIC_ENGINE_BACKOFF_S": "20", "PDFABRIC_ENGINE_BACKOFF_MAX_S": "10"})
