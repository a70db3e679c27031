"""The SGLang plugin: ``register`` runs in every SGLang process (``load_plugins()``).

SGLang picks a transfer backend by name in three places: the ``--disaggregation-transfer-backend``
choices, the ``TransferBackend`` enum the scheduler builds from that flag, and ``get_kv_class``,
which returns a backend's manager / sender / receiver / bootstrap-server classes. The plugin adds
``pdfabric`` to each through SGLang's own extension points (the choices list's ``add_...``
function, ``HookRegistry``'s class REPLACE and AROUND hooks), changing nothing else.

With pdfabric as the backend on SGLang's CPU engine, the MHA KV pool's buffers (an SWA hybrid's
sub-pools among them) and a hybrid model's Mamba state are allocated in shared memory so the node
agent can map them (``pdfabric_agent.client.shm``). SGLang's ``MetadataBuffers`` stay as
SGLang makes them (private CPU memory, or GPU memory with INTRA_NODE_NVLINK): private rows travel
with each room (``kvargs.registration``'s ``aux_inline``).
"""

from __future__ import annotations

import enum
from typing import Any

BACKEND = "pdfabric"
TRANSFER_BACKEND = "sglang.srt.disaggregation.utils.TransferBackend"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
MHA_POOL_BUFFERS = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal"
# A Mamba/GDN hybrid's slot state (its conv and temporal tensors), allocated in the pool's constructor.
MAMBA_POOL_INIT = "sglang.srt.mem_cache.memory_pool.MambaPool.__init__"


def transfer_backend_with_pdfabric(original: type[enum.Enum]) -> type[enum.Enum]:
    """SGLang's enum with one member more: members cannot be added to an Enum in place."""
    if BACKEND in {m.value for m in original}:
        return original
    members = {m.name: m.value for m in original} | {BACKEND.upper(): BACKEND}
    extended = enum.Enum(original.__name__, members, module=original.__module__, qualname=original.__qualname__)  # type: ignore[misc]
    return extended


def get_kv_class_around(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """``get_kv_class`` for pdfabric; SGLang's own answer for every other backend."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    from pdfabric_sglang.conn import (
        PdfabricKVBootstrapServer,
        PdfabricKVManager,
        PdfabricKVReceiver,
        PdfabricKVSender,
    )

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: PdfabricKVManager,
        KVClassType.SENDER: PdfabricKVSender,
        KVClassType.RECEIVER: PdfabricKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: PdfabricKVBootstrapServer,
    }[class_type]


def pdfabric_is_the_backend() -> bool:
    """This SGLang process runs PD with pdfabric (its disaggregation settings say so)."""
    from sglang.srt.runtime_context import get_disagg

    try:
        disagg = get_disagg()
        return bool(disagg.disaggregation_transfer_backend == BACKEND and str(disagg.disaggregation_mode) != "null")
    except (AttributeError, RuntimeError, KeyError, ValueError):  # ValueError: "config namespace ... not published"
        return False  # not a serving process (no runtime context published)


def _allocating_in_shm(original: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    from pdfabric_agent.client.shm import shared_cpu_allocations

    with shared_cpu_allocations():
        return original(obj, *args, **kwargs)  # type: ignore[no-any-return]


def cpu_kv_pool_in_shm(original: Any, pool: Any, *args: Any, **kwargs: Any) -> None:
    """The MHA KV pool's buffers in the agent's shared memory when SGLang runs on the CPU."""
    if str(getattr(pool, "device", "")) != "cpu" or not pdfabric_is_the_backend():
        return original(pool, *args, **kwargs)  # type: ignore[no-any-return]
    return _allocating_in_shm(original, pool, *args, **kwargs)


def cpu_state_pool_in_shm(original: Any, pool: Any, *args: Any, **kwargs: Any) -> None:
    """A hybrid model's Mamba state tensors in the agent's shared memory when SGLang runs on the CPU
    (the pool's device is a constructor argument: it is not on the pool yet)."""
    if str(kwargs.get("device", "")) != "cpu" or not pdfabric_is_the_backend():
        return original(pool, *args, **kwargs)  # type: ignore[no-any-return]
    return _allocating_in_shm(original, pool, *args, **kwargs)


_registered = False


def register() -> None:
    """The entry point: called by ``sglang.srt.plugins.load_plugins()`` before hooks are applied.
    Once per process: the same distribution found twice on the path must not wrap SGLang twice."""
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register(TRANSFER_BACKEND, transfer_backend_with_pdfabric(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register(GET_KV_CLASS, get_kv_class_around, HookType.AROUND)
    HookRegistry.register(MHA_POOL_BUFFERS, cpu_kv_pool_in_shm, HookType.AROUND)
    HookRegistry.register(MAMBA_POOL_INIT, cpu_state_pool_in_shm, HookType.AROUND)
