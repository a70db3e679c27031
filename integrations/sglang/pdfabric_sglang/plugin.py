"""The SGLang plugin: ``register`` runs in every SGLang process (``load_plugins()``).

SGLang picks a transfer backend by name in three places: the ``--disaggregation-transfer-backend``
choices, the ``TransferBackend`` enum the scheduler builds from that flag, and ``get_kv_class``,
which returns a backend's manager / sender / receiver / bootstrap-server classes. The plugin adds
``pdfabric`` to each through SGLang's own extension points (the choices list's ``add_...``
function, ``HookRegistry``'s class REPLACE and AROUND hooks), changing nothing else.
"""

from __future__ import annotations

import enum
from typing import Any

BACKEND = "pdfabric"
TRANSFER_BACKEND = "sglang.srt.disaggregation.utils.TransferBackend"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


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


def register() -> None:
    """The entry point: called by ``sglang.srt.plugins.load_plugins()`` before hooks are applied."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register(TRANSFER_BACKEND, transfer_backend_with_pdfabric(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register(GET_KV_CLASS, get_kv_class_around, HookType.AROUND)
