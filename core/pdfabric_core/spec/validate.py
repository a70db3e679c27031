"""The spec's cross-field rules, mirrored from the CRD's CEL so parsed specs are always sane; each
refusal names the field and what to change."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdfabric_core.images import AGENT_IMAGE_CUDA, CUDA_SUFFIX, names_cpu_agent_image, needs_gpu_image
from pdfabric_core.policy.rank_mapping import kv_routes, validate_pp, validate_tp
from pdfabric_core.policy.state_slices import shard_range
from pdfabric_core.policy.transports import Locality, mem_pool_traits, pool_transports, transport_traits
from pdfabric_core.policy.types import (
    PACKED_FP8_BLOCK,
    Backend,
    FallbackPolicy,
    KvKind,
    KvPacking,
    MemPool,
    StateKind,
    Transport,
)
from pdfabric_core.quantity import QuantityError, parse_quantity
from pdfabric_core.spec.model import (
    DTYPE_BYTES,
    ENGINE_PORT_SPAN,
    FORBIDDEN_ENGINE_ENV,
    MAX_RANKS,
    PDClusterSpec,
    SpecError,
)
from pdfabric_core.spec.multinode import validate_nodes_per_replica
from pdfabric_core.spec.pod_overrides import RESERVED_NODE_ENV, check_env_secret, validate_pod
from pdfabric_core.spec.serving import EngineSpec

MAX_DRAFT_LAYERS = 64  # the CRD's maximum of model.draftLayers


def validate_spec(spec: PDClusterSpec) -> None:
    """The cross-field rules, mirrored from the CRD's CEL so parsed specs are always sane."""
    if spec.backend not in tuple(Backend):
        raise SpecError(f"backend must be one of {', '.join(Backend)}, got {spec.backend!r}")
    if spec.model.dtype not in DTYPE_BYTES:
        raise SpecError(f"model.dtype must be one of {sorted(DTYPE_BYTES)}, got {spec.model.dtype!r}")
    for role, r in (("prefill", spec.prefill), ("decode", spec.decode)):
        if r.replicas < 1 or r.tp < 1 or r.cp < 1 or r.pp < 1 or r.dp < 1:
            raise SpecError(f"{role}.replicas, dp, tp, cp and pp must each be at least 1")
        if not 0 <= r.max_unavailable <= 1024:
            raise SpecError(f"{role}.maxUnavailable must be within 0..1024, got {r.max_unavailable}")
        if r.dp > 1 and spec.engine is not None:
            raise SpecError(
                f"{role}.dp {r.dp} with spec.engine: the node pods do not launch SGLang servers of several DP "
                f"groups yet; deploy those engines yourself (leave spec.engine out)"
            )
    if spec.ranks > MAX_RANKS:
        raise SpecError(
            f"a PDCluster holds at most {MAX_RANKS} ranks (replicas x dp x tp x cp x pp of prefill, plus "
            f"decode's), this one {spec.ranks}: its rank map must fit one ConfigMap; split the deployment into "
            f"several PDClusters or lower replicas"
        )
    if spec.decode.cp != 1:
        raise SpecError(f"decode.cp must be 1 (decode context parallelism is not supported), got {spec.decode.cp}")
    if spec.transfer.max_batch_entries < 1:
        raise SpecError("transfer.maxBatchEntries must be at least 1")
    if spec.transfer.timeout_seconds <= 0:
        raise SpecError("transfer.timeoutSeconds must be positive")
    if not 0 <= spec.transfer.min_probe_g_bps <= 10000:
        raise SpecError("transfer.minProbeGBps must be within 0..10000 (0: no threshold)")
    try:
        validate_tp(spec.prefill.tp, spec.model.tp_kv_heads, role="prefill")
        validate_tp(spec.decode.tp, spec.model.tp_kv_heads, role="decode")
        if spec.prefill.tp % spec.decode.tp and spec.decode.tp % spec.prefill.tp:
            raise ValueError(f"prefill TP {spec.prefill.tp} and decode TP {spec.decode.tp} must divide each other")
        validate_pp(spec.prefill.pp, spec.decode.pp)
    except ValueError as exc:
        raise SpecError(str(exc)) from exc
    # Equal layers only without stateTensorBytes: typed tensors have sizes of their own (V4's SWA pages,
    # compress rings and C128 rings sum to no multiple of their count).
    if not spec.model.state_tensor_bytes and spec.model.state_bytes_per_request % spec.model.state_layers:
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
    _validate_packing(spec)
    validate_nodes_per_replica(spec)
    _validate_state(spec)
    _validate_kv_sharding(spec)
    _validate_transport(spec)
    _validate_agent_image(spec)
    if spec.router is not None:
        if spec.engine is None:
            raise SpecError("router needs engine: it routes to the engines the node pods run (spec.engine)")
        if not 1 <= spec.router.port <= 65535 or spec.router.replicas < 1:
            raise SpecError("router.port must be within 1..65535, router.replicas at least 1")
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
        ("model.kvLoraRank", m.kv_lora_rank, 1),
        ("model.qkRopeHeadDim", m.qk_rope_head_dim, 0),
        ("model.pageSizeTokens", m.page_size_tokens, 1),
        ("model.stateBytesPerRequest", m.state_bytes_per_request, 0),
        ("model.stateLayers", m.state_layers, 1),
        ("model.draftLayers", m.draft_layers, 0),
        ("model.expectedPromptTokens", m.expected_prompt_tokens, 1),
        ("model.auxRowBytes", min(m.aux_row_bytes, default=0), 0),
    ):
        if value < low:
            raise SpecError(f"{name} must be at least {low}, got {value}")
    if m.draft_layers > MAX_DRAFT_LAYERS:
        raise SpecError(
            f"model.draftLayers must be at most {MAX_DRAFT_LAYERS} (a draft model's KV layers: EAGLE and "
            f"DeepSeek's MTP have 1), got {m.draft_layers}"
        )
    for name, port in (
        ("agent.metricsPort", a.metrics_port),
        ("agent.apiPort", a.api_port),
        ("agent.peerPort", a.peer_port),
    ):
        if not 1 <= port <= 65535:
            raise SpecError(f"{name} must be a port number (1-65535), got {port}")
    # Quantities (the operator adds the agent's and the engines' into one container): each must be one.
    _validate_quantities(spec.agent.resources, "agent.resources")
    validate_pod(spec.agent.pod, "agent.pod", RESERVED_NODE_ENV)
    if spec.router is not None:
        validate_pod(spec.router.pod, "router.pod", RESERVED_NODE_ENV)
    if spec.engine is not None:
        _validate_engine(spec, spec.engine)


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
            check_env_secret(var, where)
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
    bases = engine.port_bases()
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
    runs = pool_transports(pool, spec.backend)
    if explicit is not None and explicit not in runs:
        allowed = ", ".join(sorted(t.value for t in runs))
        carriers = " or ".join(b.value for b in Backend if explicit in pool_transports(pool, b))
        raise SpecError(
            f"transfer.transport {explicit.value} cannot run on memPool {pool.value} with backend "
            f"{spec.backend.value}; use auto or one of: {allowed}"
            + (f", or backend {carriers}" if carriers else "")
            + ", or change memPool"
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


def _validate_packing(spec: PDClusterSpec) -> None:
    """kvPacking packedFp8 is SGLang's DSA fp8 latent: MLA, fp8 e4m3, whole scale blocks (CRD CEL)."""
    m = spec.model
    if m.kv_packing is KvPacking.NONE:
        return
    if m.kv_kind is not KvKind.MLA:
        raise SpecError("model.kvPacking packedFp8 is SGLang's packed MLA latent (DeepSeek-V3.2): set kvKind MLA")
    if m.dtype != "float8_e4m3fn":
        raise SpecError(
            f"model.kvPacking packedFp8 stores the latent as float8_e4m3fn with float32 scales: set dtype "
            f"float8_e4m3fn (got {m.dtype}), or kvPacking none for an unpacked latent"
        )
    if m.kv_lora_rank % PACKED_FP8_BLOCK:
        raise SpecError(
            f"model.kvPacking packedFp8 keeps a float32 scale per {PACKED_FP8_BLOCK} latent elements: "
            f"model.kvLoraRank must be a multiple of {PACKED_FP8_BLOCK}, got {m.kv_lora_rank}"
        )


def _validate_state(spec: PDClusterSpec) -> None:
    """Typed state (policy/state_slices.py): each kind's tensors must split as its rule moves them."""
    m = spec.model
    tensors, kind = m.state_tensor_bytes, m.state_kind
    if not tensors:
        if kind is not StateKind.SLOT or m.state_tensor_sharded or m.state_tensor_blocks:
            raise SpecError(
                f"model.stateKind {kind.value}, stateTensorSharded and stateTensorBlocks need model.stateTensorBytes "
                "(each state tensor's item bytes); without it the state is stateLayers equal replicated slot tensors"
            )
        return
    sharded = m.state_tensor_sharded
    if sharded and len(sharded) != len(tensors):
        raise SpecError(
            f"model.stateTensorSharded has {len(sharded)} entries for {len(tensors)} state tensors "
            "(model.stateTensorBytes): give one per tensor, or leave it out"
        )
    if min(tensors) < 1:
        raise SpecError(f"every entry of model.stateTensorBytes must be at least 1, got {list(tensors)}")
    if spec.prefill.pp > 1 or spec.decode.pp > 1:
        raise SpecError(
            "model.stateTensorBytes with pipeline parallelism: a PP stage holds only its own layers' state, and "
            "pdfabric moves typed state from one stage; set prefill.pp and decode.pp to 1"
        )
    tps = (spec.prefill.tp, spec.decode.tp)
    if kind is StateKind.PAGE:
        if m.state_tensor_blocks:
            raise SpecError("model.stateKind page is sharded by KV heads: leave stateTensorBlocks out")
        if sharded and not all(sharded):
            raise SpecError(
                "model.stateKind page: every state tensor is sharded by KV heads; leave stateTensorSharded out"
            )
        # Beside MLA (DSA's indexer pages) the state is whole on every attention-TP rank, like the latent.
        heads = m.tp_kv_heads
        unit = heads * m.page_size_tokens
        bad = [w for w in tensors if w % unit]
        if bad:
            raise SpecError(
                f"model.stateTensorBytes {bad[0]} is not whole pages of {m.page_size_tokens} tokens x "
                f"{heads} KV heads: a page state tensor's item is one page of every KV head"
            )
        return
    if kind is StateKind.ROW and any(sharded):
        raise SpecError("model.stateKind row is whole on every attention-TP rank: leave stateTensorSharded out")
    blocks = m.state_tensor_blocks
    if len(blocks) > len(tensors) or any(b and (not sharded or not sharded[i]) for i, b in enumerate(blocks)):
        raise SpecError(
            "model.stateTensorBlocks gives sub-blocks of TP-sharded slot tensors only, one entry a tensor at most"
        )
    for i, b in enumerate(blocks):
        if b and (sum(b) != tensors[i] or min(b) < 1):
            raise SpecError(
                f"model.stateTensorBlocks[{i}] {list(b)} must be positive and sum to the tensor's "
                f"{tensors[i]} bytes (model.stateTensorBytes[{i}])"
            )
    for i, (w, cut) in enumerate(zip(tensors, sharded, strict=False)):
        parts = (blocks[i] if i < len(blocks) else ()) or (w,)
        if cut and any(b % tps[0] or b % tps[1] for b in parts):
            raise SpecError(
                f"a TP-sharded state tensor of {w} bytes (sub-blocks {list(parts)}) does not split evenly over "
                f"prefill TP {tps[0]} and decode TP {tps[1]}: check model.stateTensorBytes (whole, before sharding)"
            )
    if any(sharded):
        routes = {(r.prefill_tp_rank, r.decode_tp_rank) for r in kv_routes(*tps, m.tp_kv_heads)}
        w = next(w for w, cut in zip(tensors, sharded, strict=True) if cut)
        for p in range(tps[0]):
            for d in range(tps[1]):
                src, dst = shard_range(w, tps[0], p), shard_range(w, tps[1], d)
                if max(src.start, dst.start) < min(src.stop, dst.stop) and (p, d) not in routes:
                    raise SpecError(
                        f"prefill TP rank {p} holds state decode TP rank {d} needs, but takes it no KV "
                        f"({m.tp_kv_heads} KV heads over TP {tps[0]} -> {tps[1]}): pdfabric moves TP-sharded "
                        "state along KV routes; use TP sizes at most the KV head count"
                    )


def _validate_kv_sharding(spec: PDClusterSpec) -> None:
    """prefill.kvCacheSharding: SGLang's MLA sharding over attention TP, and only what is moved."""
    p, m = spec.prefill, spec.model
    if not p.kv_cache_sharding:
        return
    if m.kv_kind is not KvKind.MLA:
        raise SpecError(
            "prefill.kvCacheSharding needs model.kvKind MLA (SGLang shards GQA pages only over attention CP, "
            "which pdfabric does not move); set kvCacheSharding false"
        )
    if p.cp != 1:
        raise SpecError(
            f"prefill.kvCacheSharding with prefill.cp {p.cp}: SGLang then shards pages over attention CP, "
            "which pdfabric does not move; set prefill.cp to 1 or kvCacheSharding false"
        )
    if p.tp != spec.decode.tp:
        raise SpecError(
            f"prefill.kvCacheSharding requires equal prefill and decode attention TP (SGLang's rule), got "
            f"prefill.tp {p.tp} and decode.tp {spec.decode.tp}; make them equal"
        )
    if m.state_tensors:
        raise SpecError(
            "prefill.kvCacheSharding with per-request state (model.stateBytesPerRequest / stateTensorBytes): "
            "state under KV cache sharding (DSA's indexer filtered by page owner) is not moved yet; drop the state "
            "or kvCacheSharding"
        )
    if m.draft_layers:
        raise SpecError(
            "prefill.kvCacheSharding with model.draftLayers: a draft KV group under KV cache sharding is not "
            "moved yet; set draftLayers 0 or kvCacheSharding false"
        )
