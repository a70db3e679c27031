"""The PDCluster spec's model: one frozen dataclass per CRD section, with the CRD's defaults.

The CRD (crds/pdcluster.yaml) is the API's single source: the API server applies its defaults and
rejects what its schema and CEL rules forbid. These dataclasses carry the same defaults, which a unit
test checks, so an object read from an API server that skipped defaulting still means the same thing.
parse.py turns a stored spec into them; validate.py holds the cross-field rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pdfabric_core.images import default_agent_image
from pdfabric_core.policy.chunking import DEFAULT_MAX_BATCH_ENTRIES
from pdfabric_core.policy.rank_mapping import all_cp_ranks_send, kv_buffers_per_layer, local_heads, tp_kv_heads
from pdfabric_core.policy.transports import implied_transport
from pdfabric_core.policy.types import (
    AUTO_TRANSPORT,
    Backend,
    FallbackPolicy,
    KvKind,
    KvPacking,
    MemPool,
    StateKind,
    Transport,
    packed_fp8_token_bytes,
)
from pdfabric_core.spec.serving import EngineSpec, PodOverrides, RouterSpec

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}

# The aux rows SGLang 0.5.23's MetadataBuffers hand from prefill to decode, in bytes per request
# row, by default (no sampling mask, no DSA top-k, no checksum; 128 top logprobs): output ids,
# cached tokens, logprob values and indices, top-logprob values and indices, top-k p and index
# (speculative decoding), hidden states (bf16, 8192 hidden), bootstrap room. Only the status's
# traffic prediction reads them: the agents take the rows the engines register.
DEFAULT_AUX_ROW_BYTES = (64, 64, 64, 64, 512, 512, 64, 128, 16384, 64)

# The k-th engine of a role in one pod serves on port + k (and prefill's bootstrap on
# bootstrapPort + k): each of the three port bases owns this many ports (the CRD's most GPUs per node).
ENGINE_PORT_SPAN = 64
# The most ranks one PDCluster may hold (the CRD's CEL says the same): its rank map, about 75 bytes
# a rank, must fit one ConfigMap (1 MiB) with room to spare. Larger deployments are several PDClusters.
MAX_RANKS = 8192
# The device plugin's allocation is the only GPU grant: engines may not widen or narrow it.
FORBIDDEN_ENGINE_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")

# Field metadata key: the stored value that means None (transfer.transport "auto").
NONE_VALUE_KEY = "pdfabric.none_value"
# Field metadata key: a section parse_spec parses itself (spec.engine, optional and without defaults).
OWN_PARSER_KEY = "pdfabric.own_parser"


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
    # SGLang's --enable-kv-cache-sharding over attention TP (MLA, CP 1): logical page l lives on
    # attention-TP rank l % tp as its local page l // tp; every decode rank takes from every rank.
    kv_cache_sharding: bool = False
    # SGLang's DP groups per server (--attn-dp-size, or --dp-size replicas behind one bootstrap
    # server); each group is tp x cp x pp ranks of its own.
    dp: int = 1
    # One replica over this many nodes (a node pod each, SGLang's --nnodes): its ranks in (pp, tp)
    # order, an equal block per node rank, placed all or none (docs/engines.md).
    nodes_per_replica: int = 1
    # Replicas of the role that evictions (a node drain) may take down at once: its node pods'
    # PodDisruptionBudget (0: none, a drain waits for the user).
    max_unavailable: int = 1

    @property
    def ranks_per_replica(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

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
    dp: int = 1  # SGLang's DP groups per server, as PrefillSpec.dp
    nodes_per_replica: int = 1  # as PrefillSpec.nodes_per_replica
    max_unavailable: int = 1  # as PrefillSpec.max_unavailable

    @property
    def ranks_per_replica(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class TransferSpec:
    mem_pool: MemPool = MemPool.NONE
    # None (stored as "auto"): the one the pool implies
    transport: Transport | None = field(default=None, metadata={NONE_VALUE_KEY: AUTO_TRANSPORT})
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
    # MHA: per layer a K and a V of kv_heads x head_dim. MLA: per layer one latent of
    # kv_lora_rank + qk_rope_head_dim per token, whole on every attention-TP rank (kv_heads and
    # head_dim are not read). fp8 stores a byte per element and no per-token scale (SGLang's
    # MLATokenToKVPool keeps fp8 as uint8; its scale is the checkpoint's, per tensor).
    kv_kind: KvKind = KvKind.MHA
    kv_heads: int = 8
    head_dim: int = 128
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    # MLA only: packedFp8 is SGLang's DSA fp8 latent (fp8 latent, float32 block scales, bf16 rope);
    # its bytes a token follow from kvLoraRank and qkRopeHeadDim (dtype float8_e4m3fn).
    kv_packing: KvPacking = KvPacking.NONE
    dtype: str = "bfloat16"
    page_size_tokens: int = 16
    state_bytes_per_request: int = 0
    state_layers: int = 1
    # Typed state (policy/state_slices.py): how it is indexed, and each tensor's whole item bytes
    # (before attention-TP sharding) and whether TP shards it. parse_spec derives stateLayers and
    # stateBytesPerRequest from stateTensorBytes; without it, stateLayers equal replicated slot tensors.
    state_kind: StateKind = StateKind.SLOT
    state_tensor_bytes: tuple[int, ...] = ()
    state_tensor_sharded: tuple[bool, ...] = ()
    # Per sharded slot tensor, the whole bytes of its sub-blocks that TP shards apart (GDN's conv
    # state: q, k, v; SGLang's state_conv_shard_groups); an empty entry (or none): one block.
    state_tensor_blocks: tuple[tuple[int, ...], ...] = ()
    aux_row_bytes: tuple[int, ...] = DEFAULT_AUX_ROW_BYTES
    # The speculative draft's KV (EAGLE, MTP/NextN): its layers, appended after the target's in
    # SGLang's kv_data_ptrs, of the target's KV kind, heads, dims and dtype (SGLang's Mooncake
    # backend slices every entry by the target's head split), on the same page ids. Only the last
    # PP stage runs the draft, so only it holds and sends them. 0: no draft KV.
    draft_layers: int = 0
    # Prompt length the status uses to predict bytes per request; it sizes nothing.
    expected_prompt_tokens: int = 4096

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_buffers(self) -> int:
        """KV buffers per layer: K and V, or the MLA latent."""
        return kv_buffers_per_layer(self.kv_kind)

    @property
    def tp_kv_heads(self) -> int:
        """The KV heads attention TP splits (MLA: the one latent, replicated)."""
        return tp_kv_heads(self.kv_kind, self.kv_heads)

    @property
    def head_width(self) -> int:
        """Elements of one head of one token: head_dim, or the MLA latent width."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.kv_kind is KvKind.MLA else self.head_dim

    @property
    def packed(self) -> bool:
        """The latent is SGLang's packed fp8 (spec.model.kvPacking packedFp8)."""
        return self.kv_kind is KvKind.MLA and self.kv_packing is KvPacking.PACKED_FP8

    @property
    def head_token_bytes(self) -> int:
        """Bytes of one head of one token: head width x dtype, or the packed latent's own bytes."""
        if self.packed:
            return packed_fp8_token_bytes(self.kv_lora_rank, self.qk_rope_head_dim)
        return self.head_width * self.dtype_bytes

    @property
    def head_page_bytes(self) -> int:
        """Bytes of one head of one page of one KV buffer."""
        return self.page_size_tokens * self.head_token_bytes

    @property
    def state_tensors(self) -> tuple[int, ...]:
        """Whole item bytes of each state tensor (none when the model has no state)."""
        if self.state_tensor_bytes:
            return self.state_tensor_bytes
        if not self.state_bytes_per_request:
            return ()
        return (self.state_bytes_per_request // self.state_layers,) * self.state_layers

    @property
    def state_sharded(self) -> tuple[bool, ...]:
        """Per state tensor, whether attention TP shards it (page state: always, by KV heads)."""
        n = len(self.state_tensors)
        if self.state_kind is StateKind.PAGE:
            return (True,) * n
        return self.state_tensor_sharded or (False,) * n

    def state_blocks(self, tensor: int) -> tuple[int, ...]:
        """Whole bytes of each sub-block TP shards apart in state tensor ``tensor`` (one block: the item)."""
        blocks = self.state_tensor_blocks[tensor] if tensor < len(self.state_tensor_blocks) else ()
        return blocks or (self.state_tensors[tensor],)

    def state_item_bytes(self, tp: int) -> tuple[int, ...]:
        """Item bytes of each state tensor on one rank of a TP group (SGLang's state_item_lens)."""
        if self.state_kind is StateKind.PAGE:
            heads = local_heads(tp, self.tp_kv_heads)
            return tuple(w * heads // self.tp_kv_heads for w in self.state_tensors)
        return tuple(w // tp if s else w for w, s in zip(self.state_tensors, self.state_sharded, strict=True))

    def draft_layers_on(self, pp: int, pp_stage: int) -> int:
        """Draft KV layers one PP stage holds: all of them on the last stage, none elsewhere."""
        return self.draft_layers if pp_stage == pp - 1 else 0

    def kv_page_bytes(self, tp: int) -> int:
        """Bytes of one page of one KV buffer (a layer's K, V or latent) on one rank of a TP group."""
        return local_heads(tp, self.tp_kv_heads) * self.head_page_bytes

    def describe_page(self, tp: int) -> str:
        """How one page's bytes come about, for refusals that name a mismatch."""
        heads = local_heads(tp, self.tp_kv_heads)
        if self.packed:
            r, rope = self.kv_lora_rank, self.qk_rope_head_dim
            return (
                f"{self.page_size_tokens} tokens x a packed fp8 latent of {self.head_token_bytes} bytes "
                f"(kvLoraRank {r} fp8 + {r // 128} float32 scales + qkRopeHeadDim {rope} bfloat16)"
            )
        per = (
            f"a latent of {self.head_width} (kvLoraRank {self.kv_lora_rank} + qkRopeHeadDim {self.qk_rope_head_dim})"
            if self.kv_kind is KvKind.MLA
            else f"{heads} KV heads x {self.head_dim} head dim"
        )
        return f"{self.page_size_tokens} tokens x {per} x {self.dtype_bytes} bytes of {self.dtype}"


@dataclass(frozen=True)
class PlacementSpec:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    nvlink_domain_key: str = "nvidia.com/gpu.clique"
    rdma_resource: str = "rdma/hca"
    gpu_resource: str = "nvidia.com/gpu"
    fallback: FallbackPolicy = FallbackPolicy.FAIL
    # GPUs one node offers at most; bounds what intra-node NVLink may ask of a single node.
    max_gpus_per_node: int = 8
    # A node label every node of one replica over several nodes shares a value of ("": any nodes).
    group_topology_key: str = ""


@dataclass(frozen=True)
class AgentSpec:
    # Left out (""): the image the transport needs, CPU or CUDA (PDClusterSpec.agent_image, images.py).
    image: str = ""
    metrics_port: int = 9400
    api_port: int = 7400
    peer_port: int = 7401
    resources: Mapping[str, Any] = field(default_factory=dict)
    run_as_user: int = 65532  # the node pods' user and group (0: root, for engine images that need it)
    pod: PodOverrides = field(default_factory=PodOverrides)  # parsed by parse_spec (a section in a section)


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
    engine: EngineSpec | None = field(default=None, metadata={OWN_PARSER_KEY: True})
    # Optional, with spec.engine: SGLang's router in front of the engines.
    router: RouterSpec | None = field(default=None, metadata={OWN_PARSER_KEY: True})

    @property
    def agent_image(self) -> str:
        """The node pods' agent image: agent.image, or when left out the one the transport needs."""
        return self.agent.image or default_agent_image(self.transfer.effective_transport)

    @property
    def ranks(self) -> int:
        """Every rank of the cluster, prefill's and decode's: one GPU each."""
        return (
            self.prefill.replicas * self.prefill.ranks_per_replica
            + self.decode.replicas * self.decode.ranks_per_replica
        )

    def role(self, role: str) -> PrefillSpec | DecodeSpec:
        """prefill or decode's parallel layout, by the role's name (a Role is one)."""
        return self.prefill if role == "prefill" else self.decode

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
