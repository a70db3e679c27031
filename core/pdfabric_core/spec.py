"""The PDCluster spec as typed, validated Python values.

The CRD (crds/pdcluster.yaml) is the API's single source: the API server applies its defaults and
rejects what its schema and CEL rules forbid. This module parses the (defaulted) spec for the
operator and the agent; its defaults equal the CRD's, which a unit test checks, so an object read
from an API server that skipped defaulting still means the same thing.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, is_dataclass, replace
from typing import Any, Union, get_args, get_origin, get_type_hints

from pdfabric_core.images import (
    AGENT_IMAGE_CUDA,
    CUDA_SUFFIX,
    default_agent_image,
    names_cpu_agent_image,
    needs_gpu_image,
)
from pdfabric_core.policy.chunking import DEFAULT_MAX_BATCH_ENTRIES
from pdfabric_core.policy.rank_mapping import all_cp_ranks_send, local_heads, validate_pp, validate_tp
from pdfabric_core.policy.transports import Locality, implied_transport, mem_pool_traits, transport_traits
from pdfabric_core.policy.types import AUTO_TRANSPORT, Backend, FallbackPolicy, MemPool, Transport
from pdfabric_core.quantity import QuantityError, parse_quantity

__all__ = [
    "DEFAULT_AUX_ROW_BYTES",
    "DTYPE_BYTES",
    "ENGINE_PORT_SPAN",
    "FORBIDDEN_ENGINE_ENV",
    "AgentSpec",
    "DecodeEngineSpec",
    "DecodeSpec",
    "EngineRoleSpec",
    "EngineSpec",
    "FallbackPolicy",
    "ModelGeometry",
    "PDClusterSpec",
    "PlacementSpec",
    "PodOverrides",
    "PrefillEngineSpec",
    "PrefillSpec",
    "SpecError",
    "TransferSpec",
    "crd_key",
    "field_default",
    "parse_spec",
    "validate_spec",
]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}

# Aux rows upstream MetadataBuffers hand from prefill to decode, in bytes per request row:
# output ids, cached tokens, logprob values/indices, top-logprobs, hidden states (bf16, 8192
# hidden), bootstrap room, checksum. Users override them per model.
DEFAULT_AUX_ROW_BYTES = (16, 8, 8, 8, 128, 16384, 8, 8)

# The k-th engine of a role in one pod serves on port + k (and prefill's bootstrap on
# bootstrapPort + k): each of the three port bases owns this many ports (the CRD's most GPUs per node).
ENGINE_PORT_SPAN = 64
# The device plugin's allocation is the only GPU grant: engines may not widen or narrow it.
FORBIDDEN_ENGINE_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")

# What a PDCluster's pod overrides (agent.pod, router.pod) may not touch: the operator's own
# labels and annotations (selectors, the pod index and kopf's bookkeeping read them), the volumes
# and paths the agent's contract mounts, and the Secrets the operator issues (a CA key mounted
# into a pod would let its processes mint agent certificates).
RESERVED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/managed-by", "app.kubernetes.io/component")
RESERVED_KEY_PREFIX = "pdfabric.dev/"
RESERVED_VOLUMES = ("rankmap", "engine-token", "peer-tls", "home", "dshm")
RESERVED_PATHS = ("/etc/pdfabric", "/var/lib/pdfabric", "/dev/shm")
RESERVED_SECRET_SUFFIXES = ("-peer-ca", "-peer-tls", "-engine-token")
# Set by the operator in the node pod's container (the downward API, the agent's settings).
RESERVED_NODE_ENV = ("NODE_NAME", "POD_NAME", "POD_NAMESPACE", "POD_IP", "HOME")

# Field metadata key: the stored value that means None (transfer.transport "auto").
_NONE_VALUE = "pdfabric.none_value"
# Field metadata key: a section parse_spec parses itself (spec.engine, optional and without defaults).
_OWN_PARSER = "pdfabric.own_parser"


class SpecError(ValueError):
    """A spec the operator or agent cannot honour; the message says what to change."""


@dataclass(frozen=True)
class PrefillSpec:
    replicas: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    all_cp_ranks_transfer: bool = False
    dsa_cache_layer_split: bool = False

    @property
    def ranks_per_replica(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def all_cp_ranks_send(self) -> bool:
        """Every CP rank sends its own share, not only CP rank 0 (rank_mapping.all_cp_ranks_send)."""
        return all_cp_ranks_send(
            all_cp_ranks_transfer=self.all_cp_ranks_transfer, dsa_cache_layer_split=self.dsa_cache_layer_split
        )


@dataclass(frozen=True)
class DecodeSpec:
    replicas: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def ranks_per_replica(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class TransferSpec:
    mem_pool: MemPool = MemPool.NONE
    # None (stored as "auto"): the one the pool implies
    transport: Transport | None = field(default=None, metadata={_NONE_VALUE: AUTO_TRANSPORT})
    aux_over_tcp: bool = False
    max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES
    # End-to-end checksums: decode is Success only when what arrived matches what was sent.
    verify: bool = False
    timeout_seconds: float = 30.0
    # Pre-flight link check: an agent stays not Ready while a peer it sends to probes below this
    # many GB/s (agent probe.py); 0 probes and reports without a threshold.
    min_probe_g_bps: float = 0.0  # CRD key minProbeGBps (crd_key)

    @property
    def effective_transport(self) -> Transport:
        return implied_transport(self.mem_pool, self.transport)


@dataclass(frozen=True)
class ModelGeometry:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    page_size_tokens: int = 16
    state_bytes_per_request: int = 0
    state_layers: int = 1
    aux_row_bytes: tuple[int, ...] = DEFAULT_AUX_ROW_BYTES
    # Prompt length the status uses to predict bytes per request; it sizes nothing.
    expected_prompt_tokens: int = 4096

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_page_bytes(self, tp: int) -> int:
        """Bytes of one page of one layer's K (or V) on one rank of a TP group."""
        return self.page_size_tokens * local_heads(tp, self.kv_heads) * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class PlacementSpec:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    nvlink_domain_key: str = "nvidia.com/gpu.clique"
    rdma_resource: str = "rdma/hca"
    gpu_resource: str = "nvidia.com/gpu"
    fallback: FallbackPolicy = FallbackPolicy.FAIL
    # GPUs one node offers at most; bounds what intra-node NVLink may ask of a single node.
    max_gpus_per_node: int = 8


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
class AgentSpec:
    # Left out (""): the image the transport needs, CPU or CUDA (PDClusterSpec.agent_image, images.py).
    image: str = ""
    metrics_port: int = 9400
    api_port: int = 7400
    peer_port: int = 7401
    resources: Mapping[str, Any] = field(default_factory=dict)
    run_as_user: int = 65532  # the node pods' user and group (0: root, for engine images that need it)
    pod: PodOverrides = PodOverrides()  # parsed by parse_spec (a section inside a section)


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


