"""Real agent processes on two GPUs under INTRA_NODE_NVLINK: prefill ranks on GPU 0, decode ranks
on GPU 1, pools on the GPUs, mapped by this test through the client's CUDA IPC mapping as a
serving engine would. Random bytes in the prefill pools, poison in the decode pools, fresh random
pages every room: after the decode room's Success every destination page (or head slice) equals
its source, state and aux rows too, and nothing else in the decode pools changed. The decode agent
learned completion from the completion board when the kernels took the whole room."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")

LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 4, 4, 64, 16
POOL_PAGES, STATE_SLOTS, AUX_SLOTS = 512, 8, 8
AUX_ITEMS = [64, 4096]


def spec(decode_tp: int) -> dict[str, Any]:
    return {
        "prefill": {"tp": 1},
        "decode": {"tp": decode_tp},
        "transfer": {"memPool": "INTRA_NODE_NVLINK", "transport": "nvlink-intra", "timeoutSeconds": 30},
        "model": {
            "layers": LAYERS,
            "kvHeads": HEADS,
            "headDim": HEAD_DIM,
            "pageSizeTokens": PAGE_TOKENS,
            "stateBytesPerRequest": 2 * 4096,
            "stateLayers": 2,
            "auxRowBytes": AUX_ITEMS,
        },
    }


@pytest.fixture(params=[1, 2], ids=["tp1-tp1", "tp1-tp2"])
def fabric(request: pytest.FixtureRequest) -> Iterator[Any]:
    from pdfabric_devcluster.fabric import LocalFabric

    env = {
        "PDFABRIC_KV_PAGES": str(POOL_PAGES),
        "PDFABRIC_STATE_SLOTS": str(STATE_SLOTS),
        "PDFABRIC_AUX_SLOTS": str(AUX_SLOTS),
    }
    with LocalFabric(spec(request.param), env=env, decode_gpu=1) as lc:
        yield lc


def kv_view(raw: bytes, layout: Any) -> np.ndarray:
    """(layer, K/V, page, head, head bytes), as pools.py lays a KV pool out."""
    return np.frombuffer(raw, dtype=np.uint8).reshape(
        layout.layers, 2, layout.kv_pages, layout.local_heads, layout.head_bytes
    )


def test_rooms_land_exactly_and_touch_nothing_else(fabric: Any) -> None:
    lc = fabric
    p = "prefill-0-tp0-cp0"
    decode_ranks = [f"decode-0-tp{d}" for d in range(lc.spec.decode.tp)]
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    src = lc.client(p).map_pools(p)
    dst = {d: lc.client(d).map_pools(d) for d in decode_ranks}
    try:
        assert all(type(m).__name__ == "GpuPool" for m in (src.kv, src.state, src.aux))
        src_kv, src_state, src_aux = (os.urandom(len(m)) for m in (src.kv, src.state, src.aux))
        src.kv.write(0, src_kv)
        src.state.write(0, src_state)
        src.aux.write(0, src_aux)
        sl = src.layout
        boards_before = lc.metric_sum("pdfabric_decode_completions_total", how="completion-board")
        for k, n in enumerate((100, 7, 300)):  # pipelined, small, pipelined
            for pools in dst.values():  # poison: anything not addressed must still read 0xA5
                for m in (pools.kv, pools.state, pools.aux):
                    m.write(0, b"\xa5" * len(m))
            room = 100 + k
            src_pages, dst_pages = rng.sample(range(POOL_PAGES), n), rng.sample(range(POOL_PAGES), n)
            s_state, d_state = rng.randrange(STATE_SLOTS), rng.randrange(STATE_SLOTS)
            s_aux, d_aux = rng.randrange(AUX_SLOTS), rng.randrange(AUX_SLOTS)
            for d in decode_ranks:
                lc.client(d).receive(d, room, dst_pages, state_indices=[d_state], aux_index=d_aux)
            lc.client(p).send(p, room, src_pages, state_indices=[s_state], aux_index=s_aux)
            for d in decode_ranks:
                view = lc.client(d).wait(d, room, 30)
                assert view.succeeded, view
            assert lc.client(p).wait(p, room, 30).succeeded

            s = kv_view(src_kv, sl)
            for i, d in enumerate(decode_ranks):
                dl = dst[d].layout
                got = kv_view(dst[d].kv.read(0, len(dst[d].kv)), dl)
                heads = slice(i * dl.local_heads, (i + 1) * dl.local_heads)  # this decode rank's heads
                want = np.full_like(got, 0xA5)
                want[:, :, dst_pages] = s[:, :, src_pages, heads]
                assert np.array_equal(got, want), f"room {room} ({n} pages) differs on {d}"
                # State and aux rows: each decode rank gets one copy of its request's rows.
                state = np.frombuffer(dst[d].state.read(0, len(dst[d].state)), dtype=np.uint8).copy()
                want_state = np.full_like(state, 0xA5)
                for layer in range(sl.state_layers):
                    so, do = sl.state_offset(layer, s_state), dl.state_offset(layer, d_state)
                    want_state[do : do + sl.state_layer_bytes] = np.frombuffer(
                        src_state[so : so + sl.state_layer_bytes], dtype=np.uint8
                    )
                assert np.array_equal(state, want_state), f"room {room}: state differs on {d}"
                aux = np.frombuffer(dst[d].aux.read(0, len(dst[d].aux)), dtype=np.uint8).copy()
                want_aux = np.full_like(aux, 0xA5)
                for item, size in enumerate(sl.aux_items):
                    so, do = sl.aux_offset(item, s_aux), dl.aux_offset(item, d_aux)
                    want_aux[do : do + size] = np.frombuffer(src_aux[so : so + size], dtype=np.uint8)
                assert np.array_equal(aux, want_aux), f"room {room}: aux differs on {d}"
        assert lc.metric_sum("pdfabric_transfer_bytes_total", role="prefill", path="mooncake") == 0
        assert lc.metric_sum("pdfabric_transfer_bytes_total", role="prefill", path="nvlink-kernel") > 0
        boards = lc.metric_sum("pdfabric_decode_completions_total", how="completion-board") - boards_before
        if lc.spec.decode.tp == 1:  # whole pages: every source's completion read off the board
            assert boards == 3
    finally:
        src.close()
        for pools in dst.values():
            pools.close()
