"""The PDCluster spec as typed, validated Python values.

The CRD (crds/pdcluster.yaml) is the API's single source: the API server applies its defaults and
rejects what its schema and CEL rules forbid. This module parses the (defaulted) spec for the
operator and the agent; its defaults equal the CRD's, which a unit test checks, so an object read
from an API server that skipped defaulting still means the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdfabric_core.policy.chunking import DEFAULT_MAX_BATCH_ENTRIES
from pdfabric_core.policy.rank_mapping import local_heads, validate_pp, validate_tp
from pdfabric_core.policy.types import MemPool, Transport, implied_transport

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}

# Aux rows upstream MetadataBuffers hand from prefill to decode, in bytes per request row:
# output ids, cached tokens, logprob values/indices, top-logprobs, hidden states (bf16, 8192
# hidden), bootstrap room, checksum. Users override them per model.
DEFAULT_AUX_ROW_BYTES = (16, 8, 8, 8, 128, 16384, 8, 8)


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
    transport: Transport | None = None  # None: the one the pool implies
    aux_over_tcp: bool = False
    max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES
    timeout_seconds: float = 30.0

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


class FallbackPolicy:
    FAIL = "Fail"
    TCP = "TCP"


# Transports each custom pool can actually run on. NVLINK (MNNVL) needs fabric memory that only
# its own pool allocates; Mooncake's intra-node NVLink needs whole cudaMalloc segments, which only
# the INTRA_NODE_NVLINK pool provides; BAREX is an RDMA pool; the default pool runs tcp or rdma.
ALLOWED_TRANSPORTS: dict[MemPool, frozenset[Transport]] = {
    MemPool.NONE: frozenset({Transport.TCP, Transport.RDMA}),
    MemPool.NVLINK: frozenset({Transport.NVLINK}),
    MemPool.INTRA_NODE_NVLINK: frozenset({Transport.NVLINK_INTRA}),
    MemPool.BAREX: frozenset({Transport.RDMA}),
}

# MORI-IO has XGMI, RDMA and TCP backends and none of Mooncake's custom pools.
MORI_TRANSPORTS = frozenset({Transport.TCP, Transport.RDMA})


@dataclass(frozen=True)
class PlacementSpec:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    nvlink_domain_key: str = "nvidia.com/gpu.clique"
    rdma_resource: str = "rdma/hca"
    gpu_resource: str = "nvidia.com/gpu"
    fallback: str = FallbackPolicy.FAIL
    # GPUs one node offers at most; bounds what intra-node NVLink may ask of a single node.
    max_gpus_per_node: int = 8


@dataclass(frozen=True)
class AgentSpec:
    image: str = "pdfabric/agent:latest"
    metrics_port: int = 9400
    api_port: int = 7400
    resources: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PDClusterSpec:
    backend: str = "mooncake"
    transfer: TransferSpec = TransferSpec()
    prefill: PrefillSpec = PrefillSpec()
    decode: DecodeSpec = DecodeSpec()
    model: ModelGeometry = ModelGeometry()
    placement: PlacementSpec = PlacementSpec()
    agent: AgentSpec = AgentSpec()

    @property
    def decode_per_prefill(self) -> int:
        """Decode replicas each prefill replica feeds when the transport pins them to its node."""
        return max(1, self.decode.replicas // max(1, self.prefill.replicas))

    @property
    def intra_node_group_gpus(self) -> int:
        """GPUs one prefill replica and the decode replicas it feeds take on one node."""
        return self.prefill.ranks_per_replica + self.decode_per_prefill * self.decode.ranks_per_replica


def _get(obj: Mapping[str, Any], key: str, default: Any) -> Any:
    value = obj.get(key, default)
    return default if value is None else value


def parse_spec(raw: Mapping[str, Any]) -> PDClusterSpec:
    """Parse a PDCluster `.spec` (camelCase, as stored) and check the cross-field rules.

    Raises SpecError naming the field and what to change.
    """
    try:
        t = raw.get("transfer") or {}
        p = raw.get("prefill") or {}
        d = raw.get("decode") or {}
        m = raw.get("model") or {}
        pl = raw.get("placement") or {}
        a = raw.get("agent") or {}
        transport = t.get("transport")
        spec = PDClusterSpec(
            backend=_get(raw, "backend", "mooncake"),
            transfer=TransferSpec(
                mem_pool=MemPool(_get(t, "memPool", "NONE")),
                transport=None if transport in (None, "auto") else Transport(transport),
                aux_over_tcp=bool(_get(t, "auxOverTcp", False)),
                max_batch_entries=int(_get(t, "maxBatchEntries", DEFAULT_MAX_BATCH_ENTRIES)),
                timeout_seconds=float(_get(t, "timeoutSeconds", 30)),
            ),
            prefill=PrefillSpec(
                replicas=int(_get(p, "replicas", 1)),
                tp=int(_get(p, "tp", 1)),
                cp=int(_get(p, "cp", 1)),
                pp=int(_get(p, "pp", 1)),
                all_cp_ranks_transfer=bool(_get(p, "allCpRanksTransfer", False)),
                dsa_cache_layer_split=bool(_get(p, "dsaCacheLayerSplit", False)),
            ),
            decode=DecodeSpec(
                replicas=int(_get(d, "replicas", 1)),
                tp=int(_get(d, "tp", 1)),
                cp=int(_get(d, "cp", 1)),
                pp=int(_get(d, "pp", 1)),
            ),
            model=ModelGeometry(
                layers=int(_get(m, "layers", 32)),
                kv_heads=int(_get(m, "kvHeads", 8)),
                head_dim=int(_get(m, "headDim", 128)),
                dtype=str(_get(m, "dtype", "bfloat16")),
                page_size_tokens=int(_get(m, "pageSizeTokens", 16)),
                state_bytes_per_request=int(_get(m, "stateBytesPerRequest", 0)),
                state_layers=int(_get(m, "stateLayers", 1)),
                aux_row_bytes=tuple(int(x) for x in _get(m, "auxRowBytes", DEFAULT_AUX_ROW_BYTES)),
                expected_prompt_tokens=int(_get(m, "expectedPromptTokens", 4096)),
            ),
            placement=PlacementSpec(
                node_selector=dict(_get(pl, "nodeSelector", {})),
                nvlink_domain_key=str(_get(pl, "nvlinkDomainKey", "nvidia.com/gpu.clique")),
                rdma_resource=str(_get(pl, "rdmaResource", "rdma/hca")),
                gpu_resource=str(_get(pl, "gpuResource", "nvidia.com/gpu")),
                fallback=str(_get(pl, "fallback", FallbackPolicy.FAIL)),
                max_gpus_per_node=int(_get(pl, "maxGpusPerNode", 8)),
            ),
            agent=AgentSpec(
                image=str(_get(a, "image", "pdfabric/agent:latest")),
                metrics_port=int(_get(a, "metricsPort", 9400)),
                api_port=int(_get(a, "apiPort", 7400)),
                resources=dict(_get(a, "resources", {})),
            ),
        )
    except (ValueError, TypeError) as exc:
        raise SpecError(f"invalid PDCluster spec: {exc}") from exc
    validate_spec(spec)
    return spec


def validate_spec(spec: PDClusterSpec) -> None:
    """The cross-field rules, mirrored from the CRD's CEL so parsed specs are always sane."""
    if spec.backend not in ("mooncake", "mori"):
        raise SpecError(f"backend must be mooncake or mori, got {spec.backend!r}")
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
    try:
        validate_tp(spec.prefill.tp, spec.model.kv_heads, role="prefill")
        validate_tp(spec.decode.tp, spec.model.kv_heads, role="decode")
        if spec.prefill.tp % spec.decode.tp and spec.decode.tp % spec.prefill.tp:
            raise ValueError(f"prefill TP {spec.prefill.tp} and decode TP {spec.decode.tp} must divide each other")
        validate_pp(spec.prefill.pp, spec.decode.pp)
    except ValueError as exc:
        raise SpecError(str(exc)) from exc
    if spec.prefill.dsa_cache_layer_split and spec.model.state_layers % spec.prefill.cp:
        raise SpecError(
            f"model.stateLayers ({spec.model.state_layers}) must be divisible by prefill.cp "
            f"({spec.prefill.cp}) when dsaCacheLayerSplit is on"
        )
    _validate_transport(spec)
    if spec.placement.fallback not in (FallbackPolicy.FAIL, FallbackPolicy.TCP):
        raise SpecError(f"placement.fallback must be Fail or TCP, got {spec.placement.fallback!r}")
    if spec.placement.max_gpus_per_node < 1:
        raise SpecError("placement.maxGpusPerNode must be at least 1")
    if spec.agent.metrics_port == spec.agent.api_port:
        raise SpecError(f"agent.metricsPort and agent.apiPort must differ (both {spec.agent.api_port})")
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
    for name, port in (("agent.metricsPort", a.metrics_port), ("agent.apiPort", a.api_port)):
        if not 1 <= port <= 65535:
            raise SpecError(f"{name} must be a port number (1-65535), got {port}")


def _validate_transport(spec: PDClusterSpec) -> None:
    pool, explicit = spec.transfer.mem_pool, spec.transfer.transport
    if explicit is not None and explicit not in ALLOWED_TRANSPORTS[pool]:
        allowed = ", ".join(sorted(t.value for t in ALLOWED_TRANSPORTS[pool]))
        raise SpecError(
            f"transfer.transport {explicit.value} cannot run on memPool {pool.value}; "
            f"use auto or one of: {allowed}, or change memPool"
        )
    if spec.backend == "mori" and (
        pool is not MemPool.NONE or spec.transfer.effective_transport not in MORI_TRANSPORTS
    ):
        raise SpecError("backend mori supports only memPool NONE with transport tcp or rdma; use backend mooncake")
    if spec.transfer.effective_transport is Transport.NVLINK_INTRA:
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
