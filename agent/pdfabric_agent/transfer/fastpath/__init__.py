"""NVLink gather/scatter fast path for scattered KV pages between GPUs of one node.

Pure parts (importable anywhere, tested in CI): `table` (the launch table format and plan types),
`layout` (tables from page lists over a connection's fixed buffers), `plan` (tables from blocks and
from a route's KV pages), `select` (path choice and the INTRA_NODE_NVLINK start-up check), `ledger`
(receiver overlap refusal). GPU parts (driver + NVRTC, loaded on first use): `cuda`, `kernel`,
`ipc`, `channel`, `peers` (pool export files and peer mappings) and `backend` (the agent's
TransferBackend with the kernel path). See docs/fastpath.md.
"""

from pdfabric_agent.transfer.fastpath.layout import plan_launch
from pdfabric_agent.transfer.fastpath.ledger import OverlapError, ReceiverLedger
from pdfabric_agent.transfer.fastpath.select import (
    IntraNodeNvlinkError,
    PathChoice,
    TransferPath,
    check_intra_node_nvlink_startup,
    choose_path,
)
from pdfabric_agent.transfer.fastpath.table import BufferPair, CopyGroup, LaunchPlan, PlanError

__all__ = [
    "BufferPair",
    "CopyGroup",
    "IntraNodeNvlinkError",
    "LaunchPlan",
    "OverlapError",
    "PathChoice",
    "PlanError",
    "ReceiverLedger",
    "TransferPath",
    "check_intra_node_nvlink_startup",
    "choose_path",
    "plan_launch",
]
