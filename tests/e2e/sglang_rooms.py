"""Polling SGLang's senders and receivers as its scheduler does, for the e2e tests that drive
SGLang's classes by hand (bytes, DP, state, DSA, metadata buffers, chunks), and those classes for
the pdfabric backend."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

FAILED = 0  # SGLang's KVPoll.Failed


def poll_until(objs: Sequence[Any], until: set[int], timeout_s: float = 30.0, *, failed_ends: bool = True) -> list[int]:
    """Every object's ``poll()`` once each is in ``until`` (or Failed, with ``failed_ends``), or
    at the deadline: the states then, for the caller to assert on."""
    ends = until | {FAILED} if failed_ends else until
    deadline = time.monotonic() + timeout_s
    while True:
        states = [int(o.poll()) for o in objs]
        if all(s in ends for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.005)


def sglang_classes() -> dict[str, Any]:
    """SGLang's classes for ``--disaggregation-transfer-backend pdfabric``: the plugin's entry point
    and SGLang's hook application, as ``load_plugins()`` runs them (the distribution's entry point
    is not installed in this process's environment), then SGLang's own ``get_kv_class``."""
    from pdfabric_sglang.plugin import register
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()
    from sglang.srt.disaggregation import utils

    backend = utils.TransferBackend("pdfabric")
    return {
        kind: utils.get_kv_class(backend, getattr(utils.KVClassType, kind))
        for kind in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")
    }
