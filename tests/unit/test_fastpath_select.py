"""Path choice and the INTRA_NODE_NVLINK start-up check (no GPU needed)."""

from __future__ import annotations

import pytest

from pdfabric_agent.memory import cuda
from pdfabric_agent.transfer.fastpath.ledger import OverlapError, ReceiverLedger
from pdfabric_agent.transfer.fastpath.select import (
    IntraNodeNvlinkError,
    TransferPath,
    check_intra_node_nvlink_startup,
    choose_path,
    fastpath_enabled,
)
from pdfabric_core.policy.types import MemPool, Transport

OK = (True, "")


def _choose(**kw):
    args = dict(
        pool=MemPool.INTRA_NODE_NVLINK,
        transport=Transport.NVLINK_INTRA,
        visible_gpus=2,
        src_device=0,
        dst_device=1,
        peer_access=True,
        kernel_available=OK,
    )
    args.update(kw)
    return choose_path(args.pop("pool"), args.pop("transport"), **args)


def test_intra_node_nvlink_with_peer_access_takes_the_fast_path() -> None:
    assert _choose().path is TransferPath.FASTPATH


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"visible_gpus": 0}, "no GPU"),
        ({"peer_access": False}, "no peer access"),
        ({"kernel_available": (False, "libcuda.so.1 missing")}, "libcuda.so.1 missing"),
        ({"pool": MemPool.NONE, "transport": Transport.TCP}, "intra-node NVLink only"),
        ({"pool": MemPool.NVLINK, "transport": Transport.NVLINK}, "intra-node NVLink only"),
        ({"dst_device": 3}, "not visible"),
        ({"enabled": False}, "disabled"),
    ],
)
def test_everything_else_falls_back_to_the_engine_with_a_reason(kw: dict, reason: str) -> None:
    choice = _choose(**kw)
    assert choice.path is TransferPath.ENGINE
    assert reason in choice.reason


def test_one_gpu_takes_the_kernels_without_peer_access() -> None:
    """Every rank of the node on one GPU: the kernels copy within it (CUDA IPC between processes);
    Mooncake's engine cannot register an engine's buffers mapped from another process."""
    choice = _choose(visible_gpus=1, dst_device=0, peer_access=False)
    assert choice.path is TransferPath.FASTPATH and "one GPU" in choice.reason
    assert _choose(dst_device=0, kernel_available=(False, "no nvrtc")).path is TransferPath.ENGINE


def test_one_visible_gpu_under_intra_node_nvlink_is_a_startup_error() -> None:
    with pytest.raises(IntraNodeNvlinkError, match="sees 1 GPU") as exc:
        check_intra_node_nvlink_startup("INTRA_NODE_NVLINK", 1, cuda_visible_devices="3")
    assert "CUDA_VISIBLE_DEVICES='3'" in str(exc.value)


def test_other_pools_start_with_one_gpu() -> None:
    check_intra_node_nvlink_startup(MemPool.NONE, 1, cuda_visible_devices="0")
    check_intra_node_nvlink_startup(MemPool.INTRA_NODE_NVLINK, 2, cuda_visible_devices=None)
    with pytest.raises(ValueError):
        check_intra_node_nvlink_startup("intra", 2, cuda_visible_devices=None)


def test_fastpath_switch() -> None:
    assert fastpath_enabled({})
    assert not fastpath_enabled({"PDFABRIC_FASTPATH": "0"})


def test_toolchain_probe_never_raises_on_a_cpu_machine() -> None:
    ok, why = cuda.available()
    assert ok or why  # a reason always comes with a refusal


def test_ledger_counts_a_request_with_pages_and_byte_ranges_once() -> None:
    ledger = ReceiverLedger()
    ledger.reserve_ranges(("batch", 1), "decode0", [(0, 64)])  # a block launch: its bytes, then its pages
    ledger.reserve(("batch", 1), "decode0", {"kv": {7}})
    ledger.reserve(("batch", 2), "decode0", {"kv": {8}})
    assert ledger.in_flight() == 2
    ledger.release(("batch", 1))
    assert ledger.in_flight() == 1


def test_ledger_refuses_overlap_until_release() -> None:
    ledger = ReceiverLedger()
    ledger.reserve("a", "decode0", {"kv": {1, 2, 3}, "aux": {0}})
    with pytest.raises(OverlapError, match="pages \\[3\\]"):
        ledger.reserve("b", "decode0", {"kv": {3, 4}})
    with pytest.raises(OverlapError, match="already in flight"):
        ledger.reserve("a", "decode0", {"kv": {9}})
    ledger.reserve("c", "decode0", {"kv": {4, 5}, "aux": {1}})  # disjoint: accepted
    ledger.reserve("d", "decode1", {"kv": {1, 2, 3}})  # another receiver: accepted
    assert ledger.in_flight() == 3
    ledger.release("a")
    ledger.reserve("b", "decode0", {"kv": {3}})
    ledger.release("zzz")  # releasing an unknown room is harmless
