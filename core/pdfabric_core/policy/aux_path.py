"""How aux rows travel (sglang #26707, send_aux).

The TCP side channel is used only when the custom pool is *exactly* NVLINK or aux-over-TCP is
requested; otherwise aux goes as one batched write through the transfer engine. Upstream review
found ``pool in ("NVLINK")``: a substring test on a string, true for "INTRA_NODE_NVLINK" too. The
comparison here is on the enum, never on a substring.
"""

from __future__ import annotations

import enum

from pdfabric_core.policy.types import MemPool


class AuxPath(enum.StrEnum):
    ENGINE = "engine"
    TCP = "tcp"


def choose_aux_path(pool: MemPool | str, *, aux_over_tcp: bool) -> AuxPath:
    pool = MemPool(pool)  # raises ValueError on an unknown pool instead of guessing
    if aux_over_tcp or pool is MemPool.NVLINK:
        return AuxPath.TCP
    return AuxPath.ENGINE
