"""GPU memory between two agent processes on ONE GPU through NIXL (issue 43): ``backend: nixl``,
memPool NONE, transport nvlink-intra, which the NIXL backend runs as UCX's CUDA IPC
(``nixl_setup.ucx_env``: cuda_ipc for GPU memory, cuda_copy to know it, tcp beside them for UCX's
wire-up and host memory). A prefill agent and a decode agent (TP 1 -> TP 1, and TP 1 -> TP 2 with
two decode ranks taking head slices) keep their KV and state pools on ``cuda:0`` and their aux rows
in host memory; this test maps the pools through the client's CUDA IPC mapping as a serving engine
would (``AgentClient.map_pools``), puts random bytes in the prefill pools and poison in the decode
pools, and moves rooms of scattered pages: after each room's Success every destination page (or
head slice), state row and aux row equals its source byte for byte and nothing else changed. The
agents' byte counters name only the NIXL path, and UCX itself says which transport it chose for
the GPU writes: the agents run with ``UCX_PROTO_INFO=y``, which makes UCX print every protocol it
selects, and the prefill agent's log must show cuda_ipc for them.

The second case registers an engine's own GPU buffers (``GpuEngineRank``: torch allocations the
agent opens by CUDA IPC, as SGLang's KVArgs are registered). The agent takes GPU buffers only from
a backend that says it moves GPU memory (``TransferBackend.device_memory``); where the NIXL backend
does not say so yet, the agent refuses the registration and the case skips with its words, unless
``PDFABRIC_TEST_NIXL_DEVICE_MEMORY=1`` makes the agents' NIXL backends say so for this test (a
``sitecustomize`` on their PYTHONPATH; what a one-line change in transfer/nixl.py would do). Then
the bytes land byte-exact, but not by CUDA IPC: UCX cannot pass on an IPC handle of memory the
agent itself opened by CUDA IPC, and emulates those writes over tcp (seen on an H100; the case
records UCX's tables and asks no cuda_ipc of them).

Needs a GPU and NIXL (nixl, nixl-cu13) importable; results go to $PDFABRIC_GPU_RESULTS when set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pdfabric_agent.client.api import AgentRefused  # noqa: E402
from pdfabric_agent.protocol.views import RoomState  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402
from pdfabric_devcluster.procs import source_pythonpath  # noqa: E402
from pdfabric_devcluster.ucx_tables import ucx_tables  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="needs NIXL (nixl, nixl-cu13)"),
    pytest.mark.slow,
]

LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 4, 4, 64, 16  # bfloat16: 2 KiB per head and page
POOL_PAGES, STATE_SLOTS, AUX_SLOTS = 512, 8, 8
AUX_ITEMS = [64, 4096]
POISON = 0xA5
P = "prefill-0-tp0-cp0"


def spec(decode_tp: int) -> dict[str, Any]:
    return {
        "backend": "nixl",
        "prefill": {"tp": 1},
        "decode": {"tp": decode_tp},
        "transfer": {"transport": "nvlink-intra", "timeoutSeconds": 30},
        "model": {
            "layers": LAYERS,
            "kvHeads": HEADS,
            "headDim": HEAD_DIM,
            "dtype": "bfloat16",
            "pageSizeTokens": PAGE_TOKENS,
            "stateBytesPerRequest": 2 * 4096,
            "stateLayers": 2,
            "auxRowBytes": AUX_ITEMS,
        },
    }


AGENT_ENV = {
    "PDFABRIC_KV_PAGES": str(POOL_PAGES),
    "PDFABRIC_STATE_SLOTS": str(STATE_SLOTS),
    "PDFABRIC_AUX_SLOTS": str(AUX_SLOTS),
    "UCX_PROTO_INFO": "y",  # UCX prints each protocol it selects (to the agent's log)
}


def save(name: str, report: dict[str, Any]) -> None:
    target = os.environ.get("PDFABRIC_GPU_RESULTS")
    if target:
        (Path(target) / name).write_text(json.dumps(report, indent=1))


def check_nixl_path(lc: LocalFabric, *, require_cuda_ipc: bool = True) -> dict[str, Any]:
    """Every byte the decode agents counted came over NIXL; UCX chose cuda_ipc for GPU writes (or,
    without ``require_cuda_ipc``, the tables say what it chose)."""
    paths = lc.bytes_by_path()
    assert paths and all(key.startswith("nixl-ucx") for key in paths), paths
    for name in lc.agents:
        body = lc.readyz(name)[1]
        assert (body["transport"], body["requested"]) == ("nvlink-intra", "nvlink-intra"), body
    tables = ucx_tables(lc.agents[lc.agent_of(P)].log_path.read_text(errors="replace"))
    from_gpu = [(head, rows) for head, rows in tables if " from cuda" in head]
    assert from_gpu, lc.log(lc.agent_of(P))[-3000:]
    if require_cuda_ipc:  # every write from GPU memory: UCX's CUDA IPC, zero-copy
        assert all(rows and all("cuda_ipc" in r for r in rows) for _, rows in from_gpu), from_gpu
    return {"bytes_by_path": paths, "ucx_gpu_write_protocols": [f"{head}: {'; '.join(rows)}" for head, rows in tables]}


@pytest.fixture(params=[1, 2], ids=["tp1-tp1", "tp1-tp2"])
def fabric(request: pytest.FixtureRequest) -> Iterator[LocalFabric]:
    with LocalFabric(spec(request.param), env=AGENT_ENV, decode_gpu=0) as lc:
        yield lc


def gpu_bytes(pool: Any) -> Any:
    """A mapped GPU pool as a uint8 tensor on cuda:0 (no copy)."""
    return torch.as_tensor(pool, device="cuda:0")


def test_rooms_of_gpu_pools_land_byte_exact_over_nixl_cuda_ipc(fabric: LocalFabric) -> None:
    lc = fabric
    decodes = [f"decode-0-tp{d}" for d in range(lc.spec.decode.tp)]
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    src = lc.client(P).map_pools(P)
    dst = {d: lc.client(d).map_pools(d) for d in decodes}
    try:
        assert all(type(m).__name__ == "GpuPool" for m in (src.kv, src.state)), "KV and state pools on the GPU"
        sl = src.layout
        shape = (sl.layers, 2, sl.kv_pages, sl.local_heads, sl.head_bytes)
        src_kv, src_state = gpu_bytes(src.kv), gpu_bytes(src.state)
        src_kv.copy_(torch.randint(0, 256, src_kv.shape, dtype=torch.uint8, device="cuda:0"))
        src_state.copy_(torch.randint(0, 256, src_state.shape, dtype=torch.uint8, device="cuda:0"))
        src_aux = os.urandom(len(src.aux))
        src.aux[0 : len(src.aux)] = src_aux  # host memory on memPool NONE: the shm file mapped here
        torch.cuda.synchronize()
        rooms = []
        for k, n in enumerate((100, 7, 300)):
            for pools in dst.values():  # poison: whatever no room addresses must still read 0xA5
                gpu_bytes(pools.kv).fill_(POISON)
                gpu_bytes(pools.state).fill_(POISON)
                pools.aux[0 : len(pools.aux)] = bytes([POISON]) * len(pools.aux)
            torch.cuda.synchronize()
            room = 100 + k
            sp, dp = rng.sample(range(POOL_PAGES), n), rng.sample(range(POOL_PAGES), n)
            s_state, d_state = rng.randrange(STATE_SLOTS), rng.randrange(STATE_SLOTS)
            s_aux, d_aux = rng.randrange(AUX_SLOTS), rng.randrange(AUX_SLOTS)
            for d in decodes:
                lc.client(d).receive(d, room, dp, state_indices=[d_state], aux_index=d_aux)
            lc.client(P).send(P, room, sp, state_indices=[s_state], aux_index=s_aux)
            for d in decodes:
                view = lc.client(d).wait(d, room, 60)
                assert view.state is RoomState.SUCCESS, view
            assert lc.client(P).wait(P, room, 60).state is RoomState.SUCCESS
            torch.cuda.synchronize()
            s = src_kv.view(shape)
            for i, (d, pools) in enumerate(dst.items()):
                dl = pools.layout
                got = gpu_bytes(pools.kv).view(dl.layers, 2, dl.kv_pages, dl.local_heads, dl.head_bytes)
                heads = slice(i * dl.local_heads, (i + 1) * dl.local_heads)  # this decode rank's heads
                want = torch.full_like(got, POISON)
                want[:, :, dp] = s[:, :, sp][:, :, :, heads]
                assert torch.equal(got, want), f"room {room} ({n} pages): KV differs on {d}"
                got_state = gpu_bytes(pools.state)
                want_state = torch.full_like(got_state, POISON)
                for layer in range(sl.state_layers):
                    so, do = sl.state_offset(layer, s_state), dl.state_offset(layer, d_state)
                    want_state[do : do + sl.state_layer_bytes] = src_state[so : so + sl.state_layer_bytes]
                assert torch.equal(got_state, want_state), f"room {room}: state differs on {d}"
                aux = np.frombuffer(pools.aux[0 : len(pools.aux)], dtype=np.uint8)
                want_aux = np.full_like(aux, POISON)
                for item, size in enumerate(sl.aux_items):
                    so, do = sl.aux_offset(item, s_aux), dl.aux_offset(item, d_aux)
                    want_aux[do : do + size] = np.frombuffer(src_aux[so : so + size], dtype=np.uint8)
                assert np.array_equal(aux, want_aux), f"room {room}: aux differs on {d}"
            rooms.append(n)
        report = check_nixl_path(lc)
    finally:
        src.close()
        for pools in dst.values():
            pools.close()
    save(
        f"nixl-gpu-pools-tp1-tp{lc.spec.decode.tp}.json",
        {"case": f"agent GPU pools, prefill tp1 -> decode tp{lc.spec.decode.tp}, backend nixl, nvlink-intra, "
                 "memPool NONE, one GPU", "rooms_pages": rooms, "byte_exact": True,
         "device": torch.cuda.get_device_name(0), **report},
    )  # fmt: skip


DEVICE_MEMORY_PATCH = """\
# Written by tests/gpu/test_nixl_gpu.py (PDFABRIC_TEST_NIXL_DEVICE_MEMORY=1): the NIXL backend
# says it moves GPU memory, so the agent takes an engine's GPU buffers for it.
from pdfabric_agent.transfer import nixl as _nixl