@dataclass(frozen=True)
class PrefillEngineSpec(EngineRoleSpec):
    bootstrap_port: int = 8998  # SGLang's --disaggregation-bootstrap-port default, + k for the k-th


@dataclass(frozen=True)
class DecodeEngineSpec(EngineRoleSpec):
    port: int = 31000


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


ROUTER_COMMAND = ("python3", "-m", "sglang_router.launch_router")


@dataclass(frozen=True)
class RouterSpec:
    """spec.router: SGLang's PD router, run by the operator as a Deployment in front of the
    engines, its workers the engines' endpoints (pdfabric_core.engines.sglang_router_args)."""

    image: str
    command: tuple[str, ...] = ROUTER_COMMAND
    args: tuple[str, ...] = ()  # after the workers and the listen address, e.g. --policy cache_aware
    port: int = 8000
    metrics_port: int = 29000  # sglang-router's --prometheus-port (its own default)
    replicas: int = 1
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    pod: PodOverrides = PodOverrides()  # parsed by _parse_router


@dataclass(frozen=True)
class PDClusterSpec:
    backend: Backend = Backend.MOONCAKE
    transfer: TransferSpec = TransferSpec()
    prefill: PrefillSpec = PrefillSpec()
    decode: DecodeSpec = DecodeSpec()
    model: ModelGeometry = ModelGeometry()
    placement: PlacementSpec = PlacementSpec()
    agent: AgentSpec = AgentSpec()
    # Optional: without it the PDCluster is fabric-only (engines deployed by something else).
    engine: EngineSpec | None = field(default=None, metadata={_OWN_PARSER: True})
    # Optional, with spec.engine: SGLang's router in front of the engines.
    router: RouterSpec | None = field(default=None, metadata={_OWN_PARSER: True})

    @property
    def agent_image(self) -> str:
        """The node pods' agent image: agent.image, or when left out the one the transport needs."""
        return self.agent.image or default_agent_image(self.transfer.effective_transport)

    @property
    def decode_per_prefill(self) -> int:
        """Decode replicas each prefill replica feeds when the transport pins them to its node."""
        return max(1, self.decode.replicas // max(1, self.prefill.replicas))

    @property
    def intra_node_group_gpus(self) -> int:
        """GPUs one prefill replica and the decode replicas it feeds take on one node."""
        return self.prefill.ranks_per_replica + self.decode_per_prefill * self.decode.ranks_per_replica

    def agent_setup(self) -> dict[str, Any]:
        """What a running agent set itself up from (engine, pools, ports): a change replaces its
        pod (the operator's config hash), while anything else, replica counts above all, a running
        agent takes from a newer rank map (live membership)."""
        return {
            "backend": self.backend.value,
            "transfer": asdict(self.transfer),
            "model": asdict(self.model),
            "ports": [self.agent.api_port, self.agent.peer_port, self.agent.metrics_port],
        }


def crd_key(name: str) -> str:
    """The CRD's (camelCase) key of a spec dataclass field: max_gpus_per_node -> maxGpusPerNode."""
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


def _convert(tp: Any, value: Any, where: str) -> Any:
    """`value` as stored (JSON) turned into the field type `tp`."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return _convert(inner, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in tp)
            raise ValueError(f"{where} must be one of {allowed}, got {value!r}") from None
    if origin is tuple:
        return tuple(_convert(get_args(tp)[0], x, where) for x in value)
    if origin is not None and issubclass(origin, Mapping):
        return dict(value)
    if tp in (bool, int, float, str):
        return tp(value)
    raise TypeError(f"{where}: no parser for field type {tp!r}")


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    """The resolved field types of `cls` (annotations are strings here), computed once."""
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _parse_fields(cls: type[Any], raw: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Keyword arguments for dataclass `cls` from its stored section: a field that is absent (or
    null) keeps the dataclass default, so the defaults live in the dataclasses alone."""
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for f in fields(cls):
        if is_dataclass(hints[f.name]) or _OWN_PARSER in f.metadata:
            continue
        value = raw.get(crd_key(f.name))
        if value is None:
            continue
        if _NONE_VALUE in f.metadata and value == f.metadata[_NONE_VALUE]:
            out[f.name] = None
            continue
        out[f.name] = _convert(hints[f.name], value, f"{prefix}{crd_key(f.name)}")
    return out


def field_default(f: Field[Any]) -> Any:
    """A dataclass field's default value (calling its default_factory)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise LookupError(f"field {f.name} has no default")


def parse_spec(raw: Mapping[str, Any]) -> PDClusterSpec:
    """Parse a PDCluster `.spec` (camelCase, as stored) and check the cross-field rules.

    Every field the spec leaves out takes its dataclass default (equal to the CRD's, which a unit
    test checks). Raises SpecError naming the field and what to change.
    """
    try:
        top = _parse_fields(PDClusterSpec, raw, "")
        hints = _hints(PDClusterSpec)
        for f in fields(PDClusterSpec):
            section = hints[f.name]
            if isinstance(section, type) and is_dataclass(section):
                top[f.name] = section(**_parse_fields(section, raw.get(crd_key(f.name)) or {}, f"{crd_key(f.name)}."))
        top["agent"] = replace(top["agent"], pod=_parse_pod((raw.get("agent") or {}).get("pod"), "agent.pod."))
        top["engine"] = _parse_engine(raw.get("engine"))
        top["router"] = _parse_router(raw.get("router"))
        spec = PDClusterSpec(**top)
    except (ValueError, TypeError) as exc:
        raise SpecError(f"invalid PDCluster spec: {exc}") from exc
    validate_spec(spec)
    return spec


def _parse_engine(raw: Any) -> EngineSpec | None:
    """spec.engine, or None when it is left out (the section has no defaults of its own)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"engine must be an object, got {raw!r}")
    if not raw.get("image"):
        raise ValueError("engine.image is required (the engine image)")
    for role in ("prefill", "decode"):
        if not isinstance(raw.get(role), Mapping):
            raise ValueError(f"engine.{role} is required (its command)")
    return EngineSpec(
        image=str(raw["image"]),
        prefill=PrefillEngineSpec(**_parse_fields(PrefillEngineSpec, raw["prefill"], "engine.prefill.")),
        decode=DecodeEngineSpec(**_parse_fields(DecodeEngineSpec, raw["decode"], "engine.decode.")),
        shared_memory="" if raw.get("sharedMemory") is None else str(raw["sharedMemory"]),
        sandbox=_parse_sandbox(raw.get("sandbox")),
    )


