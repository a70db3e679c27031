"""PDCluster specs and agent settings the e2e tests share."""

from __future__ import annotations

from typing import Any

from tests.builders import SMALL_MODEL

# The smallest 1P1D cluster: for tests of the agents' doors and peer protocol, whose rooms are tiny.
TINY: dict[str, Any] = {"prefill": {"tp": 1}, "decode": {"tp": 1}, "model": {"layers": 1, "kvHeads": 1, "headDim": 8}}
# 1P1D on tcp with the builders' small model (every kind of memory moves): the attack tests' cluster.
TCP_SMALL_MODEL: dict[str, Any] = {
    "prefill": {"tp": 1},
    "decode": {"tp": 1},
    "transfer": {"transport": "tcp", "timeoutSeconds": 10},
    "model": SMALL_MODEL,
}
SMALL: dict[str, Any] = {
    "prefill": {"tp": 1},
    "decode": {"tp": 1},
    "transfer": {"transport": "tcp", "timeoutSeconds": 3},
    "model": {"layers": 2, "kvHeads": 2, "headDim": 16, "pageSizeTokens": 4, "auxRowBytes": [8, 8]},
}
# 32 KiB pages, 128 pages x 4 layers x K/V: a 32 MiB room, far more than loopback socket buffers
# hold, so a frozen receiver really stalls the engine mid-transfer.
BIG: dict[str, Any] = {
    **SMALL,
    "model": {"layers": 4, "kvHeads": 8, "headDim": 128, "pageSizeTokens": 16, "auxRowBytes": [8, 8]},
}
FAST_RECOVERY = {
    "PDFABRIC_PROBE_BACKOFF_S": "0.5",
    "PDFABRIC_PROBE_BACKOFF_MAX_S": "1",
    "PDFABRIC_BOOTSTRAP_TIMEOUT_S": "3",
}