_nixl.NixlBackend.device_memory = property(lambda self: True)
"""


def test_an_engines_own_gpu_buffers_move_byte_exact_over_nixl(tmp_path: Path) -> None:
    from pdfabric_devcluster.gpu_engine import GpuEngineRank

    env = dict(AGENT_ENV)
    patched = os.environ.get("PDFABRIC_TEST_NIXL_DEVICE_MEMORY") == "1"
    if patched:
        (tmp_path / "sitecustomize.py").write_text(DEVICE_MEMORY_PATCH)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), source_pythonpath(os.environ)])
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    head_bytes = HEAD_DIM * 2  # one token of one head (bfloat16)
    with LocalFabric(spec(1), env=env, decode_gpu=0) as lc:
        d = "decode-0-tp0"
        ranks = {}
        try:
            for r in (P, d):
                ranks[r] = GpuEngineRank(r, layers=LAYERS, heads=HEADS, head_bytes=head_bytes, page_tokens=PAGE_TOKENS,
                                         pages=POOL_PAGES, aux_row_bytes=AUX_ITEMS, aux_slots=AUX_SLOTS,
                                         shm_dir=lc.shm_dir, state_layers=2, state_slot_bytes=4096,
                                         state_slots=STATE_SLOTS)  # fmt: skip
                try:
                    ranks[r].register(lc.client(r))
                except AgentRefused as exc:
                    if "moves host memory only" in exc.message and not patched:
                        pytest.skip(f"the agent refuses an engine's GPU buffers for backend nixl: {exc.message}")
                    raise
            src, dstr = ranks[P], ranks[d]
            for t in (*src.k, *src.v, *src.state):
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
            for a in src.aux:
                a.copy_(torch.randint(0, 256, a.shape, dtype=torch.uint8))
            for room, n in enumerate((100, 7, 300), start=1):
                for t in (*dstr.k, *dstr.v, *dstr.state, *dstr.aux):
                    t.fill_(POISON)
                torch.cuda.synchronize()
                sp, dp = rng.sample(range(POOL_PAGES), n), rng.sample(range(POOL_PAGES), n)
                ss, ds = rng.randrange(STATE_SLOTS), rng.randrange(STATE_SLOTS)
                sa, da = rng.randrange(AUX_SLOTS), rng.randrange(AUX_SLOTS)
                lc.client(d).receive(d, room, dp, state_indices=[ds], aux_index=da)
                lc.client(P).send(P, room, sp, state_indices=[ss], aux_index=sa)
                assert lc.client(d).wait(d, room, 60).state is RoomState.SUCCESS
                assert lc.client(P).wait(P, room, 60).state is RoomState.SUCCESS
                torch.cuda.synchronize()
                for got, want in zip((*dstr.k, *dstr.v), (*src.k, *src.v), strict=True):
                    expect = torch.full_like(got, POISON)
                    expect[dp] = want[sp]
                    assert torch.equal(got, expect), f"room {room}: KV differs"
                for got_s, want_s in zip(dstr.state, src.state, strict=True):
                    expect_s = torch.full_like(got_s, POISON)
                    expect_s[ds] = want_s[ss]
                    assert torch.equal(got_s, expect_s), f"room {room}: state differs"
                for got_a, want_a in zip(dstr.aux, src.aux, strict=True):
                    expect_a = torch.full_like(got_a, POISON)
                    expect_a[da] = want_a[sa]
                    assert torch.equal(got_a, expect_a), f"room {room}: aux differs"
            # No cuda_ipc asked of this case: UCX cannot export a CUDA IPC handle of memory the
            # agent opened by CUDA IPC itself, and emulates the writes over tcp (the tables say so).
            report = check_nixl_path(lc, require_cuda_ipc=False)
        finally:
            for rank in ranks.values():
                rank.close()
    save("nixl-gpu-engine-buffers.json",
         {"case": "an engine's own GPU buffers registered by CUDA IPC, prefill tp1 -> decode tp1, backend nixl, "
                  "nvlink-intra, memPool NONE, one GPU", "device_memory_patched": patched, "rooms": 3,
          "byte_exact": True, "device": torch.cuda.get_device_name(0), **report})  # fmt: skip