def _parse_sandbox(raw: Any) -> EngineSandbox:
    if raw is None:
        return EngineSandbox.BEST_EFFORT
    try:
        return EngineSandbox(raw)
    except ValueError:
        raise ValueError(f"engine.sandbox must be one of {', '.join(EngineSandbox)}, got {raw!r}") from None


def _parse_router(raw: Any) -> RouterSpec | None:
    """spec.router, or None when it is left out."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"router must be an object, got {raw!r}")
    if not raw.get("image"):
        raise ValueError("router.image is required (an image with SGLang's router, sglang-router)")
    return RouterSpec(
        image=str(raw["image"]),
        pod=_parse_pod(raw.get("pod"), "router.pod."),
        **_parse_fields(RouterSpec, {k: v for k, v in raw.items() if k != "image"}, "router."),
    )


def _parse_pod(raw: Any, prefix: str) -> PodOverrides:
    if raw is None:
        return PodOverrides()
    if not isinstance(raw, Mapping):
        raise ValueError(f"{prefix[:-1]} must be an object, got {raw!r}")
    return PodOverrides(**_parse_fields(PodOverrides, raw, prefix))


def validate_spec(spec: PDClusterSpec) -> None:
    """The cross-field rules, mirrored from the CRD's CEL so parsed specs are always sane."""
    if spec.backend not in tuple(Backend):
        raise SpecError(f"backend must be one of {', '.join(Backend)}, got {spec.backend!r}")
    if spec.model.dtype not in DTYPE_BYTES:
        raise SpecError(f"model.dtype must be one of {sorted(DTYPE_BYTES)}, got {spec.model.dtype!r}")
    for role, r in (("prefill", spec.prefill), ("decode", spec.decode)):
        if r.replicas < 1 or r.tp < 1 or r.cp < 1 or r.pp < 1:
            raise SpecError(f"{role}.replicas, tp, cp and pp must each be at least 1")
    if spec.decode.cp != 1:
        raise SpecError(f"decode.cp must be 1 (decode context parallelism is not supported), got {spec.decode.cp}")
    if spec.transfer.max_batch_entries < 1:
        raise SpecError("transfer.maxBatchEntries must be at least 1")
    if spec.transfer.timeout_seconds <= 0:
        raise SpecError("transfer.timeoutSeconds must be positive")
    if not 0 <= spec.transfer.min_probe_g_bps <= 10000:
        raise SpecError("transfer.minProbeGBps must be within 0..10000 (0: no threshold)")
    try:
        validate_tp(spec.prefill.tp, spec.model.kv_heads, role="prefill")
        validate_tp(spec.decode.tp, spec.model.kv_heads, role="decode")
        if spec.prefill.tp % spec.decode.tp and spec.decode.tp % spec.prefill.tp:
            raise ValueError(f"prefill TP {spec.prefill.tp} and decode TP {spec.decode.tp} must divide each other")
        validate_pp(spec.prefill.pp, spec.decode.pp)
    except ValueError as exc:
        raise SpecError(str(exc)) from exc
    if spec.model.state_bytes_per_request % spec.model.state_layers:
        raise SpecError(
            f"model.stateBytesPerRequest ({spec.model.state_bytes_per_request}) must be divisible by "
            f"model.stateLayers ({spec.model.state_layers}): each state layer has the same size; "
            f"change one of them"
        )
    if spec.prefill.dsa_cache_layer_split and spec.model.state_layers % spec.prefill.cp:
        raise SpecError(
            f"model.stateLayers ({spec.model.state_layers}) must be divisible by prefill.cp "
            f"({spec.prefill.cp}) when dsaCacheLayerSplit is on"
        )
    _validate_transport(spec)
    _validate_agent_image(spec)
    if spec.router is not None:
        if spec.engine is None:
            raise SpecError("router needs engine: it routes to the engines the node pods run (spec.engine)")
        if not 1 <= spec.router.port <= 65535 or spec.router.replicas < 1 or not spec.router.command:
            raise SpecError("router.port must be within 1..65535, router.replicas at least 1, router.command not empty")
        if spec.router.metrics_port == spec.router.port:
            raise SpecError(
                "router.metricsPort must differ from router.port: the router serves requests and metrics on two listeners"
            )
    if spec.placement.fallback not in tuple(FallbackPolicy):
        raise SpecError(
            f"placement.fallback must be one of {', '.join(FallbackPolicy)}, got {spec.placement.fallback!r}"
        )
    if spec.placement.max_gpus_per_node < 1:
        raise SpecError("placement.maxGpusPerNode must be at least 1")
    if spec.agent.metrics_port == spec.agent.api_port:
        raise SpecError(f"agent.metricsPort and agent.apiPort must differ (both {spec.agent.api_port})")
    if spec.agent.peer_port in (spec.agent.metrics_port, spec.agent.api_port):
        raise SpecError(
            f"agent.peerPort must differ from agent.apiPort and agent.metricsPort (it is {spec.agent.peer_port})"
        )
    m, a = spec.model, spec.agent
    # The CRD's minimums, for specs that did not pass through an API server.
    for name, value, low in (
        ("model.layers", m.layers, 1),
        ("model.headDim", m.head_dim, 1),
        ("model.pageSizeTokens", m.page_size_tokens, 1),
        ("model.stateBytesPerRequest", m.state_bytes_per_request, 0),
        ("model.stateLayers", m.state_layers, 1),
        ("model.expectedPromptTokens", m.expected_prompt_tokens, 1),
        ("model.auxRowBytes", min(m.aux_row_bytes, default=0), 0),
    ):
        if value < low:
            raise SpecError(f"{name} must be at least {low}, got {value}")
    for name, port in (
        ("agent.metricsPort", a.metrics_port),
        ("agent.apiPort", a.api_port),
        ("agent.peerPort", a.peer_port),
    ):
        if not 1 <= port <= 65535:
            raise SpecError(f"{name} must be a port number (1-65535), got {port}")
    # Quantities (the operator adds the agent's and the engines' into one container): each must be one.
    _validate_quantities(spec.agent.resources, "agent.resources")
    _validate_pod(spec.agent.pod, "agent.pod", RESERVED_NODE_ENV)
    if spec.router is not None:
        _validate_pod(spec.router.pod, "router.pod", RESERVED_NODE_ENV)
    if spec.engine is not None:
        _validate_engine(spec, spec.engine)


