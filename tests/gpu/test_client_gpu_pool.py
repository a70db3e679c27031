"""A serving engine's view of an agent's GPU pools (one GPU is enough): pools allocated in one
process (the agent's way), mapped in another through the client's CUDA IPC mapping; bytes written
on either side are read on the other, and torch sees the mapping without a copy."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

SIZES = {"kv": 3 << 20, "state": 8192, "aux": 4096 + 64}


def _owner(q_out, q_in) -> None:
    from pdfabric_agent.memory.pools import Pool, PoolLayout, RankPools
    from pdfabric_agent.protocol.info import RankInfo
    from pdfabric_core.policy.types import Device

    torch.cuda.set_device(0)
    pools = {k: Pool.allocate(f"t-{k}", n, Device.CUDA, shm_dir="/dev/shm", gpu=0) for k, n in SIZES.items()}
    layout = PoolLayout(layers=1, local_heads=1, head_bytes=1, kv_pages=1, state_layers=1, state_layer_bytes=1,
                        state_slots=1, aux_items=(1,), aux_slots=1)  # fmt: skip
    rank = RankPools(layout, pools["kv"], pools["state"], pools["aux"])
    data = os.urandom(SIZES["kv"])
    pools["kv"].write(0, data)
    torch.cuda.synchronize(0)
    q_out.put((RankInfo.of("prefill", "", "mooncake", rank), hashlib.sha256(data).hexdigest()))
    offset, payload = q_in.get(timeout=60)  # the client wrote this; read it back here
    q_out.put(pools["state"].read(offset, len(payload)) == payload)
    q_in.get(timeout=60)
    rank.close()


def test_gpu_pools_map_into_another_process() -> None:
    from pdfabric_agent.client.api import GpuPool, map_rank_pools

    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_owner, args=(q_out, q_in))
    proc.start()
    try:
        rank, digest = q_out.get(timeout=120)
        assert all(rank.pools[k].handle and rank.pools[k].gpu == 0 for k in SIZES)
        pools = map_rank_pools("r", rank)
        try:
            assert isinstance(pools.kv, GpuPool) and len(pools.kv) == SIZES["kv"]
            assert hashlib.sha256(pools.kv.read(0, SIZES["kv"])).hexdigest() == digest
            assert pools.kv[10:20] == pools.kv.read(10, 10)
            view = torch.as_tensor(pools.kv, device="cuda:0")  # no copy: the owner's bytes
            assert view.dtype == torch.uint8 and view.numel() == SIZES["kv"]
            assert hashlib.sha256(view.cpu().numpy().tobytes()).hexdigest() == digest
            payload = os.urandom(4096)
            pools.state[1000 : 1000 + len(payload)] = payload
            q_in.put((1000, payload))
            assert q_out.get(timeout=60) is True
            with pytest.raises(ValueError, match="outside this pool"):
                pools.aux.read(SIZES["aux"] - 8, 16)
        finally:
            pools.close()
            q_in.put("done")
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
