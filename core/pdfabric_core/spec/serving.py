"""The spec's sections for what runs in the operator's pods besides the agent: the serving engines
(spec.engine), an engine's PD router (spec.router), and what users add to the pods (PodOverrides).
Frozen dataclasses with the CRD's defaults, as in model.py (which holds the spec as a whole)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PodOverrides:
    """What users add to the pods the operator builds (agent.pod: the node pods; router.pod: the
    router's): Kubernetes objects as written, merged with the operator's (docs/pods.md)."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    priority_class_name: str = ""
    service_account_name: str = ""
    image_pull_secrets: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class EngineRoleSpec:
    """The engines of one role: the process the agent runs per replica of the role on a node, with
    its ranks' GPUs (docs/engines.md)."""

    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()  # Kubernetes EnvVar objects, as written
    resources: Mapping[str, Any] = field(default_factory=dict)  # extra (CPU, memory); GPUs are the operator's
    port: int = 30000  # the first engine of the role in a pod; the k-th serves on port + k
    health_path: str = "/health"
    startup_seconds: int = 1800
    # A replica over several nodes: the leader's rendezvous port (SGLang's --dist-init-addr), + k.
    dist_init_port: int = 20000


@dataclass(frozen=True)
class PrefillEngineSpec(EngineRoleSpec):
    bootstrap_port: int = 8998  # SGLang's --disaggregation-bootstrap-port default, + k for the k-th


@dataclass(frozen=True)
class DecodeEngineSpec(EngineRoleSpec):
    port: int = 31000
    dist_init_port: int = 21000


class EngineSandbox(enum.StrEnum):
    """spec.engine.sandbox: whether the agent starts its engines in a Landlock sandbox that hides
    the peer credentials from them (pdfabric_agent.engines.sandbox)."""

    REQUIRED = "Required"  # no Landlock in the node's kernel: the engines are not started
    BEST_EFFORT = "BestEffort"  # no Landlock: started without it, and reported
    DISABLED = "Disabled"


@dataclass(frozen=True)
class EngineSpec:
    """spec.engine: the serving engines the agents run in the node pods (None: fabric-only)."""

    image: str
    prefill: PrefillEngineSpec = PrefillEngineSpec()
    decode: DecodeEngineSpec = DecodeEngineSpec()
    shared_memory: str = ""  # sizeLimit of the pod's /dev/shm; "": unlimited
    sandbox: EngineSandbox = EngineSandbox.BEST_EFFORT

    def role(self, role: str) -> EngineRoleSpec:
        return self.prefill if role == "prefill" else self.decode

    def port_bases(self) -> dict[str, int]:
        """Every port range's first port, by field: the k-th engine of a role in a pod takes + k."""
        return {
            "engine.prefill.port": self.prefill.port,
            "engine.prefill.bootstrapPort": self.prefill.bootstrap_port,
            "engine.decode.port": self.decode.port,
            "engine.prefill.distInitPort": self.prefill.dist_init_port,
            "engine.decode.distInitPort": self.decode.dist_init_port,
        }


class RouterKind(enum.StrEnum):
    """spec.router.kind: whose PD router runs in front of the engines. Each pairs a prefill with a
    decode by its engine's own protocol (pdfabric_core.engines.router.router_worker_args)."""

    SGLANG = "sglang"  # sglang-router: decode asks the prefill's bootstrap server for the request
    VLLM = "vllm"  # vllm-router: prefill's answer carries kv_transfer_params, which decode gets


ROUTER_COMMANDS: Mapping[RouterKind, tuple[str, ...]] = {
    RouterKind.SGLANG: ("python3", "-m", "sglang_router.launch_router"),
    RouterKind.VLLM: ("vllm-router",),
}


@dataclass(frozen=True)
class RouterSpec:
    """spec.router: an engine's PD router (SGLang's or vLLM's), run by the operator as a Deployment
    in front of the engines, its workers the engines' endpoints."""

    image: str
    kind: RouterKind = RouterKind.SGLANG
    command: tuple[str, ...] = ()  # (): the kind's (ROUTER_COMMANDS)
    args: tuple[str, ...] = ()  # after the workers and the listen address, e.g. --policy cache_aware
    port: int = 8000
    metrics_port: int = 29000  # sglang-router's --prometheus-port (its own default)
    replicas: int = 1
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    pod: PodOverrides = PodOverrides()  # parsed by _parse_router

    @property
    def launch_command(self) -> tuple[str, ...]:
        return self.command or ROUTER_COMMANDS[self.kind]
