"""``PdfabricConnector``, the class vLLM loads (``kv_connector_module_path: pdfabric_vllm.connector``):
one instance in the engine core (the scheduler side) and one per worker process (a TP rank), each
handing vLLM's calls to ``scheduler.SchedulerSide`` or ``worker.WorkerSide``.

What pdfabric cannot move yet is refused when the server starts, by name: a hybrid model (several
KV cache groups), MLA, pipeline or data parallelism, ``kv_both``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from pdfabric_core.policy.types import Role
from pdfabric_vllm import stats
from pdfabric_vllm.memory import kv_allocation
from pdfabric_vllm.orders import Orders
from pdfabric_vllm.scheduler import SchedulerSide
from pdfabric_vllm.worker import WorkerSide

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

log = logging.getLogger("pdfabric.vllm")


class PdfabricMetadata(Orders, KVConnectorMetadata):
    """A step's orders as vLLM's connector metadata."""


@dataclass
class PdfabricStats(KVConnectorStats):
    """vLLM's connector stats over ``stats``' plain dict: the rooms that ended per interval."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = stats.empty()

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)


def role_of(vllm_config: Any) -> Role:
    """The PD role from ``kv_role``: a server is a prefill (``kv_producer``) or a decode
    (``kv_consumer``), as the PDCluster's rank map names it."""
    kv = vllm_config.kv_transfer_config
    if kv.kv_role == "kv_producer":
        return Role.PREFILL
    if kv.kv_role == "kv_consumer":
        return Role.DECODE
    raise RuntimeError(
        f"pdfabric: kv_role {kv.kv_role!r}: a pdfabric server is a prefill (kv_producer) or a decode (kv_consumer)"
    )


def unsupported(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """What of this server pdfabric cannot move yet, named; None when it can."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if getattr(model, "use_mla", False):
        return "an MLA model (DeepSeek's latent KV) through vLLM's connector"
    if int(parallel.pipeline_parallel_size) > 1:
        return f"pipeline parallelism (pipeline_parallel_size {parallel.pipeline_parallel_size})"
    if int(parallel.data_parallel_size) > 1:
        return f"data parallelism (data_parallel_size {parallel.data_parallel_size})"
    if int(getattr(parallel, "decode_context_parallel_size", 1) or 1) > 1:
        return "decode context parallelism"
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) > 1:
        return f"a hybrid model of {len(groups)} KV cache groups (sliding window, Mamba)"
    return None


class PdfabricConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        refused = unsupported(vllm_config, kv_cache_config)
        if refused is not None:
            raise RuntimeError(f"pdfabric: not supported yet: {refused} (docs/vllm.md)")
        self.pd_role = role_of(vllm_config)
        replica = int(os.environ.get("PDFABRIC_REPLICA", "0"))
        block_size = int(vllm_config.cache_config.block_size)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.pd_role, replica, 0, block_size)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker = WorkerSide(self.pd_role, get_tensor_model_parallel_rank(), 0)
        self._device = vllm_config.device_config.device

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 asks when ``enable_sleep_mode`` is set, and refuses the server): sleep
        remaps the KV cache under the agent's registration, which this connector does not redo."""
        return False

    # ------------------------------------------------------------------ worker side
    def _worker(self) -> WorkerSide:
        assert self.worker is not None, "a worker call on the scheduler's connector"
        return self.worker

    def get_mem_pool_context(self) -> AbstractContextManager[None] | None:
        return kv_allocation(self._device)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        gpu = first.device.index if first.device.type == "cuda" else None
        self._worker().register(kv_caches, gpu)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, Orders):
            self._worker().take(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # loads are asynchronous: the agents write decode's pages between steps

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # prefill's pages are sent from where vLLM wrote them, once its request ends

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().finished()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.worker.take_stats() if self.worker is not None else None
        return PdfabricStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PdfabricStats(data=dict(data)) if data else PdfabricStats()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # ------------------------------------------------------------------ scheduler side
    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler call on a worker's connector"
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        orders = self._scheduler().build_connector_meta(scheduler_output)
        return PdfabricMetadata(orders.sends, orders.receives, orders.releases, orders.aborts, orders.idle)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()
