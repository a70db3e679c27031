"""How aux rows travel (sglang #26707, send_aux).

The TCP side channel is used only when the custom pool is *exactly* NVLINK (the pool table's
``aux_side_channel``) or aux-over-TCP is requested; otherwise aux goes as one batched write through
the transfer engine. Upstream review found ``pool in ("NVLINK")``: a substring test on a string,
true for "INTRA_NODE_NVLINK" too. The lookup here is by enum member, never by substring.
"""

from __future__ import annotations

import enum

from pdfabric_core.policy.transports import mem_pool_traits
from pdfabric_core.policy.types import MemPool


class AuxPath(enum.StrEnum):
    ENGINE = "engine"
    TCP = "tcp"


def choose_aux_path(pool: MemPool | str, *, aux_over_tcp: bool) -> AuxPath:
    # mem_pool_traits raises ValueError on an unknown pool instead of guessing.
    if aux_over_tcp or mem_pool_traits(pool).aux_side_channel:
        return AuxPath.TCP
    return AuxPath.ENGINE