def _reserved_path(path: str) -> str | None:
    """The reserved path `path` would hide or sit inside (or be), None when it is clear of them."""
    norm = "/" + path.strip("/")
    for reserved in RESERVED_PATHS:
        if norm == reserved or norm.startswith(reserved + "/") or reserved.startswith(norm.rstrip("/") + "/"):
            return reserved
    return None


def _secret_names(volume: Mapping[str, Any]) -> list[str]:
    """The Secrets a volume mounts: a secret volume's, a projected volume's secret sources."""
    names = [str((volume.get("secret") or {}).get("secretName") or "")]
    for source in (volume.get("projected") or {}).get("sources") or []:
        names.append(str((source.get("secret") or {}).get("name") or ""))
    return [n for n in names if n]


def _check_env_secret(var: Mapping[str, Any], where: str) -> None:
    """A variable may not read a Secret the operator issues (valueFrom.secretKeyRef)."""
    secret = str(((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name") or "")
    if secret.endswith(RESERVED_SECRET_SUFFIXES):
        raise SpecError(
            f"{where}.env: {var.get('name')} reads Secret {secret}, a name of the Secrets the operator issues "
            f"(peer CA, agent certificates, engine token), which only the operator places"
        )


def _validate_pod(pod: PodOverrides, where: str, reserved_env: tuple[str, ...]) -> None:
    """The pod overrides' rules (mirrored by the CRD's CEL where CEL can see them): nothing that
    would break the contract of the pods the operator builds."""
    for kind, keys in (("labels", pod.labels), ("annotations", pod.annotations)):
        for key in keys:
            if key.startswith(RESERVED_KEY_PREFIX) or (kind == "labels" and key in RESERVED_LABELS):
                raise SpecError(f"{where}.{kind}: {key} is the operator's (its selectors and bookkeeping read it)")
    names = []
    for volume in pod.volumes:
        name = str(volume.get("name") or "")
        if not name:
            raise SpecError(f"{where}.volumes: every volume needs a name")
        if name in RESERVED_VOLUMES:
            raise SpecError(f"{where}.volumes: {name} is the name of a volume the operator mounts")
        for secret in _secret_names(volume):
            if secret.endswith(RESERVED_SECRET_SUFFIXES):
                raise SpecError(
                    f"{where}.volumes: {name} mounts Secret {secret}, a name of the Secrets the operator issues "
                    f"(peer CA, agent certificates, engine token), which only the operator places"
                )
        names.append(name)
    if len(set(names)) != len(names):
        raise SpecError(f"{where}.volumes: volume names must be unique")
    for mount in pod.volume_mounts:
        path, name = str(mount.get("mountPath") or ""), str(mount.get("name") or "")
        if name not in names:
            raise SpecError(f"{where}.volumeMounts: {name or 'a mount'} names no volume of {where}.volumes")
        reserved = _reserved_path(path) if path else None
        if not path.startswith("/") or reserved is not None:
            raise SpecError(
                f"{where}.volumeMounts: {name} at {path!r} must be an absolute path clear of "
                f"{', '.join(RESERVED_PATHS)} (the agent's files)"
            )
    for var in pod.env:
        name = str(var.get("name") or "")
        if not name:
            raise SpecError(f"{where}.env: every variable needs a name")
        if name.startswith("PDFABRIC_") or name in reserved_env or name in FORBIDDEN_ENGINE_ENV:
            raise SpecError(f"{where}.env: {name} is set by the operator (or is the device plugin's)")
        _check_env_secret(var, where)
    for tol in pod.tolerations:
        effects = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
        if tol.get("operator", "Equal") not in ("Exists", "Equal") or tol.get("effect", "") not in effects:
            raise SpecError(
                f"{where}.tolerations: operator must be Exists or Equal, effect a taint effect: {dict(tol)}"
            )
    for ref in pod.image_pull_secrets:
        if not ref.get("name"):
            raise SpecError(f"{where}.imagePullSecrets: every entry needs a name")


def _validate_engine(spec: PDClusterSpec, engine: EngineSpec) -> None:
    """spec.engine's rules, mirrored from the CRD (schema and CEL)."""
    top = 65535 - ENGINE_PORT_SPAN
    for role in ("prefill", "decode"):
        r = engine.role(role)
        where = f"engine.{role}"
        if not r.command:
            raise SpecError(
                f"{where}.command is required: the engine's launch command (the container's entrypoint is "
                f"the agent, which runs the engine)"
            )
        for var in r.env:
            name = str(var.get("name") or "")
            if not name:
                raise SpecError(f"{where}.env: every variable needs a name")
            if name.startswith("PDFABRIC_"):
                raise SpecError(f"{where}.env: PDFABRIC_* variables are set by the operator ({name})")
            if name in FORBIDDEN_ENGINE_ENV:
                raise SpecError(
                    f"{where}.env: the device plugin's allocation is the only GPU grant; {name} may not be set"
                )
            _check_env_secret(var, where)
        for kind in ("requests", "limits"):
            if spec.placement.gpu_resource in (r.resources.get(kind) or {}):
                raise SpecError(
                    f"{where}.resources.{kind} may not name {spec.placement.gpu_resource}: "
                    f"the operator requests each engine's GPUs"
                )
        _validate_quantities(r.resources, f"{where}.resources")
        if not r.health_path.startswith("/"):
            raise SpecError(f"{where}.healthPath must start with /, got {r.health_path!r}")
        if r.startup_seconds < 10:
            raise SpecError(f"{where}.startupSeconds must be at least 10, got {r.startup_seconds}")
    if engine.shared_memory:
        try:
            parse_quantity(engine.shared_memory)
        except QuantityError as exc:
            raise SpecError(f"engine.sharedMemory: {exc}") from None
    bases = {
        "engine.prefill.port": engine.prefill.port,
        "engine.prefill.bootstrapPort": engine.prefill.bootstrap_port,
        "engine.decode.port": engine.decode.port,
    }
    for name, base in bases.items():
        if not 1 <= base <= top:
            raise SpecError(f"{name} must be between 1 and {top} (it starts a range of {ENGINE_PORT_SPAN}), got {base}")
        for agent_port in (spec.agent.api_port, spec.agent.peer_port, spec.agent.metrics_port):
            if base <= agent_port < base + ENGINE_PORT_SPAN:
                raise SpecError(f"{name} ({base}) + {ENGINE_PORT_SPAN} ports hold the agent's port {agent_port}")
    names = list(bases)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if abs(bases[a] - bases[b]) < ENGINE_PORT_SPAN:
                raise SpecError(
                    f"{a} ({bases[a]}) and {b} ({bases[b]}) must be at least {ENGINE_PORT_SPAN} apart "
                    f"(the k-th engine of a role in a pod takes base + k)"
                )


def _validate_quantities(resources: Mapping[str, Any], where: str) -> None:
    parsed: dict[str, dict[str, Any]] = {}
    for kind in ("requests", "limits"):
        for name, value in (resources.get(kind) or {}).items():
            try:
                parsed.setdefault(kind, {})[name] = parse_quantity(value)
            except QuantityError as exc:
                raise SpecError(f"{where}.{kind}.{name}: {exc}") from None
    for name, limit in parsed.get("limits", {}).items():
        request = parsed.get("requests", {}).get(name)
        if request is not None and request > limit:
            raise SpecError(f"{where}.requests.{name} must not exceed limits.{name}")


def _validate_agent_image(spec: PDClusterSpec) -> None:
    """A transport with KV in GPU memory on the CPU agent image never becomes Ready (NoGpu): refuse
    it here, with the fix. Not a CEL rule: it needs the transport memPool implies and the image's
    name parsed. With spec.engine the engine image runs the agent and agent.image is not used."""
    transport = spec.transfer.effective_transport
    image = spec.agent.image
    if spec.engine is None and needs_gpu_image(transport) and image and names_cpu_agent_image(image):
        raise SpecError(
            f"agent.image {image} is the CPU agent image, but transport {transport.value} keeps KV in GPU "
            f"memory and needs the CUDA one: use {image}{CUDA_SUFFIX} (docs/images.md), or leave agent.image "
            f"out for {AGENT_IMAGE_CUDA}"
        )


def _validate_transport(spec: PDClusterSpec) -> None:
    pool, explicit = spec.transfer.mem_pool, spec.transfer.transport
    pool_traits = mem_pool_traits(pool)
    if explicit is not None and explicit not in pool_traits.transports:
        allowed = ", ".join(sorted(t.value for t in pool_traits.transports))
        raise SpecError(
            f"transfer.transport {explicit.value} cannot run on memPool {pool.value}; "
            f"use auto or one of: {allowed}, or change memPool"
        )
    transport = spec.transfer.effective_transport
    if spec.backend not in pool_traits.backends or spec.backend not in transport_traits(transport).backends:
        pools = ", ".join(p.value for p in MemPool if spec.backend in mem_pool_traits(p).backends)
        carried = " or ".join(t.value for t in Transport if spec.backend in transport_traits(t).backends)
        raise SpecError(
            f"backend {spec.backend} supports only memPool {pools} with transport {carried}; use backend mooncake"
        )
    if transport_traits(transport).locality is Locality.NODE:
        p, d = spec.prefill.replicas, spec.decode.replicas
        if d % p:
            raise SpecError(
                f"intra-node NVLink pins each prefill replica to the decode replicas it feeds: "
                f"decode.replicas ({d}) must be a multiple of prefill.replicas ({p})"
            )
        if spec.intra_node_group_gpus > spec.placement.max_gpus_per_node:
            raise SpecError(
                f"intra-node NVLink needs one prefill replica and the decode replicas it feeds on one node: "
                f"{spec.intra_node_group_gpus} GPUs exceed placement.maxGpusPerNode "
                f"({spec.placement.max_gpus_per_node}); lower TP/CP/PP or replicas, or use transport nvlink or rdma"
            )
