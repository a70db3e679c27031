"""NVLink gather/scatter fast path for scattered KV pages between GPUs of one node.

Pure parts (importable anywhere, tested in CI): `plan` (launch tables from page lists), `select`
(path choice and the INTRA_NODE_NVLINK start-up check), `ledger` (receiver overlap refusal).
GPU parts (driver + NVRTC, loaded on first use): `kernel`, `ipc`, `channel`. See docs/fastpath.md.
"""

from pdfabric_agent.fastpath.ledger import OverlapError, ReceiverLedger
from pdfabric_agent.fastpath.plan import BufferPair, CopyGroup, LaunchPlan, PlanError, plan_launch
from pdfabric_agent.fastpath.select import (
    IntraNodeNvlinkError,
    PathChoice,
    TransferPath,
    check_intra_node_nvlink_startup,
    choose_path,
)

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
